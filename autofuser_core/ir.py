"""Kernel IR: what a lowering turns an fx node into.

A lowering describes its op as a small expression DAG of ``Value``s built
through a ``LoweringContext``:

- ``ctx.tensor(arg)`` - read a tensor argument (an fx node) or a Python
  number as a constant;
- ``ctx.pointwise(template, *values)`` - one Triton expression over values,
  ``{0}``, ``{1}``, ... standing for the operands (``"tl.exp({0})"``);
  operands broadcast as in torch;
- ``ctx.reduce(op, value, dims, keepdim)`` - ``sum``/``max``/``min`` over dims;
- ``ctx.matmul(a, b, transpose_b, column_dims)`` - a matrix product over the
  last two dims (leading dims broadcast), accumulated in fp32, its operands
  rounded to the product's dtype (bf16/fp16 under autocast; fp32 products use
  TF32 only where torch's own matmul-precision setting allows it); with
  ``column_dims=c`` the product's columns span ``b``'s last ``c`` dims (a
  channels-first 1x1 convolution: ``[O, C] @ [B, C, H, W] -> [B, O, H, W]``);
- ``ctx.read_as(arg, shape)`` - read a tensor argument with size-1 dims
  inserted or removed (a conv weight ``[O, C, 1, 1]`` as ``[O, C]``, a
  per-channel ``[C]`` as ``[C, 1, 1]``); no data moves;
- ``ctx.read_shifted(arg, shape, offsets, scales, mode, fill)`` - a value read
  at other coordinates: output coordinate ``i`` along dim ``d`` reads the
  operand at ``scales[d] * i + offsets[d]``; where that falls outside the
  operand, ``mode`` says what is read: ``fill`` (the ``fill`` value, itself a
  value or a number), ``wrap`` (modulo the operand's size), ``clamp`` (the
  nearest edge) or ``reflect`` (mirrored about the edge, the edge not
  repeated). Composed onto a computed value, its ops are computed again at
  the shifted coordinates;
- ``ctx.read_reshaped(arg, shape)`` - a value's elements, in row-major order,
  read as another shape of as many elements (a reshape that eager must copy,
  since no strides express it); also composed at the moved coordinates;
- ``ctx.packed_weight(data, scales, ...)`` - a weight stored quantised
  (integer elements plus per-block scales), read only as a product's second
  operand and decoded in registers by a quantiser's helper;
- ``ctx.extern()`` - the node as one opaque value: the op is real and lowered,
  but no generic strategy can generate it. Only a strategy with its own
  ``compose`` (``StrategySpec.compose``), which reads the node's arguments
  itself, takes it; ``compose_group`` refuses any group that contains one.

Values carry torch-level shapes, so a lowering is checked against the node's
real output shape. Everything computes in fp32 (or int1 for booleans); the
core rounds each op's result to the dtype eager produced for it, so fused
code follows eager's precision op by op (autocast included).

Nothing here knows any particular op: ops live in plugins.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, NoReturn, Optional, Sequence, cast

import torch
import torch.fx

_ids = itertools.count()


@dataclass(frozen=True)
class AttrRef:
    """A parameter or buffer of the model, read at call time (``get_attr``)."""

    path: str


@dataclass(frozen=True)
class PackedWeight:
    """How a quantised weight is stored, for a ``load`` whose ``source`` is its element tensor.

    The logical weight is the load's ``shape`` (``[..., N, K]`` for a linear
    layer, the reduction dim last); the element tensor holds it with the
    reduction dim padded to a multiple of ``block``, and ``scales`` one entry
    per ``block`` elements along it. ``decode`` names a ``@triton.jit`` helper
    ``decode(elements, scales) -> fp32 tile`` that receives a ``[BLOCK_K,
    BLOCK_N]`` element tile and its ``[BLOCK_K // block, BLOCK_N]`` scales (the
    reduction along axis 0 of both); tiles along the reduction are multiples
    of ``block``. ``dtype`` is the dtype eager dequantises to, which a product
    rounds its operands to anyway, so no rounding is inserted for it.
    ``exact_tf32``: every decoded value is exact in TF32 (at most 11
    significant bits), so strict fp32 products split only the other operand.
    """

    scales: Any  # torch.fx.Node or AttrRef
    block: int
    decode: str
    dtype: torch.dtype
    format: str = ""
    exact_tf32: bool = False


SHIFT_MODES = ("fill", "wrap", "clamp", "reflect")


@dataclass(frozen=True)
class ShiftedIndex:
    """Where a ``shifted`` value (``ctx.read_shifted``) reads its operand: along dim ``d``,
    output coordinate ``i`` reads the operand at ``scales[d] * i + offsets[d]``; ``mode``
    (one of ``SHIFT_MODES``) says what a coordinate outside the operand reads."""

    scales: tuple[int, ...]
    offsets: tuple[int, ...]
    mode: str
    new_dims: tuple[int, ...] = ()  # dims of the result the operand lacks: read as size 1 there
    fixed_dims: tuple[tuple[int, int], ...] = ()  # (dim, index): operand dims the result lacks, read at index
    # ``ctx.read_reshaped``: the operand's elements in row-major order, read as the result's
    # shape (scales 1, offsets 0, no new or fixed dims); its coordinates come from the
    # result's by division and remainder
    reshaped: bool = False


@dataclass(eq=False)
class Value:
    """One node of the kernel expression DAG."""

    op: str  # one of IR_OPS
    shape: tuple[int, ...]
    is_bool: bool = False
    args: tuple["Value", ...] = ()
    template: str = ""
    constant: Any = None
    # const only: the element count the constant is, less ``size_less``
    # (``LoweringContext.count``), which a kernel whose sizes vary takes at run time
    # instead of as a literal (docs/dynamic.md).
    size: Optional[int] = None
    size_less: int = 0
    source: Any = None  # load: torch.fx.Node or AttrRef
    reduce_op: str = ""
    dims: tuple[int, ...] = ()  # reduce: dims of args[0].shape, non-negative
    keepdim: bool = True
    # -- dot only (``LoweringContext.matmul``) --
    transpose_b: bool = False  # b is stored [..., N, K]: read transposed, in place
    column_dims: int = 1  # the columns span this many trailing dims of b and of the result
    # How the eager op multiplies fp32 operands where that differs from torch's matmul
    # rule (``allow_tf32`` / matmul precision): e.g. "tf32" for a library call with its
    # own TF32 switch; None follows the matmul rule.
    fp32_precision: Optional[str] = None
    dtype: Optional[torch.dtype] = None  # the product's dtype in eager (set when composed)
    packed: Optional[PackedWeight] = None  # load: a quantised weight (see PackedWeight)
    # shifted only: args[0] is read at these coordinates, args[1] is the fill ("fill" mode)
    shift: Optional[ShiftedIndex] = None
    uid: int = field(default_factory=lambda: next(_ids))


REDUCE_OPS = ("sum", "max", "min")
IR_OPS = ("load", "const", "pointwise", "reduce", "dot", "extern", "shifted")


class LoweringRefused(Exception):
    """Raised by ``ctx.refuse``: this node stays eager, with the given reason."""

    def __init__(self, code: str, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


def broadcast_shapes(*shapes: Sequence[int] | int) -> tuple[int, ...]:
    """The shape ``shapes`` broadcast to, as ``torch.broadcast_shapes`` gives (which imports
    sympy on first use: seconds of a cold first call); ``RuntimeError`` if they don't."""
    out: list[int] = []
    for shape in shapes:
        shape = (int(shape),) if isinstance(shape, int) else tuple(int(d) for d in shape)
        so_far = tuple(out)
        out = [1] * (len(shape) - len(out)) + out
        for i, size in enumerate(shape, start=len(out) - len(shape)):
            if size != out[i] and out[i] != 1 and size != 1:
                raise RuntimeError(
                    f"shape {shape} cannot be broadcast with {so_far} (the shapes before it "
                    f"broadcast together): size {size} against {out[i]}, "
                    f"{len(out) - i} dimension(s) from the end"
                )
            out[i] = out[i] if size == 1 else size
    return tuple(out)


def describe_tensor(value: torch.Tensor):
    """The ``TensorMetadata`` (as ``ShapeProp`` files under ``node.meta["tensor_meta"]``) of a
    tensor, without probing memory formats: torch's probe imports sympy, seconds of a cold
    first call. ``memory_format`` is ``None``; the strides say it all."""
    from torch.fx.passes.shape_prop import TensorMetadata

    stride = value.stride() if value.layout == torch.strided else ()
    return TensorMetadata(value.shape, value.dtype, value.requires_grad, stride, None, value.is_quantized, {})


#: ``node.meta`` key: True where the node's result re-reads an input's memory (a view), so
#: it moves no data (the report counts it as free). The capture sets it from the values it
#: saw; a graph pass sets it on the nodes it adds through ``annotate_node``.
FREE_KEY = "autofuser_free"


def annotate_node(node: torch.fx.Node, value: torch.Tensor, inputs: Sequence[torch.Tensor] = ()) -> None:
    """File what a graph pass knows of a node it added: ``value``'s metadata (a tensor
    computed alike, a meta tensor will do) and whether it is a view of one of ``inputs``
    (the tensors it was computed from, alike), which the report counts as free."""
    node.meta["tensor_meta"] = describe_tensor(value)
    base = value._base
    node.meta[FREE_KEY] = any(value is t or (base is not None and (base is t or base is t._base)) for t in inputs)


def tensor_meta(node: Any):
    """The ``TensorMetadata`` recorded for an fx node, or ``None`` for non-tensors."""
    if isinstance(node, torch.fx.Node):
        meta = node.meta.get("tensor_meta")
        if meta is not None and hasattr(meta, "shape"):
            return meta
    return None


class LoweringContext:
    """What a lowering function sees: its node, its module, and IR builders."""

    def __init__(self, node: torch.fx.Node, root: torch.nn.Module, helpers: dict[str, str]):
        self.node = node
        self.root = root
        self.module: Optional[torch.nn.Module] = (
            root.get_submodule(cast(str, node.target)) if node.op == "call_module" else None
        )
        self._helpers = helpers
        meta = tensor_meta(node)
        self.out_shape: Optional[tuple[int, ...]] = tuple(meta.shape) if meta is not None else None
        self.out_dtype: Optional[torch.dtype] = meta.dtype if meta is not None else None

    # -- facts about arguments ---------------------------------------------

    def is_tensor(self, arg: Any) -> bool:
        return tensor_meta(arg) is not None

    def shape(self, arg: Any) -> tuple[int, ...]:
        meta = tensor_meta(arg)
        if meta is None:
            self.refuse("not_a_tensor", f"argument {arg!r} is not a tensor")
        return tuple(meta.shape)

    def dtype(self, arg: Any) -> torch.dtype:
        meta = tensor_meta(arg)
        if meta is None:
            self.refuse("not_a_tensor", f"argument {arg!r} is not a tensor")
        return meta.dtype

    # -- building IR ---------------------------------------------------------

    def refuse(self, code: str, reason: str) -> NoReturn:
        raise LoweringRefused(code, reason)

    def const(self, value: Any) -> Value:
        if isinstance(value, bool):
            return Value("const", (), is_bool=True, constant=value)
        if isinstance(value, (int, float)):
            return Value("const", (), constant=float(value))
        self.refuse("unsupported_argument", f"constant {value!r} of type {type(value).__name__}")

    def count(self, n: int, less: int = 0) -> Value:
        """The element count ``n`` less ``less`` (a variance's correction) - what a mean
        or norm divides by - as a float constant: a literal in kernels specialised on
        their shapes, a run-time size in kernels whose sizes vary (docs/dynamic.md),
        where a literal would make every size a kernel of its own."""
        return Value("const", (), constant=float(n - less), size=int(n), size_less=int(less))

    def tensor(self, arg: Any) -> Value:
        """An operand: a tensor-valued fx node, or a Python number as a constant."""
        if isinstance(arg, Value):
            return arg
        if isinstance(arg, torch.fx.Node):
            meta = tensor_meta(arg)
            if meta is None:
                self.refuse("not_a_tensor", f"argument {arg.name} is not a tensor")
            return self._load(arg, meta.shape, meta.dtype)
        return self.const(arg)

    def attr(self, name: str) -> Value:
        """A parameter or buffer of this node's module as an operand (read at call time)."""
        if self.module is None:
            raise ValueError("ctx.attr() is for call_module lowerings")
        value = getattr(self.module, name)
        if not isinstance(value, torch.Tensor):
            self.refuse("not_a_tensor", f"{self.node.target}.{name} is not a tensor")
        return self._load(AttrRef(f"{self.node.target}.{name}"), value.shape, value.dtype)

    def _load(self, source: Any, shape: Sequence[int], dtype: torch.dtype) -> Value:
        if dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.bool):
            self.refuse("unsupported_dtype", f"operand of dtype {dtype} (kernels read float32/16, bfloat16, bool)")
        return Value("load", tuple(shape), is_bool=dtype == torch.bool, source=source)

    def pointwise(self, template: str, *operands: Any, is_bool: bool = False) -> Value:
        """``template`` over ``operands`` (Values or numbers), broadcast as torch does."""
        args = tuple(self.tensor(v) for v in operands)
        try:
            shape = broadcast_shapes(*(a.shape for a in args))
        except RuntimeError as err:
            self.refuse("shape_mismatch", str(err))
        return Value("pointwise", shape, is_bool=is_bool, args=args, template=template)

    def reduce(self, op: str, value: Any, dims: Any = None, keepdim: bool = False) -> Value:
        """``op`` in ``sum``/``max``/``min`` over ``dims`` (``None``: all dims)."""
        if op not in REDUCE_OPS:
            raise ValueError(f"reduce op {op!r} not in {REDUCE_OPS}")
        value = self.tensor(value)
        rank = len(value.shape)
        if dims is None or dims == ():
            dims = tuple(range(rank))
        elif isinstance(dims, int):
            dims = (dims,)
        norm = tuple(sorted({d % rank if rank else 0 for d in dims}))
        if keepdim:
            shape = tuple(1 if i in norm else s for i, s in enumerate(value.shape))
        else:
            shape = tuple(s for i, s in enumerate(value.shape) if i not in norm)
        return Value("reduce", shape, args=(value,), reduce_op=op, dims=norm, keepdim=keepdim)

    def matmul(
        self, a: Any, b: Any, transpose_b: bool = False, column_dims: int = 1, fp32_precision: Optional[str] = None
    ) -> Value:
        """``a @ b`` (``a @ b.transpose(-2, -1)`` with ``transpose_b``) over the last two dims.

        ``column_dims=c`` lets the columns span ``b``'s last ``c`` dims: ``a``
        is ``[..., M, K]``, ``b`` is ``[..., K, N1, ..., Nc]`` and the result
        ``[..., M, N1, ..., Nc]`` - a product over a channels-first tensor's
        channel dim, read in place. The layout walks the ``c`` dims as one
        column index, so every tensor of the group must walk them contiguously
        (any strides, as long as they merge), else the group is refused.
        """
        a, b = self.tensor(a), self.tensor(b)
        if column_dims < 1 or (column_dims > 1 and transpose_b):
            raise ValueError("column_dims must be >= 1, and 1 with transpose_b")
        if len(a.shape) < 2 or len(b.shape) < 1 + column_dims:
            self.refuse("unsupported_shape", "matrix products of vectors stay eager")
        m, k = a.shape[-2:]
        if transpose_b:
            kb, columns, b_batch = b.shape[-1], (b.shape[-2],), b.shape[:-2]
        else:
            kb, columns, b_batch = (
                b.shape[-1 - column_dims],
                b.shape[len(b.shape) - column_dims :],
                b.shape[: -1 - column_dims],
            )
        if k != kb:
            self.refuse("shape_mismatch", f"inner dims {k} and {kb} differ")
        try:
            batch = broadcast_shapes(a.shape[:-2], b_batch)
        except RuntimeError as err:
            self.refuse("shape_mismatch", str(err))
        return Value(
            "dot",
            batch + (m,) + tuple(columns),
            args=(a, b),
            transpose_b=transpose_b,
            column_dims=column_dims,
            fp32_precision=fp32_precision,
        )

    def read_as(self, arg: Any, shape: Sequence[int]) -> Value:
        """Read tensor ``arg`` (an fx node or a loaded ``Value``) as ``shape``: its own
        shape with size-1 dims inserted or removed, nothing else (``[O, C, 1, 1]`` as
        ``[O, C]``, ``[C]`` as ``[C, 1, 1]``). No data moves: the layout reads the
        tensor through its own strides."""
        value = self.tensor(arg)
        shape = tuple(int(s) for s in shape)
        if value.op != "load":
            self.refuse("unsupported_argument", "only tensors read from memory can be re-read with another shape")
        if [s for s in shape if s != 1] != [s for s in value.shape if s != 1]:
            self.refuse(
                "shape_mismatch",
                f"{list(value.shape)} can't be read as {list(shape)}: only size-1 dims may be inserted or removed",
            )
        return Value("load", shape, is_bool=value.is_bool, source=value.source)

    def read_shifted(
        self,
        arg: Any,
        shape: Sequence[int],
        offsets: Sequence[int],
        scales: Optional[Sequence[int]] = None,
        mode: str = "fill",
        fill: Any = 0.0,
        new_dims: Sequence[int] = (),
        fixed_dims: Optional[dict[int, int]] = None,
    ) -> Value:
        """``arg`` (a value, an fx node or a number) read at other coordinates, as ``shape``.

        ``arg`` has one dim per dim of ``shape`` but ``new_dims``, where it is read
        as if it had a dim of size 1 (a ``stack``'s new dim), plus ``fixed_dims``
        (``{dim of arg: index}``), which the result lacks and which are read at that
        one index (a ``select``). Along each dim ``d``, output
        coordinate ``i`` reads ``arg`` at ``scales[d] * i + offsets[d]`` (``scales``
        default 1). A coordinate outside ``arg`` reads, by ``mode``:

        - ``"fill"``: ``fill`` (a number, or a value broadcast to ``shape`` and read
          at the output's own coordinates) - a zero-padded border, one input's slice
          of a concatenation (``fill`` being the read of the next input);
        - ``"wrap"``: ``arg`` at that coordinate modulo its size - a roll, a circular pad;
        - ``"clamp"``: the nearest edge - a replicated border;
        - ``"reflect"``: mirrored about the edge, the edge not repeated - a reflected
          border; the read may reach at most ``size - 1`` past either edge.

        A size-1 dim of ``arg`` is a real extent here, not a broadcast. A group whose
        values are computed from ``arg`` computes them again at these coordinates;
        only the core's own layout (one domain, no matrix product) reads this way,
        and every other composition refuses such a group.
        """
        value = self.tensor(arg)
        shape = tuple(int(s) for s in shape)
        rank = len(shape)
        offsets = tuple(int(o) for o in offsets)
        scales = (1,) * rank if scales is None else tuple(int(s) for s in scales)
        new_dims = tuple(sorted({int(d) % rank for d in new_dims})) if rank else ()
        if mode not in SHIFT_MODES:
            raise ValueError(f"read_shifted mode {mode!r} is not one of {SHIFT_MODES}")
        fixed: dict[int, int] = {}
        for d, index in (fixed_dims or {}).items():
            d = int(d) % max(len(value.shape), 1)
            if not 0 <= index < value.shape[d]:
                raise ValueError(f"read_shifted: index {index} of dim {d} is outside the operand's {value.shape[d]}")
            fixed[d] = int(index)
        if len(value.shape) - len(fixed) + len(new_dims) != rank or len(offsets) != rank or len(scales) != rank:
            raise ValueError(
                f"read_shifted: operand of rank {len(value.shape)} with new dims {list(new_dims)} and fixed dims "
                f"{sorted(fixed)}, shape {list(shape)}, {len(offsets)} offsets and {len(scales)} scales must all "
                "have one entry per dim"
            )
        operand_shape = [n for d, n in enumerate(value.shape) if d not in fixed]
        for d in new_dims:
            operand_shape.insert(d, 1)
        if any(s < 1 for s in scales):
            raise ValueError(f"read_shifted: scales {list(scales)} must be positive")
        if any(n == 0 for n in value.shape + shape):
            self.refuse("unsupported_shape", "shifted reads of empty tensors stay eager")
        if mode == "reflect":
            for n_in, n_out, scale, offset in zip(operand_shape, shape, scales, offsets):
                low, high = offset, scale * (n_out - 1) + offset
                if low < -(n_in - 1) or high > 2 * (n_in - 1):
                    self.refuse(
                        "unsupported_argument",
                        f"a reflected read from {low} to {high} of a dim of size {n_in} mirrors more than once",
                    )
        if mode == "fill":
            fill_value = self.tensor(fill)
            if fill_value.is_bool != value.is_bool:
                self.refuse("unsupported_dtype", "read_shifted: the fill and the operand differ in being bool")
            try:
                if broadcast_shapes(fill_value.shape, shape) != shape:
                    raise RuntimeError(f"it would grow {list(shape)}")
            except RuntimeError as err:
                self.refuse("shape_mismatch", f"read_shifted: fill of shape {list(fill_value.shape)}: {err}")
            args: tuple[Value, ...] = (value, fill_value)
        else:
            args = (value,)
        return Value(
            "shifted",
            shape,
            is_bool=value.is_bool,
            args=args,
            shift=ShiftedIndex(
                scales=scales, offsets=offsets, mode=mode, new_dims=new_dims, fixed_dims=tuple(sorted(fixed.items()))
            ),
        )

    def read_reshaped(self, arg: Any, shape: Sequence[int]) -> Value:
        """``arg`` (a value or an fx node) read as ``shape``: its elements in row-major
        order, as ``torch.reshape`` orders them, whatever ``arg``'s strides. A read at
        output coordinates ``i`` takes ``arg`` at the coordinates of the same row-major
        position, found by division and remainder; what ``arg`` is computed from is
        computed there, each tensor read through its own strides. For the reshapes eager
        has to copy (a merge of dims that a permute made non-adjacent in memory); a
        reshape that is a view needs no value at all (its readers read its strides).
        Like every shifted read, only the core's own one-domain layout takes it."""
        value = self.tensor(arg)
        shape = tuple(int(s) for s in shape)
        count = 1
        for n in value.shape:
            count *= n
        target = 1
        for n in shape:
            target *= n
        if count != target:
            self.refuse(
                "shape_mismatch", f"{list(value.shape)} ({count} elements) can't be read as {list(shape)} ({target})"
            )
        if count == 0:
            self.refuse("unsupported_shape", "reshaped reads of empty tensors stay eager")
        rank = len(shape)
        return Value(
            "shifted",
            shape,
            is_bool=value.is_bool,
            args=(value,),
            shift=ShiftedIndex(scales=(1,) * rank, offsets=(0,) * rank, mode="wrap", reshaped=True),
        )

    def packed_weight(
        self,
        data: Any,
        scales: Any,
        shape: Sequence[int],
        block: int,
        decode: str,
        dtype: torch.dtype,
        format: str = "",
        exact_tf32: bool = False,
    ) -> Value:
        """A quantised weight of logical ``shape`` (reduction dim last), stored as
        ``data`` (int8/uint8 elements, reduction dim padded to a multiple of
        ``block``) and ``scales`` (one per ``block`` elements): see ``PackedWeight``.

        It may only be the second operand of ``ctx.matmul(..., transpose_b=True)``
        somewhere in the group; a group that reads it any other way is refused.
        """
        for arg, what in ((data, "elements"), (scales, "scales")):
            meta = tensor_meta(arg)
            if meta is None or meta.dtype not in (torch.int8, torch.uint8):
                self.refuse("unsupported_dtype", f"packed weight {what} must be an int8/uint8 tensor")
        data_shape, scale_shape = tensor_meta(data).shape, tensor_meta(scales).shape
        shape = tuple(shape)
        padded = -(-shape[-1] // block) * block
        if (
            len(data_shape) != len(shape)
            or tuple(data_shape[:-1]) != shape[:-1]
            or data_shape[-1] != padded
            or tuple(scale_shape) != shape[:-1] + (padded // block,)
        ):
            self.refuse(
                "shape_mismatch",
                f"packed weight of shape {list(shape)} stored as {list(data_shape)} "
                f"elements and {list(scale_shape)} scales (block {block})",
            )
        if decode not in self._helpers:
            raise ValueError(f"packed weight decoder {decode!r} is not a helper: register it with ctx.helper first")
        return Value(
            "load",
            shape,
            source=data,
            packed=PackedWeight(
                scales=scales, block=block, decode=decode, dtype=dtype, format=format, exact_tf32=exact_tf32
            ),
        )

    def extern(self) -> Value:
        """This node as one opaque value of its own output shape.

        For an op that is real and lowered, but that only a strategy with its
        own ``compose`` can generate (a whole attention, a convolution): such a
        strategy reads the node's arguments from the graph itself. The generic
        composition (``compose_group``) refuses every group containing an
        extern value, so the generic strategies never take the node.
        """
        if self.out_shape is None:
            self.refuse("not_a_tensor", f"{self.node.name}'s result is not a single tensor")
        return Value("extern", self.out_shape, is_bool=self.out_dtype == torch.bool)

    def helper(self, name: str, source: str) -> str:
        """Add a ``@triton.jit`` helper function to the kernel module; returns ``name``.

        ``source`` is the full function text including the decorator. The
        same name must always come with the same text.
        """
        existing = self._helpers.get(name)
        if existing is not None and existing != source:
            raise ValueError(f"kernel helper {name!r} defined twice with different source")
        self._helpers[name] = source
        return name

    # -- conveniences built on the primitives -----------------------------

    def where(self, cond: Any, a: Any, b: Any) -> Value:
        return self.pointwise("tl.where({0}, {1}, {2})", cond, a, b)

    def mean(self, value: Any, dims: Any = None, keepdim: bool = False) -> Value:
        value = self.tensor(value)
        total = self.reduce("sum", value, dims, keepdim)
        count = 1
        for d in set(total_dims(value, dims)):
            count *= value.shape[d]
        return self.pointwise("{0} * %r" % (1.0 / max(count, 1)), total)

    def normalize(self, x: Any, dims: Any, n: int, eps: float, weight: Any = None, bias: Any = None) -> Value:
        """``(x - mean) * rsqrt(var + eps) * weight + bias`` over ``dims`` (``n`` elements):
        the standardisation that layer, group and instance norms share."""
        x = self.tensor(x)
        mean = self.pointwise("{0} / {1}", self.reduce("sum", x, dims, keepdim=True), self.count(n))
        deviation = self.pointwise("{0} - {1}", x, mean)
        squares = self.reduce("sum", self.pointwise("{0} * {0}", deviation), dims, keepdim=True)
        var = self.pointwise("{0} / {1}", squares, self.count(n))
        out = self.pointwise("{0} * tl.rsqrt({1} + %r)" % eps, deviation, var)
        if weight is not None:
            out = self.pointwise("{0} * {1}", out, weight)
        if bias is not None:
            return self.pointwise("{0} + {1}", out, bias)
        # Eager's exact zeros are +0.0 (it adds a shift, 0 without a bias); a zero deviation
        # times rstd and a negative weight, or a row of -0.0, would give -0.0 here.
        return self.pointwise("{0} + 0.0", out)


def total_dims(value: Value, dims: Any) -> tuple[int, ...]:
    rank = len(value.shape)
    if dims is None or dims == ():
        return tuple(range(rank))
    if isinstance(dims, int):
        dims = (dims,)
    return tuple(d % rank for d in dims)
