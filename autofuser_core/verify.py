"""Verification: is a fused group's kernel right?

The driver (compile.py) runs the graph once with a ``Verifier``, which keeps the real
values at each kept group's boundary (``snapshot``: copies, so later in-place ops can't
change them) and hands each group to the driver's check as soon as eager has produced
its outputs. The check compares the kernel's outputs with eager's (``max_error``, within
the loosest ``tolerance`` of the group's ops), then runs both again on drawn inputs that
cover what one real batch may not (``synthetic_mismatch``; docs/verification.md).

The job records the Verifier walks are the driver's (``compile._Job``): it reads each
one's ``candidate.program`` and keeps its own state in ``started``, ``inputs``,
``outputs``, ``storages``, ``watched`` and ``overwritten_by``.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Optional, Sequence, cast

import torch
import torch.fx

from .effects import barrier_reason
from .group import ROUNDED_DTYPES, GroupProgram, attr_tensor
from .ir import AttrRef
from .planner import Candidate
from .rewrite import SAVED_NODES_KEY
from .specs import DEFAULT_TOLERANCES, Tolerance, dtype_name

logger = logging.getLogger("autofuser.verify")


def snapshot(value: Any) -> Any:
    """A detached copy of a tensor with the same shape and strides (the kernel
    was written for those strides); other values as they are."""
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach()
    copy = value.clone()
    if copy.stride() == value.stride() or value.numel() == 0:
        return copy
    # An overlapping view (expand): copy the memory it spans and view it alike.
    span = 1 + sum((size - 1) * stride for size, stride in zip(value.shape, value.stride()))
    return value.as_strided((span,), (1,)).clone().as_strided(value.shape, value.stride())


class Verifier(torch.fx.Interpreter):
    """Runs the graph once and checks each group as soon as eager has produced
    its outputs, so only one group's boundary values are held at a time.

    A group's inputs are copied as they are when the group would run: at its
    first node for those already computed, and as they are produced for the
    rest (the planner guarantees nothing writes memory between a group's first
    and last node). Outputs are copied as eager produces them. Copies, because
    a later in-place op (``a.add_(1)``, ``out[:, :3] = y``) must not change what
    the kernel is checked against.

    With ``track_writes`` it also notes, for each group, any later in-place op
    that writes into the memory of one of its inputs (through any view): with
    gradients on, the group's backward recomputes from those inputs, so such a
    group must stay eager (eager's own ops may not need the old values).
    """

    def __init__(self, gm: torch.fx.GraphModule, jobs: list, check, track_writes: bool = False):
        super().__init__(gm)
        self.check = check
        self.writers = {}
        self.opaque = {}  # untraceable or hooked parts: whatever they write shows in version counters
        if track_writes:
            for n in gm.graph.nodes:
                reason = barrier_reason(n, gm)
                if reason is not None and reason[0] == "mutation":
                    self.writers[n] = reason[1]
                elif reason is not None and reason[0] == "opaque":
                    self.opaque[n] = reason[1]
        self.jobs = jobs
        self.first_of: dict[torch.fx.Node, list] = {}
        self.input_of: dict[torch.fx.Node, list] = {}
        self.output_of: dict[torch.fx.Node, list] = {}
        self.last_of: dict[torch.fx.Node, list] = {}
        for job in jobs:
            program = job.candidate.program
            self.first_of.setdefault(program.nodes[0], []).append(job)
            self.last_of.setdefault(program.nodes[-1], []).append(job)
            for t in program.inputs:
                if isinstance(t.source, torch.fx.Node):
                    self.input_of.setdefault(t.source, []).append(job)
            for t in program.outputs:
                self.output_of.setdefault(t.source, []).append(job)

    def run_node(self, n: torch.fx.Node) -> Any:
        for job in self.first_of.get(n, ()):
            job.started = True
            for t in job.candidate.program.inputs:
                if isinstance(t.source, torch.fx.Node) and t.source in self.env:
                    job.inputs[t.source] = snapshot(self.env[t.source])
                    self._remember_storage(job, self.env[t.source])
                elif isinstance(t.source, AttrRef):
                    self._remember_storage(job, attr_tensor(self.module, t.source.path))
        if n in self.writers:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            for tensor in _written_tensors(n, args, kwargs, self.module):
                ptr = tensor.untyped_storage().data_ptr()
                for job in self.jobs:
                    if job.started and job.overwritten_by is None and ptr in job.storages:
                        job.overwritten_by = f"{n.name} ({self.writers[n]})"
        watched = (
            [
                (job, t, t._version)
                for job in self.jobs
                if job.started and job.overwritten_by is None
                for t in job.watched
            ]
            if n in self.opaque
            else []
        )
        result = super().run_node(n)
        for job, tensor, version in watched:
            if tensor._version != version and job.overwritten_by is None:
                job.overwritten_by = f"{n.name} (an opaque part that wrote in place)"
        for job in self.input_of.get(n, ()):
            if job.started and n not in job.inputs:
                job.inputs[n] = snapshot(result)
                self._remember_storage(job, result)
        for job in self.output_of.get(n, ()):
            job.outputs[n] = snapshot(result)
        for job in self.last_of.get(n, ()):
            self.check(job)
            job.inputs, job.outputs = {}, {}
        return result

    def _remember_storage(self, job, value: Any) -> None:
        # The storage object itself is kept, so its address can't be reused by another tensor.
        if (self.writers or self.opaque) and isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            job.storages[storage.data_ptr()] = storage
            job.watched.append(value)


def _written_tensors(node: torch.fx.Node, args: tuple, kwargs: dict, root: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors an in-place node writes into: ``out=``, else its first argument;
    a module's buffers too (BatchNorm's running statistics)."""
    out = kwargs.get("out")
    if out is not None:
        candidates = list(out) if isinstance(out, (tuple, list)) else [out]
    else:
        candidates = list(args[:1])
    if node.op == "call_module":
        candidates += list(root.get_submodule(cast(str, node.target)).buffers())  # call_module: a path
    return [t for t in candidates if isinstance(t, torch.Tensor)]


def tolerance(candidate: Candidate, view) -> Tolerance:
    """The loosest tolerance of the group's ops over every dtype inside the group:
    a bf16 step inside makes fp32 outputs carry bf16 error, and so does a product
    that runs in TF32."""
    dtypes = set()
    for node in candidate.nodes:
        for n in (node, *node.all_input_nodes):
            meta = n.meta.get("tensor_meta")
            if meta is not None and hasattr(meta, "dtype") and meta.dtype.is_floating_point:
                dtypes.add(dtype_name(meta.dtype))
    if candidate.program is not None and candidate.program.precision == "tf32":  # tf32x3 is held to fp32
        dtypes.add("tf32")
    tols = []
    for name in dtypes or {"float32"}:
        found = [view.lowering_of[n].tolerances.get(name) for n in candidate.nodes if n in view.lowering_of]
        found = [t for t in found if t is not None] or [DEFAULT_TOLERANCES.get(name, DEFAULT_TOLERANCES["float32"])]
        tols.extend(found)
    return Tolerance(atol=max(t.atol for t in tols), rtol=max(t.rtol for t in tols))


def where_worst(fused: torch.Tensor, eager: torch.Tensor) -> str:
    """Where ``fused`` is farthest from ``eager`` (finite elements), said for a mismatch's
    reason: the element, both values there, and eager's largest magnitude in the output,
    which tell a rounding difference of a large sum from a wrong value."""
    try:
        a, b = fused.detach().float(), eager.detach().float()
        finite = torch.isfinite(a) & torch.isfinite(b)
        diff = torch.where(finite, (a - b).abs(), torch.zeros_like(a))
        if diff.numel() == 0:
            return ""
        flat = int(diff.reshape(-1).argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape)) if diff.dim() else ()
        largest = float(torch.where(torch.isfinite(b), b.abs(), torch.zeros_like(b)).max())
        return (
            f"at {list(index)}: {float(a.reshape(-1)[flat]):.6g} against eager's {float(b.reshape(-1)[flat]):.6g}, "
            f"where eager's largest magnitude is {largest:.4g}"
        )
    except Exception:  # noqa: BLE001 - a detail of the reason, never a failure of the check
        return ""


def max_error(fused: torch.Tensor, eager: torch.Tensor, tol: Tolerance, scale_rows: bool = False) -> tuple[bool, float]:
    """Whether ``fused`` is within ``tol`` of ``eager``, and the largest difference.
    ``scale_rows``: ``atol`` relative to each row's largest magnitude (``_half_scale``) and
    the mean error held to the plain bound whatever the dtype, as fp16/bf16 always are."""
    if fused.dtype == torch.bool or eager.dtype == torch.bool:
        ok = torch.equal(fused, eager)
        return ok, 0.0 if ok else 1.0
    # fp32 is exact enough to compare fp32/fp16/bf16 results, and half the memory of fp64.
    a, b = fused.float(), eager.float()
    # Where either side is not finite, both must be the same: NaN where eager has NaN, the
    # same infinity where it has one. (A tolerance of rtol * inf would let any finite
    # number, or the other infinity, pass.)
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False, float("nan")
    unequal_inf = (torch.isinf(a) | torch.isinf(b)) & (a != b)
    if bool(unequal_inf.any()):
        return False, float("inf")
    finite = torch.isfinite(b)
    a, b = a.masked_fill(~finite, 0), b.masked_fill(~finite, 0)
    diff = (a - b).abs()
    scaled = scale_rows or eager.dtype in ROUNDED_DTYPES
    ok = bool((diff <= tol.atol * (_half_scale(eager, b) if scaled else 1.0) + tol.rtol * b.abs()).all())
    if ok and scaled and diff.numel():
        # The scaled bound above is per element; on average the error must still meet the
        # plain one, which a kernel that is wrong across the board does not.
        ok = float(diff.mean()) <= tol.atol + tol.rtol * float(b.abs().mean())
    return ok, float(diff.max()) if diff.numel() else 0.0


#: Where a fused output misses eager's by more than the tolerance, both are held to the
#: group's own ops run in float64 (``float64_outputs``): the fused output stands where it
#: is at most this many times as far from that as eager's own output is, element by
#: element, plus the tolerance (``closer_than_eager``). A long sum in fp32 (a bias
#: gradient over every point, a product reducing over thousands of rows) rounds
#: differently in each order, and where its terms cancel, both sides miss the exact value
#: by far more than the dtype's tolerance of the result; a wrong kernel misses it by
#: about the values.
FLOAT64_FACTOR = 4.0
#: An element's own eager error can be near zero by luck, where the kernel's rounding of
#: the same sum is not: each element's bound takes at least this quantile of its row's
#: eager errors (a high one: most of a row's errors stay under it, and one large value in
#: the row - a channel far from the others - does not lift every element's bound).
FLOAT64_ROW_QUANTILE = 0.9


@contextlib.contextmanager
def no_autocast():
    """Autocast off on every device a group may run on: a float64 judge computes in float64,
    and a backward graph holds its own casts."""
    with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
        yield


#: What a dtype asked for inside ``exact_casts`` becomes: the widest of its kind.
_EXACT = {
    torch.float16: torch.float64,
    torch.bfloat16: torch.float64,
    torch.float32: torch.float64,
    torch.complex64: torch.complex128,
}
_NARROWING_METHODS = frozenset({"half", "bfloat16", "float"})
#: Calls whose dtype is not a cast: a bitcast view keeps its meaning.
_KEPT = frozenset({"view"})


class exact_casts(torch.overrides.TorchFunctionMode):
    """Inside a float64 judge: every floating dtype a call asks for (``x.to(torch.bfloat16)``,
    ``dtype=`` of a factory or a softmax, ``x.half()``) is float64 (complex128) instead, so
    the casts a group holds as nodes (autocast's, made explicit on CUDA) do not round its
    exact reference, and a complex64 tensor a model makes of its own takes complex128
    values."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name in _NARROWING_METHODS and first is not None and first.dtype == torch.float64:
            return first.clone()  # a cast copies: what is written into its result stays there
        if name in _KEPT:
            return func(*args, **kwargs)
        narrow = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.dtype) and a in _EXACT]
        if not narrow:
            return func(*args, **kwargs)
        wide = tuple(_EXACT.get(a, a) if isinstance(a, torch.dtype) else a for a in args)
        found = func(*wide, **{k: _EXACT.get(v, v) if isinstance(v, torch.dtype) else v for k, v in kwargs.items()})
        return found.clone() if first is not None and found is first else found  # a cast copies; this would alias


def float64_outputs(eager: torch.fx.GraphModule, inputs: Sequence[Any], count: int) -> Optional[list[Any]]:
    """The group's eager ops (``eager``, the group module) on ``inputs`` widened to float64,
    autocast off: its ``count`` visible outputs, then the values it saves for the backward
    (``SAVED_NODES_KEY``), in the kernel's output order; ``None`` where it has no floating
    input or can't run so (an op without float64 support; no memory for the float64
    copies). The weights it reads, as attributes or inside the modules it calls, are
    widened too, for that run only: the model's own stay as they are. Under autocast
    too, the reference is the ops' exact arithmetic: eager's bf16 roundings (its
    products' operands and results) are then part of its error, which a kernel rounding at other points must stay within
    ``FLOAT64_FACTOR`` of, element by element - a bound tighter than the bf16 tolerance
    wherever eager is closer to exact than that tolerance."""
    if not any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in inputs):
        return None
    try:
        wide = [t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs]
        with no_autocast(), torch.no_grad():
            recording = _Recording(eager, widen=True)
            found = recording.run(*wide)
    except Exception as err:  # noqa: BLE001 - no float64 judge for this group: its plain check stands
        logger.debug("the group's ops don't run in float64 (%s)", err)
        return None
    return ([found] if count == 1 else list(found)) + recording.saved


class Float64Judge:
    """One group's float64 judge over one set of inputs: the group's ops run in float64
    (``float64_outputs``) once, at the first output that misses eager's, and each such
    output weighed against them (``closer_than_eager``). ``ran``: whether the ops ran."""

    def __init__(self, eager: torch.fx.GraphModule, inputs: Sequence[Any], count: int):
        self.eager, self.inputs, self.count = eager, inputs, count
        self.exact: Optional[list[Any]] = None

    @property
    def ran(self) -> bool:
        return bool(self.exact)

    def accepts(self, slot: int, fused: torch.Tensor, eager: torch.Tensor, tol: Tolerance) -> bool:
        """Whether output ``slot`` of the kernel (``fused``), which missed ``eager``, stands."""
        if self.exact is None:
            self.exact = float64_outputs(self.eager, self.inputs, self.count) or []
        return slot < len(self.exact) and closer_than_eager(fused, eager, self.exact[slot], tol)[0]


def closer_than_eager(fused: torch.Tensor, eager: torch.Tensor, exact: Any, tol: Tolerance) -> tuple[bool, float]:
    """Whether ``fused`` is as close to ``exact`` (the float64 result) as ``eager`` is, within
    ``FLOAT64_FACTOR``: each element within that many times the larger of its own eager
    error and its row's ``FLOAT64_ROW_QUANTILE`` of them, plus ``tol`` of the exact value;
    and on average, what exceeds ``tol`` within that many times eager's mean error.
    Non-finite values must be where eager has them (``max_error``), and an exact value
    must be finite where eager's is. Returns the verdict and the largest error of
    ``fused`` against ``exact``; ``False`` where it can't be judged (no memory for it)."""
    if not isinstance(exact, torch.Tensor) or not exact.is_floating_point() or not fused.is_floating_point():
        return False, float("nan")
    try:
        return _closer_than_eager(fused, eager, exact, tol)
    except Exception as err:  # noqa: BLE001 - not judged: the plain check's miss stands
        logger.debug("the float64 judge could not compare (%s)", err)
        return False, float("nan")


def _closer_than_eager(fused: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor, tol: Tolerance):
    ok, error = max_error(fused, eager, Tolerance(atol=math.inf, rtol=0.0))  # only the non-finite rule
    if not ok:
        return False, error
    finite = torch.isfinite(eager.float())
    x = exact.to(device=fused.device)
    if not bool(torch.isfinite(x[finite]).all()):
        return False, float("inf")  # eager finite where the exact value is not: nothing to weigh
    if x.numel() == 0:
        return True, 0.0
    x = x.masked_fill(~finite, 0)
    off_f = (fused.double().masked_fill(~finite, 0) - x).abs()
    off_e = (eager.double().masked_fill(~finite, 0) - x).abs()
    rows = off_e.reshape(-1, off_e.shape[-1]) if off_e.dim() else off_e.reshape(1, 1)
    k = max(1, math.ceil(FLOAT64_ROW_QUANTILE * rows.shape[1]))
    typical = rows.kthvalue(k, dim=1, keepdim=True).values.expand_as(rows).reshape(off_e.shape)
    allowed = tol.atol + tol.rtol * x.abs()
    ok = bool((off_f <= FLOAT64_FACTOR * torch.maximum(off_e, typical) + allowed).all())
    if ok:
        excess = (off_f - allowed).clamp_min(0)
        ok = float(excess.mean()) <= FLOAT64_FACTOR * float(off_e.mean())
    return ok, float(off_f.max())


def _half_scale(eager: torch.Tensor, values: torch.Tensor):
    """What ``atol`` is relative to where rows are scaled (``max_error``): each row's
    largest magnitude when above 1. Asked for fp16/bf16 outputs (docs/architecture.md,
    Tolerances: eager rounds each intermediate to the half type, so the two sides differ
    by roundings of the terms summed into an element, which can be far larger than the
    element), and by the synthetic check for every dtype. Values past half the dtype's
    range (masking sentinels such as ``finfo.min``) and infinities don't count."""
    if values.numel() == 0:
        return 1.0
    magnitude = values.abs()
    sentinel = torch.finfo(eager.dtype).max / 2
    magnitude = torch.where(torch.isfinite(magnitude) & (magnitude < sentinel), magnitude, torch.zeros_like(magnitude))
    rows = magnitude.reshape(-1, magnitude.shape[-1]) if magnitude.dim() else magnitude.reshape(1, 1)
    scale = rows.amax(dim=1, keepdim=True).clamp_min(1.0)
    return scale.expand_as(rows).reshape(values.shape)


#: Synthetic verification (docs/verification.md). Real inputs of one batch may all be
#: positive, or small, and a lowering wrong only elsewhere would pass on them; so each group
#: is also run once on drawn inputs and compared with its own eager ops on the same ones.
#: Seeded: the same group gets the same draws on every compile.
SYNTHETIC_SEED = 1234
#: Per kind of special value (+large, -large, +tiny, -tiny), one element in this many.
SYNTHETIC_SPECIAL_EVERY = 64
#: "Large" is this many times the real input's largest finite magnitude ...
SYNTHETIC_LARGE = 2.0
#: ... and "tiny" this share of its root mean square.
SYNTHETIC_TINY = 1e-6
#: The largest magnitude drawn for fp32 and wider: squares and sums of thousands of
#: squares stay finite in fp32 (sqrt of fp32's largest, 1.8e19, over 2048).
SYNTHETIC_WIDE_LIMIT = 9e15


def _synthetic_like(real: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A floating tensor with ``real``'s shape, strides, dtype and device, drawn to cover
    what one real batch may not: ``randn`` times the real values' root mean square (so
    both signs, at their scale), a few values of twice their largest magnitude and a few
    of a millionth of their scale, each of either sign, and an exact zero.

    Draws stay well inside the dtype's range, where eager and a kernel may part for
    reasons that say nothing about the kernel: half types keep the large values below
    half the square root of their range (eager squaring one in fp16 overflows where a
    kernel computing in fp32 does not), or at the real values' largest; for fp32 and
    wider, real values beyond ``SYNTHETIC_WIDE_LIMIT`` are drawn scaled down to it (near
    fp32's range, eager on CPU accumulating in double stays finite where an fp32 sum
    overflows)."""
    values = real.detach()
    finite = values[torch.isfinite(values)].float()
    peak = float(finite.abs().max()) if finite.numel() else 0.0
    scale = float(finite.square().mean().sqrt()) if finite.numel() else 0.0
    if not (math.isfinite(scale) and scale > 0):
        scale = peak if math.isfinite(peak) and peak > 0 else 1.0
    if real.dtype not in ROUNDED_DTYPES and peak > SYNTHETIC_WIDE_LIMIT:
        scale, peak = scale * (SYNTHETIC_WIDE_LIMIT / peak), SYNTHETIC_WIDE_LIMIT
    large = SYNTHETIC_LARGE * max(peak, scale)
    if real.dtype in ROUNDED_DTYPES:
        large = min(large, max(peak, math.sqrt(torch.finfo(real.dtype).max) / 2))
    else:
        large = min(large, SYNTHETIC_WIDE_LIMIT)
    # Drawn over the memory the strides span, then viewed alike: an expanded input stays
    # expanded (each drawn value seen at every position that shares it), as the kernel expects.
    span = 1 + sum((size - 1) * stride for size, stride in zip(real.shape, real.stride()))
    drawn = torch.randn(span, generator=generator, device=real.device, dtype=torch.float32) * scale
    if span >= 8:
        count = max(1, span // SYNTHETIC_SPECIAL_EVERY)
        where = torch.randint(0, span, (4 * count + 1,), generator=generator, device=real.device)
        special = torch.tensor(
            [large, -large, scale * SYNTHETIC_TINY, -scale * SYNTHETIC_TINY], device=real.device
        ).repeat_interleave(count)
        drawn[where[:-1]] = special
        drawn[where[-1:]] = 0.0
    return drawn.to(real.dtype).as_strided(real.shape, real.stride())


def _synthetic_inputs(program: GroupProgram, kernel_inputs: Sequence[Any]) -> Optional[list]:
    """The group's inputs for its synthetic check, or ``None`` where none is drawn.

    Only floating activations (values the graph computes or takes as inputs) are drawn;
    parameters and buffers keep their real values (eager reads a module's own parameters,
    ``self.ln(x)``, and the kernel reads the same), and integer and bool inputs keep theirs
    (indices must stay in range, masks and counts mean what they mean). A group with a
    node of integer result gets no draws at all: the values it turns into integers could
    be positions."""
    for node in program.nodes:
        meta = node.meta.get("tensor_meta")
        dtype = getattr(meta, "dtype", None)
        if dtype is not None and not dtype.is_floating_point and dtype != torch.bool:
            return None
    drawn, any_drawn = [], False
    generators: dict[torch.device, torch.Generator] = {}
    for tensor, real in zip(program.inputs, kernel_inputs):
        activation = isinstance(tensor.source, torch.fx.Node) and tensor.source.op != "get_attr"
        if activation and isinstance(real, torch.Tensor) and real.is_floating_point() and real.numel():
            if real.device not in generators:
                generators[real.device] = torch.Generator(device=real.device)
                generators[real.device].manual_seed(SYNTHETIC_SEED)
            drawn.append(_synthetic_like(real, generators[real.device]))
            any_drawn = True
        else:
            drawn.append(real)
    return drawn if any_drawn else None


class _Recording(torch.fx.Interpreter):
    """A group's eager module run node by node, keeping the values of the nodes whose
    results the kernel also writes for the group's backward (``saved``, in output order)."""

    def __init__(self, eager: torch.fx.GraphModule, widen: bool = False):
        super().__init__(eager)
        self.names = list(eager.meta.get(SAVED_NODES_KEY, ()))
        self.found: dict[str, Any] = {}
        # widen: the floating tensors the group reads as attributes, and the parameters and
        # buffers of the modules it calls, in float64; the modules' other buffers copied too:
        # what a module updates in place (a batch norm's running statistics and step count)
        # is the copy, never the model's.
        self.widen = widen

    def fetch_attr(self, target: str) -> Any:
        value = super().fetch_attr(target)
        if self.widen and isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.detach().double()
        return value

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        if not self.widen:
            return super().call_module(target, args, kwargs)
        module = super().fetch_attr(target)
        state = {
            name: tensor.detach().double() if tensor.is_floating_point() else tensor.detach().clone()
            for name, tensor in (*module.named_parameters(), *module.named_buffers())
        }
        return torch.func.functional_call(module, state, tuple(args), dict(kwargs))

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        if n.name in self.names:
            self.found[n.name] = result
        return result

    @property
    def saved(self) -> list[Any]:
        return [self.found[name] for name in self.names]


def synthetic_mismatch(job, kernel_inputs: Sequence[Any], tol: Tolerance) -> Optional[str]:
    """Why the group's kernel disagrees with its own eager ops on synthetic inputs
    (``_synthetic_inputs``), compared as fp16/bf16 results are on the real ones
    (``max_error`` with ``scale_rows``), or ``None``.

    Eager runs first: inputs it refuses (outside an op's domain) say nothing about the
    kernel, and the kernel is then not launched on them."""
    program = job.candidate.program
    drawn = _synthetic_inputs(program, kernel_inputs)
    if drawn is None:
        return None
    try:
        # Through the interpreter, node by node, as the real check's eager values came: the
        # group module's generated Python can differ from its nodes (fx prints
        # ``operator.pow(-2.0, y)`` as ``-2.0 ** y``, which Python reads as ``-(2.0 ** y)``).
        recording = _Recording(job.eager)
        expected = recording.run(*drawn)
    except Exception as err:
        logger.debug(
            "group %s: eager refuses the synthetic inputs (%s); checked on the real ones only", job.entry.nodes, err
        )
        return None
    expected = [expected] if len(program.visible_outputs) == 1 else list(expected)
    # Outputs written for the backward (last) are checked too: eager's values of their nodes.
    expected += recording.saved
    try:
        outputs = job.fused.launch(*drawn)
    except Exception as err:
        return (
            f"the kernel failed on synthetic inputs, where eager runs: {type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}; kept eager"
        )
    judge = Float64Judge(job.eager, drawn, len(program.visible_outputs))
    for slot, (out_tensor, eager_tensor, meta) in enumerate(zip(outputs, expected, program.outputs)):
        # atol relative to each output row's largest magnitude, whatever the dtype: the draws
        # are at the real inputs' scale, which may be far from 1, and with both signs and a
        # few large values their sums cancel more than real data does, so an element can be
        # much smaller than the terms whose roundings it carries. A wrong kernel is wrong by
        # about the values themselves, and the mean error is still held to the plain bound.
        ok, error = max_error(out_tensor, eager_tensor, tol, scale_rows=True)
        if not ok and math.isfinite(error):
            ok = judge.accepts(slot, out_tensor, eager_tensor, tol)
        if not ok:
            return (
                f"output {meta.name} matches eager on the real inputs but differs from it by {error:.3g} on "
                f"synthetic ones (drawn at each floating input's scale, both signs, with large and tiny "
                f"values; docs/verification.md; tolerance atol {tol.atol:g}, rtol {tol.rtol:g}); kept eager"
            )
    return None
