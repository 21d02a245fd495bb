"""``fuse()``: the user's entry point, and the module it returns.

``FusedModule`` compiles lazily: the first forward with a new *signature*
(input shapes, dtypes, devices and strides; grad mode; autocast state; the
train/eval flags of every submodule; torch's fp32 matmul and cuDNN TF32 settings) captures the model on those inputs,
plans, generates, tunes, verifies and rewrites it, and keeps the result. Later
forwards with the same signature reuse it. Up to ``max_signatures`` compiled
versions are kept; past that, new signatures run the original model, with one
warning.

The wrapper owns no parameters of its own: it shares the original model's,
so ``state_dict``, ``load_state_dict``, ``.to()``, ``eval()`` and optimisers
act on the model itself, and updated weights take effect without recompiling.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import inspect
import json
import logging
import sys
import time
import warnings
from collections import OrderedDict
from typing import Any, Literal, Optional, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .capture import bind_inputs, capture
from .cache import cache_dir, read_verdict, write_verdict
from .compile import _device_of, _snapshot, compile_graph, device_key, median_call_ms, preserved_state
from .cudagraphs import CudaGraphRunner, try_cuda_graph
from .errors import AutoFuserError, CaptureError
from .launch import FusedKernel
from .plugins import load_plugins
from .quantize import QuantizedLayer, QuantizeOptions, parse_quantize, quantize_model
from .report import FusionReport

logger = logging.getLogger("autofuser")


class FuseOptions(BaseModel):
    """Options of ``fuse()``; unknown names are refused."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    cache_dir: Optional[str] = Field(None, description="Cache folder; default $AUTOFUSER_CACHE_DIR or ~/.cache/autofuser.")
    max_signatures: int = Field(8, ge=1, description="Compiled signatures kept; later new ones run eager.")
    tune: bool = Field(True, description="Benchmark each kernel's configs on a GPU (cached).")
    tune_budget_s: float = Field(20.0, gt=0, description="Tuning time per group, seconds.")
    tune_all_configs: bool = Field(
        False, description="Tune every valid config, also past the few that strategies with large kernels tune "
                           "(their max_tuned_configs): longer cold compiles, for gathering tuning statistics "
                           "(benchmarks/tuning_stats.py). Cached apart from capped tuning.")
    verify_speed: bool = Field(True, description="On a GPU, time each group fused vs eager and keep the faster; "
                                                 "run the original model unless the whole fused forward is at "
                                                 "least FORWARD_MARGIN (2%) faster.")
    progress: bool = Field(True, description="Print progress lines to stderr while compiling.")
    cuda_graphs: bool = Field(True, description="For inference on CUDA, replay each compiled forward as a CUDA graph "
                                                "where that is measured to be faster.")
    quantize: Optional[QuantizeOptions] = Field(
        None, description="Quantise weights first: a format name ('mxint8'), or a dict / QuantizeOptions "
                          "naming the format and which layers (include, exclude, min_numel).")
    strict_fp32_products: Literal["tf32x3", "ieee"] = Field(
        "tf32x3", description="fp32 products where torch disallows TF32: 3xTF32 (fp32-level error, tensor cores) "
                              "or plain fp32 FMAs.")
    reassociate_products: bool = Field(
        False, description="Let strategies reorder a chain of matrix products where exact arithmetic gives the same "
                           "result ((q @ k^T) @ v as q @ (k^T @ v)): rounding differs and the cost changes, often "
                           "from quadratic to linear in the sequence length. Off: products run as written.")


    @field_validator("quantize", mode="before")
    @classmethod
    def _parse_quantize(cls, value: Any) -> Optional[QuantizeOptions]:
        return parse_quantize(value)


class _Unguardable(Exception):
    """A call argument the signature guard can't compare (unhashable, not a tensor)."""


class FusedModule(torch.nn.Module):
    """Behaves like the wrapped model; runs fused kernels. See module doc."""

    def __init__(self, model: torch.nn.Module, plugins: Optional[Sequence[Any]], options: FuseOptions):
        super().__init__()
        self._plugins = plugins
        self._plugin_set = _load_plugins_quietly(plugins)
        self._quantized: list[QuantizedLayer] = []
        if options.quantize is not None:
            # A quantised copy; the caller's model keeps its float weights.
            model, self._quantized = quantize_model(model, options.quantize, self._plugin_set.registry)
        # Not a registered submodule: state_dict keys stay those of the model.
        object.__setattr__(self, "_model", model)
        self._options = options
        self._compiled: "OrderedDict[Any, tuple[Any, FusionReport]]" = OrderedDict()
        self._last_report: Optional[FusionReport] = None
        self._warned_full = False
        self._warned_unguardable = False
        self._all_modules = list(model.modules())
        self._forward_signature = inspect.signature(model.forward)
        forward_parameters = self._forward_signature.parameters.values()
        # Calls that pass exactly the positional parameters need no binding.
        self._positional_count = (
            -1 if any(p.kind in (p.VAR_POSITIONAL, p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in forward_parameters)
            else len(forward_parameters))

    # -- nn.Module plumbing: everything that holds state is the model's ------

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    def state_dict(self, *args, **kwargs):
        return self._model.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self._model.load_state_dict(*args, **kwargs)

    def parameters(self, recurse: bool = True):
        return self._model.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self._model.named_parameters(*args, **kwargs)

    def buffers(self, recurse: bool = True):
        return self._model.buffers(recurse)

    def named_buffers(self, *args, **kwargs):
        return self._model.named_buffers(*args, **kwargs)

    def children(self):
        return self._model.children()

    def named_children(self):
        return self._model.named_children()

    def modules(self):
        return self._model.modules()

    def named_modules(self, *args, **kwargs):
        # DistributedDataParallel finds the parameters module by module through this.
        return self._model.named_modules(*args, **kwargs)

    def train(self, mode: bool = True):
        self._model.train(mode)
        return super().train(mode)

    def _apply(self, fn, *args, **kwargs):
        # .to()/.cuda()/.half() move the model; compiled graphs hold its tensors, so drop them.
        self._model._apply(fn, *args, **kwargs)
        self._compiled.clear()
        return self

    def __repr__(self) -> str:
        return f"FusedModule({self._model!r})"

    # -- copying and saving: compiled kernels and loaded plugins are per process ---

    _PER_PROCESS = ("_plugin_set", "_compiled", "_last_report", "_forward_signature")

    def __deepcopy__(self, memo):
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        shared = ("_model", "_plugins")  # the model is copied below; plugin modules can't be, nor need be
        state = {k: v for k, v in self.__dict__.items() if k not in self._PER_PROCESS and k not in shared}
        clone.__dict__.update(copy.deepcopy(state, memo))
        clone._plugins = self._plugins
        object.__setattr__(clone, "_model", copy.deepcopy(self._model, memo))
        clone._all_modules = list(clone._model.modules())
        clone._plugin_set, clone._compiled, clone._last_report = self._plugin_set, OrderedDict(), None
        clone._forward_signature = inspect.signature(clone._model.forward)
        return clone

    def __getstate__(self):
        state = {k: v for k, v in self.__dict__.items() if k not in self._PER_PROCESS}
        state["_plugins"] = list(self._plugin_set.names)  # names load again in another process
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._plugin_set = _load_plugins_quietly(self._plugins)
        self._compiled, self._last_report = OrderedDict(), None
        self._forward_signature = inspect.signature(self._model.forward)

    # -- signatures -----------------------------------------------------------

    def _signature(self, args: tuple, kwargs: dict) -> Any:
        def describe(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return ("T", tuple(x.shape), x.dtype, x.device, tuple(x.stride()), x.requires_grad)
            if isinstance(x, (list, tuple)):
                return (type(x).__name__, tuple(describe(v) for v in x))
            if isinstance(x, dict):
                return ("dict", tuple(sorted((k, describe(v)) for k, v in x.items())))
            try:
                hash(x)
            except TypeError:
                raise _Unguardable(type(x).__name__) from None
            return ("V", type(x), x)  # the type too: 1 == True == 1.0, but code may tell them apart

        autocast = tuple(
            (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) for dev in ("cpu", "cuda")
        )
        modes = tuple(m.training for m in self._all_modules)
        precision = _fp32_settings()
        return (describe(args), describe(kwargs), torch.is_grad_enabled(), autocast, modes, precision)

    # -- forward ----------------------------------------------------------------

    def forward(self, *args, **kwargs):
        try:
            key = self._signature(args, kwargs)
        except _Unguardable as err:
            # The graph bakes in non-tensor arguments; one that can't be compared can't be guarded.
            if not self._warned_unguardable:
                warnings.warn(f"AutoFuser: an argument of type {err} can't be hashed, so a compiled graph "
                              "can't tell when it changes; these calls run the original model.")
                self._warned_unguardable = True
            return self._model(*args, **kwargs)
        entry = self._compiled.get(key)
        if entry is None:
            if len(self._compiled) >= self._options.max_signatures:
                if not self._warned_full:
                    warnings.warn(
                        f"AutoFuser: {self._options.max_signatures} input signatures are already compiled "
                        "(max_signatures); new ones run the original model. Raise max_signatures to compile more."
                    )
                    self._warned_full = True
                return self._model(*args, **kwargs)
            entry = self._compile(args, kwargs, key)
        else:
            self._compiled.move_to_end(key)
        graph_module, report = entry
        self._last_report = report
        if graph_module is None:
            return self._model(*args, **kwargs)
        return graph_module(*self._flatten(args, kwargs))

    def _flatten(self, args: tuple, kwargs: dict) -> tuple:
        """The call's inputs in the captured graph's placeholder order, defaults filled in."""
        if not kwargs and len(args) == self._positional_count:
            return args  # the common case, kept cheap: it runs on every call
        return tuple(bind_inputs(self._model, args, kwargs, self._forward_signature)[2])

    def _progress(self, message: str) -> None:
        logger.info(message)
        if self._options.progress:
            print(f"autofuser: {message}", file=sys.stderr, flush=True)

    def _compile(self, args: tuple, kwargs: dict, key: Any):
        start = time.perf_counter()
        name = type(self._model).__name__
        self._progress(f"compiling {name} for {_describe_inputs(args)}")
        gm = capture(self._model, *args, **kwargs)
        captured_s = time.perf_counter() - start
        flat = self._flatten(args, kwargs)
        if list(gm.meta.get("autofuser_opaque", {})) == [""]:
            report = FusionReport(plugins=self._plugin_set.names, opaque=dict(gm.meta["autofuser_opaque"]),
                                  notes=["the model could not be traced at all; it runs unchanged"])
            entry = (None, report)
        else:
            grad = torch.is_grad_enabled()
            with torch.no_grad():
                fused_gm, report = compile_graph(gm, flat, self._plugin_set, self._options, self._progress,
                                                 backward=grad)
            report.phases = {"capture": captured_s, **report.phases}
            runner = fused_gm
            # Graph capture and timing run the forward many times: only for inference
            # (eval mode, no grad), and leaving buffers and RNG state as they were.
            inference = not grad and not any(m.training for m in self._all_modules)
            step = time.perf_counter()
            device = _device_of(flat)
            cuda = device.type == "cuda"
            # A forward that writes into its inputs can't replay as a graph: the replay would
            # write into its own static copies instead. Writes into tensors the forward makes
            # itself (FNO's `out_ft[..., :m] = ...`) or into parameters and buffers (the same
            # addresses on every replay) are fine.
            no_graph = False
            if self._options.cuda_graphs and inference and cuda:
                with preserved_state(self._model):
                    no_graph = writes_into_inputs(fused_gm, flat)
                if no_graph:
                    report.notes.append("no CUDA graph: the forward writes into its inputs in place")
                elif any(kernel.host_scalars for kernel in fused_kernels(fused_gm)):
                    # A copy from host memory can't be captured: capture would fail, and torch warn.
                    no_graph = True
                    report.notes.append("no CUDA graph: a kernel reads a one-element tensor the forward makes "
                                        "in host memory (torch.tensor(2.5)), copied to the GPU on every call")
            measured = self._options.verify_speed and inference and _can_time_forward(device)
            vkey = _verdict_key(fused_gm, bool(report.fused), kwargs, flat) if measured else None
            root = cache_dir(self._options.cache_dir)
            known = read_verdict(root, vkey) if vkey is not None else {}
            times = dict(known)
            if self._options.cuda_graphs and inference and not no_graph and cuda:
                graph, why = None, None
                slower_before = "graph_ms" in known and known["graph_ms"] >= known.get("plain_ms", 0.0)
                if not slower_before:
                    with torch.no_grad(), preserved_state(self._model):
                        bound = None if "graph_ms" in known else _gpu_bound(fused_gm, flat)
                        if bound is not None:
                            why = bound
                        else:
                            graph, why = try_cuda_graph(fused_gm, flat, self._model)
                if graph is not None:
                    # Replays copy the inputs in and clone the outputs: worth it when launches, not
                    # bytes, dominate. Measured, not guessed.
                    if "graph_ms" not in times or "plain_ms" not in times:
                        with torch.no_grad(), preserved_state(self._model):
                            times["plain_ms"], times["graph_ms"] = _time(fused_gm, flat), _time(graph, flat)
                    plain_ms, graph_ms = times["plain_ms"], times["graph_ms"]
                    if graph_ms < plain_ms:
                        runner = graph
                        report.notes.append(f"the compiled forward replays as one CUDA graph "
                                            f"({graph_ms:.3f} ms vs {plain_ms:.3f} ms launched op by op)")
                    else:
                        report.notes.append(f"no CUDA graph: replaying it ({graph_ms:.3f} ms, with input copies and "
                                            f"output clones) is not faster than launching ({plain_ms:.3f} ms)")
                elif slower_before:
                    report.notes.append(f"no CUDA graph: replaying it ({known['graph_ms']:.3f} ms) was measured "
                                        f"not faster than launching ({known.get('plain_ms', 0.0):.3f} ms)")
                else:
                    report.notes.append(f"no CUDA graph ({why}); kernels launch one by one")
            report.add_phase("cuda_graph", time.perf_counter() - step)
            step = time.perf_counter()
            if measured:
                # The last word on "never slower than eager": the whole forward, as the user calls it.
                use = "graph" if runner is not fused_gm else "plain"
                if f"{use}_fused_ms" not in times or "eager_ms" not in times:
                    with torch.no_grad(), preserved_state(self._model):
                        times[f"{use}_fused_ms"], times["eager_ms"] = _forward_times(
                            runner, lambda *a: self._model(*args, **kwargs), flat)
                eager_ms, fused_ms = times["eager_ms"], times[f"{use}_fused_ms"]
                if fused_ms >= eager_ms * (1.0 - FORWARD_MARGIN):
                    report.notes.append(f"the fused forward ({fused_ms:.3f} ms) was not at least "
                                        f"{100 * FORWARD_MARGIN:.0f}% faster than the original ({eager_ms:.3f} ms) "
                                        "for these inputs: the original runs")
                    runner = None
                else:
                    report.notes.append(f"forward: {fused_ms:.3f} ms fused vs {eager_ms:.3f} ms eager")
                if known:
                    report.notes.append("whole-forward times read from the cache (measured when first compiled)")
                if times != known:
                    write_verdict(root, vkey, times)
            report.add_phase("forward_check", time.perf_counter() - step)
            entry = (runner, report)
        report.quantized = list(self._quantized)
        report.signature = _describe_inputs(args)
        report.device = str(_device_of(flat))
        report.compile_s = time.perf_counter() - start
        self._compiled[key] = entry
        self._progress(f"compiled {name} in {report.compile_s:.1f} s: {len(report.fused)} fused group(s), "
                       f"{len(report.skipped)} skipped")
        return entry

    def reset(self) -> None:
        """Forget every compiled signature; the next call compiles again.

        Needed after changes a guard doesn't see: a submodule or parameter
        replaced by a new object (in-place updates and ``load_state_dict`` are
        seen), or a Python attribute that ``forward`` reads changed.
        """
        self._compiled.clear()
        self._last_report = None

    def report(self) -> FusionReport:
        """The report of the most recently used compiled signature."""
        if self._last_report is None:
            raise AutoFuserError("nothing compiled yet: call the fused model on real inputs first, then .report().")
        return self._last_report

    def reports(self) -> list[FusionReport]:
        """Reports of every compiled signature, the least recently called first."""
        return [report for _, report in self._compiled.values()]

    def kernels(self) -> list[FusedKernel]:
        """The fused kernels the compiled signatures run, the least recently called
        signature first: inside a forward replayed as one CUDA graph too, none of a
        signature that runs the original model because fusing it was not faster. One per
        generated source: of two identical layers, only the first's kernel is listed
        (each kernel reads its own layer's parameters when called)."""
        found: dict[str, FusedKernel] = {}
        for runner, _ in self._compiled.values():
            graph_module = runner.forward if isinstance(runner, CudaGraphRunner) else runner
            if graph_module is None:
                continue
            for kernel in fused_kernels(graph_module):
                found.setdefault(kernel.source.name, kernel)
        return list(found.values())


def fused_kernels(graph_module: torch.fx.GraphModule) -> list[FusedKernel]:
    """The ``FusedKernel`` each call of a rewritten graph runs, in graph order."""
    return [node.target for node in graph_module.graph.nodes
            if node.op == "call_function" and isinstance(node.target, FusedKernel)]


def _load_plugins_quietly(plugins):
    """``load_plugins`` leaving the CPU random stream as it was: a plugin may build
    sample modules when it is first imported, and ``fuse()`` must not change what
    the user's next ``torch.randn`` draws."""
    with torch.random.fork_rng(devices=[]):
        return load_plugins(plugins)


#: The whole-forward check: alternating rounds of eager and fused timing, and the
#: share by which the fused forward must beat the original to replace it (when in
#: doubt, the original runs).
FORWARD_ROUNDS = 2
FORWARD_MARGIN = 0.02
FORWARD_BUDGET_MS = 25.0
#: A fused forward this much faster than eager in the first round needs no second one: a
#: slow moment of the GPU moves a median of several calls by a few percent, not by this.
CLEAR_GAP = 0.2
#: A fused forward over FORWARD_BUDGET_MS that is more than this share faster than one
#: eager call is kept without timing eager further: the eager calls of a long forward cost
#: seconds (a transformer over every mesh point runs 0.3 s), and no slow moment of the GPU
#: doubles a forward that long.
WIDE_GAP = 0.5
FORWARD_TIMING = (f"back-to-back events, fused first, best of {FORWARD_ROUNDS} rounds "
                  f"(one past a {CLEAR_GAP:.0%} gap), 3 calls for a forward over {FORWARD_BUDGET_MS:g} ms, "
                  f"one eager call over that past a {WIDE_GAP:.0%} gap")


def writes_into_inputs(forward, flat: Sequence[Any]) -> bool:
    """Whether ``forward`` writes into the memory of one of its tensor inputs, through any
    view or any call (an opaque part included): it runs once on copies of the inputs (the
    caller's tensors are left alone), and an in-place write shows in a copy's version counter."""
    copies = [_snapshot(x) for x in flat]
    before = [(c, c._version) for c in copies if isinstance(c, torch.Tensor)]
    with torch.no_grad():
        forward(*copies)
    return any(c._version != version for c, version in before)


#: A forward over FORWARD_BUDGET_MS that the host queues in under this share of its time
#: is GPU-bound: every launch is queued while the GPU still runs earlier work, so a CUDA
#: graph replay has no launch time left to save.
HOST_SHARE_GPU_BOUND = 0.5


def _forward_times(fused, eager, flat: Sequence[Any]) -> tuple[float, float]:
    """(fused ms, eager ms) for the whole-forward check. Alternating rounds, the best of
    each side: a slow moment of the GPU (clocks, another process) then can't decide the
    verdict by landing on one side only. The fused side goes first in each round: a GPU
    still ramping its clocks after the compile slows it, not eager, so any bias favours the
    original. A fused forward more than CLEAR_GAP ahead after one round needs no second;
    one more than WIDE_GAP ahead of a single eager call over FORWARD_BUDGET_MS needs no
    more eager calls."""
    fused_runs, eager_runs = [], []
    for round_ in range(FORWARD_ROUNDS):
        fused_runs.append(_time(fused, flat))
        once = None
        if round_ == 0:
            _, once = _once(eager, flat)  # eager ran in capture and verification: no warm-up
            if once > FORWARD_BUDGET_MS and fused_runs[0] < once * (1.0 - WIDE_GAP):
                return fused_runs[0], once
        eager_runs.append(_time(eager, flat, once))
        if min(fused_runs) < min(eager_runs) * (1.0 - CLEAR_GAP):
            break
    return min(fused_runs), min(eager_runs)


def _gpu_bound(forward: torch.fx.GraphModule, flat: Sequence[Any]) -> Optional[str]:
    """Why a CUDA graph can't pay for this forward, or ``None`` (try one): a forward over
    FORWARD_BUDGET_MS that the host queues in under HOST_SHARE_GPU_BOUND of its time. The
    caller ran the forward just before (``writes_into_inputs``), so its kernels are loaded."""
    queued_ms, total_ms = _once(forward, flat)
    if total_ms > FORWARD_BUDGET_MS and queued_ms < HOST_SHARE_GPU_BOUND * total_ms:
        return (f"the forward is GPU-bound: the host queues it in {queued_ms:.1f} of its {total_ms:.1f} ms, "
                "so a replay would save no launch time")
    return None


def _on_device(args: Sequence[Any]):
    """A context making the device of the first CUDA tensor in ``args`` current (none: the
    current device stays)."""
    device = next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
    return torch.cuda.device(device) if device is not None else contextlib.nullcontext()


def _once(fn, args: Sequence[Any]) -> tuple[float, float]:
    """One call of ``fn(*args)`` on the device of ``args``: (ms until the host returned from
    it, ms until the GPU finished it), wall clock from a synchronised start."""
    with _on_device(args):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        fn(*args)
        queued = time.perf_counter()
        torch.cuda.synchronize()
        return (queued - begin) * 1e3, (time.perf_counter() - begin) * 1e3


def _time(fn, args: tuple, once_ms: Optional[float] = None) -> float:
    """Median ms per call of ``fn(*args)`` called back to back, as a loop of forwards runs:
    each call between two CUDA events, no cache flush between calls (a flush would also
    give the host a head start, hiding launch overhead), about ``FORWARD_BUDGET_MS`` of calls
    after two warm-up calls. On the device of the first tensor argument (``args`` or, for
    a closure over the call's arguments, the current device). ``once_ms``: one call's time,
    where the caller has just measured it (else the first call measures it)."""
    with _on_device(args):
        if once_ms is None:
            _, once_ms = _once(fn, args)
        # A forward longer than the budget on its own: 3 calls after 1 warm-up (a transformer
        # over every mesh point runs 0.3 s eager; 5 calls and 2 warm-ups cost seconds).
        slow = once_ms > FORWARD_BUDGET_MS
        calls = 3 if slow else max(5, min(100, int(FORWARD_BUDGET_MS / max(once_ms, 1e-3))))
        return median_call_ms(lambda: fn(*args), calls, warmup=1 if slow else 2)


def _can_time_forward(device: torch.device) -> bool:
    """Whole-forward timings mean something only on a GPU."""
    return device.type == "cuda"


def _fp32_settings() -> tuple:
    """How eager multiplies fp32 (matmuls, and cuDNN's convolutions): kernels are written to match it."""
    return (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision(),
            torch.backends.cudnn.allow_tf32)


def _verdict_key(fused_gm: torch.fx.GraphModule, fused: bool, kwargs: dict, flat: list) -> Optional[dict]:
    """What the whole-forward timings depend on: the rewritten graph, each kernel and
    config, the inputs' shapes, dtypes and strides, the GPU and the versions.
    ``None`` (never cached) when nothing was fused."""
    if not fused:
        return None
    kernels = [[k.source.name, k.source.source_hash, sorted(k.config.items())] for k in fused_kernels(fused_gm)]
    inputs = [[str(x.dtype), list(x.shape), list(x.stride())] if isinstance(x, torch.Tensor) else repr(x)
              for x in flat]
    precision = _fp32_settings()  # they change eager's own time
    # The timing method is part of the key: verdicts timed another way are not reused.
    text = json.dumps([fused_gm.code, kernels, inputs, sorted(kwargs), precision, FORWARD_TIMING], default=str)
    return {"forward": hashlib.sha256(text.encode()).hexdigest(), **device_key(_device_of(flat))}


def _describe_inputs(args: tuple) -> str:
    parts = []
    for x in args:
        if isinstance(x, torch.Tensor):
            parts.append(f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}")
        else:
            parts.append(type(x).__name__)
    return "(" + ", ".join(parts) + ")"


def fuse(model: torch.nn.Module, plugins: Optional[Sequence[Any]] = None, **options: Any) -> FusedModule:
    """Wrap ``model`` so that it runs fused Triton kernels.

    :param model: an ``nn.Module`` instance.
    :param plugins: ``None`` for every installed plugin, or a list of plugin
        modules, hook-carrying objects or entry-point names.
    :param options: see ``FuseOptions`` (``cache_dir``, ``max_signatures``,
        ``tune``, ``tune_budget_s``, ``verify_speed``, ``progress``,
        ``cuda_graphs``, ``strict_fp32_products``, ``reassociate_products``,
        ``quantize``). With ``quantize``, the fused module wraps a quantised
        copy of ``model`` (``fused.model``); ``model`` itself is left unchanged.
    :raises CaptureError: ``model`` is not a module instance.
    :raises PluginError, SpecError: a plugin could not be loaded or is invalid.
    """
    if not isinstance(model, torch.nn.Module):
        hint = " - it is a class; instantiate it first" if isinstance(model, type) else ""
        raise CaptureError(f"fuse() takes an nn.Module instance, got {type(model).__name__}{hint}.")
    try:
        parsed = FuseOptions(**options)
    except ValidationError as err:
        known = ", ".join(FuseOptions.model_fields)
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise AutoFuserError(f"invalid fuse() option(s): {problems}. Known options: {known}.") from None
    return FusedModule(model, plugins, parsed)
