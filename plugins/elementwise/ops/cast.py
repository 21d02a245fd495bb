"""Dtype casts: ``x.float()``, ``x.half()``, ``x.bfloat16()``, ``x.bool()``,
``x.to(dtype)``, ``x.type(dtype)``, ``x.type_as(y)``; and ATen's ``_to_copy`` (how a
traced backward graph spells a cast, under autocast in particular).

Kernels compute in fp32 and the core rounds every node's result to the dtype
eager produced for it, so a cast between float types is the value itself.
bool -> float becomes 0/1 and float -> bool is ``x != 0`` (NaN is True, as in
torch). Everything else stays eager: integer and float64 targets, device moves
(``x.to("cuda")``, a device anywhere in the arguments; ``_to_copy`` naming the
device its input is on already, as a traced backward names it, is a cast), type
strings (they can name a device) and memory formats other than the preserved one.
"""

from typing import Any, Optional

import torch
import torch.fx

from autofuser import LoweringSpec, Sample

from ._common import FLOAT_DTYPES, lowering, randn


@lowering
def lower_cast(ctx, input, *args, **kwargs):
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, (str, torch.device)):
            ctx.refuse(
                "device_move", f"{ctx.node.target}: argument {arg!r} names a device or a type string; left to eager"
            )
    if kwargs.get("device") is not None:
        ctx.refuse("device_move", f"{ctx.node.target}: device= moves the tensor; left to eager")
    memory_format = kwargs.get("memory_format", torch.preserve_format)
    if memory_format is not torch.preserve_format:
        ctx.refuse("unsupported_argument", f"{ctx.node.target}: memory_format={memory_format} changes the layout")
    if ctx.out_shape is None:
        ctx.refuse("not_a_tensor", f"{ctx.node.target}: the result is not a tensor")
    # to(other) and type_as(other) take other's device too; every operand of a
    # fused kernel lives on one device, so a cross-device cast never fuses anyway.
    return _convert(ctx, input, copy=bool(kwargs.get("copy") or (len(args) >= 3 and args[2] is True)))


def _traced_device(node: Any) -> Optional[torch.device]:
    """The device of ``node``'s value as the trace filed it (``meta["val"]``); for a node
    a graph pass made since (which files shapes only), the one device of the nearest traced
    nodes it reads, or ``None`` where they are on several (a CPU scalar beside a CUDA
    tensor: the result's device is not theirs to tell). A pass keeps computing the same
    function on the same tensors, and no op but a cast or copy naming a device moves one."""
    devices: set[torch.device] = set()
    seen, queue = set(), [node]
    while queue:
        current = queue.pop(0)
        if not isinstance(current, torch.fx.Node) or current in seen:
            continue
        seen.add(current)
        value = current.meta.get("val")
        if isinstance(value, torch.Tensor):
            devices.add(value.device)
        elif current.op in ("call_function", "call_method", "call_module"):
            queue.extend(current.all_input_nodes)
        else:
            return None  # a graph input or attribute without a traced value
    return devices.pop() if len(devices) == 1 else None


def _where_it_is(ctx, device) -> bool:
    """Whether ``device=`` names the device the input is on already, as a traced backward
    spells every cast (autocast's among them): the result's device as traced, the input's
    (``_traced_device``) and ``device`` agree."""
    made = ctx.node.meta.get("val")
    given = _traced_device(ctx.node.args[0]) if ctx.node.args else None
    if not isinstance(made, torch.Tensor) or given is None:
        return False
    try:
        named = torch.device(device)
    except (RuntimeError, TypeError):
        return False
    return made.device == given == named


@lowering
def lower_to_copy(
    ctx, input, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None
):
    if (device is not None and not _where_it_is(ctx, device)) or pin_memory:
        ctx.refuse("device_move", f"{ctx.node.target}: device={device!r} moves the tensor; left to eager")
    if layout not in (None, torch.strided):
        ctx.refuse("unsupported_argument", f"{ctx.node.target}: layout={layout} changes the layout")
    # A group writes each output in the strides eager's result has (the node's), so a
    # dense format only names those strides; other formats stay eager all the same.
    if memory_format not in (None, torch.preserve_format, torch.contiguous_format):
        ctx.refuse("unsupported_argument", f"{ctx.node.target}: memory_format={memory_format} changes the layout")
    if ctx.out_shape is None:
        ctx.refuse("not_a_tensor", f"{ctx.node.target}: the result is not a tensor")
    return _convert(ctx, input, copy=True)  # a new tensor always, whatever the dtype


def _convert(ctx, input, copy: bool):
    """The cast of ``input`` to the node's dtype; ``copy``: eager makes a new tensor even
    for the same dtype."""
    source, target = ctx.dtype(input), ctx.out_dtype
    if target == torch.bool:
        if source == torch.bool:
            return ctx.tensor(input)
        return ctx.pointwise("{0} != 0", input, is_bool=True)
    if target not in FLOAT_DTYPES:
        ctx.refuse("unsupported_dtype", f"{ctx.node.target}: cast to {target} (kernels store fp32/fp16/bf16/bool)")
    if source == torch.bool:
        return ctx.pointwise("{0}.to(tl.float32)", input)
    if copy:
        # A new tensor even for the same dtype, so this is a real op.
        return ctx.pointwise("{0}", input)
    # Otherwise the value itself; for the same dtype eager returns the input tensor
    # (the core won't make a kernel output of that alias).
    return ctx.tensor(input)


def _samples(dtype):
    return [
        Sample(args=(randn((3, 37), dtype, scale=100.0), randn((3, 37), dtype)), note="values fp16/bf16 must round"),
        Sample(args=(randn((1, 129), dtype), randn((), dtype))),
        Sample(args=(randn((2, 3, 5, 7), dtype) > 0, randn((1,), dtype)), note="bool input"),
    ]


SPECS = [
    LoweringSpec(
        name="elementwise.cast",
        description="dtype conversion between fp32/fp16/bf16/bool (the value itself; the core rounds)",
        targets=("float", "half", "bfloat16", "bool", "to", "type", "type_as"),
        kind="pointwise",
        lower=lower_cast,
        samples=_samples,
        references=(
            lambda x, y: x.float(),
            lambda x, y: x.half(),
            lambda x, y: x.bfloat16(),
            lambda x, y: x.bool(),
            lambda x, y: x.to(torch.float16),
            lambda x, y: x.to(dtype=torch.bfloat16),
            lambda x, y: x.to(torch.float32, copy=True),
            lambda x, y: x.to(y),
            lambda x, y: x.type(torch.float16),
            lambda x, y: x.type_as(y),
            lambda x, y: x.float() * 3 + y.half(),  # casts feeding arithmetic
        ),
    ),
    LoweringSpec(
        name="elementwise.to_copy",
        description="ATen's _to_copy with a dtype only: a cast between fp32/fp16/bf16/bool that copies",
        targets=(torch.ops.aten._to_copy.default,),
        kind="pointwise",
        lower=lower_to_copy,
        samples=_samples,
        references=(
            lambda x, y: torch.ops.aten._to_copy.default(x, dtype=torch.bfloat16),
            lambda x, y: torch.ops.aten._to_copy.default(x, dtype=torch.float16) * 3 + y.half(),
            lambda x, y: torch.ops.aten._to_copy.default(x, dtype=torch.float32),
            lambda x, y: torch.ops.aten._to_copy.default(x, dtype=torch.bool),
            lambda x, y: torch.ops.aten._to_copy.default(x, dtype=torch.float16, memory_format=torch.contiguous_format),
        ),
    ),
]
