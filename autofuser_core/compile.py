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
5. ``rewrite_graph``: every surviving group becomes one call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from typing import Any, Optional

import torch
import torch.fx

from .cache import cache_dir, load_kernel_module, read_tuning, write_tuning
from .group import GroupProgram, attr_tensor
from .ir import AttrRef
from .launch import FusedKernel
from .planner import Candidate, Plan, plan_fusion_groups
from .report import FusionReport, GroupEntry, NodeEntry
from .rounding import interpreting
from .rewrite import extract_group_module, rewrite_graph
from .specs import DEFAULT_TOLERANCES, Tolerance, dtype_name

logger = logging.getLogger("autofuser")


@contextlib.contextmanager
def preserved_state(module: torch.nn.Module):
    """Run code on ``module`` without leaving a trace: buffers and RNG state are
    restored afterwards (BatchNorm statistics, dropout draws)."""
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in module.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


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


class _Recorder(torch.fx.Interpreter):
    """Runs the graph once and keeps, per kept group, its inputs as they are when
    the group runs and its outputs as eager produced them. Both are copies: an
    in-place op later in the graph (``a.add_(1)``, ``out[:, :3] = y``) must not
    change what the kernel is checked against."""

    def __init__(self, gm: torch.fx.GraphModule, programs: list[GroupProgram]):
        super().__init__(gm)
        self.programs = programs
        self.starts: dict[torch.fx.Node, list[int]] = {}
        for index, program in enumerate(programs):
            self.starts.setdefault(program.nodes[0], []).append(index)
        self.wanted = {t.source for program in programs for t in program.outputs}
        self.values: dict[torch.fx.Node, Any] = {}
        self.inputs: dict[int, dict[torch.fx.Node, Any]] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        for index in self.starts.get(n, ()):
            self.inputs[index] = {t.source: _snapshot(self.env[t.source]) for t in self.programs[index].inputs
                                  if isinstance(t.source, torch.fx.Node)}
        result = super().run_node(n)
        if n in self.wanted:
            self.values[n] = _snapshot(result)
        return result


def _tolerance(candidate: Candidate, dtype: torch.dtype, view) -> Tolerance:
    name = dtype_name(dtype)
    tols = [view.lowering_of[n].tolerances.get(name) for n in candidate.nodes if n in view.lowering_of]
    tols = [t for t in tols if t is not None] or [DEFAULT_TOLERANCES.get(name, DEFAULT_TOLERANCES["float32"])]
    return Tolerance(atol=max(t.atol for t in tols), rtol=max(t.rtol for t in tols))


def _max_error(fused: torch.Tensor, eager: torch.Tensor, tol: Tolerance) -> tuple[bool, float]:
    if fused.dtype == torch.bool or eager.dtype == torch.bool:
        ok = torch.equal(fused, eager)
        return ok, 0.0 if ok else 1.0
    a, b = fused.double(), eager.double()
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False, float("nan")
    a, b = a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0)
    same_inf = (a == b)  # infinities must match exactly
    diff = torch.where(same_inf, torch.zeros_like(a), (a - b).abs())
    ok = bool((diff <= tol.atol + tol.rtol * b.abs()).all())
    return ok, float(diff.max()) if diff.numel() else 0.0


def _bench(fn, *args) -> float:
    import triton.testing

    return float(triton.testing.do_bench(lambda: fn(*args), warmup=5, rep=20, return_mode="median"))


def _device_key(device: torch.device) -> dict[str, Any]:
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


def _pick_config(candidate: Candidate, source, kernel, inputs, device, options, progress) -> tuple[dict, bool, float, list]:
    strategy = candidate.strategy
    program = candidate.program
    default = strategy.default_config(program)
    if not _can_tune(device, options):
        return default, False, 0.0, []
    key = {"kernel": source.name, "source_sha256": source.source_hash, **_device_key(device)}
    root = cache_dir(options.cache_dir)
    entry = read_tuning(root, key)
    if entry is not None:
        return entry["config"], True, 0.0, entry.get("timings", [])
    configs = [c for c in strategy.configs(program) if strategy.is_valid(program, c) is None] or [default]
    progress(f"tuning {source.name}: {len(configs)} configs")
    start = time.perf_counter()
    timings = []
    best, best_ms = default, float("inf")
    outputs = [torch.empty_strided(t.shape, t.stride, dtype=t.dtype, device=device) for t in program.outputs]
    for config in configs:
        if time.perf_counter() - start > options.tune_budget_s and timings:
            break
        launch = {**source.constexprs, **config}
        grid = source.grid(config)
        try:
            ms = _bench(lambda: kernel[grid](*inputs, *outputs, **launch))
        except Exception as err:  # a config the compiler rejects (resources) is just not a candidate
            logger.debug("config %s of %s failed: %s", config, source.name, err)
            continue
        timings.append({"config": config, "ms": ms})
        if ms < best_ms:
            best, best_ms = config, ms
    write_tuning(root, key, best, timings)
    return best, False, time.perf_counter() - start, timings


def compile_graph(gm: torch.fx.GraphModule, inputs: tuple, plugin_set, options, progress) -> tuple[torch.fx.GraphModule, FusionReport]:
    """Steps 1-5 of the module doc; returns the rewritten module and its report."""
    started = time.perf_counter()
    report = FusionReport(plugins=list(plugin_set.names), opaque=dict(gm.meta.get("autofuser_opaque", {})))
    for impl in plugin_set.manager.hook.autofuser_transform_graph.get_hookimpls():
        impl.function(*[{"gm": gm, "options": options}[a] for a in impl.argnames])
        gm.recompile()

    def veto(candidate):
        return plugin_set.manager.hook.autofuser_veto_fusion(group=candidate, options=options)

    plan = plan_fusion_groups(gm, plugin_set.registry, veto=veto, options=options)
    view = plan.view
    for entry in view.skipped:
        report.unfused_nodes.append(NodeEntry(node=entry.node, target=entry.target,
                                              reason_code=entry.reason_code, reason=entry.reason))
    for decision in plan.decisions:
        report.groups.append(_entry(decision.strategy, decision.nodes, view, False, decision.reason_code,
                                    decision.reason, decision.program))

    device = _device_of(inputs)
    if device.type != "cuda" and not interpreting():
        report.notes.append("no CUDA device and TRITON_INTERPRET is not 1: every group stays eager")
        for candidate in plan.kept:
            report.groups.append(_entry(candidate.strategy.name, candidate.nodes, view, False, "no_device",
                                        "Triton needs a CUDA device (or TRITON_INTERPRET=1)", candidate.program))
        report.compile_s = time.perf_counter() - started
        return gm, report

    recorder = _Recorder(gm, [candidate.program for candidate in plan.kept])
    with preserved_state(gm), torch.no_grad():
        # On copies: the graph may write into its inputs, and the caller's tensors
        # must be changed once, by the real forward, not also by this run.
        recorder.run(*[_snapshot(x) for x in inputs])
    values = recorder.values

    survivors: list[tuple[Candidate, FusedKernel]] = []
    total = len(plan.kept)
    for index, candidate in enumerate(plan.kept, 1):
        program: GroupProgram = candidate.program
        eager = extract_group_module(gm, program)
        entry = _entry(candidate.strategy.name, candidate.nodes, view, True, "fused", "", program)
        try:
            source = candidate.strategy.generate(program, view.helpers)
            module = load_kernel_module(source.name, source.source, cache_dir(options.cache_dir))
            kernel = getattr(module, source.name)
            kernel_inputs = [attr_tensor(gm, t.source.path) if isinstance(t.source, AttrRef)
                             else recorder.inputs[index - 1][t.source] for t in program.inputs]
            config, hit, tuning_s, _ = _pick_config(candidate, source, kernel, kernel_inputs, device, options,
                                                   lambda msg: progress(f"[{index}/{total}] {msg}"))
            fused = FusedKernel(kernel, source, config, program, eager, gm)
            with torch.no_grad():
                outputs = fused.launch(*kernel_inputs)
        except Exception as err:
            entry.fused, entry.reason_code = False, "codegen_failed"
            entry.reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            logger.warning("group %s could not be compiled: %s", entry.nodes, entry.reason)
            report.groups.append(entry)
            continue
        entry.kernel, entry.config, entry.cache_hit, entry.tuning_s = source.name, config, hit, tuning_s
        worst = 0.0
        for out_tensor, meta in zip(outputs, program.outputs):
            tol = _tolerance(candidate, meta.dtype, view)
            ok, err = _max_error(out_tensor, values[meta.source], tol)
            worst = max(worst, err) if err == err else err
            if not ok:
                entry.fused, entry.reason_code = False, "mismatch"
                entry.reason = (f"output {meta.name} differs from eager by {err:.3g} "
                                f"(tolerance atol {tol.atol:g}, rtol {tol.rtol:g}); kept eager")
                break
        entry.max_error = worst
        if entry.fused and device.type == "cuda" and options.verify_speed:
            with torch.no_grad():
                entry.time_fused_ms = _bench(fused.launch, *kernel_inputs)
                entry.time_eager_ms = _bench(eager, *kernel_inputs)
            if entry.time_fused_ms >= entry.time_eager_ms:
                entry.fused, entry.reason_code = False, "slower"
                entry.reason = (f"fused {entry.time_fused_ms:.4f} ms vs eager {entry.time_eager_ms:.4f} ms: "
                                "kept eager for speed")
        report.groups.append(entry)
        if entry.fused:
            survivors.append((candidate, fused))
    del values, recorder

    new_gm = rewrite_graph(gm, [(c.program, f) for c, f in survivors])
    report.compile_s = time.perf_counter() - started
    return new_gm, report


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
    return GroupEntry(strategy=strategy, nodes=[n.name for n in nodes], ops=ops, fused=fused, reason_code=code,
                      reason=reason, bytes_before=before, bytes_after=program.bytes_after() if program else 0)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
