"""Running a fused kernel: the host wrapper the rewritten graph calls.

``FusedKernel`` allocates the outputs with exactly the shapes and strides eager
produced, launches the Triton kernel on the live inputs (parameters included,
read at call time), and returns one tensor or a tuple. If an input arrives
with another shape or layout than it was compiled for, or gradients are
needed, it does not guess: it runs the group's original ops instead (for
gradients, through ``RecomputeForBackward``: kernel forward, eager backward).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from .codegen import KernelSource
from .group import GroupProgram


class FusedKernel:
    """Callable that runs one fused group."""

    def __init__(self, kernel: Any, source: KernelSource, config: dict, program: GroupProgram,
                 eager: Callable[..., Any]):
        self.kernel = kernel
        self.source = source
        self.config = dict(config)
        self.eager = eager  # the group's original ops, as a GraphModule
        self.grid = source.grid(self.config)
        self.launch_args = {**source.constexprs, **self.config}
        self.input_layout = [(t.shape, t.stride) for t in program.inputs]
        self.output_layout = [(t.shape, t.stride, t.dtype) for t in program.outputs]
        self.single_output = len(program.outputs) == 1
        self.__name__ = source.name
        self.__qualname__ = source.name

    def matches(self, inputs: Sequence[torch.Tensor]) -> bool:
        for tensor, (shape, stride) in zip(inputs, self.input_layout):
            if tuple(tensor.shape) != shape or (tensor.numel() > 1 and tuple(tensor.stride()) != stride):
                return False
        return True

    def launch(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        device = inputs[0].device
        outputs = [torch.empty_strided(shape, stride, dtype=dtype, device=device)
                   for shape, stride, dtype in self.output_layout]
        self.kernel[self.grid](*inputs, *outputs, **self.launch_args)
        return outputs

    def __call__(self, *inputs: torch.Tensor):
        if not self.matches(inputs):
            return self.eager(*inputs)
        if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
            outputs = RecomputeForBackward.apply(self, *inputs)
        else:
            outputs = self.launch(*inputs)
        return outputs[0] if self.single_output else tuple(outputs)


class RecomputeForBackward(torch.autograd.Function):
    """Forward by the fused kernel; backward by recomputing the group's eager ops."""

    @staticmethod
    def forward(ctx, fused: FusedKernel, *inputs: torch.Tensor):
        ctx.fused = fused
        ctx.save_for_backward(*inputs)
        return tuple(fused.launch(*inputs))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            outputs = ctx.fused.eager(*inputs)
        if not isinstance(outputs, (tuple, list)):
            outputs = (outputs,)
        wanted = [t for t in inputs if t.requires_grad]
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        found = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True) if pairs else [None] * len(wanted)
        it = iter(found)
        return (None, *[next(it) if t.requires_grad else None for t in inputs])
