"""Composing a fusion group: the lowered values of its nodes become one
expression DAG over the group's external inputs, laid out in one iteration
domain.

Algorithm (``compose_group``):

1. Walk the group's nodes in graph order. Each node's lowered value is copied
   with every load of an in-group node replaced by that node's composed value,
   rounded to the dtype eager produced for it (so fp16/bf16 and autocast
   chains round exactly where eager rounds).
2. Loads that remain read the group's external inputs (fx nodes or
   parameters); nodes used outside the group become outputs.
3. Every value is right-aligned, torch-style, into one domain ``S`` of rank
   ``D``: each dim of each value is either ``S[d]`` or 1. Reductions set their
   dims to 1 (``keepdim``); a reduction that drops its dims may only be an
   output, never an operand inside the group.
4. All reductions must reduce the same dims ``R``; the other dims are the
   outer dims. Inputs and outputs get one stride per dim of ``S`` (0 where
   they broadcast), which is all the kernel writer needs: permutes,
   broadcasting and views are folded into index arithmetic.

A node lowered to an ``extern`` value (``ctx.extern()``) has no expression to
substitute: ``compose_group`` refuses every group containing one. Strategies
that generate such nodes compose their groups themselves
(``StrategySpec.compose``), usually starting from ``program_from_nodes``: the
group's external inputs and outputs, without IR values.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
import torch.fx

from .ir import AttrRef, Value, tensor_meta
from .rounding import rounded
from .tf32 import tf32_allowed

ROUNDED_DTYPES = (torch.float16, torch.bfloat16)

#: How fp32 products run when torch does not allow TF32: "tf32x3" (each operand split
#: into two TF32 parts, three tensor-core products, fp32 accumulation: error at fp32
#: level, checked against eager at fp32 tolerance) or "ieee" (plain fp32 FMAs, slow).
STRICT_FP32 = contextvars.ContextVar("autofuser_strict_fp32", default="tf32x3")
#: Products one group may hold (several only where a plugin lays them out). Lowered when
#: re-planning the nodes of a multi-product group that stayed eager, so they still
#: fuse in smaller groups (``autofuser_core.compile``).
MAX_PRODUCTS = contextvars.ContextVar("autofuser_max_products", default=8)
#: Nodes of the group being composed whose values its backward takes from the forward
#: (``saved_products``): with gradients on, ``compose_group`` and ``program_from_nodes``
#: make each an output (``KernelTensor.saved``) even where nothing outside reads it.
SAVED_FOR_BACKWARD: contextvars.ContextVar[frozenset] = contextvars.ContextVar(
    "autofuser_saved_for_backward", default=frozenset()
)


def layout_settings() -> tuple:
    """What laying out a group's products depends on besides its IR (products per
    group, how fp32 products run): composed groups stay valid while it stays."""
    return MAX_PRODUCTS.get(), fp32_precision()


def fp32_precision() -> str:
    """Torch's own rule for fp32 matrix products: TF32 only where it is allowed."""
    return "tf32" if tf32_allowed("matmul") else STRICT_FP32.get()


#: A plugin's layout of groups with a given number of matrix products
#: (``ProductLayoutSpec.lay_out``): ``lay_out(program, values)`` sets the program's
#: domain, strides and ``product_layout``, or raises ``GroupRefused``.
ProductLayout = Callable[["GroupProgram", dict[int, Value]], None]


class GroupRefused(Exception):
    def __init__(self, code: str, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass
class KernelTensor:
    """An input or output of a fused kernel, with strides laid out over ``S``."""

    source: Union[torch.fx.Node, AttrRef]
    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]  # the tensor's own strides
    domain_stride: tuple[int, ...] = ()  # one per dim of S; 0 where it broadcasts
    read: bool = True  # False: an argument the ops need only for its metadata (x.to(y))
    # Set where the launcher converts the tensor to ``dtype`` before every launch (from
    # ``cast_from``): an fp32 weight that a 16-bit product reads, converted once per call
    # instead of once per program that reads it.
    cast_from: Optional[torch.dtype] = None
    # An output only the group's backward reads (a product's result, saved as eager saves
    # it, so the backward need not compute the product again): the kernel writes it, the
    # graph never sees it (``GroupProgram.visible_outputs``).
    saved: bool = False

    @property
    def name(self) -> str:
        return self.source.path if isinstance(self.source, AttrRef) else self.source.name

    @property
    def nbytes(self) -> int:
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class GroupProgram:
    """A composed fusion group, ready for a strategy to tile and write."""

    nodes: list[torch.fx.Node]
    inputs: list[KernelTensor]
    outputs: list[KernelTensor]
    output_values: list[Value]
    domain: tuple[int, ...]
    reduced_dims: tuple[int, ...]
    input_of_load: dict[int, int] = field(default_factory=dict)  # load uid -> input index
    scales_of_load: dict[int, int] = field(default_factory=dict)  # packed weight load uid -> its scales' input index
    op_names: list[str] = field(default_factory=list)
    # Set when the group contains matrix products: the layout object of the product layout
    # that laid it out (``ProductLayoutSpec``), which its strategy reads.
    product_layout: Optional[Any] = None
    identity_reduces: set[int] = field(default_factory=set)  # reductions over size-1 dims only
    # Sums over exactly the outer dims (every dim but ``reduced_dims``) whose results are
    # outputs and nothing else: a layer norm's weight gradient beside its input gradient.
    # Each program sums its rows into one partial row of the output's size; the launcher
    # adds the partial rows (``KernelSource.partial_outputs``).
    cross_reduces: set[int] = field(default_factory=set)
    # fp32 products of a group laid out without a product layout (a strategy's own
    # compose): "tf32" where torch allows it, else "tf32x3"/"ieee"; None without products.
    products_precision: Optional[str] = None
    # One sentence from a strategy's own compose on what it recognised; the report
    # shows it as the fused group's reason.
    summary: str = ""

    @property
    def precision(self) -> Optional[str]:
        """How the group's fp32 products run ("tf32" loosens the check against eager)."""
        if self.product_layout is not None:
            return getattr(self.product_layout, "precision", None)
        return self.products_precision

    @property
    def visible_outputs(self) -> list[KernelTensor]:
        """The outputs the graph reads, in order: all but those saved for backward, which
        come last."""
        return [t for t in self.outputs if not t.saved]

    @property
    def has_reduction(self) -> bool:
        return bool(self.reduced_dims)

    @property
    def outer_numel(self) -> int:
        n = 1
        for d, s in enumerate(self.domain):
            if d not in self.reduced_dims:
                n *= s
        return n

    @property
    def reduced_numel(self) -> int:
        n = 1
        for d in self.reduced_dims:
            n *= self.domain[d]
        return n

    def bytes_after(self) -> int:
        return sum(t.nbytes for t in self.inputs if t.read) + sum(t.nbytes for t in self.outputs)


TensorDescription = tuple[tuple[int, ...], torch.dtype, tuple[int, ...]]


def _dtype_of(
    source: Any, root: torch.nn.Module, attr_cache: Optional[dict[str, TensorDescription]] = None
) -> TensorDescription:
    if isinstance(source, AttrRef):
        if attr_cache is not None and source.path in attr_cache:
            return attr_cache[source.path]
        # getattr, not get_parameter: a parametrised weight (weight_norm) is computed on access.
        tensor = attr_tensor(root, source.path)
        described = tuple(tensor.shape), tensor.dtype, tuple(tensor.stride())
        if attr_cache is not None:
            attr_cache[source.path] = described
        return described
    meta = tensor_meta(source)
    return tuple(meta.shape), meta.dtype, tuple(meta.stride)


def attr_tensor(root: torch.nn.Module, path: str) -> torch.Tensor:
    """The live tensor behind an ``AttrRef`` path."""
    owner, _, name = path.rpartition(".")
    return getattr(root.get_submodule(owner) if owner else root, name)


def compose_group(
    nodes: Sequence[torch.fx.Node],
    lowered: dict[torch.fx.Node, Value],
    root: torch.nn.Module,
    op_names: Optional[dict[torch.fx.Node, str]] = None,
    lay_out: Optional[Callable[[GroupProgram, dict[int, Value]], None]] = None,
    attr_cache: Optional[dict[str, TensorDescription]] = None,
    product_layouts: Optional[Mapping[int, ProductLayout]] = None,
) -> GroupProgram:
    """Compose ``nodes`` (in graph order) into a ``GroupProgram``; see module doc.

    ``lay_out(program, values)`` replaces steps 3-4 (``values``: every IR value
    of the group by uid): a strategy that tiles the composed DAG its own way
    (a chain of several products) sets the domain and strides itself, or
    raises ``GroupRefused``. ``attr_cache``: shape, dtype and strides of the
    parameters already read, by path, shared by calls on the same ``root``
    while its parameters stay as they are (a parametrised weight is computed
    each time it is read). ``product_layouts``: the plugins' layouts of groups
    with matrix products, by count (``Registry.product_layouts()``; the rule is
    ``ProductLayoutSpec``'s): without one for a group's count, the group is refused."""
    members = set(nodes)
    composed: dict[torch.fx.Node, Value] = {}
    memo: dict[int, Value] = {}
    inputs: list[KernelTensor] = []
    input_index: dict[Any, int] = {}
    input_of_load: dict[int, int] = {}

    scales_of_load: dict[int, int] = {}

    def input_for(source: Any) -> int:
        key = source if isinstance(source, AttrRef) else ("node", source)
        if key not in input_index:
            shape, dtype, stride = _dtype_of(source, root, attr_cache)
            input_index[key] = len(inputs)
            inputs.append(KernelTensor(source, shape, dtype, stride))
        return input_index[key]

    def rebuild(v: Value, node: torch.fx.Node) -> Value:
        """``v`` (of ``node``'s lowered value) with in-group loads substituted."""
        if v.uid in memo:
            return memo[v.uid]  # no extern below: it would have been refused when first seen
        if v.op == "extern":
            raise GroupRefused(
                "extern_op",
                f"{node.name} ({(op_names or {}).get(node, node.target)}) is lowered as an extern op: only a "
                "strategy with its own compose generates it",
            )
        if v.op == "load" and isinstance(v.source, torch.fx.Node) and v.source in members:
            out = composed[v.source]
        elif v.op == "load":
            out = Value("load", v.shape, is_bool=v.is_bool, source=v.source, packed=v.packed)
            input_of_load[out.uid] = input_for(v.source)
            if v.packed is not None:
                scales_of_load[out.uid] = input_for(v.packed.scales)
        elif v.args:
            out = Value(
                v.op,
                v.shape,
                is_bool=v.is_bool,
                args=tuple(rebuild(a, node) for a in v.args),
                template=v.template,
                constant=v.constant,
                reduce_op=v.reduce_op,
                dims=v.dims,
                keepdim=v.keepdim,
                transpose_b=v.transpose_b,
                column_dims=v.column_dims,
                fp32_precision=v.fp32_precision,
                dtype=v.dtype,
                shift=v.shift,
            )
        else:
            out = v
        memo[v.uid] = out
        return out

    stamped: set[int] = set()
    for node in nodes:
        value = rebuild(lowered[node], node)
        meta = tensor_meta(node)
        if _is_no_op(lowered[node], meta) and any(user not in members for user in node.users):
            # A no-op (x.float() on fp32, eval dropout, Identity) returns its input itself in
            # eager; a kernel output would be a copy, and an in-place op on one name would no
            # longer reach the other.
            raise GroupRefused(
                "alias_output",
                f"{node.name} is its input itself in eager; a copy made by a kernel would break that alias",
            )
        _stamp_dot_dtype(value, meta.dtype, stamped)
        # A packed weight is only ever a product's operand, which rounds to its dtype itself.
        if meta.dtype in ROUNDED_DTYPES and not value.is_bool and value.packed is None:
            value = Value("pointwise", value.shape, args=(value,), template=rounded("{0}", meta.dtype))
        composed[node] = value

    # Tensor arguments the lowerings never read (``x.type_as(y)`` needs only y's
    # dtype) still pass through, so the group's eager ops can run on the same inputs.
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg in members or ("node", arg) in input_index:
                continue
            meta = tensor_meta(arg)
            if meta is None:
                raise GroupRefused("unsupported_argument", f"{node.name} takes {arg.name}, which is not a tensor")
            input_index[("node", arg)] = len(inputs)
            inputs.append(KernelTensor(arg, tuple(meta.shape), meta.dtype, tuple(meta.stride), read=False))

    outputs: list[KernelTensor] = []
    output_values: list[Value] = []
    for node in _output_nodes(nodes, members):
        meta = tensor_meta(node)
        saved = not any(user not in members for user in node.users)
        outputs.append(KernelTensor(node, tuple(meta.shape), meta.dtype, tuple(meta.stride), saved=saved))
        output_values.append(composed[node])
    if not any(not t.saved for t in outputs):
        raise GroupRefused("no_outputs", "no value of the group is used outside it")

    program = GroupProgram(
        nodes=list(nodes),
        inputs=inputs,
        outputs=outputs,
        output_values=output_values,
        domain=(),
        reduced_dims=(),
        input_of_load=input_of_load,
        scales_of_load=scales_of_load,
        op_names=[(op_names or {}).get(n, n.name) for n in nodes],
    )
    if lay_out is None:
        _lay_out(program, product_layouts)
    else:
        values = collect_values(program.output_values)
        refuse_shifted_reads(values, "a strategy's own layout")
        lay_out(program, values)
    return program


def program_from_nodes(
    nodes: Sequence[torch.fx.Node],
    op_names: Optional[dict[torch.fx.Node, str]] = None,
    summary: str = "",
    products_precision: Optional[str] = None,
) -> GroupProgram:
    """A ``GroupProgram`` for ``nodes`` (in graph order) without IR values, for
    strategies that compose their groups themselves (``StrategySpec.compose``).

    - inputs: every tensor the nodes read from outside the group, in order of
      first use (node by node, argument by argument), as fx nodes with their
      recorded shape, dtype and strides; a non-tensor node argument refuses
      the group;
    - outputs: every node used outside the group, in graph order, with the
      shape, dtype and strides eager produced (``FusedKernel`` allocates them
      so);
    - ``domain`` is the first output's shape; no reduced dims, no
      ``output_values``, no ``domain_stride``s: the strategy's generator reads
      the nodes and the tensors' own strides.

    Parameters a ``call_module`` node reads itself are not inputs: the group's
    eager ops (verification, the fallback, backward) read them from the module,
    and a kernel that needs them must not use this helper.
    """
    members = set(nodes)
    inputs: list[KernelTensor] = []
    seen: set[torch.fx.Node] = set()
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg in members or arg in seen:
                continue
            meta = tensor_meta(arg)
            if meta is None:
                raise GroupRefused("unsupported_argument", f"{node.name} takes {arg.name}, which is not a tensor")
            seen.add(arg)
            inputs.append(KernelTensor(arg, tuple(meta.shape), meta.dtype, tuple(meta.stride)))
    outputs: list[KernelTensor] = []
    for node in _output_nodes(nodes, members):
        meta = tensor_meta(node)
        if meta is None:
            raise GroupRefused("not_a_tensor", f"{node.name}'s result is not a single tensor")
        saved = not any(user not in members for user in node.users)
        outputs.append(KernelTensor(node, tuple(meta.shape), meta.dtype, tuple(meta.stride), saved=saved))
    if not any(not t.saved for t in outputs):
        raise GroupRefused("no_outputs", "no value of the group is used outside it")
    return GroupProgram(
        nodes=list(nodes),
        inputs=inputs,
        outputs=outputs,
        output_values=[],
        domain=outputs[0].shape,
        reduced_dims=(),
        op_names=[(op_names or {}).get(n, n.name) for n in nodes],
        products_precision=products_precision,
        summary=summary,
    )


def _output_nodes(nodes: Sequence[torch.fx.Node], members: set[torch.fx.Node]) -> list[torch.fx.Node]:
    """The group's outputs: the nodes used outside it in graph order, then those saved for
    its backward (``SAVED_FOR_BACKWARD``) that nothing outside reads, in graph order."""
    saved = SAVED_FOR_BACKWARD.get()
    used = [n for n in nodes if any(user not in members for user in n.users)]
    return used + [n for n in nodes if n in saved and n not in used]


def saved_products(nodes: Sequence[torch.fx.Node], lowered: Mapping[torch.fx.Node, Value]) -> list[torch.fx.Node]:
    """The nodes of a group whose values its backward takes from the forward rather than
    computing again (docs/training.md, "What a backward saves"): each node whose own
    lowering makes a matrix product (a ``dot`` value, ``ctx.matmul``), where nothing
    outside the group reads it already. Eager's derivative of a product reads only its
    operands, so its result is needed only by the ops after it (an activation's
    derivative); computing it again would cost the product a third time in the step."""
    members = set(nodes)
    found = []
    for node in nodes:
        value = lowered.get(node)
        if value is None or any(user not in members for user in node.users):
            continue
        own = _own_values(value)
        if any(v.op == "dot" for v in own):
            found.append(node)
    return found


def _own_values(root: Value) -> list[Value]:
    """The values of one node's lowering, down to its loads (other nodes' values)."""
    return list(collect_values([root]).values())


def _is_no_op(value: Value, meta) -> bool:
    """The node's result is its input unchanged (eager returns the same tensor)."""
    if value.op != "load":
        return False
    source = tensor_meta(value.source)
    return source is None or source.dtype == meta.dtype


def _stamp_dot_dtype(value: Value, dtype: torch.dtype, seen: set[int]) -> None:
    """A product's operands round to the dtype its node produced in eager.

    ``seen``: values stamped already, with every product below them (shared by
    the nodes of one group, so each value is walked once)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if v.uid in seen:
            continue
        seen.add(v.uid)
        if v.op == "dot" and v.dtype is None:
            v.dtype = dtype
        stack.extend(v.args)


def collect_values(roots: Sequence[Value]) -> dict[int, Value]:
    """Every value the ``roots`` depend on (themselves included), by uid."""
    values: dict[int, Value] = {}
    stack = list(roots)
    while stack:
        v = stack.pop()
        if v.uid not in values:
            values[v.uid] = v
            stack.extend(v.args)
    return values


def top_level_values(roots: Sequence[Value]) -> dict[int, Value]:
    """The values ``roots`` depend on at the group's own coordinates, by uid: every value
    but those below a shifted read's operand (``ctx.read_shifted``), which are computed
    at the shifted coordinates (the shifted value and its fill are included)."""
    values: dict[int, Value] = {}
    stack = list(roots)
    while stack:
        v = stack.pop()
        if v.uid not in values:
            values[v.uid] = v
            stack.extend(v.args[1:] if v.op == "shifted" else v.args)
    return values


def refuse_shifted_reads(values: Mapping[int, Value], where: str) -> None:
    """Refuse a group holding a shifted read (``ctx.read_shifted``), which only the core's
    own one-domain layout reads at its coordinates: ``where`` names what else lays it out."""
    if any(v.op == "shifted" for v in values.values()):
        raise GroupRefused(
            "shifted_read",
            f"the group reads a value at shifted coordinates (a roll, pad, concatenation or window), "
            f"which {where} does not lay out",
        )


def _check_shifted_operands(values: Mapping[int, Value]) -> set[int]:
    """What the operand of every shifted read in ``values`` is made of may be computed
    again at the shifted coordinates: loads, constants, pointwise ops and further shifted
    reads, no reduction (its rows would be other rows). Returns the uids of the loads
    read at shifted coordinates."""
    loads: set[int] = set()
    seen: set[int] = set()
    stack = [v.args[0] for v in values.values() if v.op == "shifted"]
    while stack:
        v = stack.pop()
        if v.uid in seen:
            continue
        seen.add(v.uid)
        if v.op == "reduce":
            raise GroupRefused(
                "shifted_reduction",
                "a reduction is read at shifted coordinates (a roll, pad or window of its result): "
                "a kernel computes each row's reduction only at that row",
            )
        if v.op == "load":
            loads.add(v.uid)
        stack.extend(v.args)
    return loads


def product_count(program: Optional[GroupProgram]) -> int:
    """Matrix products (``dot`` values) in a composed group."""
    if program is None:
        return 0
    return sum(v.op == "dot" for v in collect_values(program.output_values).values())


def _lay_out(program: GroupProgram, product_layouts: Optional[Mapping[int, ProductLayout]] = None) -> None:
    """Steps 3 and 4 of the module doc: the domain, the reduced dims, strides
    (groups with products: the plugins' layout for their count, ``_lay_out_products``)."""
    values = collect_values(program.output_values)  # no extern op: compose_group refused those
    products = sum(v.op == "dot" for v in values.values())
    if not products and any(v.packed is not None for v in values.values()):
        raise GroupRefused("packed_weight", "a quantised weight is decoded only inside a matrix product's kernel")
    if products:
        refuse_shifted_reads(values, "a layout of matrix products")
        _lay_out_products(program, values, products, product_layouts or {})
        return
    shifted_loads = _check_shifted_operands(values)
    # Values below a shifted read live at the shifted coordinates, not in the domain:
    # the kernel writer computes them there (``codegen``); only the rest sets the domain.
    values = top_level_values(program.output_values)

    # A reduction without keepdim drops its dims: it and pointwise ops over only
    # such values (its dtype rounding, `x.sum(-1) * 2`) live in the reduced space
    # and can only be outputs; mixing them with full-domain values would need a
    # reshape, which the index scheme doesn't express.
    squeezed: set[int] = set()
    for v in sorted(values.values(), key=lambda v: v.uid):
        tensor_args = [a for a in v.args if a.op != "const"]
        dropped = [a for a in tensor_args if a.uid in squeezed]
        if v.op == "reduce" and not v.keepdim and not dropped:
            squeezed.add(v.uid)
        elif dropped and (v.op != "pointwise" or len(dropped) != len(tensor_args)):
            raise GroupRefused(
                "reduction_drops_dims",
                "a reduction without keepdim feeds an op that also reads full-size values; "
                "its result can only be an output",
            )
        elif dropped:
            squeezed.add(v.uid)
    rank = max([len(v.shape) for uid, v in values.items() if uid not in squeezed] + [0])

    aligned: dict[int, tuple[int, ...]] = {}
    reduced_sets: set[tuple[int, ...]] = set()
    dims_of: dict[int, tuple[int, ...]] = {}  # each reduction's dims, where not the identity

    def align(v: Value) -> tuple[int, ...]:
        if v.uid in aligned:
            return aligned[v.uid]
        if v.uid in squeezed and v.op == "pointwise":
            out = next(align(a) for a in v.args if a.uid in squeezed)
            for a in v.args:
                align(a)
        elif v.op == "shifted":
            for a in v.args[1:]:  # the fill, read at the group's own coordinates
                align(a)
            out = (1,) * (rank - len(v.shape)) + tuple(v.shape)
        elif v.op == "reduce":
            arg = align(v.args[0])
            shift = rank - len(v.args[0].shape)
            dims = tuple(d + shift for d in v.dims)
            # Over dims where the operand has size 1 a reduction is the identity: those
            # dims must not join the group's reduced dims (the kernel would sum copies).
            effective = tuple(d for d in dims if arg[d] != 1)
            if effective:
                reduced_sets.add(effective)
                dims_of[v.uid] = tuple(sorted(effective))
            else:
                program.identity_reduces.add(v.uid)
            out = tuple(1 if d in dims else s for d, s in enumerate(arg))
        else:
            for a in v.args:
                align(a)
            out = (1,) * (rank - len(v.shape)) + tuple(v.shape)
        aligned[v.uid] = out
        return out

    for v in program.output_values:
        align(v)

    domain = [1] * rank
    for shape in aligned.values():
        for d, s in enumerate(shape):
            if s != 1:
                if domain[d] not in (1, s):
                    raise GroupRefused("shape_mismatch", f"sizes {domain[d]} and {s} meet in dim {d}")
                domain[d] = s
    program.domain = tuple(domain)
    cross: tuple[int, ...] = ()
    if len(reduced_sets) > 1:
        reduced, cross = _rows_and_cross(program, values, dims_of)
        program.cross_reduces = {uid for uid, dims in dims_of.items() if dims == cross}
    else:
        reduced = next(iter(reduced_sets)) if reduced_sets else ()
    program.reduced_dims = tuple(d for d in reduced if domain[d] != 1)

    views: dict[int, set[tuple[int, ...]]] = {}
    for v in values.values():
        if v.op == "load":
            views.setdefault(program.input_of_load[v.uid], set()).add(tuple(v.shape))
    for index, tensor in enumerate(program.inputs):
        if not tensor.read:
            tensor.domain_stride = (0,) * len(program.domain)
            continue
        if index not in views and any(program.input_of_load[uid] == index for uid in shifted_loads):
            tensor.domain_stride = (0,) * len(program.domain)  # read only at shifted coordinates
            continue
        shapes = views.get(index, {tensor.shape})
        if len(shapes) > 1:
            raise GroupRefused("mixed_views", f"{tensor.name} is read with several shapes {sorted(shapes)}")
        tensor.domain_stride = domain_strides(*read_view(tensor, next(iter(shapes))), program.domain)
    for index, (tensor, value) in enumerate(zip(program.outputs, program.output_values)):
        shape_s = aligned[value.uid]
        # What this output is reduced over: the rows' dims, or the outer dims for a cross sum.
        own_reduced = cross if cross_sum_of(program, index) is not None else reduced
        for d in range(rank):
            full = shape_s[d] == program.domain[d]
            if d in own_reduced:
                continue
            if not full:
                raise GroupRefused(
                    "output_broadcasts",
                    f"output {tensor.name} {list(tensor.shape)} is smaller than the group's domain "
                    f"{list(program.domain)} outside the reduced dims",
                )
        if value.uid in squeezed:
            kept = [d for d in range(rank) if d not in own_reduced]
            strides = [0] * rank
            own = list(tensor.stride)
            offset = len(kept) - len(own)
            for i, d in enumerate(kept):
                j = i - offset
                strides[d] = own[j] if 0 <= j < len(own) and tensor.shape[j] != 1 else 0
            tensor.domain_stride = tuple(strides)
        else:
            tensor.domain_stride = domain_strides(tensor.shape, tensor.stride, program.domain)
        reduced_full = [shape_s[d] == program.domain[d] for d in own_reduced if program.domain[d] != 1]
        if reduced_full and any(reduced_full) and not all(reduced_full):
            raise GroupRefused("output_broadcasts", f"output {tensor.name} is partly reduced")


def _summed(value: Value, dtype: torch.dtype) -> Optional[Value]:
    """The reduction an output ``value`` of ``dtype`` writes: itself, or the reduction it
    rounds to ``dtype`` (half-precision groups round every result where eager rounds)."""
    if value.op == "reduce":
        return value
    if value.op == "pointwise" and len(value.args) == 1 and value.template == rounded("{0}", dtype):
        inner = value.args[0]
        return inner if inner.op == "reduce" else None
    return None


def cross_sum_of(program: GroupProgram, index: int) -> Optional[Value]:
    """The cross sum (``GroupProgram.cross_reduces``) output ``index`` writes, if it writes one:
    the kernel stores its partial rows unrounded, and the launcher's sum of them rounds once."""
    if not program.cross_reduces:
        return None
    reduce = _summed(program.output_values[index], program.outputs[index].dtype)
    return reduce if reduce is not None and reduce.uid in program.cross_reduces else None


#: The outputs a cross sum may write: its partial rows are fp32, so a float64 sum would
#: lose precision against eager's, and torch sums bools to int64.
CROSS_SUM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _rows_and_cross(
    program: GroupProgram, values: Mapping[int, Value], dims_of: Mapping[int, tuple[int, ...]]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Of two sets of reduced dims, the rows' and the cross sums' (``GroupProgram.cross_reduces``):
    the cross set is every dim of the domain the rows' set leaves out, and its reductions
    are sums written as outputs that nothing else in the group reads. Any other mix of
    reductions is refused."""
    sets = sorted(set(dims_of.values()))
    refusal = GroupRefused("mixed_reductions", f"reductions over different dims {sets}")
    if len(sets) != 2:
        raise refusal
    wide = {d for d, s in enumerate(program.domain) if s != 1}

    def can_cross(dims: tuple[int, ...], rows: tuple[int, ...]) -> bool:
        if set(dims) | set(rows) != wide or set(dims) & set(rows):
            return False
        members = {uid for uid, d in dims_of.items() if d == dims}
        if any(values[uid].reduce_op != "sum" for uid in members):
            return False
        # Each is written as an output, itself or rounded to the output's dtype, and read by
        # nothing else; the output is floating (the partial rows are summed in fp32, and
        # torch sums bools to int64).
        written = {}
        for t, v in zip(program.outputs, program.output_values):
            reduce = _summed(v, t.dtype)
            if reduce is not None and reduce.uid in members and t.dtype in CROSS_SUM_DTYPES:
                written[reduce.uid] = v.uid
        if set(written) != members:
            return False
        # Nothing in the group reads a cross sum or its rounding: inside the kernel either
        # holds one program's partial row, not the sum.
        wrappers = {w for r, w in written.items() if w != r}
        for v in values.values():
            for a in v.args:
                if a.uid in wrappers or (a.uid in members and v.uid not in wrappers):
                    return False
        return True

    # Where either set could be the cross one, the rows are the set holding the last dim
    # (the contiguous one in a dense tensor), so rows are read along memory.
    last_first = sorted(sets, key=lambda dims: -max(dims))
    for rows, cross in ((last_first[0], last_first[1]), (last_first[1], last_first[0])):
        if can_cross(cross, rows):
            return rows, cross
    raise refusal


def _lay_out_products(
    program: GroupProgram, values: dict[int, Value], products: int, product_layouts: Mapping[int, ProductLayout]
) -> None:
    """A group with ``products`` matrix products, laid out by the plugins' layout for that
    count; one product always may be, several only up to ``MAX_PRODUCTS``."""
    lay_out = product_layouts.get(products) if products <= max(1, MAX_PRODUCTS.get()) else None
    if lay_out is not None:
        lay_out(program, values)
    elif products > 1:
        raise GroupRefused("several_products", f"{products} matrix products in one group")
    else:
        raise GroupRefused(
            "no_product_layout",
            "no loaded plugin lays out a group with a matrix product (the bundled one is the matmul plugin's)",
        )


def read_view(tensor: KernelTensor, shape: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``tensor``'s shape and strides when read as ``shape`` (``ctx.read_as``: size-1
    dims inserted or removed); its own when ``shape`` is its shape."""
    shape = tuple(shape)
    if shape == tuple(tensor.shape):
        return shape, tuple(tensor.stride)
    own = iter([st for s, st in zip(tensor.shape, tensor.stride) if s != 1])
    return shape, tuple(next(own) if s != 1 else 0 for s in shape)


def domain_strides(shape: Sequence[int], stride: Sequence[int], domain: Sequence[int]) -> tuple[int, ...]:
    pad = len(domain) - len(shape)
    out = []
    for d in range(len(domain)):
        j = d - pad
        if j < 0 or shape[j] == 1:
            out.append(0)
        else:
            out.append(int(stride[j]))
    return tuple(out)
