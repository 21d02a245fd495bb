"""Compiling one captured signature: plan, generate, tune, verify, rewrite.

``compile_graph`` runs, for one ``GraphModule`` and its real inputs:

1. the plugins' ``autofuser_transform_graph`` passes;
2. ``plan_fusion_groups`` (lowering, proposals, legality);
3. one interpreted run of the graph that keeps the real values at every kept
   group's boundary (RNG state and buffers are restored afterwards);
4. per group: write the kernel, load it from the cache folder, pick a config
   (tuned on a GPU and cached; the strategy's default under the interpreter),
   run it on the real inputs and compare with eager within the dtype's
   tolerance - a mismatch un-fuses that group only; on a GPU, also time fused
   against eager and keep the faster;
4b. on a GPU, a kept group is timed against a split of its nodes made in the
   next round, and the faster side is kept (``_settle``): a group of several
   products that round 1 kept against shorter groups of fewer products (then, where a
   row reduction feeds a product, against those with the reduction apart too); a
   group whose product is fed by a row reduction (a layer norm) against the same
   nodes with the reduction in a group of its own, once; one split per round, while
   the group keeps winning; groups that stayed eager are re-planned in the same rounds;
5. ``rewrite_graph``: every surviving group becomes one call.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
from dataclasses import dataclass, field
import gc
import logging
import math
import operator
import statistics
import time
from typing import Any, Optional, Sequence

import torch
import torch.fx

from .capture import preserved_state
from .cache import cache_dir, load_kernel_module, read_tuning, tuning_lock, write_tuning
from .group import (MAX_PRODUCTS, ROUNDED_DTYPES, STRICT_FP32, GroupProgram, attr_tensor, product_count,
                    reduction_prologue)
from .ir import AttrRef
from .launch import FusedKernel, cast_inputs, host_scalars, to_device
from .planner import SPLIT_RULES, Candidate, Plan, SplitRule, barrier_reason, plan_fusion_groups
from .precompile import CompileJob, Compiling, launch_items, start as start_compiling
from .registry import PLUGIN_FAULTS, PluginFault, PluginHookError, describe_target, record_fault
from .report import FusionReport, GroupEntry, NodeEntry, describe_graph
from .rounding import interpreting
from .rewrite import extract_group_module, rewrite_graph
from .specs import DEFAULT_TOLERANCES, Tolerance, dtype_name

logger = logging.getLogger("autofuser")


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off for a stretch of pure-Python work.

    Planning and writing kernels allocate hundreds of thousands of small objects
    that outlive the youngest generation (IR values, composed programs), and that
    sets off full collections, each a walk over every object the process holds
    (torch, the model, its graph): measured, up to half of a planning round.
    What these steps allocate is freed by reference counting; the collector
    runs as before afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _snapshot(value: Any) -> Any:
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


@dataclass(eq=False)  # a job is itself: compared by identity, never field by field (tensors)
class _Job:
    """One kept group on its way through verification."""

    candidate: Candidate
    entry: GroupEntry
    source: Any = None
    kernel: Any = None
    eager: Any = None
    started: bool = False
    inputs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    fused: Optional[FusedKernel] = None
    kernel_path: str = ""
    storages: dict = field(default_factory=dict)  # data_ptr -> storage of each input, while tracking writes
    watched: list = field(default_factory=list)  # its input tensors, for opaque parts' writes (version counters)
    overwritten_by: Optional[str] = None  # a later in-place op that writes into one of its inputs
    configs: Optional[tuple] = None  # _tuning_configs' answer, where compiling ahead asked for it


class _Verifier(torch.fx.Interpreter):
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

    def __init__(self, gm: torch.fx.GraphModule, jobs: list[_Job], check, track_writes: bool = False):
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
        self.first_of: dict[torch.fx.Node, list[_Job]] = {}
        self.input_of: dict[torch.fx.Node, list[_Job]] = {}
        self.output_of: dict[torch.fx.Node, list[_Job]] = {}
        self.last_of: dict[torch.fx.Node, list[_Job]] = {}
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
                    job.inputs[t.source] = _snapshot(self.env[t.source])
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
        watched = [(job, t, t._version) for job in self.jobs if job.started and job.overwritten_by is None
                   for t in job.watched] if n in self.opaque else []
        result = super().run_node(n)
        for job, tensor, version in watched:
            if tensor._version != version and job.overwritten_by is None:
                job.overwritten_by = f"{n.name} (an opaque part that wrote in place)"
        for job in self.input_of.get(n, ()):
            if job.started and n not in job.inputs:
                job.inputs[n] = _snapshot(result)
                self._remember_storage(job, result)
        for job in self.output_of.get(n, ()):
            job.outputs[n] = _snapshot(result)
        for job in self.last_of.get(n, ()):
            self.check(job)
            job.inputs, job.outputs = {}, {}
        return result

    def _remember_storage(self, job: _Job, value: Any) -> None:
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
        candidates += list(root.get_submodule(node.target).buffers())
    return [t for t in candidates if isinstance(t, torch.Tensor)]


def _tolerance(candidate: Candidate, view) -> Tolerance:
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


def _max_error(fused: torch.Tensor, eager: torch.Tensor, tol: Tolerance,
               scale_rows: bool = False) -> tuple[bool, float]:
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


def _half_scale(eager: torch.Tensor, values: torch.Tensor):
    """What ``atol`` is relative to where rows are scaled (``_max_error``): each row's
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
        special = torch.tensor([large, -large, scale * SYNTHETIC_TINY, -scale * SYNTHETIC_TINY],
                               device=real.device).repeat_interleave(count)
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


def _synthetic_mismatch(job: _Job, kernel_inputs: Sequence[Any], tol: Tolerance) -> Optional[str]:
    """Why the group's kernel disagrees with its own eager ops on synthetic inputs
    (``_synthetic_inputs``), compared as fp16/bf16 results are on the real ones
    (``_max_error`` with ``scale_rows``), or ``None``.

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
        expected = torch.fx.Interpreter(job.eager).run(*drawn)
    except Exception as err:
        logger.debug("group %s: eager refuses the synthetic inputs (%s); checked on the real ones only",
                     job.entry.nodes, err)
        return None
    expected = [expected] if len(program.outputs) == 1 else list(expected)
    try:
        outputs = job.fused.launch(*drawn)
    except Exception as err:
        return (f"the kernel failed on synthetic inputs, where eager runs: {type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}; kept eager")
    for out_tensor, eager_tensor, meta in zip(outputs, expected, program.outputs):
        # atol relative to each output row's largest magnitude, whatever the dtype: the draws
        # are at the real inputs' scale, which may be far from 1, and with both signs and a
        # few large values their sums cancel more than real data does, so an element can be
        # much smaller than the terms whose roundings it carries. A wrong kernel is wrong by
        # about the values themselves, and the mean error is still held to the plain bound.
        ok, err = _max_error(out_tensor, eager_tensor, tol, scale_rows=True)
        if not ok:
            return (f"output {meta.name} matches eager on the real inputs but differs from it by {err:.3g} on "
                    f"synthetic ones (drawn at each floating input's scale, both signs, with large and tiny "
                    f"values; docs/verification.md; tolerance atol {tol.atol:g}, rtol {tol.rtol:g}); kept eager")
    return None


#: Most timed calls per measurement. A typical fused kernel runs for less time on the GPU than
#: the host takes to launch it and its two events, so the number of calls, not ``rep_ms``,
#: sets how long tuning takes (BENCHMARKS.md, "Measurements behind rules in the code"). 30
#: calls give a stable median.
BENCH_MAX_CALLS = 30


def median_call_ms(fn, calls: int, warmup: int, before=None) -> float:
    """Median ms of one call of ``fn()`` on the current CUDA device: ``warmup`` untimed
    calls, then ``calls`` calls back to back, each between two CUDA events (and each
    after ``before()``, outside the events, where given)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    for start, end in events:
        if before is not None:
            before()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return float(statistics.median(start.elapsed_time(end) for start, end in events))


def _bench(fn, *args, rep_ms: float = 20) -> float:
    """Median ms of one call of ``fn(*args)`` on the current CUDA device, L2 flushed before
    each call (as Triton's ``do_bench``): after an untimed call (it loads the kernel), three
    timed calls; a call of ``rep_ms`` or more is measured by those three (an eager attention
    of 40 ms would otherwise cost nine calls), a shorter one by about ``rep_ms`` of further
    calls, at least 5 and at most ``BENCH_MAX_CALLS``."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    call = lambda: fn(*args)  # noqa: E731
    estimate_ms = median_call_ms(call, 3, warmup=1, before=flush.zero_)
    if estimate_ms >= rep_ms:
        return estimate_ms
    calls = max(5, min(BENCH_MAX_CALLS, int(rep_ms / max(estimate_ms, 1e-3))))
    return median_call_ms(call, calls, warmup=0, before=flush.zero_)


#: Milliseconds of repeats per tuning config (``_bench``'s ``rep_ms``): for a typical fused
#: kernel of tens of microseconds, the cap of ``BENCH_MAX_CALLS`` calls is what applies.
TUNING_REP_MS = 6


def device_key(device: torch.device) -> dict[str, Any]:
    import triton

    key = {"torch": torch.__version__, "triton": triton.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        key.update(gpu=props.name, capability=f"{props.major}.{props.minor}")
    else:
        key.update(gpu="interpreter", capability="cpu")
    return key


def _can_tune(device: torch.device, options) -> bool:
    """Tuning times real launches: only on a GPU (the interpreter's timings mean
    nothing), and only when the user asked for it."""
    return device.type == "cuda" and options.tune


def _can_time(device: torch.device, options) -> bool:
    """Fused-vs-eager timing, like tuning, means something only on a GPU."""
    return device.type == "cuda" and options.verify_speed


@dataclass
class _Tuned:
    config: dict
    cache_hit: bool = False
    seconds: float = 0.0
    timings: list = field(default_factory=list)
    key: Optional[dict] = None  # the cache key, where tuning (and so caching) happens
    speed: Optional[dict] = None  # a cached fused-vs-eager verdict: {"fused_ms", "eager_ms"}
    config_limit: Optional[int] = None  # tuned over only the first configs (a re-planning round)


#: Configs tuned per kernel in a re-planning round (the second on), the first ones in
#: the strategy's list (strategies list their most promising configs first). Those
#: rounds re-try the leftovers of groups that lost - shorter chains, single products
#: - and each config tuned is a Triton compile: a cold compile of the Galerkin
#: Transformer spent half its compiles in three re-planning rounds.
LATER_ROUND_CONFIGS = 4
_CONFIG_LIMIT: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("autofuser_config_limit", default=None)


def _tuning_configs(candidate: Candidate, every: bool = False) -> tuple[list[dict], Optional[int]]:
    """The configs tuning times: the strategy's valid ones in its order, the first
    ``max_tuned_configs`` of them (all with ``every``: ``tune_all_configs``), and in a
    re-planning round the first
    ``LATER_ROUND_CONFIGS``; the default where none is valid. Also the round's limit where
    it shortened the list (else ``None``): an entry tuned over fewer configs than a first
    round would try is tuned again by one (``_valid_entry``)."""
    strategy, program = candidate.strategy, candidate.program
    valid = [c for c in strategy.configs(program) if strategy.is_valid(program, c) is None]
    valid = valid if every else valid[:strategy.max_tuned_configs]
    limit = _CONFIG_LIMIT.get()
    cut = limit if limit is not None and len(valid) > limit else None
    return valid[:limit] or [strategy.default_config(program)], cut


def _tuning_key(source, device: torch.device, options) -> dict[str, Any]:
    key = {"kernel": source.name, "source_sha256": source.source_hash, **device_key(device)}
    if options.tune_all_configs:
        key["all_configs"] = True  # kept apart: a capped entry is not a whole list's
    return key


def _precompile_untuned(jobs: list, device: torch.device, options, progress) -> Optional[Compiling]:
    """Start compiling, in parallel, every config that tuning is about to time, kernels in
    the order they will be timed (see precompile.py); ``None`` where nothing is tuned."""
    if not _can_tune(device, options):
        return None
    root = cache_dir(options.cache_dir)
    work: dict[str, list[CompileJob]] = {}
    tuned: set[str] = set()  # kernels with a cached config (repeated layers share one: read it once)
    for job in jobs:
        if job.source.name in work or job.source.name in tuned:
            continue
        try:
            if _valid_entry(job.candidate, read_tuning(root, _tuning_key(job.source, device, options)), warn=False):
                tuned.add(job.source.name)
                continue
            job.configs = _tuning_configs(job.candidate, options.tune_all_configs)  # tuning reads them again
        except PluginHookError:
            continue  # the strategy's configs raised: its check refuses the group, naming it
        program = job.candidate.program
        # One job per set of argument dtypes: configs that convert the launcher's casts
        # themselves take those inputs unconverted.
        by_dtypes: dict[tuple, list] = {}
        for config in job.configs[0]:
            dtypes = (*job.source.input_dtypes(program, config), *(t.dtype for t in program.outputs))
            by_dtypes.setdefault(dtypes, []).append(launch_items(job.source.launch_args(config)))
        work[job.source.name] = [
            CompileJob(path=job.kernel_path, name=job.source.name,
                       dtypes=tuple(str(d).removeprefix("torch.") for d in dtypes), launches=tuple(launches))
            for dtypes, launches in by_dtypes.items()]
    return start_compiling([j for kernel_jobs in work.values() for j in kernel_jobs], progress)


def _finish_compiling(compiling: Optional[Compiling], report) -> None:
    if compiling is None:
        return
    compiled = compiling.finish()
    if compiled:
        report.notes.append(f"compiled {compiled} of {len(compiling.launches)} tuning config(s) in parallel "
                            "before timing")


def _pick_config(candidate: Candidate, source, kernel, inputs, device, options, progress, ready=None,
                 configs=None) -> _Tuned:
    """The config to launch with: the cached one, else tuned (``configs``: ``_tuning_configs``'
    answer where already known)."""
    if not _can_tune(device, options):
        return _Tuned(candidate.strategy.default_config(candidate.program))
    key = _tuning_key(source, device, options)
    root = cache_dir(options.cache_dir)
    entry = _valid_entry(candidate, read_tuning(root, key))
    if entry is None:
        # Another process (a rank of the same job) may be tuning this kernel: wait for
        # it, then read what it found, rather than tune the same kernel twice.
        with tuning_lock(root, key, on_wait=lambda: progress(f"waiting for another process tuning {source.name}")):
            entry = _valid_entry(candidate, read_tuning(root, key))
            if entry is None:
                return _tune(candidate, source, kernel, inputs, device, options, progress, root, key, ready, configs)
    return _Tuned(entry["config"], True, 0.0, entry.get("timings", []), key, entry.get("speed"),
                  entry.get("config_limit"))


def _valid_entry(candidate: Candidate, entry: Optional[dict], warn: bool = True) -> Optional[dict]:
    """A cached tuning entry whose config the strategy still accepts, else ``None`` (tune again):
    a validity rule added since the entry was written (a config found to fault, say) holds
    for cached configs too, and the config must be one the strategy lists now (or its
    default): an entry selects among the strategy's configs, it never adds one."""
    if entry is None:
        return None
    if entry.get("config_limit") is not None and _CONFIG_LIMIT.get() is None:
        return None  # tuned over a re-planning round's few configs; a first round tries them all
    strategy, program = candidate.strategy, candidate.program
    if entry["config"] == strategy.default_config(program):
        return entry  # the fallback when no listed config is valid; validity rules are written for the list
    try:
        why = strategy.is_valid(program, entry["config"])
    except Exception as err:  # a config missing a key the rule reads
        why = f"its validity check failed: {type(err).__name__}: {err}"
    if why is not None:
        if warn:
            logger.warning("cached config %s of %s is no longer valid (%s); tuning again", entry["config"],
                           candidate.strategy.name, why)
        return None
    # A cache entry only chooses among the strategy's own configs: one it doesn't list (an
    # older list, or an entry written by hand) could launch with block sizes nobody checked.
    if entry["config"] not in strategy.configs(program):
        if warn:
            logger.warning("cached config %s of %s is not one of the strategy's configs; tuning again",
                           entry["config"], candidate.strategy.name)
        return None
    return entry


def _tune(candidate: Candidate, source, kernel, inputs, device, options, progress, root, key,
          ready=None, configs=None) -> _Tuned:
    """Time the strategy's valid configs within the budget; store and return the fastest.
    ``ready(launch_args)``: wait until that config is compiled ahead (not counted as tuning)."""
    program = candidate.program
    default = candidate.strategy.default_config(program)
    configs, limit = configs or _tuning_configs(candidate, options.tune_all_configs)
    progress(f"tuning {source.name}: {len(configs)} configs")
    start = time.perf_counter()
    timings = []
    best, best_ms = default, float("inf")
    outputs = [torch.empty_strided(t.shape, t.stride, dtype=t.dtype, device=device) for t in program.outputs]
    waited = 0.0
    for config in configs:
        if time.perf_counter() - start - waited > options.tune_budget_s and timings:
            break
        launch = source.launch_args(config)
        if ready is not None:
            begin = time.perf_counter()
            ready(launch)
            waited += time.perf_counter() - begin
        grid = source.grid(config)
        # Timed with the launcher's conversions, as the forward runs them: a config that
        # converts its inputs itself (``KernelSource.converts_casts``) competes fairly.
        casts = source.casts(program, config)
        try:
            ms = _bench(lambda: kernel[grid](*cast_inputs(inputs, casts), *outputs, **launch),
                        rep_ms=TUNING_REP_MS)
        except Exception as err:  # a config the compiler rejects (resources) is just not a candidate
            logger.debug("config %s of %s failed: %s", config, source.name, err)
            continue
        timings.append({"config": config, "ms": ms})
        if ms < best_ms:
            best, best_ms = config, ms
    write_tuning(root, key, best, timings, config_limit=limit)
    return _Tuned(best, False, time.perf_counter() - start - waited, timings, key, config_limit=limit)


#: Planning rounds at most: each later one re-plans what the groups that lost covered.
MAX_ROUNDS = 6


def compile_graph(gm: torch.fx.GraphModule, inputs: tuple, plugin_set, options, progress,
                  backward: bool = False) -> tuple[torch.fx.GraphModule, FusionReport]:
    """Steps 1-5 of the module doc; returns the rewritten module and its report.

    ``backward``: the graph will run with gradients on, so every group must be
    able to recompute its ops for backward from its saved inputs.
    """
    # Plugin code that raises is contained (registry.py, PluginFault): the node or group it
    # concerned stays eager, and the compile returns normally, so the caller keeps its
    # verdict instead of compiling, and failing, again on every call.
    faults: list[PluginFault] = []
    token = PLUGIN_FAULTS.set(faults)
    try:
        new_gm, report = _compile_graph(gm, inputs, plugin_set, options, progress, backward)
    finally:
        PLUGIN_FAULTS.reset(token)
    report.notes.extend(fault.sentence for fault in faults)
    return new_gm, report


def _transform_graph(gm: torch.fx.GraphModule, plugin_set, options) -> None:
    """Step 1: every plugin's ``autofuser_transform_graph``. A pass that raises is undone (the graph as it was before it) and reported; the graph then
    still computes the model's function, without that pass."""
    for impl in plugin_set.manager.hook.autofuser_transform_graph.get_hookimpls():
        before = copy.deepcopy(gm.graph)
        try:
            impl.function(*[{"gm": gm, "options": options}[a] for a in impl.argnames])
            gm.recompile()
        except Exception as err:
            gm.graph = before  # recompiles
            record_fault(impl.plugin_name, "autofuser_transform_graph", err,
                         "its rewrite of the graph was undone and the graph is planned without it")


def _spell_negative_bases(gm: torch.fx.GraphModule) -> None:
    """``operator.pow`` of a negative number base as ``torch.pow``: fx writes the node
    ``operator.pow(-2.0, y)`` as ``-2.0 ** y``, which Python reads as ``-(2.0 ** y)``, so
    the rewritten graph's eager parts (and a group's eager fallback) would compute another
    function than the graph's nodes. A call is written as a call."""
    changed = False
    for node in gm.graph.nodes:
        base = node.args[0] if node.op == "call_function" and node.target is operator.pow and node.args else None
        if isinstance(base, (int, float)) and not isinstance(base, bool) and math.copysign(1.0, base) < 0:
            node.target = torch.pow
            changed = True
    if changed:
        gm.recompile()


def _veto(plugin_set, candidate: Candidate, options) -> Optional[str]:
    """The ``autofuser_veto_fusion`` hook, first non-``None`` answer wins (pluggy's
    order); an implementation that raises vetoes the group, naming itself."""
    impls = plugin_set.manager.hook.autofuser_veto_fusion.get_hookimpls()
    if any(impl.hookwrapper or getattr(impl, "wrapper", False) for impl in impls):
        try:  # wrappers need pluggy's own call; a fault is then one of these plugins'
            return plugin_set.manager.hook.autofuser_veto_fusion(group=candidate, options=options)
        except Exception as err:
            names = ", ".join(sorted({impl.plugin_name for impl in impls}))
            return record_fault(names, "autofuser_veto_fusion", err, "the group runs eager").sentence
    for impl in reversed(impls):
        try:
            answer = impl.function(*[{"group": candidate, "options": options}[a] for a in impl.argnames])
        except Exception as err:
            return record_fault(impl.plugin_name, "autofuser_veto_fusion", err, "the group runs eager").sentence
        if answer is not None:
            return answer
    return None


def _compile_graph(gm: torch.fx.GraphModule, inputs: tuple, plugin_set, options, progress,
                   backward: bool) -> tuple[torch.fx.GraphModule, FusionReport]:
    started = time.perf_counter()
    report = FusionReport(plugins=list(plugin_set.names), opaque=dict(gm.meta.get("autofuser_opaque", {})))
    _transform_graph(gm, plugin_set, options)
    _spell_negative_bases(gm)
    report.graph = describe_graph(gm)
    registry = plugin_set.registry.guarded()

    device = _device_of(inputs)
    taken: set[torch.fx.Node] = set()
    retry: Optional[set[torch.fx.Node]] = None  # later rounds: only the nodes of groups that stayed eager
    lost: set[tuple[str, frozenset]] = set()  # (strategy, nodes) of the groups that stayed eager
    survivors: list[tuple[Candidate, FusedKernel]] = []
    # Round 1 plans freely. A group of several ops that turns out wrong or slower
    # would leave all its nodes eager, so each later round re-plans the nodes no
    # kept group covers, without the groups that lost, and with fewer products per
    # group than the largest that lost (down to one): a group of several products
    # falls back to shorter chains and single products; a convolution that lost to
    # cuDNN leaves its epilogue to fuse on its own.
    # A kept, timed group that a split may beat is held back (``_split_rules``): the
    # next round also re-plans its nodes, under its rule, and whichever of the two
    # ran faster is kept (``_settle``). Beating eager does not make it the best split.
    max_products = MAX_PRODUCTS.get()
    round_number = 0
    plan: Optional[Plan] = None
    held: list[_Job] = []  # kept groups awaiting their split's timing
    rules: tuple[SplitRule, ...] = ()  # how the next round splits each held group's nodes
    pending: dict[frozenset, list[SplitRule]] = {}  # each kept group's splits not yet timed (``_split_rules``)
    while True:
        round_number += 1

        def veto(candidate):
            if taken.intersection(candidate.nodes) or (retry is not None and not retry.issuperset(candidate.nodes)):
                return "decided in an earlier round"
            nodes = set(candidate.nodes)
            if any(nodes & rule.nodes and not nodes <= rule.nodes for rule in rules):
                # a split of a held group stays inside it (the rules keep grown groups there; this
                # also holds strategies that compose on their own to it)
                return "decided in an earlier round"
            if (candidate.strategy.name, frozenset(candidate.nodes)) in lost:
                return "decided in an earlier round"
            return _veto(plugin_set, candidate, options)

        tokens = (STRICT_FP32.set(options.strict_fp32_products), MAX_PRODUCTS.set(max_products),
                  SPLIT_RULES.set(rules))
        step = time.perf_counter()
        try:
            with gc_paused():
                plan = plan_fusion_groups(gm, registry, veto=veto, options=options, earlier=plan)
        finally:
            SPLIT_RULES.reset(tokens[2])
            MAX_PRODUCTS.reset(tokens[1])
            STRICT_FP32.reset(tokens[0])
        report.add_phase("plan", time.perf_counter() - step)
        view = plan.view
        if round_number == 1:
            for entry in view.skipped:
                report.unfused_nodes.append(NodeEntry(node=entry.node, target=entry.target,
                                                      reason_code=entry.reason_code, reason=entry.reason))
            # An extern op only a specialised strategy can generate, which none took, runs eager too.
            kept = {n for candidate in plan.kept for n in candidate.nodes}
            for node, value in view.lowered.items():
                if value.op == "extern" and node not in kept:
                    report.unfused_nodes.append(NodeEntry(
                        node=node.name, target=describe_target(node.target), reason_code="extern_not_taken",
                        reason=f"{view.lowering_of[node].name} is lowered for a strategy with its own compose, "
                               "and no such strategy took this node (see its refused groups); it runs eager"))
        for decision in plan.decisions:
            if round_number == 1 or decision.reason != "decided in an earlier round":
                report.groups.append(_entry(decision.strategy, decision.nodes, view, False, decision.reason_code,
                                            decision.reason, decision.program))
        if device.type != "cuda" and not interpreting():
            report.notes.append("no CUDA device and TRITON_INTERPRET is not 1: every group stays eager")
            for candidate in plan.kept:
                report.groups.append(_entry(candidate.strategy.name, candidate.nodes, view, False, "no_device",
                                            "Triton needs a CUDA device (or TRITON_INTERPRET=1)", candidate.program))
            break
        limit = _CONFIG_LIMIT.set(LATER_ROUND_CONFIGS if round_number > 1 else None)
        try:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                jobs = _verify_round(gm, plan, inputs, device, options, progress, report, backward)
        finally:
            _CONFIG_LIMIT.reset(limit)
        if held:
            jobs = _settle(held, jobs)  # each held group against its split
        rules_of = {}
        for job in jobs if round_number < MAX_ROUNDS else ():
            if not job.entry.fused:
                continue
            nodes = frozenset(job.candidate.nodes)
            if nodes not in pending:
                pending[nodes] = _split_rules(job, round_number)
            if pending[nodes]:
                rules_of[job] = pending[nodes].pop(0)
        held, rules = list(rules_of), tuple(rules_of.values())
        kept = [job for job in jobs if job.entry.fused and job not in rules_of]
        survivors += [(job.candidate, job.fused) for job in kept]
        taken.update(n for job in kept for n in job.candidate.nodes)
        failed = [job for job in jobs if not job.entry.fused and len(job.candidate.nodes) > 1]
        if not (failed or held) or round_number >= MAX_ROUNDS:
            break
        retry = {n for job in failed + held for n in job.candidate.nodes}
        lost |= {(job.candidate.strategy.name, frozenset(job.candidate.nodes)) for job in failed + held}
        most = max((product_count(job.candidate.program) for job in failed), default=0)
        if most > 1:
            max_products = min(max_products, most) - 1
        if failed:
            progress(f"re-planning the nodes of {len(failed)} group(s) that stayed eager, at most "
                     f"{max_products} product(s) per group")
        several = sum(rule.max_products < product_count(job.candidate.program) for job, rule in rules_of.items())
        if several:
            progress(f"timing {several} group(s) of several products against their split into groups of "
                     f"fewer products")
        if len(rules) > several:
            progress(f"timing {len(rules) - several} group(s) with a row reduction before a product against "
                     f"their split with the reduction on its own")

    step = time.perf_counter()
    new_gm = rewrite_graph(gm, [(c.program, f) for c, f in survivors])
    report.add_phase("rewrite", time.perf_counter() - step)
    report.compile_s = time.perf_counter() - started
    return new_gm, report


def _verify_round(gm, plan: Plan, inputs: tuple, device: torch.device, options, progress, report,
                  backward: bool = False) -> list[_Job]:
    """Generate, load, tune and check every kept group of ``plan`` in one recording pass.

    Returns every job, those whose code could not be generated included (not fused),
    so a group that failed either way is re-planned. On a GPU the caller makes the
    inputs' device current: the timer's events and buffers, and the target configs
    compile for, are the current device's."""
    view = plan.view
    jobs: list[_Job] = []
    not_generated: list[_Job] = []
    step = time.perf_counter()
    with gc_paused():
        for candidate in plan.kept:
            program: GroupProgram = candidate.program
            job = _Job(candidate, _entry(candidate.strategy.name, candidate.nodes, view, True, "fused", "", program))
            try:
                job.source = candidate.strategy.generate(program, view.helpers)
                job.entry.kernel_source = job.source.source
                module = load_kernel_module(job.source.name, job.source.source, cache_dir(options.cache_dir))
                job.kernel_path = module.__file__  # the private copy that ran (compile children read it)
                job.kernel = getattr(module, job.source.name)
                job.eager = extract_group_module(gm, program)
            except Exception as err:
                _refuse_job(job, "codegen_failed", err)
                report.groups.append(job.entry)
                not_generated.append(job)
                continue
            jobs.append(job)

    total = len(jobs)
    report.add_phase("generate", time.perf_counter() - step)
    step = time.perf_counter()
    # Kernels are checked (and tuned) as the graph reaches their groups' last nodes:
    # compiled in that order, the first ones are timed while the rest still compile.
    by_use = sorted(jobs, key=lambda job: view.order.get(job.candidate.program.nodes[-1], 0))
    compiling = _precompile_untuned(by_use, device, options, progress)
    started_s = time.perf_counter() - step
    step = time.perf_counter()

    def check(job: _Job) -> None:
        index = jobs.index(job) + 1
        program, entry = job.candidate.program, job.entry
        # Each config is timed as soon as it is compiled ahead, while the children go on.
        ready = None if compiling is None else (
            lambda launch: compiling.wait_for(job.source.name, launch_items(launch)))
        try:
            kernel_inputs = [attr_tensor(gm, t.source.path) if isinstance(t.source, AttrRef) else job.inputs[t.source]
                             for t in program.inputs]
            hosted = host_scalars(program, kernel_inputs, device)
            kernel_inputs = to_device(kernel_inputs, hosted, device)
            tuned = _pick_config(job.candidate, job.source, job.kernel, kernel_inputs, device, options,
                                 lambda msg: progress(f"[{index}/{total}] {msg}"), ready, job.configs)
            config = tuned.config
            job.fused = FusedKernel(job.kernel, job.source, config, program, job.eager, gm, hosted, device)
            outputs = job.fused.launch(*kernel_inputs)
        except Exception as err:
            _refuse_job(job, "codegen_failed", err)
            return
        entry.kernel, entry.config, entry.cache_hit, entry.tuning_s = job.source.name, config, tuned.cache_hit, tuned.seconds
        worst = 0.0
        tol = _tolerance(job.candidate, view)
        for out_tensor, meta in zip(outputs, program.outputs):
            ok, err = _max_error(out_tensor, job.outputs[meta.source], tol)
            worst = max(worst, err) if err == err else err
            if not ok:
                entry.fused, entry.reason_code = False, "mismatch"
                entry.reason = (f"output {meta.name} differs from eager by {err:.3g} "
                                f"(tolerance atol {tol.atol:g}, rtol {tol.rtol:g}); kept eager")
                break
        entry.max_error = worst
        del outputs
        if entry.fused:
            refusal = _synthetic_mismatch(job, kernel_inputs, tol)
            if refusal is not None:
                entry.fused, entry.reason_code, entry.reason = False, "mismatch", refusal
        if entry.fused and _can_time(device, options):
            if tuned.speed is not None:  # measured when this kernel was tuned for this GPU and these versions
                entry.time_fused_ms, entry.time_eager_ms = tuned.speed["fused_ms"], tuned.speed["eager_ms"]
            else:
                entry.time_fused_ms = _bench(job.fused.launch, *kernel_inputs)
                entry.time_eager_ms = _bench(job.eager, *kernel_inputs)
                if tuned.key is not None:
                    write_tuning(cache_dir(options.cache_dir), tuned.key, config, tuned.timings,
                                 speed={"fused_ms": entry.time_fused_ms, "eager_ms": entry.time_eager_ms},
                                 config_limit=tuned.config_limit)
            if entry.time_fused_ms >= entry.time_eager_ms:
                entry.fused, entry.reason_code = False, "slower"
                entry.reason = (f"fused {entry.time_fused_ms:.4f} ms vs eager {entry.time_eager_ms:.4f} ms: "
                                "kept eager for speed")

    try:
        verifier = _Verifier(gm, jobs, check, track_writes=backward)
        with preserved_state(gm), torch.no_grad():
            # On copies: the graph may write into its inputs, and the caller's tensors
            # must be changed once, by the real forward, not also by this run.
            verifier.run(*[_snapshot(x) for x in inputs])
    except BaseException:
        if compiling is not None:
            compiling.abort()  # the compile fails (or is interrupted): its children are no use
        raise
    finally:
        _finish_compiling(compiling, report)
    del verifier
    tuning = sum(job.entry.tuning_s for job in jobs)
    waited = compiling.waited_s if compiling is not None else 0.0
    # parallel_compile: starting the children and waiting for them (compiling overlaps timing).
    report.add_phase("parallel_compile", started_s + waited)
    report.add_phase("verify", time.perf_counter() - step - tuning - waited)
    report.add_phase("tune", tuning)
    for job in jobs:
        job.storages, job.watched = {}, []
        if job.fused is None and job.entry.fused:
            _refuse_job(job, "not_verified", RuntimeError("the group's outputs were never produced"))
        if job.overwritten_by is not None and job.entry.fused:
            job.entry.fused, job.entry.reason_code = False, "overwritten_before_backward"
            job.entry.reason = (f"{job.overwritten_by} later writes into one of its inputs, which its backward "
                                "would recompute from; kept eager while gradients are on")
        report.groups.append(job.entry)
    return jobs + not_generated



def _split_rules(job: _Job, round_number: int) -> list[SplitRule]:
    """The splits of ``job``'s nodes to time it against, in order: the next round
    re-plans them under the first, and while the group keeps winning, each round after
    under the next.

    Only kept groups timed against eager are split. One of several products that
    round 1 kept: into groups of fewer products (the row-tiled kernel may lose to
    shorter ones); where a row reduction feeds one of its products, then also with
    that reduction in a group of its own (an MLP behind its layer norm as the norm and
    two linear kernels: with the norm fused, the first linear's kernel recomputes it
    for every column tile, so the split with the norm fused can lose to the MLP kernel
    where this one beats it: BENCHMARKS.md, "Measurements behind rules in the code"). One
    whose product a row reduction feeds: with that reduction in a group of its own, and
    otherwise as it is (a layer norm as its own kernel can beat the same norm
    recomputed for every column tile of the product, or held in registers beside it)."""
    if not job.entry.fused or job.entry.time_fused_ms is None:
        return []
    nodes = frozenset(job.candidate.nodes)
    products = product_count(job.candidate.program)
    prologue = reduction_prologue(job.candidate.program)
    rules = []
    if products > 1 and round_number == 1:
        rules.append(SplitRule(nodes, products - 1))
        if prologue:
            rules.append(SplitRule(nodes, products - 1, prologues=False))
    if prologue:
        rules.append(SplitRule(nodes, products, prologues=False))
    return rules


def _settle(held: list[_Job], jobs: list[_Job]) -> list[_Job]:
    """A round's jobs once each group ``held`` from the round before is weighed against
    the groups this round made of its nodes: their fused times, the eager times of those
    that stayed eager because they were slower (measured: a lone linear left to cuBLAS),
    and for the nodes no group took, the held group's eager time less all of theirs. The
    faster side is kept; the other's entries say why they are not. The held groups kept
    are returned with the jobs."""
    out = list(jobs)
    for big in held:
        nodes = set(big.candidate.nodes)
        inside = [job for job in jobs if nodes.issuperset(job.candidate.nodes)]
        parts = [job for job in inside if job.entry.fused]
        slower = [job for job in inside if job.entry.reason_code == "slower" and job.entry.time_eager_ms is not None]
        timed = parts and all(job.entry.time_fused_ms is not None for job in parts)
        # Without a fused part (or with one untimed) the held group stands.
        split_ms = (sum(job.entry.time_fused_ms for job in parts) + sum(job.entry.time_eager_ms for job in slower)
                    + max(0.0, big.entry.time_eager_ms - sum(job.entry.time_eager_ms for job in parts + slower))
                    if timed else math.inf)
        if split_ms < big.entry.time_fused_ms:
            big.entry.fused, big.entry.reason_code = False, "split_faster"
            big.entry.reason = (f"fused {big.entry.time_fused_ms:.4f} ms vs {split_ms:.4f} ms as {len(parts)} "
                                f"shorter group(s) of its ops: the shorter groups run")
            continue
        for job in inside:
            out.remove(job)  # the held group covers these nodes; nothing of them is re-planned
            if job.entry.fused:
                job.entry.fused, job.entry.reason_code = False, "larger_group_faster"
                job.entry.reason = (f"part of a split of a group that ran faster "
                                    f"({big.entry.time_fused_ms:.4f} ms vs {split_ms:.4f} ms for the split)")
        out.append(big)
    return out


def _refuse_job(job: _Job, code: str, err: Exception) -> None:
    if isinstance(err, PluginHookError):
        code = "plugin_failed"  # the plugin's own code raised; the message names it and the hook
    job.entry.fused, job.entry.reason_code = False, code
    job.entry.reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    logger.warning("group %s could not be compiled: %s", job.entry.nodes, job.entry.reason)


def _device_of(inputs: tuple) -> torch.device:
    for x in inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def _entry(strategy: str, nodes, view, fused: bool, code: str, reason: str, program: Optional[GroupProgram]) -> GroupEntry:
    before = 0
    for node in nodes:
        meta = node.meta.get("tensor_meta")
        if meta is None:
            continue
        size = torch.empty((), dtype=meta.dtype).element_size()
        before += _numel(meta.shape) * size
        for arg in node.all_input_nodes:
            m = arg.meta.get("tensor_meta")
            if m is not None and hasattr(m, "shape"):
                before += _numel(m.shape) * torch.empty((), dtype=m.dtype).element_size()
        if node.op == "call_module":
            before += sum(p.numel() * p.element_size() for p in view.gm.get_submodule(node.target).parameters(recurse=False))
    ops = [view.lowering_of[n].name if n in view.lowering_of else n.name for n in nodes]
    if fused and not reason and program is not None:
        reason = program.summary  # what the strategy recognised, where it said
    return GroupEntry(strategy=strategy, nodes=[n.name for n in nodes], ops=ops, fused=fused, reason_code=code,
                      reason=reason, bytes_before=before, bytes_after=program.bytes_after() if program else 0)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
