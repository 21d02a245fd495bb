"""2-D convolutions fed the channels-last view they copy from, so two copies go.

Solver code that keeps its fields as ``[batch, height, width, channels]`` and
convolves them writes (the structured-mesh Transolver's slice projections)

    x = h.permute(0, 3, 1, 2).contiguous()     # a copy, to NCHW
    y = conv(x).permute(0, 2, 3, 1).contiguous()  # a copy, back to NHWC

``h.permute(0, 3, 1, 2)`` is already a dense channels-last tensor, which a
convolution takes as it is: cuDNN's convolutions (and the CPU's) then run in
the channels-last layout, the one their tensor-core kernels read, and give a
channels-last result, whose ``permute(0, 2, 3, 1)`` is row-major, so the second
``contiguous()`` returns it as it is. The values are the convolution's either
way; what goes is a read and a write of the input and of the result.

This pass rewrites ``conv(x.contiguous())`` to ``conv(x)`` where

- ``x`` is a dense channels-last 4-d tensor of fp32, fp16 or bf16 (float64
  convolutions stay row-major in cuDNN) and the copy is a real one;
- every reader of the copy is a 2-D convolution the conv plugin reads
  (``convolution.parse_conv``: ``nn.Conv2d`` with torch's own forward or
  ``F.conv2d``) and cuDNN runs (``implicit_gemm_takes`` false: the
  implicit-GEMM kernels read pixels along their tiles, adjacent in the
  row-major copy, not in the view);
- each such convolution's result is read by one ``permute(0, 2, 3, 1)``, read
  by one ``contiguous()``: so nothing else sees the result's new layout, the
  ``contiguous()`` keeps its row-major result, and no two readers that each
  had a copy come to share one tensor;
- nothing in the graph writes into a tensor (``autofuser.first_write``): a
  write into the copy's source between the copy and the convolution would
  reach the convolution.

The nodes whose layout changes (each convolution and each permute) are filed
again with their new strides, and each ``contiguous()`` after them as the free
view it now is. Where a backend gave another layout than the one
filed, a fused kernel reading it sees other strides than it was made for and
runs its eager ops instead (``FusedKernel.matches``): slower, never wrong.

``fuse(..., conv_channels_last=False)`` turns the pass off (``options.py``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx

from autofuser import annotate_node, first_write
from autofuser.kernel import tensor_meta

from .convolution import implicit_gemm_takes, parse_conv

#: Dtypes whose convolutions take a channels-last input as it is.
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: NCHW -> NHWC: the permute that reads a channels-last result row-major.
TO_ROWS = (0, 2, 3, 1)


def _permute_dims(node: torch.fx.Node) -> Optional[tuple[int, ...]]:
    if node.op != "call_method" or node.target != "permute" or node.kwargs:
        return None
    dims = node.args[1:]
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = tuple(dims[0])
    return tuple(dims) if all(isinstance(d, int) and not isinstance(d, bool) for d in dims) else None


def _row_major_copy(node: torch.fx.Node) -> bool:
    """``x.contiguous()`` with the default memory format."""
    if node.op != "call_method" or node.target != "contiguous" or len(node.args) != 1:
        return False
    return node.kwargs.get("memory_format", torch.contiguous_format) is torch.contiguous_format and set(
        node.kwargs
    ) <= {"memory_format"}


def channels_last_strides(shape) -> tuple[int, ...]:
    """The strides of a dense channels-last tensor of this NCHW shape."""
    _, channels, height, width = shape
    return (height * width * channels, 1, width * channels, channels)


def _channels_last(shape, stride) -> bool:
    """Whether a 4-d tensor of these strides is dense in the channels-last layout (a
    dimension of size 1 may have any stride)."""
    dense = channels_last_strides(shape)
    return all(size == 1 or given == want for size, given, want in zip(shape, stride, dense))


def _convolution_of(node: torch.fx.Node, copy: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    """Whether ``node`` is a 2-D convolution cuDNN runs (``implicit_gemm_takes`` false: the
    implicit-GEMM kernels read pixels along their tiles, which the row-major copy keeps
    adjacent), reading ``copy`` as its input only, whose result one ``permute(0, 2, 3, 1)``
    reads, and that permute one ``contiguous()``: each copy had a tensor of its own, so
    no two readers come to share one."""
    conv = parse_conv(node, gm)
    if isinstance(conv, str) or conv.x is not copy or len(conv.kernel) != 2 or implicit_gemm_takes(conv):
        return False
    if copy in (conv.weight, conv.bias) or len(node.users) != 1:
        return False
    (permute,) = node.users
    if _permute_dims(permute) != TO_ROWS or len(permute.users) != 1:
        return False
    return _row_major_copy(next(iter(permute.users)))


def feed_convolutions_channels_last(gm: torch.fx.GraphModule) -> int:
    """The rewrite the module docstring describes; how many copies it removed."""
    removed, writes, checked = 0, None, False
    for copy in list(gm.graph.nodes):
        if not _row_major_copy(copy) or not isinstance(copy.args[0], torch.fx.Node):
            continue
        source = copy.args[0]
        source_meta, copy_meta = tensor_meta(source), tensor_meta(copy)
        if source_meta is None or copy_meta is None or source_meta.dtype not in DTYPES:
            continue
        if len(source_meta.shape) != 4 or tuple(source_meta.stride) == tuple(copy_meta.stride):
            continue  # not a 4-d tensor, or no copy (contiguous() returns the tensor itself)
        if not _channels_last(source_meta.shape, source_meta.stride):
            continue
        convolutions = list(copy.users)
        if not convolutions or not all(_convolution_of(c, copy, gm) for c in convolutions):
            continue
        if not checked:
            writes, checked = first_write(gm), True
        if writes is not None:
            return removed  # a write anywhere might reach a copy's source between copy and reader
        for conv in convolutions:
            conv.replace_input_with(copy, source)
            meta = tensor_meta(conv)
            shape = tuple(meta.shape)
            result = torch.empty_strided(shape, channels_last_strides(shape), dtype=meta.dtype, device="meta")
            result.requires_grad_(meta.requires_grad)
            annotate_node(conv, result)
            for permute in conv.users:
                rows = result.permute(*TO_ROWS)
                annotate_node(permute, rows, [result])
                for reader in permute.users:
                    annotate_node(reader, rows, [rows])  # contiguous() of a row-major tensor: itself
        gm.graph.erase_node(copy)
        removed += 1
    return removed
