"""Tuning: which of a strategy's configs a kernel launches with.

``pick_config`` answers from the on-disk cache (cache.py) where an entry for this
kernel, GPU and versions holds a config the strategy still accepts, else times the
strategy's valid configs within the time budget (``_tune``), under a lock so that
several processes tune a kernel once between them, and stores the fastest. Before
the timing starts, ``precompile_untuned`` compiles the configs ahead in child
processes (precompile.py). Where the current timer (timing.py) says not to tune (no
GPU, or ``tune=False``), the strategy's default config is used.

A re-planning round (the second on) tunes only the first ``LATER_ROUND_CONFIGS`` of
each list: the driver sets ``CONFIG_LIMIT`` for it.
"""

from __future__ import annotations

import contextvars
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from . import timing
from .cache import cache_dir, read_tuning, tuning_lock, write_tuning
from .codegen import GridTooLarge
from .launch import cast_inputs, finish_partials, kernel_outputs
from .planner import Candidate
from .precompile import CompileJob, Compiling, launch_items
from .precompile import start as start_compiling
from .registry import PluginHookError

logger = logging.getLogger("autofuser.tune")


#: Milliseconds of repeats per tuning config (``rep_ms`` of ``Timer.bench``): for a typical fused
#: kernel of tens of microseconds, the cap of ``timing.BENCH_MAX_CALLS`` calls is what applies.
TUNING_REP_MS = 6


def device_key(device: torch.device) -> dict[str, Any]:
    """What a measurement on ``device`` depends on besides the code: the torch and Triton
    versions, the GPU's name and capability (the interpreter's, off a GPU)."""
    import triton

    key = {"torch": torch.__version__, "triton": triton.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        key.update(gpu=props.name, capability=f"{props.major}.{props.minor}")
    else:
        key.update(gpu="interpreter", capability="cpu")
    return key


@dataclass
class Tuned:
    """``pick_config``'s answer: the config, where it came from and what tuning it cost."""

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
CONFIG_LIMIT: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("autofuser_config_limit", default=None)


def _tuning_configs(candidate: Candidate, every: bool = False) -> tuple[list[dict], Optional[int]]:
    """The configs tuning times: the strategy's valid ones in its order, the first
    ``max_tuned_configs`` of them (all with ``every``: ``tune_all_configs``), and in a
    re-planning round the first
    ``LATER_ROUND_CONFIGS``; the default where none is valid. Also the round's limit where
    it shortened the list (else ``None``): an entry tuned over fewer configs than a first
    round would try is tuned again by one (``_valid_entry``)."""
    strategy, program = candidate.strategy, candidate.program
    valid = [c for c in strategy.configs(program) if strategy.is_valid(program, c) is None]
    valid = valid if every else valid[: strategy.max_tuned_configs]
    limit = CONFIG_LIMIT.get()
    cut = limit if limit is not None and len(valid) > limit else None
    return valid[:limit] or [strategy.default_config(program)], cut


def _tuning_key(source, device: torch.device, options) -> dict[str, Any]:
    key = {"kernel": source.name, "source_sha256": source.source_hash, **device_key(device)}
    if getattr(source, "sizes", None):  # duck-typed sources without run-time sizes have none
        # One source serves every size of a dynamic dim: tuned, and cached, per size bucket.
        key["size_buckets"] = list(source.size_buckets)
    if options.tune_all_configs:
        key["all_configs"] = True  # kept apart: a capped entry is not a whole list's
    return key


def precompile_untuned(jobs: list, device: torch.device, options, progress) -> Optional[Compiling]:
    """Start compiling, in parallel, every config that tuning is about to time, kernels in
    the order they will be timed (see precompile.py); ``None`` where nothing is tuned.
    ``jobs``: the driver's records (``compile._Job``), of which it reads ``candidate``,
    ``source`` and ``kernel_path``, and sets ``configs`` (``_tuning_configs``' answer)."""
    if not timing.current().can_tune(device, options):
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
            dtypes = (*job.source.input_dtypes(program, config), *job.source.output_dtypes(program))
            by_dtypes.setdefault(dtypes, []).append(launch_items(job.source.launch_args(config)))
        work[job.source.name] = [
            CompileJob(
                path=job.kernel_path,
                name=job.source.name,
                dtypes=tuple(str(d).removeprefix("torch.") for d in dtypes),
                launches=tuple(launches),
            )
            for dtypes, launches in by_dtypes.items()
        ]
    return start_compiling([j for kernel_jobs in work.values() for j in kernel_jobs], progress)


def finish_compiling(compiling: Optional[Compiling], report) -> None:
    if compiling is None:
        return
    compiled = compiling.finish()
    if compiled:
        report.notes.append(
            f"compiled {compiled} of {len(compiling.launches)} tuning config(s) in parallel before timing"
        )


def pick_config(
    candidate: Candidate, source, kernel, inputs, device, options, progress, ready=None, configs=None
) -> Tuned:
    """The config to launch with: the cached one, else tuned (``configs``: ``_tuning_configs``'
    answer where already known)."""
    if not timing.current().can_tune(device, options):
        return Tuned(candidate.strategy.default_config(candidate.program))
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
    return Tuned(
        entry["config"], True, 0.0, entry.get("timings", []), key, entry.get("speed"), entry.get("config_limit")
    )


def _valid_entry(candidate: Candidate, entry: Optional[dict], warn: bool = True) -> Optional[dict]:
    """A cached tuning entry whose config the strategy still accepts, else ``None`` (tune again):
    a validity rule added since the entry was written (a config found to fault, say) holds
    for cached configs too, and the config must be one the strategy lists now (or its
    default): an entry selects among the strategy's configs, it never adds one."""
    if entry is None:
        return None
    if entry.get("config_limit") is not None and CONFIG_LIMIT.get() is None:
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
            logger.warning(
                "cached config %s of %s is no longer valid (%s); tuning again",
                entry["config"],
                candidate.strategy.name,
                why,
            )
        return None
    # A cache entry only chooses among the strategy's own configs: one it doesn't list (an
    # older list, or an entry written by hand) could launch with block sizes nobody checked.
    if entry["config"] not in strategy.configs(program):
        if warn:
            logger.warning(
                "cached config %s of %s is not one of the strategy's configs; tuning again",
                entry["config"],
                candidate.strategy.name,
            )
        return None
    return entry


def _tune(
    candidate: Candidate, source, kernel, inputs, device, options, progress, root, key, ready=None, configs=None
) -> Tuned:
    """Time the strategy's valid configs within the budget; store and return the fastest.
    ``ready(launch_args)``: wait until that config is compiled ahead (not counted as tuning)."""
    program = candidate.program
    assert program is not None  # only a kept candidate, so a composed one, has a kernel to tune
    default = candidate.strategy.default_config(program)
    configs, limit = configs or _tuning_configs(candidate, options.tune_all_configs)
    progress(f"tuning {source.name}: {len(configs)} configs")
    start = time.perf_counter()
    timings: list[dict[str, Any]] = []
    best, best_ms = default, float("inf")
    timer = timing.current()
    outputs = [torch.empty_strided(t.shape, t.stride, dtype=t.dtype, device=device) for t in program.outputs]
    waited = 0.0
    for config in configs:
        if time.perf_counter() - start - waited > options.tune_budget_s and timings:
            break
        launch = source.launch_args(config)
        try:
            grid = source.launch_grid(config)
        except GridTooLarge as err:  # CUDA refuses its grid: no candidate, not even compiled
            logger.debug("config %s of %s: %s", config, source.name, err)
            continue
        if ready is not None:
            begin = time.perf_counter()
            ready(launch)
            waited += time.perf_counter() - begin
        # Timed with the launcher's conversions, as the forward runs them: a config that
        # converts its inputs itself (``KernelSource.converts_casts``) competes fairly.
        casts = source.casts(program, config)
        try:
            # Partial rows (a cross sum, a split K): their count follows the config's grid, so
            # their sum, which the launcher adds after the kernel, is timed with it.
            written = kernel_outputs(source, outputs, grid)

            def run(grid=grid, casts=casts, written=written, launch=launch):
                kernel[grid](*cast_inputs(inputs, casts), *written, **launch)
                finish_partials(source, outputs, written)

            ms = timer.bench(run, rep_ms=TUNING_REP_MS)
        except Exception as err:  # a config the compiler rejects (resources) is just not a candidate
            logger.debug("config %s of %s failed: %s", config, source.name, err)
            continue
        timings.append({"config": config, "ms": ms})
        if ms < best_ms:
            best, best_ms = config, ms
    write_tuning(root, key, best, timings, config_limit=limit)
    return Tuned(best, False, time.perf_counter() - start - waited, timings, key, config_limit=limit)
