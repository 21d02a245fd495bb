"""Replaying a compiled forward as one CUDA graph.

On the small meshes of many solvers, kernel launches - not bytes - bound the
time. For inference on CUDA, ``CudaGraphRunner`` captures the whole compiled
forward of one signature once and replays it:

1. warm up on a side stream (lazy initialisations must not be captured);
2. capture into static input buffers; check one replay equals the uncaptured
   forward bit for bit, else give up (the caller runs without graphs);
3. each call copies the new inputs into the static buffers, replays, and
   returns *clones* of the static outputs, so a later call never overwrites a
   tensor an earlier call returned;
4. the graph baked in the addresses of the model's parameters and buffers:
   each call checks they are still the same tensors (an optimiser's in-place
   update is fine; a replaced parameter is not) and otherwise runs uncaptured.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.utils._pytree as pytree

from .tf32 import tf32_allowed
from .timing import uncached_casts


class CudaGraphRunner:
    def __init__(self, forward: Callable[..., Any], inputs: tuple, model: torch.nn.Module):
        self.forward = forward
        self.model = model
        self.tensor_slots = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]
        self.static_inputs = [x.clone() for x in inputs if isinstance(x, torch.Tensor)]
        self.template = list(inputs)
        self.baked = BakedAddresses(model)
        self.graph = torch.cuda.CUDAGraph()
        args = self._args(self.static_inputs)
        with uncached_casts():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    forward(*args)
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(self.graph):
                self.static_outputs = forward(*args)
        self.graph.replay()
        reference = forward(*args)
        if not _bit_equal(self.static_outputs, reference):
            raise RuntimeError("a replay of the captured graph differs from the uncaptured forward")

    def _args(self, tensors) -> list:
        args = list(self.template)
        for slot, t in zip(self.tensor_slots, tensors):
            args[slot] = t
        return args

    def __call__(self, *inputs):
        if not self.baked.unchanged():
            return self.forward(*inputs)
        for static, slot in zip(self.static_inputs, self.tensor_slots):
            static.copy_(inputs[slot])
        self.graph.replay()
        return _clone(self.static_outputs)


class BakedAddresses:
    """The memory a captured graph baked in: each parameter and buffer of the model, found
    where it lives (its owner's dict and name), and each submodule where it hangs.
    ``unchanged()`` runs on every replay, so it checks them with dict lookups instead of
    walking the module tree: an optimiser's in-place update keeps them; a replaced
    parameter, a ``.data`` swap or a replaced submodule does not."""

    def __init__(self, model: torch.nn.Module):
        self.modules = []  # (parent._modules, name, child)
        self.tensors = []  # (owner dict, name, data_ptr)
        for parent in model.modules():
            self.modules += [(parent._modules, name, child) for name, child in parent._modules.items()]
            for owner in (parent._parameters, parent._buffers):
                self.tensors += [(owner, name, t.data_ptr()) for name, t in owner.items() if t is not None]

    def unchanged(self) -> bool:
        if any(modules.get(name) is not child for modules, name, child in self.modules):
            return False
        for owner, name, address in self.tensors:
            tensor = owner.get(name)
            if tensor is None or tensor.data_ptr() != address:
                return False
        return True


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


def _bit_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point() or a.is_complex():
            return torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_bit_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_bit_equal(a[k], b[k]) for k in a)
    return a == b


def try_cuda_graph(
    forward: Callable[..., Any], inputs: tuple, model: torch.nn.Module
) -> tuple[Optional[CudaGraphRunner], str]:
    """A runner, or ``None`` and the reason capture is not possible."""
    return _captured(lambda: CudaGraphRunner(forward, inputs, model), inputs)


def _captured(capture: Callable[[], Any], inputs: tuple) -> tuple[Any, str]:
    """``capture()``'s result and "captured", or ``None`` and why it could not be: the
    inputs are not all on a GPU, or capture raised."""
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    if not tensors or any(t.device.type != "cuda" for t in tensors):
        return None, "inputs are not all CUDA tensors"
    try:
        return capture(), "captured"
    except Exception as err:  # anything the graph can't hold (syncs, CPU ops) means: run uncaptured
        torch.cuda.synchronize()
        return None, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


@contextlib.contextmanager
def _reading_through(roots: Sequence[torch.nn.Module], aliases: dict[int, torch.Tensor]) -> Iterator[None]:
    """Inside, each parameter that ``aliases`` holds an alias of (by ``id``) is that alias in the
    parameter dict of every module of ``roots``' trees that holds it, each module once (a
    module under two paths, a weight tied between two); on leaving, each dict entry is its
    own parameter again, whatever was raised."""
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    seen: set[int] = set()
    for root in roots:
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            table: dict[str, Any] = module._parameters
            swapped += [(table, name, p) for name, p in table.items() if p is not None and id(p) in aliases]
    try:
        for owner, name, p in swapped:
            owner[name] = aliases[id(p)]
        yield
    finally:
        for owner, name, p in swapped:
            owner[name] = p


#: A training step is captured in the user's loop, where other threads may use CUDA (a
#: data loader's pinning thread): only this thread's calls may break the capture, and
#: theirs, on other streams, neither break it nor are captured.
CAPTURE_MODE = "thread_local"
#: Forward and backward passes run uncaptured before a training step is captured: lazy
#: initialisations (cuBLAS workspaces, Triton's first launches) must not be captured.
TRAINING_WARMUP = 2


class TrainingGraph:
    """A compiled forward and its backward, each captured as one CUDA graph, for training.

    Where launches, not bytes, bound a training step (many small kernels on a small mesh),
    replaying two graphs replaces hundreds of launches. The forward graph writes the
    values the backward reads into memory of the graphs' own pool, so:

    - a call copies the inputs into static buffers, replays the forward and returns
      clones of the static outputs (a later call never overwrites a tensor returned);
    - the backward copies the incoming gradients into static buffers, replays the
      backward graph and returns clones of the static gradients (autograd may keep a
      returned gradient as a parameter's ``.grad``; a clone is never overwritten by a
      later replay, so accumulating over several backwards stays right);
    - while a replayed call's backward has not run and its autograd graph is alive, the
      next call runs uncaptured: replaying would overwrite what that backward reads;
    - the parameters and buffers must be those captured (``BakedAddresses``; an
      optimiser's in-place update is fine) and need gradients as they did, else calls
      run uncaptured;
    - a backward with ``create_graph=True`` runs the forward again uncaptured on the
      saved inputs, so its gradients can be differentiated in turn.

    ``check()`` runs one replayed step against uncaptured steps on the same inputs and
    gradients: outputs and gradients must be bit for bit the same, or no farther apart
    than two uncaptured steps are (atomic sums), else capture is given up (random ops)."""

    def __init__(self, forward: Callable[..., Any], inputs: tuple, model: torch.nn.Module):
        self.forward = forward
        self.model = model
        self.baked = BakedAddresses(model)
        self.all_params = list(model.parameters())
        self.wanted = [p.requires_grad for p in self.all_params]
        self.params = [p for p in self.all_params if p.requires_grad]
        self.template = list(inputs)
        self.tensor_slots = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]
        self.static_inputs = [
            inputs[i].detach().clone().requires_grad_(inputs[i].requires_grad) for i in self.tensor_slots
        ]
        self.grad_inputs = [k for k, t in enumerate(self.static_inputs) if t.requires_grad]
        if not self.grad_inputs and not self.params:
            raise RuntimeError("nothing needs gradients")
        self.pending = 0  # replayed calls whose backward has not run, their autograd graphs alive
        self.generation = 0  # forward replays so far
        with uncached_casts():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.enable_grad():
                for _ in range(TRAINING_WARMUP):
                    found, wrt = self._through_aliases()
                    outputs, differentiable = self._differentiable(found)
                    if differentiable:
                        self.gathered(
                            torch.autograd.grad(
                                differentiable, wrt, [torch.ones_like(t) for t in differentiable], allow_unused=True
                            )
                        )
                    del outputs, differentiable, found, wrt
            torch.cuda.current_stream().wait_stream(stream)
            pool = torch.cuda.graph_pool_handle()
            self.forward_graph = torch.cuda.CUDAGraph()
            with torch.enable_grad(), torch.cuda.graph(self.forward_graph, pool=pool, capture_error_mode=CAPTURE_MODE):
                found, wrt = self._through_aliases()
            leaves, self.spec = pytree.tree_flatten(found)
            self.static_outputs = leaves
            self.tensor_outputs = [k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
            self.differentiable = [
                k for k in self.tensor_outputs if leaves[k].requires_grad and leaves[k].is_floating_point()
            ]
            if not self.differentiable:
                raise RuntimeError("no output needs gradients")
            self.static_grad_outputs = [torch.zeros_like(leaves[k]) for k in self.differentiable]
            self.backward_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.backward_graph, pool=pool, capture_error_mode=CAPTURE_MODE):
                grads = torch.autograd.grad(
                    [leaves[k] for k in self.differentiable], wrt, self.static_grad_outputs, allow_unused=True
                )
                self.static_grads = self.gathered(grads)  # the sums are captured too
            del wrt
        # The leaves' autograd history is no longer needed: the graphs hold the memory.
        self.static_outputs = [t.detach() if isinstance(t, torch.Tensor) else t for t in self.static_outputs]

    def _through_aliases(self) -> tuple[Any, list[torch.Tensor]]:
        """``forward`` on the static inputs, reading each input that needs a gradient
        through a view and each parameter that does through an alias made here (a new leaf
        on the parameter's memory), and what to take gradients of (``gathered`` adds them up
        per input and parameter). A parameter is swapped for its alias in the parameter
        dict of every module that holds it, the model's (whose modules fused kernels read
        their parameters from) and the forward's, and put back after. So the gradient is
        taken at a node made on this stream, never at the parameter's own accumulator: that
        one lives as long as anything holds an earlier step's autograd graph (the loop's
        last loss) and belongs to the stream that step ran on, and reaching that stream from
        a capture is an error ("operation would make the legacy stream depend on a
        capturing blocking stream"). The parameters themselves are asked for too, for a
        read that bypasses the modules (a closure); the aliases are not connected to them,
        so nothing is counted twice, and where no such read exists their accumulators are
        not reached."""
        inputs = [t.view_as(t) if t.requires_grad else t for t in self.static_inputs]
        aliases = {id(p): p.detach().requires_grad_(True) for p in self.params}
        roots = [self.model] + ([self.forward] if isinstance(self.forward, torch.nn.Module) else [])
        with _reading_through(roots, aliases):
            found = self.forward(*self._args(inputs))
        wrt = [inputs[k] for k in self.grad_inputs] + [aliases[id(p)] for p in self.params] + self.params
        return found, wrt

    def gathered(self, grads: Sequence[Optional[torch.Tensor]]) -> list[Optional[torch.Tensor]]:
        """The gradients of ``_through_aliases``' ``wrt``, one per input that needs one, then one
        per parameter: its alias's and its own added (None where neither got one)."""
        count, params = len(self.grad_inputs), len(self.params)
        through, direct = grads[count : count + params], grads[count + params :]
        return list(grads[:count]) + [a if b is None else b if a is None else a + b for a, b in zip(through, direct)]

    def _args(self, tensors: Sequence[torch.Tensor]) -> list:
        args = list(self.template)
        for slot, t in zip(self.tensor_slots, tensors):
            args[slot] = t
        return args

    @staticmethod
    def _differentiable(found: Any) -> tuple[list, list]:
        leaves = pytree.tree_leaves(found)
        return leaves, [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]

    def placed(self, grads: list[Optional[torch.Tensor]], count: int) -> list[Optional[torch.Tensor]]:
        """Gradients of the inputs that need them, then of the parameters (``self.params``), as
        ``_ReplayStep``'s backward returns them: one per tensor input of ``count``, None where
        an input needs none, then one per parameter."""
        placed: list[Optional[torch.Tensor]] = [None] * count
        for k, grad in zip(self.grad_inputs, grads):
            placed[k] = grad
        return placed + grads[len(self.grad_inputs) :]

    def usable(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether this call, of these tensor inputs, may replay (the class doc's conditions;
        the inputs need gradients as the captured ones did)."""
        return (
            not self.pending
            and torch.is_grad_enabled()
            and all(t.requires_grad == s.requires_grad for t, s in zip(tensors, self.static_inputs))
            and self.baked.unchanged()
            and [p.requires_grad for p in self.all_params] == self.wanted
        )

    def __call__(self, *inputs):
        tensors = [inputs[i] for i in self.tensor_slots]
        if not self.usable(tensors):
            return self.forward(*inputs)
        outputs = _ReplayStep.apply(self, len(tensors), *tensors, *self.params)
        leaves = list(self.static_outputs)
        for k, t in zip(self.tensor_outputs, outputs):
            leaves[k] = t
        return pytree.tree_unflatten(leaves, self.spec)

    def check(self, inputs: tuple) -> Optional[str]:
        """``None`` where one replayed step equals one uncaptured step (outputs, and every
        gradient for the same random gradients of the outputs: ones would give an output
        that is centred or normalised zero gradients, and hide a missing one); else what
        differed. Equal means within a rounding: as far as two uncaptured steps are from
        each other (an atomic sum in a library's backward) times ``SELF_DIFFERENCE_FACTOR``,
        or, in L2, ``REPLAY_ROUNDING`` of each result's norm (another algorithm picked while
        capturing) (``as_close_as_itself``)."""
        runs = []
        upstream: list[torch.Tensor] = []
        for replay in (True, False, False):
            leaves = [
                t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in inputs
            ]
            with torch.enable_grad():
                found = self(*leaves) if replay else self.forward(*leaves)
                outputs, differentiable = self._differentiable(found)
                wrt = [leaves[self.tensor_slots[k]] for k in self.grad_inputs] + self.params
                if not upstream and differentiable:  # drawn once, from a generator of its own: the user's stream stays
                    generator = torch.Generator(device=differentiable[0].device).manual_seed(CHECK_SEED)
                    upstream = [torch.empty_like(t).normal_(generator=generator) for t in differentiable]
                grads = torch.autograd.grad(differentiable, wrt, upstream, allow_unused=True)
            runs.append(([t.detach() if isinstance(t, torch.Tensor) else t for t in outputs], list(grads)))
        (out_r, grad_r), (out_u, grad_u), (out_v, grad_v) = runs
        precision = _precision(self.static_inputs[0].device.type if self.static_inputs else "cuda", out_u + grad_u)
        rounding, self_rounding = REPLAY_ROUNDING[precision], SELF_ROUNDING[precision]
        for what, replayed, once, again in (("forward", out_r, out_u, out_v), ("backward", grad_r, grad_u, grad_v)):
            if _bit_equal(replayed, once):
                continue
            refusal = _refusal(replayed, once, again, rounding, self_rounding, SELF_NORM_FLOOR * _total_norm(once))
            if refusal is not None:
                same = "" if not _bit_equal(once, again) else " (two uncaptured steps are bit for bit the same)"
                return f"a replayed {what} differs from the uncaptured one more than a rounding{same}: {refusal}"
        return None


#: Seed of the outputs' gradients a captured step is checked with.
CHECK_SEED = 20261206
#: Two uncaptured steps may differ where a library sums with atomics (a convolution's
#: weight gradient): by a rounding, their largest difference at most this share of a
#: result's norm (or within ``SELF_ROUNDING``). A step whose runs differ more draws random
#: numbers (dropout), and is not replayed.
SELF_DIFFERENCE_LIMIT = 1e-3
#: Where a step computes in 16 bits, a library's atomic sums round in 16 bits too: two
#: uncaptured steps then differ by a few 16-bit units (bf16: 2**-8 of a value) at their
#: largest elements, past ``SELF_DIFFERENCE_LIMIT`` of the norm where a few elements
#: dominate it (U-Net's bf16 step, BENCHMARKS.md "Training"); in fp32 with TF32 allowed
#: (cuDNN's convolutions by default) by TF32 units (2**-11; LSM's fp32 step). In
#: L2 they still differ by at most this share of the norm; a random draw (dropout, even
#: of 1%) moves a tenth of it or more. The replay is then held to
#: ``SELF_DIFFERENCE_FACTOR`` times their largest difference: a wrong buffer or a skipped
#: kernel moves the largest values too, but an error smaller than their rounding does not
#: show.
SELF_ROUNDING = {"fp32": 0.0, "tf32": 1e-2, "16-bit": 2e-2}
#: Whether two uncaptured steps differ by a rounding is weighed against at least this share
#: of the norm of all results of a kind (outputs, gradients) together: a gradient that is
#: zero in exact arithmetic (a convolution's bias before a batch norm, LSM's) holds only
#: rounding, every digit of it differing run to run, while a random draw moves the large
#: results too. The replay itself is still held to each result's own differences.
SELF_NORM_FLOOR = 1e-2
#: How much farther than two uncaptured runs from each other a replay may be from one.
SELF_DIFFERENCE_FACTOR = 4.0
#: A replay may also differ from an uncaptured step by a rounding where two uncaptured
#: steps do not differ at all (a library picks another algorithm while capturing: cuBLAS
#: without its workspace): in L2, at most this share of a result's norm, by the precision the
#: step computes in (16-bit: under autocast, or a 16-bit result; tf32: fp32 where torch may
#: multiply or convolve in TF32). A capture that reads a wrong buffer or skips a kernel is
#: off by the size of the values, far above either.
REPLAY_ROUNDING = {"fp32": 1e-5, "tf32": 1e-4, "16-bit": 1e-3}


def _precision(device_type: str, results: Sequence[Any]) -> str:
    """The precision a step computes in, as ``REPLAY_ROUNDING`` and ``SELF_ROUNDING`` key it:
    "16-bit" under autocast or with a 16-bit result, else "tf32" where torch's settings let
    cuBLAS or cuDNN multiply fp32 in TF32 (cuDNN's default), else "fp32"."""
    sixteen = torch.is_autocast_enabled(device_type) or any(
        isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16) for t in results
    )
    if sixteen:
        return "16-bit"
    return "tf32" if device_type == "cuda" and (tf32_allowed("conv") or tf32_allowed("matmul")) else "fp32"


def as_close_as_itself(
    replayed: Sequence[Any],
    once: Sequence[Any],
    again: Sequence[Any],
    rounding: float = 0.0,
    self_rounding: float = 0.0,
    floor: float = 0.0,
) -> bool:
    """Whether ``replayed`` is as close to ``once`` as the uncaptured ``again`` is, tensor by
    tensor: the largest difference within ``SELF_DIFFERENCE_FACTOR`` times theirs, or the
    L2 difference within ``rounding`` times the result's norm; theirs within
    ``SELF_DIFFERENCE_LIMIT`` of the larger of that norm and ``floor``, or in L2 within
    ``self_rounding`` of it; anything not a floating tensor the same."""
    return _refusal(replayed, once, again, rounding, self_rounding, floor) is None


def _total_norm(results: Sequence[Any]) -> float:
    """The L2 norm of all finite floating tensors of ``results`` together, in float64."""
    squares = [
        float(t.double().norm()) ** 2
        for t in results
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() and bool(torch.isfinite(t).all())
    ]
    return math.sqrt(sum(squares))


def _refusal(
    replayed: Sequence[Any],
    once: Sequence[Any],
    again: Sequence[Any],
    rounding: float,
    self_rounding: float = 0.0,
    floor: float = 0.0,
) -> Optional[str]:
    """Why ``as_close_as_itself`` says no, naming the first result that fails and by how
    much ("result K: ..."), or ``None``."""
    if not (len(replayed) == len(once) == len(again)):
        return f"{len(replayed)} results replayed against {len(once)} and {len(again)} uncaptured"
    for k, (r, u, v) in enumerate(zip(replayed, once, again)):
        if not isinstance(u, torch.Tensor) or not u.is_floating_point():
            if not (_bit_equal(r, u) and _bit_equal(u, v)):
                return f"result {k}, no floating tensor, differs"
            continue
        if not isinstance(r, torch.Tensor) or not isinstance(v, torch.Tensor) or not (r.shape == u.shape == v.shape):
            return f"result {k} is missing or of another shape"
        if not bool(torch.isfinite(u).all() and torch.isfinite(v).all() and torch.isfinite(r).all()):
            if not (_bit_equal(r, u) and _bit_equal(u, v)):
                return f"result {k} is not finite, and not the same in every run"
            continue
        off, itself, norm = _distances(r, u, v)
        numbers = f"result {k}: replayed off by {off:.3g}, two uncaptured steps by {itself:.3g}, norm {norm:.3g}"
        weighed = max(norm, floor)
        if itself > SELF_DIFFERENCE_LIMIT * weighed:
            itself_l2 = float((v.double() - u.double()).norm())
            if not itself_l2 <= self_rounding * weighed:
                of = "the norm" if weighed == norm else f"{weighed:.3g}, {SELF_NORM_FLOOR:g} of all results' norm"
                limit = f"{SELF_DIFFERENCE_LIMIT:g} of {of}" + (
                    f", {self_rounding:g} of it in L2 (theirs: {itself_l2:.3g})" if self_rounding else ""
                )
                return numbers + f" (uncaptured steps differ by more than {limit})"
        if off <= SELF_DIFFERENCE_FACTOR * itself:
            continue
        # A rounding is judged in L2 against L2: a skipped tile of a large result is a few
        # elements off by their size, whose largest difference alone the whole norm would hide.
        off_l2 = float((r.double() - u.double()).norm())
        if off_l2 > rounding * norm:
            return numbers + f" (L2 {off_l2:.3g})"
    return None


def _distances(replayed: torch.Tensor, once: torch.Tensor, again: torch.Tensor) -> tuple[float, float, float]:
    """The largest difference of ``replayed`` from ``once``, that of ``again`` from ``once``
    (in float64; 0 for empty tensors), and the norm of ``once``."""
    if not once.numel():
        return 0.0, 0.0, 0.0
    a, b, c = replayed.double(), once.double(), again.double()
    return float((a - b).abs().max()), float((b - c).abs().max()), float(b.norm())


class _Pending:
    """Held by a replayed call's autograd context: while it lives and its backward has not
    run, the graphs' memory holds what that backward reads (``TrainingGraph``)."""

    def __init__(self, graph: TrainingGraph):
        self.graph, self.open = graph, True
        graph.pending += 1

    def close(self) -> None:
        if self.open:
            self.open = False
            self.graph.pending -= 1

    def __del__(self) -> None:
        self.close()


class _ReplayStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graph: TrainingGraph, count: int, *tensors: torch.Tensor):  # type: ignore[override]
        for static, given in zip(graph.static_inputs, tensors[:count]):
            static.detach().copy_(given)
        graph.forward_graph.replay()
        graph.generation += 1
        ctx.graph, ctx.count, ctx.generation = graph, count, graph.generation
        ctx.pending = _Pending(graph)
        # Kept (not copied) for a backward that must itself be differentiable (below).
        ctx.save_for_backward(*tensors)
        outputs = tuple(graph.static_outputs[k].clone() for k in graph.tensor_outputs)
        ctx.mark_non_differentiable(
            *(t for k, t in zip(graph.tensor_outputs, outputs) if k not in graph.differentiable)
        )
        return outputs

    @staticmethod
    def backward(ctx, *grads: Optional[torch.Tensor]):  # type: ignore[override]
        graph: TrainingGraph = ctx.graph
        if torch.is_grad_enabled():
            # create_graph=True (gradients of gradients, a physics-informed loss): a replay's
            # gradients have no history, so the step runs again uncaptured and differentiably.
            ctx.pending.close()
            return (None, None, *_differentiable_gradients(ctx, grads))
        if ctx.generation != graph.generation:
            raise RuntimeError(
                "AutoFuser: a backward through an earlier call of a CUDA-graphed training step ran after a "
                "later call replayed the graph, which overwrote what it reads. Run each call's backward "
                "before the next call, or fuse with cuda_graphs=False."
            )
        by_output = dict(zip(graph.tensor_outputs, grads))
        for static, k in zip(graph.static_grad_outputs, graph.differentiable):
            grad = by_output.get(k)
            if grad is None:
                static.zero_()
            else:
                static.copy_(grad)
        graph.backward_graph.replay()
        ctx.pending.close()
        return (
            None,
            None,
            *graph.placed([g.clone() if g is not None else None for g in graph.static_grads], ctx.count),
        )


def _differentiable_gradients(ctx, grads: Sequence[Optional[torch.Tensor]]) -> list[Optional[torch.Tensor]]:
    """The gradients of ``_ReplayStep``'s inputs, computed by running its forward again
    uncaptured on the saved inputs and parameters, with their own history."""
    graph: TrainingGraph = ctx.graph
    saved = ctx.saved_tensors
    inputs, params = list(saved[: ctx.count]), list(saved[ctx.count :])
    found = graph.forward(*graph._args(inputs))
    outputs = pytree.tree_leaves(found)
    by_output = dict(zip(graph.tensor_outputs, grads))
    pairs = [
        (outputs[k], by_output[k])
        for k in graph.differentiable
        if by_output.get(k) is not None and outputs[k].requires_grad
    ]
    wanted = [inputs[k] for k in graph.grad_inputs] + params
    if not pairs:
        return [None] * (ctx.count + len(params))
    found_grads = torch.autograd.grad(
        [o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True, create_graph=True
    )
    return graph.placed(list(found_grads), ctx.count)


def try_training_graph(
    forward: Callable[..., Any], inputs: tuple, model: torch.nn.Module
) -> tuple[Optional[TrainingGraph], str]:
    """A training graph whose replay was checked against an uncaptured step, or ``None``
    and the reason it can't be."""

    def capture() -> tuple[TrainingGraph, Optional[str]]:
        graph = TrainingGraph(forward, inputs, model)
        return graph, graph.check(inputs)

    found, why = _captured(capture, inputs)
    if found is None:
        return None, why
    graph, differs = found
    return (None, differs) if differs is not None else (graph, why)
