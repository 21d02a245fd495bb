"""Convolutions as implicit GEMM: ``out[b, o, p] = sum_r W[o, r] * col(x)[b, r, p]``
where ``r`` walks (input channel, kernel offset) and ``p`` the output pixels;
``col(x)`` is never built - each ``BLOCK_K x BLOCK_N`` tile of it is gathered
from ``x`` with its padding masked, and multiplied on tensor cores.

``parse_conv(node, root)`` reads a convolution (``F.conv1d/2d/3d`` or the
modules) from the graph; ``write_conv_kernel`` writes one kernel for the
convolution and the pointwise chain after it (bias, batch norm in eval mode,
activation, residual), the chain computed on the accumulator tile before the
single store.

Where cuDNN's product plus a separate fused epilogue kernel is faster, the
compile-time check against eager (on a GPU) keeps this group eager, and the
planner's second round fuses the epilogue chain on its own
(a group that lost is re-planned without the
strategy that lost).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from autofuser import GroupRefused, KernelSource, KernelTensor, StrategySpec, device_limits, program_from_nodes
from autofuser.kernel import (
    MAX_GRID_YZ,
    STRICT_FP32,
    AttrRef,
    attr_tensor,
    dot_block,
    dot_line,
    needs_int64,
    rounded,
    tensor_meta,
    tf32_allowed,
    triton_cdiv,
)

from .strategy import ChainWriter, ResampleProgram, compose_members, follow_chain, single_output

FUNCTIONS = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3}
MODULES = {torch.nn.Conv1d: 1, torch.nn.Conv2d: 2, torch.nn.Conv3d: 3}
#: Kernel volumes fused (3x3x3 = 27; larger kernels are cuDNN's).
MAX_KERNEL_VOLUME = 27
#: Longest reduction (input channels x taps) the implicit-GEMM kernel is tried for: on the
#: zoo's convolutions, longer reductions all but always lost to cuDNN's product plus a fused
#: epilogue, and a short one won (docs/conv.md; BENCHMARKS.md, "Measurements behind rules
#: in the code"). Past the limit the group is refused up front: its kernel is neither
#: compiled nor tuned, and the epilogue fuses on its own in the first planning round
#: instead of a later one.
MAX_REDUCTION = 144


@dataclass(frozen=True)
class Conv:
    """One convolution node's operands and geometry."""

    x: torch.fx.Node
    weight: Union[torch.fx.Node, AttrRef]
    bias: Union[torch.fx.Node, AttrRef, None]
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    in_spatial: tuple[int, ...]
    out_spatial: tuple[int, ...]
    in_channels: int
    out_channels: int

    @property
    def reduction(self) -> int:
        """The product's K: input channels (of a group) times kernel taps."""
        return reduction(self.in_channels, self.kernel)

    @property
    def taps(self) -> int:
        """Kernel positions: the product of the kernel's sizes."""
        return math.prod(self.kernel)


def reduction(in_channels: int, kernel: Sequence[int]) -> int:
    """A convolution's reduction length, the figure ``MAX_REDUCTION`` bounds."""
    return in_channels * math.prod(kernel)


def _ints(value: Any, rank: int) -> Optional[tuple[int, ...]]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,) * rank
    if (
        isinstance(value, (tuple, list))
        and len(value) == rank
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        return tuple(value)
    return None


def parse_conv(node: torch.fx.Node, root: torch.nn.Module) -> Union[Conv, str]:
    """The ``Conv`` a convolution node computes, or why it isn't fused."""
    if node.op == "call_module":
        module = root.get_submodule(node.target)
        base = next((k for k in type(module).__mro__ if k in MODULES), None)
        if base is None or type(module).forward is not base.forward:
            return f"{type(module).__name__} overrides the convolution's forward"
        if len(node.args) != 1 or node.kwargs:
            return "called with more than its input"
        rank = MODULES[base]
        x, groups = node.args[0], module.groups
        weight = AttrRef(f"{node.target}.weight")
        bias = AttrRef(f"{node.target}.bias") if module.bias is not None else None
        stride, padding, dilation = module.stride, module.padding, module.dilation
        if module.padding_mode != "zeros" and any(p != 0 for p in module._reversed_padding_repeated_twice):
            return f"padding_mode={module.padding_mode!r}"
        weight_shape = tuple(module.weight.shape)
    elif node.op == "call_function" and node.target in FUNCTIONS:
        rank = FUNCTIONS[node.target]
        names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")  # a builtin: no signature
        if len(node.args) > len(names) or set(node.kwargs) - set(names[len(node.args) :]):
            return "arguments don't match conv(input, weight, bias, stride, padding, dilation, groups)"
        args = {**dict(zip(names, node.args)), **node.kwargs}
        x, weight, bias = args.get("input"), args.get("weight"), args.get("bias")
        stride, padding = args.get("stride", 1), args.get("padding", 0)
        dilation, groups = args.get("dilation", 1), args.get("groups", 1)
        if tensor_meta(weight) is None or (bias is not None and tensor_meta(bias) is None):
            return "weight or bias is not a tensor of the graph"
        weight_shape = tuple(tensor_meta(weight).shape)
    else:
        return "not a convolution"
    x_meta, out_meta = tensor_meta(x), tensor_meta(node)
    if x_meta is None or out_meta is None or x_meta.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return "input is not a float tensor"
    if len(x_meta.shape) != rank + 2:
        return f"a {len(x_meta.shape)}-d input (unbatched inputs stay eager)"
    if groups != 1:
        return f"groups={groups!r}: grouped convolutions stay eager"
    kernel = weight_shape[2:]
    stride, dilation = _ints(stride, rank), _ints(dilation, rank)
    if padding == "valid":
        padding = (0,) * rank
    elif padding == "same":
        total = [d * (k - 1) for d, k in zip(dilation or (1,) * rank, kernel)]
        if any(t % 2 for t in total):
            return "padding='same' with an even kernel pads unevenly"
        padding = tuple(t // 2 for t in total)
    padding = _ints(padding, rank)
    if stride is None or dilation is None or padding is None:
        return "stride, padding or dilation is not an int or a tuple of ints"
    return Conv(
        x,
        weight,
        bias,
        tuple(kernel),
        stride,
        padding,
        dilation,
        tuple(x_meta.shape[2:]),
        tuple(out_meta.shape[2:]),
        weight_shape[1],
        weight_shape[0],
    )


def conv_reason(conv: Conv) -> Optional[str]:
    """Why the implicit-GEMM strategy won't take ``conv`` (``None``: it will)."""
    if conv.taps > MAX_KERNEL_VOLUME:
        return f"a {'x'.join(map(str, conv.kernel))} kernel (up to {MAX_KERNEL_VOLUME} taps are fused)"
    return None


def implicit_gemm_takes(conv: Conv) -> bool:
    """Whether the implicit-GEMM strategy fuses ``conv`` (``accepts``'s rules on its
    geometry); where it does not, cuDNN runs it."""
    batch = tensor_meta(conv.x).shape[0]
    return conv_reason(conv) is None and conv.reduction <= MAX_REDUCTION and batch <= MAX_GRID_YZ


# ---------------------------------------------------------------------------
# The strategy
# ---------------------------------------------------------------------------


@dataclass
class ConvProgram(ResampleProgram):
    conv_node: Optional[torch.fx.Node] = None
    conv: Optional[Conv] = None
    operand_dtype: Optional[torch.dtype] = None  # None: fp32 operands
    dtype_precision: str = "ieee"
    epilogue: list = field(default_factory=list)


def _conv_lowered(view, node) -> bool:
    spec = view.lowering_of.get(node)
    return spec is not None and spec.name.startswith("conv.conv") and view.lowered[node].op == "extern"


def propose(view):
    return [follow_chain(view, node, cats=False) for node in view.nodes if _conv_lowered(view, node)]


def fp32_conv_precision() -> str:
    """cuDNN's rule for fp32 convolutions: TF32 where torch allows it for them
    (``autofuser.kernel.tf32_allowed``)."""
    return "tf32" if tf32_allowed("conv") else STRICT_FP32.get()


def compose(view, nodes):
    conv_node = nodes[0]
    conv = parse_conv(conv_node, view.gm)
    if isinstance(conv, str):
        raise GroupRefused("unsupported_argument", conv)
    program = program_from_nodes(nodes, {n: view.lowering_of[n].name for n in nodes})
    single_output(program, nodes)
    known = {t.source for t in program.inputs}
    for ref in (conv.weight, conv.bias):
        if isinstance(ref, AttrRef) and ref not in known:
            tensor = attr_tensor(view.gm, ref.path)
            program.inputs.append(KernelTensor(ref, tuple(tensor.shape), tensor.dtype, tuple(tensor.stride())))
    fields = dict(resamples={}, cats={}, pointwise={})
    compose_members(view, nodes[1:], program, fields)
    dtype = tensor_meta(conv_node).dtype
    precision = fp32_conv_precision() if dtype == torch.float32 else None
    kernel = "x".join(map(str, conv.kernel))
    summary = f"{kernel} convolution (stride {list(conv.stride)}, padding {list(conv.padding)}) as implicit GEMM" + (
        " with its epilogue" if len(nodes) > 1 else ""
    )
    program = ConvProgram(
        **{**program.__dict__, "summary": summary, "products_precision": precision},
        slot={t.source: k for k, t in enumerate(program.inputs)},
        **fields,
        conv_node=conv_node,
        conv=conv,
        operand_dtype=None if dtype == torch.float32 else dtype,
        dtype_precision=precision or "ieee",
        epilogue=list(nodes[1:]),
    )
    return program


def accepts(program):
    if not isinstance(program, ConvProgram):
        return ("not_convolution", "the group was not composed by the implicit-GEMM strategy")
    reason = conv_reason(program.conv)
    if reason is not None:
        return ("unsupported_kernel", reason)
    conv = program.conv
    if conv.reduction > MAX_REDUCTION:
        return (
            "cudnn_faster",
            f"a reduction of {conv.reduction} ({conv.in_channels} channels x "
            f"{conv.taps} taps): past {MAX_REDUCTION} cuDNN's product with a "
            "fused epilogue is faster",
        )
    batch = tensor_meta(program.conv.x).shape[0]
    if batch > MAX_GRID_YZ:
        return ("batch_too_large", f"{batch} samples exceed the grid's second axis ({MAX_GRID_YZ})")
    return None


CONFIGS = [
    # (BLOCK_M over output channels, BLOCK_N over pixels, BLOCK_K, num_warps, num_stages)
    (64, 128, 32, 4, 3),
    (128, 128, 32, 8, 3),
    (64, 64, 32, 4, 3),
    (32, 128, 32, 4, 3),
    (128, 64, 32, 4, 3),
    (64, 256, 32, 8, 3),
    (16, 128, 32, 4, 3),
    (32, 64, 64, 4, 3),
    (64, 128, 64, 8, 2),
    (16, 256, 16, 4, 3),
]


def configs(program):
    out = []
    for m, n, k, warps, stages in CONFIGS:
        if m > dot_block(program.conv.out_channels) * 2:
            continue
        out.append({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "num_warps": warps, "num_stages": stages})
    return out or [default_config(program)]


def default_config(program):
    conv = program.conv
    return {
        "BLOCK_M": min(64, dot_block(conv.out_channels)),
        "BLOCK_N": min(128, dot_block(math.prod(conv.out_spatial))),
        "BLOCK_K": min(64, dot_block(conv.reduction)),
        "num_warps": 4,
    }


def is_valid(program, config):
    if config["BLOCK_K"] > dot_block(program.conv.reduction):
        return "BLOCK_K larger than the reduction"
    if config["BLOCK_M"] * config["BLOCK_N"] / (32 * config["num_warps"]) > 128:
        return "too many accumulators per thread"
    element = 4 if program.operand_dtype is None else 2
    smem = (config["BLOCK_M"] + config["BLOCK_N"]) * config["BLOCK_K"] * element * config.get("num_stages", 2)
    if smem > device_limits().shared_memory_per_block:
        return f"{smem // 1024} KiB of shared memory for the pipelined tiles"
    return None


def _decompose(emit, index: str, sizes: tuple[int, ...], prefix: str) -> list[str]:
    """Coordinates of ``index`` over ``sizes`` (row-major), one name per dim."""
    names = []
    for d, size in enumerate(sizes):
        inner = math.prod(sizes[d + 1 :])
        expr = index if inner == 1 else f"({index} // {inner})"
        if d > 0:
            expr = f"{expr} % {size}"
        emit(f"{prefix}{d} = {expr}")
        names.append(f"{prefix}{d}")
    return names


def write_conv_kernel(program: ConvProgram, strategy: str, helpers=None) -> KernelSource:
    conv = program.conv
    x_index, w_index = program.slot[conv.x], program.slot[conv.weight]
    x_t, w_t = program.inputs[x_index], program.inputs[w_index]
    batch = x_t.shape[0]
    taps = conv.taps
    k_total = conv.reduction
    pixels = math.prod(conv.out_spatial)
    w = ChainWriter(program, known={program.conv_node: "acc"})
    emit = w.emit
    wide = needs_int64(program)
    cast = ".to(tl.int64)" if wide else ""

    emit(f"num_n = tl.cdiv({pixels}, BLOCK_N)")
    emit("pid_m = tl.program_id(0) // num_n")
    emit("pid_n = tl.program_id(0) % num_n")
    emit(f"b = tl.program_id(1){cast}")
    emit(f"rows = (pid_m{cast} * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]  # output channels")
    emit(f"cols = (pid_n{cast} * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]  # output pixels")
    emit(f"row_mask = rows < {conv.out_channels}")
    emit(f"col_mask = cols < {pixels}")
    q = _decompose(emit, "cols", conv.out_spatial, "q")
    for d, name in enumerate(q):
        emit(f"base{d} = {name} * {conv.stride[d]} - {conv.padding[d]}")
    x_stride, w_stride = x_t.stride, w_t.stride
    emit("acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)")
    emit(f"for k0 in range(0, {k_total}, BLOCK_K):")
    w.indent = 2
    # The weight tile [BLOCK_M, BLOCK_K]: r = (input channel, kernel offset), row-major like the weight.
    emit("ks = k0 + tl.arange(0, BLOCK_K)[None, :]")
    emit(f"wc = ks // {taps}")
    wk = _decompose(emit, f"(ks % {taps})", conv.kernel, "wk")
    w_terms = [f"rows * {w_stride[0]}", f"wc * {w_stride[1]}"] + [f"{n} * {st}" for n, st in zip(wk, w_stride[2:])]
    emit(
        f"w_tile = tl.load(in{w_index} + {' + '.join(w_terms)}, mask=row_mask & (ks < {k_total}), "
        "other=0).to(tl.float32)"
    )
    # The gathered input tile [BLOCK_K, BLOCK_N], zero where the kernel overhangs the padding.
    emit("kk = k0 + tl.arange(0, BLOCK_K)[:, None]")
    emit(f"xc = kk // {taps}")
    xk = _decompose(emit, f"(kk % {taps})", conv.kernel, "xk")
    inside = [f"(kk < {k_total})", "col_mask"]
    x_terms = [f"b * {x_stride[0]}", f"xc * {x_stride[1]}"]
    for d, name in enumerate(xk):
        emit(f"pos{d} = base{d} + {name} * {conv.dilation[d]}")
        inside.append(f"(pos{d} >= 0) & (pos{d} < {conv.in_spatial[d]})")
        x_terms.append(f"pos{d} * {x_stride[2 + d]}")
    emit(f"x_tile = tl.load(in{x_index} + {' + '.join(x_terms)}, mask={' & '.join(inside)}, other=0).to(tl.float32)")
    emit(f"acc += {dot_line('w_tile', 'x_tile', program.operand_dtype, program.dtype_precision)}")
    w.indent = 1
    coords = ("b", "rows") + tuple(q)
    if conv.bias is not None:
        bias = w.load(conv.bias, (conv.out_channels, 1), ("rows", "0"), "row_mask")
        emit(f"acc = acc + {bias}")
    conv_dtype = tensor_meta(program.conv_node).dtype
    if conv_dtype in (torch.float16, torch.bfloat16) and program.epilogue:
        emit(f"acc = {rounded('acc', conv_dtype)}")
    w.store(coords, "row_mask & col_mask", "(BLOCK_M, BLOCK_N)")

    def grid(config):
        return (triton_cdiv(conv.out_channels, config["BLOCK_M"]) * triton_cdiv(pixels, config["BLOCK_N"]), batch)

    notes = [
        f"# product: {conv.out_channels} channels x {pixels} pixels x K {k_total} "
        f"({conv.in_channels} channels x {taps} taps), batch {batch}"
    ]
    return w.assemble(
        f"conv_{'x'.join(map(str, conv.kernel))}",
        strategy,
        ["BLOCK_M", "BLOCK_N", "BLOCK_K"],
        notes,
        helpers,
        grid,
        "conv",
    )


def generate(program, helpers):
    return write_conv_kernel(program, "implicit_gemm", helpers)


CONV_STRATEGY = StrategySpec(
    name="implicit_gemm",
    description="A small-kernel convolution as implicit GEMM with its bias, norm, activation and residual epilogue.",
    priority=1,
    block_params=("BLOCK_M", "BLOCK_N", "BLOCK_K"),
    propose=propose,
    compose=compose,
    accepts=accepts,
    configs=configs,
    is_valid=is_valid,
    default_config=default_config,
    generate=generate,
)
