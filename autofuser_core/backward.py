"""Backward graphs of fused groups, planned and fused like forward ones.

With gradients on, each fused group gets a backward graph: PyTorch's own derivative
of the group's original ops, traced to ATen by ``make_fx`` (AOT Autograd's tracer)
from the group's inputs and its outputs' gradients, with torch's core ATen
decompositions, so that ``gelu``'s backward is the pointwise ops it is made of and a
layer norm's backward is row sums and pointwise ops. The graph takes the results of
the group's products from the forward, whose kernel writes them as extra outputs
(``compile._save_products``; eager saves them too, and never computes a product
again), and recomputes the rest of what it needs from the group's inputs (saved by
the forward, as eager's backward saves its inputs). Each ATen call whose
packet has a torch function of the same name and schema (``aten.mul.Tensor`` ->
``torch.mul``) is called through that function, so the plugins' lowerings, which
know torch functions, see the backward's ops as they see a forward's; others stay
ATen calls and run eager. The graph then goes through
``compile_graph`` like any forward (planning, strategies, verification, tuning).

Nothing here knows an op: which ops a backward holds is PyTorch's derivative
formulas and decompositions, which of them fuse is the plugins' lowerings.
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from .capture import record_shapes
from .group import GroupProgram
from .ir import AttrRef
from .launch import FusedKernel, run_eager
from .rewrite import SAVED_NODES_KEY, extract_group_module
from .specs import PRODUCT_TOLERANCES, dtype_name
from .verify import closer_than_eager, exact_casts, max_error, no_autocast

logger = logging.getLogger("autofuser.compile")

#: Seed of the sample gradients a backward graph is traced and verified with.
GRAD_SEED = 4321
#: ``gm.meta`` flag of a group's backward graph, for compiling (``compile_graph``).
BACKWARD_GRAPH_KEY = "autofuser_backward_graph"


def trace_backward(
    fused: FusedKernel,
    inputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    saved: Sequence[torch.Tensor] = (),
):
    """The ATen graph of the group's backward: ``(inputs..., saved..., grads...) -> one
    gradient per floating-point input`` (zeros where an input gets none), and those
    inputs' slots. Traced under the current autocast state, whose casts it then holds:
    it runs with autocast off.

    ``saved``: the values the kernel wrote for the backward (its products' results,
    ``fused.saved_names``). The ops after each such node read it as a leaf of its own;
    the gradient reaching that leaf then goes through the node's own derivative, which
    for a product reads only its operands, so the product's recompute is dead code
    (dropped by ``to_torch_level``). Leaves are taken last to first: a later one's node
    may read an earlier one's leaf."""
    slots = [k for k, t in enumerate(inputs) if t.is_floating_point()]
    count, kept = len(inputs), len(saved)
    meta = getattr(fused.eager, "meta", {})
    names = list(meta.get(SAVED_NODES_KEY, ())) if kept else []
    if len(names) != kept:
        raise ValueError(f"{kept} saved values for {len(names)} saved nodes of the group")

    def backward(*values: torch.Tensor):
        leaves = [t.detach().requires_grad_(k in slots) for k, t in enumerate(values[:count])]
        taken = [t.detach().requires_grad_() for t in values[count : count + kept]]
        made: dict[str, torch.Tensor] = {}
        with torch.enable_grad():
            found = run_eager(fused, leaves, dict(zip(names, taken)), made)
            outputs = found if isinstance(found, (tuple, list)) else (found,)
            pairs = [(o, g) for o, g in zip(outputs, values[count + kept :]) if o.requires_grad]
            if not pairs:
                return tuple(torch.zeros_like(leaves[k]) for k in slots)
            wanted = [leaves[k] for k in slots]
            result: list[Optional[torch.Tensor]] = list(
                torch.autograd.grad(
                    [o for o, _ in pairs],
                    wanted + taken,
                    [g for _, g in pairs],
                    allow_unused=True,
                    retain_graph=bool(taken),
                )
            )
            result, through = result[: len(wanted)], result[len(wanted) :]
            for j in reversed(range(kept)):
                value = made.get(names[j])
                if through[j] is None or value is None or not value.requires_grad:
                    continue
                more = torch.autograd.grad(value, wanted + taken[:j], through[j], allow_unused=True, retain_graph=True)
                result = [_sum(a, b) for a, b in zip(result, more[: len(wanted)])]
                through[:j] = [_sum(a, b) for a, b in zip(through[:j], more[len(wanted) :])]
        return tuple(torch.zeros_like(leaves[k]) if g is None else g for k, g in zip(slots, result))

    decompositions = dict(core_aten_decompositions())
    gm = make_fx(backward, decomposition_table=decompositions)(*inputs, *saved, *grads)
    return gm, slots


def saved_values_read(root: torch.fx.GraphModule, program: GroupProgram) -> Optional[set[str]]:
    """The names of ``program``'s outputs saved for backward (``KernelTensor.saved``) that
    its traced backward reads, found before any kernel is written: the backward traced on
    meta tensors (shapes, strides and dtypes only) and its dead code dropped, as
    ``build_backward`` does. ``None`` where it can't be traced so (an op without a meta
    kernel): then every saved value is kept, and ``build_backward`` drops what is unread."""
    eager = extract_group_module(root, program)
    live_attrs, attr_inputs = [], {}
    for slot, tensor in enumerate(program.inputs):
        if isinstance(tensor.source, AttrRef):
            owner, _, name = tensor.source.path.rpartition(".")
            live_attrs.append((slot, root.get_submodule(owner) if owner else root, name))
            attr_inputs[slot] = tensor.source.path
    group = SimpleNamespace(eager=eager, live_attrs=live_attrs, attr_inputs=attr_inputs)

    def meta(tensor) -> torch.Tensor:
        dtype = tensor.cast_from or tensor.dtype  # eager reads it before the launcher's cast
        return torch.empty_strided(tensor.shape, tensor.stride, dtype=dtype, device="meta")

    inputs = [meta(t) for t in program.inputs]
    saved = [meta(t) for t in program.outputs if t.saved]
    grads = [meta(t) for t in program.visible_outputs]
    try:
        gm, _ = trace_backward(group, inputs, grads, saved)  # type: ignore[arg-type]
    except Exception as err:  # noqa: BLE001 - no meta kernel, data-dependent ops: keep them all
        logger.debug("tracing %s on meta tensors failed", [n.name for n in program.nodes], exc_info=err)
        return None
    gm.graph.eliminate_dead_code()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"][len(inputs) : len(inputs) + len(saved)]
    return {t.name for t, node in zip([t for t in program.outputs if t.saved], placeholders) if node.users}


def _sum(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Two parts of one gradient, either missing (``None``)."""
    if a is None:
        return b
    return a if b is None else a + b


def _torch_function(target: Any) -> Optional[Callable]:
    """The public torch function of an ATen overload's name (``aten.mul.Tensor`` ->
    ``torch.mul``), or ``None``. Whether it reads the arguments the same way is checked
    on the traced values (``to_torch_level``)."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    name = target.overloadpacket.__name__
    if name.startswith("_") or name.endswith("_"):  # private, or in place (trying it would write twice)
        return None
    fn = getattr(torch, name, None)
    return fn if callable(fn) else None


def _same(a: Any, b: Any) -> bool:
    """Whether two results are identical: values, dtypes, shapes and strides."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and not isinstance(a, torch.Tensor) and a == b


class _Translator(torch.fx.Interpreter):
    """Runs the ATen graph on sample values; each ATen call whose torch function returns
    the identical result on the same arguments is called through that function."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm)
        self.extra_traceback = False
        self.changed = 0

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        fn = _torch_function(n.target) if n.op == "call_function" else None
        if fn is not None:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            try:
                same = _same(fn(*args, **kwargs), result)
            except Exception:  # noqa: BLE001 - another schema: the ATen call stays
                same = False
            if same:
                n.target = fn
                self.changed += 1
        return result


def to_torch_level(gm: torch.fx.GraphModule, samples: Sequence[Any]) -> int:
    """Call each ATen op of ``gm`` through its torch function where that gives the
    identical result on ``samples`` (in place); ``aten.alias`` (a no-op of the traced
    function) is dropped. Returns how many calls changed."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.alias.default:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    translator = _Translator(gm)
    translator.run(*samples)
    gm.recompile()
    return translator.changed


def _outputs(values: Any) -> list[Optional[torch.Tensor]]:
    return list(values) if isinstance(values, (tuple, list)) else [values]


def build_backward(
    fused: FusedKernel, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], compile_graph, progress
):
    """The group's backward graph, fused: ``(FusedBackward, report)``; or, where it can't be
    had, why (an op ``make_fx`` can't trace, or a traced graph whose gradients differ from
    eager's backward on the same samples): then the group's backward recomputes its eager
    ops."""
    # ``outputs``: every output the kernel wrote, those saved for the backward last.
    outputs, saved = list(outputs[: fused.n_visible]), list(outputs[fused.n_visible :])
    started = time.perf_counter()
    # Sample gradients from a generator of their own: the user's random stream stays as it was.
    generator = torch.Generator(device=outputs[0].device if outputs else "cpu").manual_seed(GRAD_SEED)
    grads = [
        torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device).normal_(generator=generator)
        for o in outputs
    ]
    try:
        gm, slots = trace_backward(fused, inputs, grads, saved)
    except Exception as err:  # noqa: BLE001 - an op make_fx can't trace: the eager backward serves
        logger.debug("tracing a backward failed", exc_info=err)
        return f"its backward could not be traced ({type(err).__name__})"
    reach = output_reach(fused, inputs)
    with no_autocast(), torch.no_grad():
        to_torch_level(gm, (*inputs, *saved, *grads))
        reads = _drop_unread_saved(gm, len(inputs), len(saved))
        saved = [saved[j] for j in reads]
        traced = gm(*inputs, *saved, *grads)
    differs = _differs_from_eager(fused, inputs, grads, slots, traced)
    if differs is not None:
        # A decomposition can pair an op's forward with a derivative that reads another of its
        # outputs than the decomposed forward returns: the eager backward serves.
        return f"its traced backward {differs}"
    with no_autocast(), torch.no_grad():
        record_shapes(gm, *inputs, *saved, *grads)
        gm.meta["autofuser_input_names"] = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
        gm.meta[BACKWARD_GRAPH_KEY] = True
        traced_s = time.perf_counter() - started
        fused_gm, report = compile_graph(gm, (*inputs, *saved, *grads), progress)
    report.phases = {"trace": traced_s, **report.phases}
    for entry in [*report.groups, *report.unfused_nodes]:
        entry.phase = "backward"
    return FusedBackward(fused_gm, slots, grads, reach, reads), report


def _eager_gradients(
    fused: FusedKernel,
    inputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    slots: Sequence[int],
) -> Sequence[Optional[torch.Tensor]]:
    """Eager's own backward of the group: the gradient of each input in ``slots`` (``None``
    where eager gives it none) for output gradients ``grads``."""
    leaves = [t.detach().requires_grad_(k in slots) for k, t in enumerate(inputs)]
    with torch.enable_grad():
        found = run_eager(fused, leaves)
        outputs = found if isinstance(found, (tuple, list)) else (found,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
        if not pairs:
            return [None] * len(slots)
        return torch.autograd.grad(
            [o for o, _ in pairs], [leaves[k] for k in slots], [g for _, g in pairs], allow_unused=True
        )


def _float64_gradients(
    fused: FusedKernel,
    inputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    slots: Sequence[int],
) -> Optional[Sequence[Optional[torch.Tensor]]]:
    """The group's backward in float64, autocast off, the casts it holds keeping float64
    (``verify.exact_casts``; ``_eager_gradients`` on widened inputs and output gradients):
    the judge where the traced backward misses eager's
    (``verify.closer_than_eager``). ``None`` where the ops don't run so (an op without
    float64 support, a weight the group reads that is not among its inputs)."""

    def wide(t: torch.Tensor) -> torch.Tensor:
        return t.double() if t.is_floating_point() else t.to(torch.complex128) if t.is_complex() else t

    try:
        with no_autocast(), exact_casts():  # the group's own casts keep float64 too
            return _eager_gradients(fused, [wide(t) for t in inputs], [wide(g) for g in grads], slots)
    except Exception as err:  # noqa: BLE001 - no float64 judge: the miss stands
        logger.debug("the group's backward doesn't run in float64 (%s)", err)
        return None


def _differs_from_eager(
    fused: FusedKernel,
    inputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    slots: Sequence[int],
    traced: Any,
) -> Optional[str]:
    """How the traced backward's gradients (``traced``, one per slot) differ from those of
    eager's own backward of the group on the same inputs, or ``None`` where they agree
    within the product tolerance of their dtype (the traced graph is the same arithmetic,
    decomposed), or where they miss it but are as near the group's backward run in
    float64 as eager's are (``verify.closer_than_eager``: a weight's gradient sums over
    every point, and two orders of that sum through bf16 products part by more than
    bf16's tolerance of the result)."""
    try:
        expected = _eager_gradients(fused, inputs, grads, slots)
    except RuntimeError as err:
        # Eager's own backward can fail where the traced one ran (an in-place op's broadcast
        # shape, as in ``output_reach``): nothing to compare with.
        logger.debug("eager's backward of %s failed; its traced one is not compared", fused.nodes, exc_info=err)
        return None
    # The narrowest dtype the group computes in bounds how far two orders of the same
    # arithmetic drift apart: its outputs' gradients', or autocast's (an fp32 input's
    # gradient then comes through bf16 products).
    dtypes = {dtype_name(g.dtype) for g in grads}
    dtypes |= {dtype_name(torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)}
    exact: Optional[Sequence[Optional[torch.Tensor]]] = None
    for index, (k, got, want) in enumerate(zip(slots, _outputs(traced), expected)):
        if want is None or got is None:
            continue  # no gradient in eager: the traced graph gives zeros, which are not used
        known = [PRODUCT_TOLERANCES[d] for d in dtypes | {dtype_name(want.dtype)} if d in PRODUCT_TOLERANCES]
        tol = max(known or [PRODUCT_TOLERANCES["float32"]], key=lambda t: (t.atol, t.rtol))
        ok, error = max_error(got, want, tol, scale_rows=True)
        if ok:
            continue
        if exact is None:
            exact = _float64_gradients(fused, inputs, grads, slots) or []
        judged = exact[index] if index < len(exact) else None
        missed = f"gives input {k} a gradient off eager's by {error:.3g}"
        if judged is None:
            return f"{missed} (no float64 judge: the group's backward doesn't run in float64)"
        closer, off = closer_than_eager(got, want, judged, tol)
        if not closer:
            # Both sides' largest errors against float64, to tell which one drifted.
            eager_off = (
                float((want.double() - judged.to(want.device)).abs().max())
                if judged.shape == want.shape
                else float("nan")
            )
            return f"{missed}, and is not as near float64's as eager's (largest errors {off:.3g} and {eager_off:.3g})"
    return None


def _drop_unread_saved(gm: torch.fx.GraphModule, count: int, kept: int) -> list[int]:
    """Which of the ``kept`` saved values (placeholders after the ``count`` inputs) the
    backward graph reads; the others' placeholders are removed (in place), so the forward
    holds only what the backward reads (a product whose result only a sum reads after it
    needs none)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"][count : count + kept]
    reads = []
    for j, node in enumerate(placeholders):
        if node.users:
            reads.append(j)
        else:
            gm.graph.erase_node(node)
    gm.recompile()
    return reads


def output_reach(fused: FusedKernel, inputs: Sequence[torch.Tensor]) -> list[frozenset[int]]:
    """For each input, the outputs its values reach through the group's original ops (an
    autograd path, whatever the values), from one eager run on ``inputs``: eager gives an
    input no gradient (``None``, not zeros) where no output it reaches gets one."""
    slots = [k for k, t in enumerate(inputs) if t.is_floating_point() or t.is_complex()]
    leaves = [t.detach().requires_grad_(k in slots) for k, t in enumerate(inputs)]
    reach: list[set[int]] = [set() for _ in inputs]
    try:
        with torch.enable_grad():
            found = run_eager(fused, leaves)
            outputs = found if isinstance(found, (tuple, list)) else (found,)
            for index, output in enumerate(outputs):
                if not output.requires_grad:
                    continue
                gradients = torch.autograd.grad(
                    output, [leaves[k] for k in slots], torch.ones_like(output), allow_unused=True, retain_graph=True
                )
                for k, gradient in zip(slots, gradients):
                    if gradient is not None:
                        reach[k].add(index)
    except RuntimeError as err:
        # Eager's own backward can fail where the traced one ran (an in-place op's broadcast
        # shape); an input then counts as reaching every output, as before it was measured.
        logger.debug("finding which outputs each input reaches failed", exc_info=err)
        everything = set(range(len(fused.output_layout)))
        reach = [set(everything) if k in slots else set() for k in range(len(inputs))]
    return [frozenset(r) for r in reach]


def _zeros_strided(shape: torch.Size, stride: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros of ``shape`` laid out with ``stride`` (the gradient of an output nothing
    differentiated, where others' are given)."""
    extent = 1 + sum((size - 1) * step for size, step in zip(shape, stride)) if all(shape) else 0
    return torch.zeros(extent, dtype=dtype, device=device).as_strided(shape, stride)


def _restrided(grad: torch.Tensor, stride: tuple) -> torch.Tensor:
    """``grad``'s values in the layout the backward graph was traced for."""
    fresh = torch.empty_strided(grad.shape, stride, dtype=grad.dtype, device=grad.device)
    return fresh.copy_(grad)


class FusedBackward:
    """A group's fused backward as ``RecomputeForBackward`` calls it: the kernel's saved
    inputs, the values it saved for backward that the graph reads (``reads_saved``) and
    the outputs' gradients in (``None`` for an output nothing differentiated),
    one gradient or ``None`` per input out - ``None`` where eager gives none: an input
    that needs no gradient, or one that reaches (``reach``) only outputs without one."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        slots: Sequence[int],
        grads: Sequence[torch.Tensor],
        reach: Sequence[frozenset[int]],
        reads_saved: Sequence[int] = (),
    ):
        self.gm, self.slots, self.reach = gm, list(slots), list(reach)
        # Which of the values the kernel saves for backward (``FusedKernel.saved_names``)
        # the graph reads, in order: the forward holds only these.
        self.reads_saved = list(reads_saved)
        # The graph was traced for gradients of these layouts (its views assume them).
        self.grad_layouts = [(g.shape, g.stride(), g.dtype) for g in grads]

    def __call__(
        self,
        inputs: Sequence[torch.Tensor],
        grads: Sequence[Optional[torch.Tensor]],
        saved: Sequence[torch.Tensor] = (),
    ) -> list:
        result: list[Optional[torch.Tensor]] = [None] * len(inputs)
        given = {index for index, g in enumerate(grads) if g is not None}
        if not given:
            return result
        # The kernels' device (a saved one-element input may be in host memory).
        device = next(g.device for g in grads if g is not None)
        laid_out = [
            _zeros_strided(shape, stride, dtype, device)
            if g is None
            else g
            if g.stride() == stride
            else _restrided(g, stride)
            for g, (shape, stride, dtype) in zip(grads, self.grad_layouts)
        ]
        with no_autocast():
            found = self.gm(*inputs, *saved, *laid_out)
        for slot, grad in zip(self.slots, _outputs(found)):
            result[slot] = grad if inputs[slot].requires_grad and self.reach[slot] & given else None
        return result
