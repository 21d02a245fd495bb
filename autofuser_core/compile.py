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
4b. on a GPU, a kept group is timed against the splits of its nodes that its
   strategy declares (``StrategySpec.split_rules``: the matmul plugin's
   split a layer norm from the product it feeds, and a group of several products
   into groups of fewer), each made in a later round, and the faster side is kept
   (``_settle``); one split per round, while the group keeps winning; groups that
   stayed eager are re-planned in the same rounds;
5. ``rewrite_graph``: every surviving group becomes one call.

This module drives those steps and writes the report's entries; the checks of step 4
are in verify.py, picking and tuning configs in tuning.py, and every measurement goes
through the current timer (timing.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import gc
import hashlib
import logging
import math
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.fx
from torch.nn.utils import parametrize

from . import timing
from .backward import BACKWARD_GRAPH_KEY, build_backward, saved_values_read
from .cache import cache_dir, load_kernel_module, write_tuning
from .capture import FREE_KEY, OutputShapeCheck, preserved_state
from .constants import fold_checked
from .dynamic import (
    CLASS_CHECKED,
    SIZE_RULE,
    SizeArguments,
    bucket,
    checked_key,
    collecting_sizes,
    passed_sizes,
)
from .group import (
    MAX_PRODUCTS,
    SAVED_FOR_BACKWARD,
    STRICT_FP32,
    GroupProgram,
    attr_tensor,
    product_count,
    saved_products,
)
from .hookspecs import GRADIENTS_KEY
from .interpreter import kernels_cannot_run, warn_once
from .ir import AttrRef
from .launch import FusedKernel, RecomputeForBackward, host_scalars, run_eager, to_device
from .planner import SPLIT_RULES, Candidate, Plan, Split, plan_fusion_groups
from .precompile import launch_items
from .progress import step as step_to
from .registry import PLUGIN_FAULTS, PluginFault, PluginHookError, describe_target, record_fault
from .report import FusionReport, GroupEntry, NodeEntry, describe_graph
from .rewrite import extract_group_module, rewrite_graph
from .tuning import CONFIG_LIMIT, LATER_ROUND_CONFIGS, finish_compiling, pick_config, precompile_untuned
from .verify import (
    FLOAT64_FACTOR,
    Float64Judge,
    Verifier,
    max_error,
    snapshot,
    synthetic_mismatch,
    tolerance,
    where_worst,
)

logger = logging.getLogger("autofuser.compile")


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
    configs: Optional[tuple] = None  # tuning._tuning_configs' answer, where compiling ahead asked for it
    samples: Optional[tuple] = None  # (kernel inputs, outputs) of its check, for its backward (gradients on)


def _program(candidate: Candidate) -> GroupProgram:
    """A kept candidate's program: the planner keeps only candidates that composed."""
    assert candidate.program is not None
    return candidate.program


#: Planning rounds at most: each later one re-plans what the groups that lost covered.
MAX_ROUNDS = 6


def compile_graph(
    gm: torch.fx.GraphModule, inputs: tuple, plugin_set, options, progress, backward: bool = False
) -> tuple[torch.fx.GraphModule, FusionReport]:
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
    """Step 1: every plugin's ``autofuser_transform_graph``. A pass that raises is undone (the graph as it was before
    it) and reported; the graph then
    still computes the model's function, without that pass."""
    for impl in plugin_set.manager.hook.autofuser_transform_graph.get_hookimpls():
        before = copy.deepcopy(gm.graph)
        try:
            impl.function(*[{"gm": gm, "options": options}[a] for a in impl.argnames])
            gm.recompile()
        except Exception as err:
            gm.graph = before  # recompiles
            record_fault(
                impl.plugin_name,
                "autofuser_transform_graph",
                err,
                "its rewrite of the graph was undone and the graph is planned without it",
            )


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


def _sums_across_rows(program) -> bool:
    """Whether a group's program (without products) reduces over dims that are not its
    innermost, keeping the innermost: a bias's gradient, a column sum over every row."""
    wide = [d for d, size in enumerate(program.domain) if size != 1]
    return bool(program.reduced_dims) and bool(wide) and wide[-1] not in program.reduced_dims


def _rows_kept_whole(program) -> bool:
    """Whether a group's program (without products) reduces over rows and still writes every
    element of them (a normalisation's shape), as opposed to pointwise work or a plain reduction."""
    if not program.reduced_dims:
        return False
    return any(any(t.domain_stride[d] != 0 for d in program.reduced_dims) for t in program.outputs)


def _compile_graph(
    gm: torch.fx.GraphModule, inputs: tuple, plugin_set, options, progress, backward: bool
) -> tuple[torch.fx.GraphModule, FusionReport]:
    started = time.perf_counter()
    backward_graph = bool(gm.meta.get(BACKWARD_GRAPH_KEY))
    report = FusionReport(plugins=list(plugin_set.names), opaque=dict(gm.meta.get("autofuser_opaque", {})))
    gm.meta[GRADIENTS_KEY] = backward  # read by graph passes (hookspecs.autofuser_transform_graph)
    # Graph passes see the compile's fp32 product precision too (a pass may write a call that
    # launches its own kernels later, when the compile's setting is no longer in force).
    token = STRICT_FP32.set(options.strict_fp32_products)
    try:
        _transform_graph(gm, plugin_set, options)
    finally:
        STRICT_FP32.reset(token)
    _spell_negative_bases(gm)
    folded, undone = ([], "") if backward_graph else fold_checked(gm, inputs)
    if undone:
        report.notes.append(f"values no input reaches were not folded into constants: {undone}")
    if folded:
        listed = ", ".join(folded[:6]) + (", ..." if len(folded) > 6 else "")
        report.notes.append(
            f"{len(folded)} op(s) that no input or parameter reaches were computed once while compiling "
            f"and are read as stored constants ({listed})"
        )
    report.graph = describe_graph(gm)
    registry = plugin_set.registry.guarded()

    device = _device_of(inputs)
    taken: set[torch.fx.Node] = set()
    retry: Optional[set[torch.fx.Node]] = None  # later rounds: only the nodes of groups that stayed eager
    lost: set[tuple[str, frozenset]] = set()  # (strategy, nodes) of the groups that stayed eager
    survivors: list[tuple[Candidate, Optional[FusedKernel]]] = []  # as _Job.fused holds it
    trained: list[_Job] = []  # kept groups whose backward is still to build (gradients on)
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
    rules: tuple[Split, ...] = ()  # how the next round splits each held group's nodes
    pending: dict[frozenset, list[Split]] = {}  # each kept group's splits not yet timed (``_split_rules``)
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
            lone = backward_graph and len(candidate.nodes) == 1 and product_count(candidate.program) == 0
            if lone and not (_rows_kept_whole(candidate.program) or _sums_across_rows(candidate.program)):
                # One pointwise op or plain reduction as a kernel moves the bytes eager's op
                # moves: nothing to gain, and a backward graph compiles at the user's first step.
                # A lone op that keeps its rows whole (a norm, a softmax), or that sums over the
                # rows keeping the contiguous dim (a linear layer's bias gradient), is planned
                # and timed: libraries' kernels for such ops are slow on narrow rows and on
                # column sums (BENCHMARKS.md, "Training"), and the group's timing keeps the faster.
                return (
                    "a single op without a product saves no memory traffic; in a backward graph "
                    "it stays the library's call"
                )
            return _veto(plugin_set, candidate, options)

        step_to(progress, "plan" if round_number == 1 else f"plan (round {round_number})")
        tokens = (STRICT_FP32.set(options.strict_fp32_products), MAX_PRODUCTS.set(max_products), SPLIT_RULES.set(rules))
        step = time.perf_counter()
        try:
            with gc_paused():
                plan = plan_fusion_groups(gm, registry, veto=veto, options=options, earlier=plan)
                if backward:
                    for candidate in plan.kept:
                        _save_products(candidate, plan.view)
        finally:
            SPLIT_RULES.reset(tokens[2])
            MAX_PRODUCTS.reset(tokens[1])
            STRICT_FP32.reset(tokens[0])
        report.add_phase("plan", time.perf_counter() - step)
        view = plan.view
        if round_number == 1:
            by_name = {n.name: n for n in gm.graph.nodes}
            for entry in view.skipped:
                node = by_name.get(entry.node)
                if node is not None and isinstance(node.target, OutputShapeCheck):
                    continue  # capture's own check on an opaque part's output: no op of the model
                # An opaque module that returned its input once is no view for that.
                free = node is not None and node.op != "call_module" and bool(node.meta.get(FREE_KEY, False))
                report.unfused_nodes.append(
                    NodeEntry(
                        node=entry.node,
                        target=entry.target,
                        reason_code=entry.reason_code,
                        reason=entry.reason,
                        free=free,
                    )
                )
            # An extern op only a specialised strategy can generate, which none took, runs eager too.
            kept_nodes = {n for candidate in plan.kept for n in candidate.nodes}
            for node, value in view.lowered.items():
                if value.op == "extern" and node not in kept_nodes:
                    report.unfused_nodes.append(
                        NodeEntry(
                            node=node.name,
                            target=describe_target(node.target),
                            reason_code="extern_not_taken",
                            reason=f"{view.lowering_of[node].name} fuses only as part of a larger pattern "
                            "(its plugin's own kernel), which was not found or not kept around this op; "
                            "it runs as in eager PyTorch",
                        )
                    )
        for decision in plan.decisions:
            if round_number == 1 or decision.reason != "decided in an earlier round":
                report.groups.append(
                    _entry(
                        decision.strategy,
                        decision.nodes,
                        view,
                        False,
                        decision.reason_code,
                        decision.reason,
                        decision.program,
                    )
                )
        cannot_run = kernels_cannot_run(device, plugin_set.manager.get_plugins())
        if cannot_run is not None:
            reason_code, message = cannot_run
            warn_once(message)
            report.notes.append(f"{reason_code}: {message}")
            for candidate in plan.kept:
                report.groups.append(
                    _entry(
                        candidate.strategy.name, candidate.nodes, view, False, reason_code, message, candidate.program
                    )
                )
            break
        limit = CONFIG_LIMIT.set(LATER_ROUND_CONFIGS if round_number > 1 else None)
        try:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                jobs = _verify_round(gm, plan, inputs, device, options, progress, report, backward)
        finally:
            CONFIG_LIMIT.reset(limit)
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
        trained += [job for job in kept if job.samples is not None]
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
            progress(
                f"re-planning the nodes of {len(failed)} group(s) that stayed eager, at most "
                f"{max_products} product(s) per group"
            )
        for description in dict.fromkeys(split.rule.description for split in rules):
            count = sum(split.rule.description == description for split in rules)
            progress(f"timing {count} group(s) against their split {description}")

    if trained:
        step = time.perf_counter()
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            slower = _fuse_backwards(trained, plugin_set, options, progress, report, device)
        survivors = [(c, f) for c, f in survivors if f not in slower]
        report.add_phase("backward", time.perf_counter() - step)
    step = time.perf_counter()
    step_to(progress, "rewrite")
    new_gm = rewrite_graph(gm, [(_program(c), f) for c, f in survivors])
    report.add_phase("rewrite", time.perf_counter() - step)
    report.compile_s = time.perf_counter() - started
    return new_gm, report


def _save_products(candidate: Candidate, view) -> None:
    """With gradients on, ``candidate``'s program composed again with the results of its
    products as outputs its backward reads (``group.saved_products``), where its strategy
    writes such outputs (``StrategySpec.writes_saved_outputs``), composes them and accepts
    the result; else its program stays as planned and its backward computes them again.
    Run under the planning round's settings (products per group, fp32 precision, splits),
    so the program differs from the planned one only by those outputs."""
    strategy = candidate.strategy
    saved = saved_products(candidate.nodes, view.lowered)
    candidate.products_recomputed = [n.name for n in saved]
    if not saved or not strategy.writes_saved_outputs:
        return
    # All of them, else without the first ones: a layout stores what follows its last
    # product (an MLP's second product's result, not its hidden one's).
    for first in range(len(saved)):
        program = _composed_saving(candidate, view, saved[first:])
        if program is None:
            continue
        stored = [n for n in saved[first:] if n.name in {t.name for t in program.outputs if t.saved}]
        candidate.products_recomputed = [n.name for n in saved[:first]]
        # Only what the backward will read: a product only a residual add follows needs none.
        read = saved_values_read(view.gm, program)
        if read is not None and len(read) < len(stored):
            wanted = [n for n in stored if n.name in read]
            program = _composed_saving(candidate, view, wanted) if wanted else None
            if program is None:
                return  # nothing read, or the layout refuses the smaller set: as planned
        candidate.program = program
        return


def _composed_saving(candidate: Candidate, view, saved: list) -> Optional[GroupProgram]:
    """``candidate``'s nodes composed again by its strategy with the results of ``saved`` as
    outputs for its backward, or ``None`` where the composition or ``accepts`` refuses."""
    strategy = candidate.strategy
    token = SAVED_FOR_BACKWARD.set(frozenset(saved))
    try:
        program = view.compose_for(strategy, list(candidate.nodes))
        refused = strategy.accepts(program)
    except Exception as err:  # noqa: BLE001 - a layout that can't store them: those are recomputed
        logger.debug("group %s can't store %s: %s", [n.name for n in candidate.nodes], saved, err)
        return None
    finally:
        SAVED_FOR_BACKWARD.reset(token)
    if refused is not None or not any(t.saved for t in program.outputs):
        return None
    return program


def _verify_round(
    gm, plan: Plan, inputs: tuple, device: torch.device, options, progress, report, backward: bool = False
) -> list[_Job]:
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
        for number, candidate in enumerate(plan.kept):
            step_to(progress, "generate", number, len(plan.kept), candidate.strategy.name)
            program = _program(candidate)
            job = _Job(candidate, _entry(candidate.strategy.name, candidate.nodes, view, True, "fused", "", program))
            try:
                # A strategy that takes dynamic sizes at run time names them while it writes.
                with collecting_sizes(candidate.strategy.dynamic_sizes) as named:
                    job.source = candidate.strategy.generate(program, view.helpers)
                job.source.sizes = passed_sizes(job.source.source, named)
                if job.source.sizes:
                    job.source.size_buckets = _class_buckets()
                _note_sizes(job.entry, job.source, candidate.strategy, named)
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
    by_use = sorted(jobs, key=lambda job: view.order.get(_program(job.candidate).nodes[-1], 0))
    compiling = precompile_untuned(by_use, device, options, progress)
    started_s = time.perf_counter() - step
    step = time.perf_counter()
    timer = timing.current()

    checked: list[bool] = []  # one entry per group checked so far, for the progress count

    def check(job: _Job) -> None:
        index = jobs.index(job) + 1
        program, entry = _program(job.candidate), job.entry
        step_to(progress, "verify", len(checked), total, job.source.name)
        checked.append(True)
        kernel_inputs: Sequence[torch.Tensor]
        # Each config is timed as soon as it is compiled ahead, while the children go on.
        ready = (
            None if compiling is None else (lambda launch: compiling.wait_for(job.source.name, launch_items(launch)))
        )
        try:
            kernel_inputs = [
                attr_tensor(gm, t.source.path) if isinstance(t.source, AttrRef) else job.inputs[t.source]
                for t in program.inputs
            ]
            hosted = host_scalars(program, kernel_inputs, device)
            kernel_inputs = to_device(kernel_inputs, hosted, device)
            tuned = pick_config(
                job.candidate,
                job.source,
                job.kernel,
                kernel_inputs,
                device,
                options,
                lambda msg: progress(f"[{index}/{total}] {msg}"),
                ready,
                job.configs,
            )
            config = tuned.config
            job.fused = FusedKernel(
                job.kernel,
                job.source,
                config,
                program,
                job.eager,
                gm,
                hosted,
                device,
                strategy=job.candidate.strategy.name,
                ops=entry.ops,
            )
            outputs = job.fused.launch(*kernel_inputs)
        except Exception as err:
            _refuse_job(job, "codegen_failed", err)
            return
        entry.kernel, entry.config, entry.cache_hit, entry.tuning_s = (
            job.source.name,
            config,
            tuned.cache_hit,
            tuned.seconds,
        )
        worst = 0.0
        tol = tolerance(job.candidate, view)
        judge = Float64Judge(job.eager, kernel_inputs, len(program.visible_outputs))
        judged = False
        for slot, (out_tensor, meta) in enumerate(zip(outputs, program.outputs)):
            expected = job.outputs[meta.source]
            ok, error = max_error(out_tensor, expected, tol)
            if not ok and math.isfinite(error):
                # Both sides round; where eager is as far from the exact value, the kernel stands.
                ok = judge.accepts(slot, out_tensor, expected, tol)
                judged = judged or ok
            worst = max(worst, error) if error == error else error
            if not ok:
                entry.fused, entry.reason_code = False, "mismatch"
                weighed = (
                    f", and more than {FLOAT64_FACTOR:g}x eager's own error from the group's ops in float64"
                    if judge.ran
                    else ""
                )
                place = where_worst(out_tensor, expected)
                entry.reason = (
                    f"output {meta.name} differs from eager by {error:.3g}{' ' + place if place else ''} "
                    f"(tolerance atol {tol.atol:g}, rtol {tol.rtol:g}){weighed}; kept eager"
                )
                break
        entry.float64_judged = judged and entry.fused
        del judge  # its float64 copies
        entry.max_error = worst
        samples = (list(kernel_inputs), list(outputs)) if backward else None
        del outputs
        in_class = CLASS_CHECKED.get()
        if entry.fused and in_class is not None and checked_key(job.source.source_hash, config) in in_class:
            # Checked on synthetic inputs for an earlier shape of this shape class, the same
            # source with other run-time sizes: this shape's real inputs suffice.
            entry.class_checked = True
        elif entry.fused:
            refusal = synthetic_mismatch(job, kernel_inputs, tol)
            if refusal is not None:
                entry.fused, entry.reason_code, entry.reason = False, "mismatch", refusal
        if entry.fused and backward:
            job.samples = samples  # its backward is built, and the group timed with it, in _fuse_backwards
        elif entry.fused and timer.can_time(device, options):
            # Measured when this kernel was tuned for this GPU and these versions, the way
            # this compile times groups (as CUDA graphs or launched), or timed now.
            graphs = _may_capture(options, job.fused)
            times = cached_speed(tuned.speed, graphs)
            if times is None:
                times = _group_times(timer, job.fused.launch, job.eager, kernel_inputs, graphs)
                if tuned.key is not None:
                    write_tuning(
                        cache_dir(options.cache_dir),
                        tuned.key,
                        config,
                        tuned.timings,
                        speed=speed_record(tuned.speed, times, graphs),
                        config_limit=tuned.config_limit,
                    )
            entry.time_fused_ms, entry.time_eager_ms, entry.timed_in_graph = times
            if entry.time_fused_ms >= entry.time_eager_ms:
                entry.fused, entry.reason_code = False, "slower"
                graphed = ", each replayed as a CUDA graph" if entry.timed_in_graph else ""
                entry.reason = (
                    f"fused {entry.time_fused_ms:.4f} ms vs eager {entry.time_eager_ms:.4f} ms{graphed}: "
                    "kept eager for speed"
                )

    try:
        verifier = Verifier(gm, jobs, check, track_writes=backward)
        with preserved_state(gm), torch.no_grad():
            # On copies: the graph may write into its inputs, and the caller's tensors
            # must be changed once, by the real forward, not also by this run.
            verifier.run(*[snapshot(x) for x in inputs])
    except BaseException:
        if compiling is not None:
            compiling.abort()  # the compile fails (or is interrupted): its children are no use
        raise
    finally:
        finish_compiling(compiling, report)
    step_to(progress, "verify", total, total)
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
            job.entry.reason = (
                f"{job.overwritten_by} later writes into one of its inputs, which its backward "
                "would recompute from; kept eager while gradients are on"
            )
        report.groups.append(job.entry)
    return jobs + not_generated


def _class_buckets() -> tuple[int, ...]:
    """The size buckets of the dynamic dims of the compile under way (its ``SizeRule``)."""
    rule = SIZE_RULE.get()
    return tuple(sorted({bucket(size) for size in rule.dynamic})) if rule is not None else ()


def _note_sizes(entry: GroupEntry, source, strategy, named: Optional[SizeArguments] = None) -> None:
    """The report's word on a group's sizes while dynamic dims are in force: the sizes its
    kernel takes at run time and their buckets, or why it stays specialised on the shape."""
    if SIZE_RULE.get() is None:
        return
    if source.sizes:
        entry.run_time_sizes = dict(source.sizes)
        entry.size_buckets = list(source.size_buckets)
    elif named is not None and named.specialised:
        entry.specialised = named.specialised  # this form of the strategy's groups (``literal_sizes``)
    elif not strategy.dynamic_sizes:
        entry.specialised = (
            f"strategy {strategy.name!r} does not take sizes at run time (StrategySpec.dynamic_sizes): "
            "its kernel is written for each shape"
        )


def _split_rules(job: _Job, round_number: int) -> list[Split]:
    """The splits of ``job``'s nodes to time it against, in order: the next round
    re-plans them under the first, and while the group keeps winning, each round after
    under the next.

    Only kept groups timed against eager are split, by the rules their strategy
    declares (``StrategySpec.split_rules``) that apply to their program; a rule
    ``first_round_only`` only for a group kept in round 1."""
    if not job.entry.fused or job.entry.time_fused_ms is None:
        return []
    program = job.candidate.program
    nodes = frozenset(job.candidate.nodes)
    products = product_count(program)
    return [
        Split(nodes, products - rule.fewer_products, rule)
        for rule in job.candidate.strategy.split_rules
        if (round_number == 1 or not rule.first_round_only) and rule.applies(program)
    ]


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
        split_ms = (
            sum(_ms(job.entry.time_fused_ms) for job in parts)
            + sum(_ms(job.entry.time_eager_ms) for job in slower)
            + max(0.0, _ms(big.entry.time_eager_ms) - sum(_ms(job.entry.time_eager_ms) for job in parts + slower))
            if timed
            else math.inf
        )
        if split_ms < _ms(big.entry.time_fused_ms):
            big.entry.fused, big.entry.reason_code = False, "split_faster"
            big.entry.reason = (
                f"fused {big.entry.time_fused_ms:.4f} ms vs {split_ms:.4f} ms as {len(parts)} "
                f"shorter group(s) of its ops: the shorter groups run"
            )
            continue
        for job in inside:
            out.remove(job)  # the held group covers these nodes; nothing of them is re-planned
            if job.entry.fused:
                job.entry.fused, job.entry.reason_code = False, "larger_group_faster"
                job.entry.reason = (
                    f"part of a split of a group that ran faster "
                    f"({big.entry.time_fused_ms:.4f} ms vs {split_ms:.4f} ms for the split)"
                )
        out.append(big)
    return out


def _fuse_backwards(jobs: list[_Job], plugin_set, options, progress, report, device) -> list[FusedKernel]:
    """Give each kept group its fused backward (``backward.build_backward``), its backward
    graph planned, verified and tuned as a forward is; then, where groups are timed, time
    each with its backward against eager's forward and backward, and return those slower.
    The backward graphs' groups join ``report`` (``phase`` "backward")."""
    timer = timing.current()
    slower = []
    # Groups alike (the layers of a stack) share one backward and one timing: built and
    # timed for the first of them (``_alike``).
    done: dict[str, tuple[Any, Optional[tuple[float, float, bool]]]] = {}
    for index, job in enumerate(jobs, 1):
        assert job.fused is not None and job.samples is not None
        inputs, outputs = job.samples
        job.samples = None
        alike = _alike(job.fused, inputs)
        if alike in done:
            built, times = done[alike]
            if built is not None:
                job.fused.backward, found = built
                # Listed for each group, as its forward is: the same kernels.
                report.groups.extend(copy.copy(entry) for entry in found.groups)
                report.unfused_nodes.extend(copy.copy(entry) for entry in found.unfused_nodes)
        else:
            step_to(progress, "backward", index - 1, len(jobs), job.entry.kernel or "")
            built = build_backward(
                job.fused,
                inputs,
                outputs,
                lambda gm, samples, say: compile_graph(gm, samples, plugin_set, options, say),
                lambda msg: progress(f"[backward {index}/{len(jobs)}] {msg}"),
            )
            if isinstance(built, str):
                report.notes.append(f"{job.entry.kernel}: {built}; its eager ops are recomputed in backward")
                built = None
            if built is not None:
                job.fused.backward, found = built
                report.groups.extend(found.groups)
                report.unfused_nodes.extend(found.unfused_nodes)
                report.notes.extend(found.notes)
                for name, seconds in found.phases.items():
                    report.backward_phases[name] = report.backward_phases.get(name, 0.0) + seconds
            timed_s = time.perf_counter()
            times = None
            if timer.can_time(device, options):
                times = _step_times(timer, job.fused, inputs, _may_capture(options, job.fused))
            if times is not None:  # each group with its backward against eager's (the "backward" phase's rest)
                report.backward_phases["time_groups"] = (
                    report.backward_phases.get("time_groups", 0.0) + time.perf_counter() - timed_s
                )
            done[alike] = built, times
        entry = job.entry
        _record_saving(entry, job)
        if times is not None:
            # A group costs its forward and its backward: both sides timed as one step
            # (the whole step is checked again in fuse.py).
            entry.timed = "forward+backward"
            entry.time_fused_ms, entry.time_eager_ms, entry.timed_in_graph = times
            if entry.time_fused_ms >= entry.time_eager_ms:
                entry.fused, entry.reason_code = False, "slower"
                graphed = ", each replayed as a CUDA graph" if entry.timed_in_graph else ""
                entry.reason = (
                    f"forward and backward fused {entry.time_fused_ms:.4f} ms vs eager "
                    f"{entry.time_eager_ms:.4f} ms{graphed}: kept eager for speed while gradients are on"
                )
                slower.append(job.fused)
    return slower


def _record_saving(entry: GroupEntry, job: _Job) -> None:
    """The report's account of what ``job``'s backward takes from its forward: the values
    its kernel saves that its backward graph reads, their bytes, and its products the
    backward computes again (all of them where it has no backward graph of its own)."""
    fused = job.fused
    assert fused is not None
    backward = fused.backward
    reads = list(getattr(backward, "reads_saved", ()))
    entry.saved_for_backward = [fused.saved_names[j] for j in reads]
    layouts = [fused.output_layout[fused.n_visible + j] for j in reads]
    entry.saved_bytes = sum(math.prod(shape) * dtype.itemsize for shape, _, dtype in layouts)
    entry.products_recomputed = list(job.candidate.products_recomputed)
    if backward is None:
        entry.products_recomputed = [*fused.saved_names, *entry.products_recomputed]


def _alike(fused: FusedKernel, inputs: Sequence[torch.Tensor]) -> str:
    """What a group's backward and its timing depend on, the same for groups alike: its
    kernel (source and config), its inputs' shapes, strides, dtypes, devices and whether
    they need gradients, which of its parameters are parametrized, and its original ops - each
    node's op and arguments, by position, a module call by the module's ``repr`` (its
    settings) and its parameters' shapes rather than by its path."""
    eager = fused.eager
    if not isinstance(eager, torch.fx.GraphModule):
        return f"group {id(fused)}"  # nothing to compare: alike to none
    positions = {node: index for index, node in enumerate(eager.graph.nodes)}

    def argument(value: Any) -> Any:
        return torch.fx.node.map_arg(value, lambda node: f"%{positions[node]}")

    ops = []
    for node in eager.graph.nodes:
        target: Any = node.target
        if node.op in ("call_module", "get_attr"):
            owner = eager.get_submodule(node.target) if node.op == "call_module" else None
            if owner is None:
                tensor = getattr(eager, str(node.target), None)
                target = ("attr", tuple(tensor.shape), str(tensor.dtype)) if isinstance(tensor, torch.Tensor) else None
            else:
                shapes = [(name, tuple(p.shape), str(p.dtype)) for name, p in owner.named_parameters()]
                target = (type(owner).__qualname__, repr(owner), shapes)
        ops.append((node.op, str(target), repr(argument(node.args)), repr(argument(node.kwargs))))
    parametrized = [parametrize.is_parametrized(module, name) for _, module, name in fused.live_attrs]
    layouts = [(tuple(t.shape), t.stride(), str(t.dtype), str(t.device), t.requires_grad) for t in inputs]
    text = repr((fused.source.source_hash, sorted(fused.config.items()), layouts, parametrized, ops))
    return hashlib.sha256(text.encode()).hexdigest()


def _step_times(
    timer: timing.Timer, fused: FusedKernel, inputs: Sequence[torch.Tensor], graphs: bool
) -> tuple[float, float, bool]:
    """(fused ms, eager ms, whether both ran as CUDA graphs) of one group's forward and
    backward on ``inputs`` (the kernel's inputs), every floating-point one needing
    gradients on both sides. Where the step may replay as CUDA graphs (``graphs``), each
    side is timed captured as one graph, as a replay runs it: a short group's launches can
    cost the host more than its kernels cost the GPU, and in a graph the host pays none of
    them (BENCHMARKS.md, "Training"). Where either side can't be captured, both are timed
    launched."""
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    fused_step = timing.TrainingStep(lambda *a: RecomputeForBackward.apply(fused, *a), fused=True)
    eager_step = timing.TrainingStep(lambda *a: run_eager(fused, a))
    return _group_times(timer, fused_step, eager_step, leaves, graphs)


#: Whether the model being compiled may replay as CUDA graphs where it runs; ``fuse`` sets
#: it (``replaying``) to False where its step or forward never will (it draws random
#: numbers, runs the model's own code in training, or runs in training mode without
#: gradients), so its groups are timed launched, as they will run.
MAY_REPLAY: contextvars.ContextVar[bool] = contextvars.ContextVar("autofuser_may_replay", default=True)


@contextlib.contextmanager
def replaying(may: bool) -> Iterator[None]:
    """Inside, ``MAY_REPLAY`` is ``may`` (in this thread or task)."""
    token = MAY_REPLAY.set(may)
    try:
        yield
    finally:
        MAY_REPLAY.reset(token)


def _may_capture(options, fused: FusedKernel) -> bool:
    """Whether a group is timed captured as CUDA graphs (``_group_times``): where the model
    may replay as graphs (``options.cuda_graphs`` and ``MAY_REPLAY``) and its kernel copies
    no host scalar (such a copy can't be captured; the timer says where else capture fails)."""
    return options.cuda_graphs and MAY_REPLAY.get() and not fused.host_scalars


def _group_times(
    timer: timing.Timer, fused: Callable, eager: Callable, args: Sequence[Any], graphs: bool
) -> tuple[float, float, bool]:
    """(fused ms, eager ms, whether both were timed as CUDA graphs) of a group's two sides
    called on ``args``: captured as one CUDA graph each and replayed where the model may
    replay as graphs (``graphs``: ``options.cuda_graphs``) and both sides can be captured
    (the timer says which can), else launched. A short group's launches can cost the
    host more than its kernels cost the GPU, which a replayed graph never pays."""
    if graphs:
        fused_ms = timer.graph_ms(fused, *args)
        eager_ms = timer.graph_ms(eager, *args) if fused_ms is not None else None
        if fused_ms is not None and eager_ms is not None:
            return fused_ms, eager_ms, True
    return timer.bench(fused, *args), timer.bench(eager, *args), False


def cached_speed(speed: Optional[dict], graphs: bool) -> Optional[tuple[float, float, bool]]:
    """A tuning entry's fused and eager times, as ``_group_times`` gives them, or ``None``
    to time them now: where this compile times as CUDA graphs (``graphs``), the pair timed
    as graphs, or the launched pair where capturing was tried and failed
    (``graph_refused``); without ``graphs``, the launched pair."""
    if speed is None:
        return None
    if graphs and "graph_fused_ms" in speed:
        return speed["graph_fused_ms"], speed["graph_eager_ms"], True
    if "fused_ms" not in speed or (graphs and not speed.get("graph_refused")):
        return None  # never timed this way (an entry from a compile without graphs: capture now)
    return speed["fused_ms"], speed["eager_ms"], False


def speed_record(known: Optional[dict], times: tuple[float, float, bool], graphs: bool) -> dict[str, Any]:
    """``known`` (a tuning entry's times, or None) with ``times`` added: the pair for the way
    they were measured (``graph_fused_ms``/``graph_eager_ms`` or ``fused_ms``/``eager_ms``),
    and ``graph_refused`` where they were to be timed as graphs (``graphs``) and could not."""
    fused_ms, eager_ms, in_graph = times
    record: dict[str, Any] = dict(known or {})
    if in_graph:
        record.update(graph_fused_ms=fused_ms, graph_eager_ms=eager_ms)
        record.pop("graph_refused", None)
    else:
        record.update(fused_ms=fused_ms, eager_ms=eager_ms)
        if graphs and "graph_fused_ms" not in record:  # a pair timed as graphs stands
            record["graph_refused"] = True
    return record


def _ms(value: Optional[float]) -> float:
    """A time ``_settle`` reads: a held group and the fused parts of its split were timed,
    fused and eager together, and the slower groups were filtered on theirs."""
    assert value is not None
    return value


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


def _entry(
    strategy: str, nodes, view, fused: bool, code: str, reason: str, program: Optional[GroupProgram]
) -> GroupEntry:
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
            before += sum(
                p.numel() * p.element_size() for p in view.gm.get_submodule(node.target).parameters(recurse=False)
            )
    ops = [view.lowering_of[n].name if n in view.lowering_of else n.name for n in nodes]
    if fused and not reason and program is not None:
        reason = program.summary  # what the strategy recognised, where it said
    return GroupEntry(
        strategy=strategy,
        nodes=[n.name for n in nodes],
        ops=ops,
        fused=fused,
        reason_code=code,
        reason=reason,
        bytes_before=before,
        bytes_after=program.bytes_after() if program else 0,
    )


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
