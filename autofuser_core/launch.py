"""Running a fused kernel: the host wrapper the rewritten graph calls.

``FusedKernel`` allocates the outputs with exactly the shapes and strides eager
produced, launches the Triton kernel on the live inputs (parameters included,
read at call time), and returns one tensor or a tuple. If an input arrives
with another shape or layout than it was compiled for, it does not guess: it
runs the group's original ops instead. When gradients are needed it runs through
``RecomputeForBackward``: kernel forward, then the group's fused backward graph
(or its eager ops recomputed, where it has none). Outputs the kernel writes only for
that backward (``KernelTensor.saved``) never reach the graph.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx
import triton
from torch.nn.utils import parametrize
from triton import knobs
from triton.runtime.driver import driver

from .codegen import KernelSource
from .group import GroupProgram
from .ir import AttrRef

_INTERPRETER_LOCK = threading.Lock()


class FusedKernel:
    """Callable that runs one fused group."""

    def __init__(
        self,
        kernel: Any,
        source: KernelSource,
        config: dict,
        program: GroupProgram,
        eager: Callable[..., Any],
        root: torch.nn.Module,
        host_scalars: Sequence[int] = (),
        device: Optional[torch.device] = None,
        *,
        strategy: str = "",
        ops: Sequence[str] = (),
    ):
        self.kernel = kernel
        # What it runs, for its repr and for people reading ``fused.kernels()``: the
        # strategy that wrote it, the graph nodes it replaces and their ops.
        self.strategy = strategy
        self.nodes = [n.name for n in program.nodes]
        self.ops = list(ops) or list(program.op_names)
        self.source = source
        self.config = dict(config)
        self.eager = eager  # the group's original ops, as a GraphModule
        self.grid = source.launch_grid(self.config)
        self.launch_args = source.launch_args(self.config)
        self.launcher = kernel[self.grid]  # indexing a Triton kernel by its grid builds a launcher: once
        self.direct: Optional[DirectLaunch] = None  # the compiled kernel, once a launch has compiled it
        # (shape, strides or None where a single element makes strides meaningless)
        self.input_layout = [
            (torch.Size(t.shape), tuple(t.stride) if math.prod(t.shape) > 1 else None) for t in program.inputs
        ]
        # What each input must arrive as: the kernel's dtype, or the dtype the launcher
        # converts from (a weight converted once per call).
        self.input_dtypes = [t.cast_from or t.dtype for t in program.inputs]
        self.casts = source.casts(program, self.config)
        # What the kernel itself takes: each input's dtype after the launcher's casts.
        self.kernel_dtypes = source.input_dtypes(program, self.config)
        # One-element inputs that arrive in host memory (``host_scalars``, see that function),
        # copied to the kernel's ``device`` before each launch.
        self.host_scalars, self.device = list(host_scalars), device
        self.host_moves = [(slot, device) for slot in self.host_scalars]  # built once, not per call
        self.output_layout = [(t.shape, t.stride, t.dtype) for t in program.outputs]
        # The graph gets the outputs it reads; those the kernel writes only for the group's
        # backward (``KernelTensor.saved``, last) go to ``RecomputeForBackward``'s context.
        self.n_visible = len(program.visible_outputs)
        self.saved_names = [t.name for t in program.outputs if t.saved]
        self.single_output = self.n_visible == 1
        # Parameters and buffers are fetched from their live module on every call,
        # so an optimiser step or a replaced parameter takes effect at once.
        self.n_inputs = len(program.inputs)
        self.live_attrs = []
        for slot, tensor in enumerate(program.inputs):
            if isinstance(tensor.source, AttrRef):
                owner, _, name = tensor.source.path.rpartition(".")
                self.live_attrs.append((slot, root.get_submodule(owner) if owner else root, name))
        # The eager group reads module parameters itself (``self.ln(x)``), not
        # through its placeholders: backward substitutes them by path.
        self.attr_inputs = {k: t.source.path for k, t in enumerate(program.inputs) if isinstance(t.source, AttrRef)}
        # The group's fused backward (backward.FusedBackward), where one was built and kept.
        # Called as ``backward(inputs, grads, saved)``; its ``reads_saved`` says which of the
        # values saved for backward it reads.
        self.backward: Optional[Callable[..., list]] = None
        self.__name__ = source.name
        self.__qualname__ = source.name

    def __repr__(self) -> str:
        by = f" by {self.strategy}" if self.strategy else ""
        return f"<FusedKernel {self.source.name}{by}: {' > '.join(self.ops)} (nodes {', '.join(self.nodes)})>"

    def matches(self, inputs: Sequence[torch.Tensor]) -> bool:
        """Whether ``inputs`` are what the kernel was made for: shapes, strides and dtypes
        (a parameter converted since, ``model.half()``, must not reach it)."""
        for tensor, (shape, stride), dtype in zip(inputs, self.input_layout, self.input_dtypes):
            if tensor.shape != shape or tensor.dtype != dtype or (stride is not None and tensor.stride() != stride):
                return False
        return True

    def launch(self, *given: torch.Tensor) -> list[torch.Tensor]:
        inputs: Sequence[torch.Tensor] = cast_inputs(given, self.host_moves) if self.host_moves else given
        device = inputs[0].device
        if device.type == "cuda" and device.index != torch.cuda.current_device():
            # Triton launches on the current device: a model on another GPU than the current
            # one (no torch.cuda.set_device) runs its kernels on its own, as torch's ops do.
            with torch.cuda.device(device):
                return self.launch(*inputs)  # host scalars already moved: their move is a no-op
        outputs = [
            torch.empty_strided(shape, stride, dtype=dtype, device=device)
            for shape, stride, dtype in self.output_layout
        ]
        written = kernel_outputs(self.source, outputs, self.grid)
        args = (*cast_inputs(inputs, self.casts), *written)
        # Past the guard above, the inputs' device is the current one: DirectLaunch checks it
        # against its own without asking torch again.
        values = self.direct.values(args, device.index) if self.direct is not None else None
        if values is not None and self.direct is not None:
            self.direct.launch(values)
        elif isinstance(self.kernel, triton.runtime.JITFunction):
            compiled = self.kernel.run(*args, grid=self.grid, warmup=False, **self.launch_args)
            if self.direct is None:  # the first call's kernel; others (another alignment) go through Triton
                self.direct = DirectLaunch.of(self.kernel, compiled, args, self.launch_args, self.grid)
        else:  # the interpreter's kernels
            # The interpreter swaps triton.language's functions for its own while a kernel
            # runs, for the whole process: two threads interpreting at once break each other.
            with _INTERPRETER_LOCK:
                self.launcher(*args, **self.launch_args)
        finish_partials(self.source, outputs, written)
        return outputs

    def with_live_attrs(self, graph_inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The kernel's inputs: the graph's values plus the live parameters, in order."""
        if not self.live_attrs:
            return list(graph_inputs)
        inputs: list = [None] * self.n_inputs
        for slot, module, name in self.live_attrs:
            inputs[slot] = getattr(module, name)
        values = iter(graph_inputs)
        return [next(values) if t is None else t for t in inputs]

    def __call__(self, *graph_inputs: torch.Tensor):
        inputs = self.with_live_attrs(graph_inputs)
        if not self.matches(inputs):
            return self.eager(*inputs)
        if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
            outputs = RecomputeForBackward.apply(self, *inputs)
        else:
            outputs = self.launch(*inputs)[: self.n_visible]
        return outputs[0] if self.single_output else tuple(outputs)


def kernel_outputs(source: KernelSource, outputs: list[torch.Tensor], grid: tuple) -> list[torch.Tensor]:
    """What the kernel writes in place of ``outputs``: each of ``source.partial_outputs`` as
    an fp32 buffer of one row per program (``grid[0]`` of them), each row the output's size."""
    if not source.partial_outputs:
        return outputs
    written = list(outputs)
    for k in source.partial_outputs:
        out = outputs[k]
        written[k] = torch.empty((grid[0], out.numel()), dtype=torch.float32, device=out.device)
    return written


def finish_partials(source: KernelSource, outputs: list[torch.Tensor], written: list[torch.Tensor]) -> None:
    """Each partial output's rows summed into the output (``kernel_outputs``)."""
    for k in source.partial_outputs:
        outputs[k].copy_(written[k].sum(0).view(outputs[k].shape))


class DirectLaunch:
    """A compiled kernel launched as Triton's own ``JITFunction.run`` launches it once it
    has found the kernel in its cache, without binding and specialising the arguments
    again on every call: host time per launch that a forward of a few short kernels can
    spend more of than the GPU spends running them (BENCHMARKS.md, "Measurements behind
    rules in the code": Direct launch).

    It serves only calls Triton would send to the same compiled kernel: the same current
    device, every tensor argument of the same dtype and as aligned to 16 bytes as when it
    was compiled (Triton specialises pointers on both), every other argument equal, and no
    launch hooks (a profiler's) set. Any other call takes Triton's own path (``values``
    says which). What ``JITFunction.run`` does besides - pre-run hooks, the check that
    globals the kernel read are unchanged, debug and instrumentation settings read per
    call - concerns no kernel AutoFuser writes."""

    def __init__(
        self,
        compiled,
        template: list,
        tensor_slots: list[tuple[int, bool, torch.dtype]],
        others: list[tuple[int, Any]],
        grid: tuple,
        device: int,
    ):
        self.compiled, self.template, self.tensor_slots, self.others = compiled, template, tensor_slots, others
        self.slots = sorted([slot for slot, _, _ in tensor_slots] + [slot for slot, _ in others])
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.device = device

    @classmethod
    def of(cls, kernel, compiled, args: Sequence[Any], launch_args: dict, grid: tuple) -> Optional["DirectLaunch"]:
        """The direct launch of ``compiled`` (what ``kernel.run`` returned for ``args``), or
        ``None`` where this Triton's kernels don't have the parts it needs."""
        if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            return None
        params = getattr(kernel, "params", None)
        if params is None or callable(grid) or not 1 <= len(grid) <= 3 or _hooked():
            return None
        template, tensor_slots, others = [], [], []
        positional = iter(args)
        for param in params:
            if param.name in launch_args:
                template.append(launch_args[param.name])
                continue
            value = next(positional, None)
            if value is None:
                return None  # a parameter left to its default: bound by Triton only
            if isinstance(value, torch.Tensor):
                tensor_slots.append((len(template), value.data_ptr() % 16 == 0, value.dtype))
            else:
                others.append((len(template), value))
            template.append(None)  # filled by each call (holding the tensor would keep it alive)
        if next(positional, None) is not None:
            return None
        return cls(compiled, template, tensor_slots, others, grid, torch.cuda.current_device())

    def values(self, args: Sequence[Any], device: Optional[int] = None) -> Optional[list]:
        """Every argument of the kernel for a call with ``args``, or ``None`` where Triton
        would not send that call to this compiled kernel. ``device``: the current CUDA
        device, where the caller knows it (else torch is asked)."""
        if device is None:
            device = torch.cuda.current_device()
        if len(args) != len(self.slots) or _hooked() or device != self.device:
            return None
        values = list(self.template)
        for slot, value in zip(self.slots, args):
            values[slot] = value
        for slot, aligned, dtype in self.tensor_slots:
            tensor = values[slot]
            if (
                not isinstance(tensor, torch.Tensor)
                or tensor.dtype != dtype
                or (tensor.data_ptr() % 16 == 0) != aligned
            ):
                return None
        for slot, value in self.others:
            if type(values[slot]) is not type(value) or values[slot] != value:
                return None
        return values

    def launch(self, values: list) -> None:
        compiled = self.compiled
        stream = driver.active.get_current_stream(self.device)
        # (grid, stream, function, metadata, launch metadata and the two launch hooks: none
        # while no hook is set, as ``values`` checked; then every argument, constexprs too)
        compiled.run(*self.grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *values)


def _hooked() -> bool:
    """Whether a launch hook (a profiler's) is set: then every launch goes through Triton.
    (A hook is a function, or from Triton 3.7 or so a chain of them, empty when unset.)"""
    return any(
        hook is not None and getattr(hook, "calls", True)
        for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    )


def host_scalars(program: GroupProgram, inputs: Sequence[torch.Tensor], device: torch.device) -> list[int]:
    """The slots of one-element inputs that arrive in host memory for a kernel on a GPU: a
    constant the forward makes (``x.masked_fill(m, torch.tensor(2.5))``), which eager takes
    as a scalar and a kernel can't read. Input devices are part of a compiled signature, so
    the slots found with the compile's inputs hold for every call."""
    if device.type == "cpu":
        return []
    return [
        slot for slot, t in enumerate(program.inputs) if math.prod(t.shape) == 1 and inputs[slot].device.type == "cpu"
    ]


def to_device(inputs: Sequence[torch.Tensor], slots: Sequence[int], device: torch.device) -> Sequence[torch.Tensor]:
    """``inputs`` with those of ``slots`` copied to ``device``."""
    return cast_inputs(inputs, [(slot, device) for slot in slots])


def cast_inputs(
    inputs: Sequence[torch.Tensor], casts: Sequence[tuple[int, "torch.dtype | torch.device | None"]]
) -> Sequence[torch.Tensor]:
    """``inputs`` with those of ``casts`` converted to the dtype the kernel reads (or
    moved to the device it runs on); ``inputs`` itself where there is none."""
    if not casts:
        return inputs
    inputs = list(inputs)
    for slot, target in casts:
        inputs[slot] = inputs[slot].to(target)
    return inputs


@contextlib.contextmanager
def _substituted_parametrizations(substitutes: Sequence[tuple[torch.nn.Module, str, torch.Tensor]]):
    """While open, ``module.<name>`` is the given tensor for each parametrized tensor of
    ``substitutes`` (``weight_norm``'s weight, any ``register_parametrization``).

    ``functional_call`` can't substitute those: it assigns the attribute, which runs the
    parametrization's ``right_inverse`` and writes the user's originals in place. Nor can
    ``parametrize.cached()``'s cache: its key is the id of the module the parametrization
    was registered on, which a ``copy.deepcopy`` of the model does not change, so a copy
    would compute its weight afresh and its originals would get no gradient. Instead the
    module's own ``ParametrizationList`` returns the tensor while open (an instance
    ``forward``), and the cache is off, so no entry cached around the call stands in.
    """
    if not substitutes:
        yield
        return
    lists: list[Any] = [getattr(module, "parametrizations")[name] for module, name, _ in substitutes]
    enabled = parametrize._cache_enabled
    parametrize._cache_enabled = 0
    try:
        for plist, (_, _, tensor) in zip(lists, substitutes):
            plist.forward = lambda tensor=tensor: tensor
        yield
    finally:
        for plist in lists:
            plist.__dict__.pop("forward", None)
        parametrize._cache_enabled = enabled


def run_eager(
    fused: FusedKernel,
    inputs: Sequence[torch.Tensor],
    saved: Optional[dict[str, torch.Tensor]] = None,
    made: Optional[dict[str, torch.Tensor]] = None,
) -> Any:
    """The group's original ops on ``inputs``, the kernel's inputs in its order: the
    parameters among them stand in for the module's own (the eager group reads those by
    path), so gradients reach ``inputs`` themselves.

    ``saved``: tensors, by node name in ``fused.eager``, that the ops after each such node
    read instead of its result; the result it computed goes into ``made`` (how a backward
    takes a value from the forward and still differentiates the op that made it)."""
    params, parametrized = {}, []
    for slot, module, name in fused.live_attrs:
        if parametrize.is_parametrized(module, name):
            parametrized.append((module, name, inputs[slot]))
        else:
            params[fused.attr_inputs[slot]] = inputs[slot]
    with _substituted_parametrizations(parametrized):
        if not saved:
            return torch.func.functional_call(fused.eager, params, tuple(inputs))  # type: ignore[arg-type]
        assert isinstance(fused.eager, torch.fx.GraphModule)  # saved values name its nodes
        module = _WithSavedValues(fused.eager, saved, {} if made is None else made)
        params = {f"eager.{path}": tensor for path, tensor in params.items()}
        return torch.func.functional_call(module, params, tuple(inputs))


class _WithSavedValues(torch.nn.Module):
    """A group's eager module run node by node, the ops after each node of ``saved``
    reading the tensor given for it (``run_eager``)."""

    def __init__(self, eager: torch.fx.GraphModule, saved: dict[str, torch.Tensor], made: dict[str, torch.Tensor]):
        super().__init__()
        self.eager, self.saved, self.made = eager, saved, made

    def forward(self, *inputs: torch.Tensor) -> Any:
        outer = self

        class Substituting(torch.fx.Interpreter):
            def run_node(self, n: torch.fx.Node) -> Any:
                result = super().run_node(n)
                if n.name in outer.saved:
                    outer.made[n.name] = result
                    return outer.saved[n.name]
                return result

        return Substituting(self.eager).run(*inputs)


class RecomputeForBackward(torch.autograd.Function):
    """Forward by the fused kernel; backward by the group's fused backward graph, which
    reads the group's inputs and the values the kernel saved for it (its products'
    results, ``KernelTensor.saved``), or where it has none by recomputing the group's
    eager ops.

    The recomputation runs under the forward's autocast state (as eager's
    backward uses the dtypes its forward chose). With ``create_graph=True``
    (gradients of gradients, as in physics-informed losses) backward runs with
    grad enabled: the recomputation then starts from the saved inputs
    themselves, so the gradients it returns stay differentiable.
    """

    @staticmethod
    def forward(ctx, fused: FusedKernel, *inputs: torch.Tensor):
        # An output nothing differentiated gets None, not zeros: its inputs then get no
        # gradient either where they reach no other output, as in eager.
        ctx.set_materialize_grads(False)
        ctx.fused = fused
        ctx.autocast = {
            device: torch.get_autocast_dtype(device) for device in ("cpu", "cuda") if torch.is_autocast_enabled(device)
        }
        outputs = fused.launch(*inputs)
        # Of the values written for backward, only those its backward graph reads are held
        # (none where the group recomputes its eager ops).
        # The backward as it is now, with what it reads: the one this forward saved for.
        ctx.backward = fused.backward
        reads = getattr(fused.backward, "reads_saved", ())
        saved = [outputs[fused.n_visible + j] for j in reads]
        ctx.n_inputs = len(inputs)
        ctx.save_for_backward(*inputs, *saved)
        return tuple(outputs[: fused.n_visible])

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        higher_order = torch.is_grad_enabled()
        held = list(ctx.saved_tensors)
        inputs, saved = held[: ctx.n_inputs], held[ctx.n_inputs :]
        if ctx.backward is not None and not higher_order:
            # Its own backward graph; gradients of gradients need the differentiable recompute.
            return (None, *ctx.backward(inputs, grads, saved))
        if not higher_order:
            inputs = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        with torch.enable_grad(), contextlib.ExitStack() as stack:
            # Exactly the forward's autocast state, whatever is in force around backward().
            for device in ("cpu", "cuda"):
                enabled = device in ctx.autocast
                stack.enter_context(torch.autocast(device, dtype=ctx.autocast.get(device), enabled=enabled))
            outputs = run_eager(ctx.fused, inputs)
        if not isinstance(outputs, (tuple, list)):
            outputs = (outputs,)
        wanted = [t for t in inputs if t.requires_grad]
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        found: Sequence[Optional[torch.Tensor]] = [None] * len(wanted)
        if pairs and wanted:
            found = torch.autograd.grad(
                [o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True, create_graph=higher_order
            )
        it = iter(found)
        return (None, *[next(it) if t.requires_grad else None for t in inputs])
