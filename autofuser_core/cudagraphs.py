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

from typing import Any, Callable, Optional

import torch


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
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    if not tensors or any(t.device.type != "cuda" for t in tensors):
        return None, "inputs are not all CUDA tensors"
    try:
        return CudaGraphRunner(forward, inputs, model), "captured"
    except Exception as err:  # anything the graph can't hold (syncs, CPU ops) means: run uncaptured
        torch.cuda.synchronize()
        return None, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
