"""Laying out a group that contains one matrix product ``C = A @ B``.

The group splits around the product:

- the *prologue*: the values ``A`` is computed from, in A's domain
  ``[..., M, K]`` (a layer norm on the rows of A, a scale, a cast); its
  reductions may only run over ``K``, and none of its values may be used after
  the product (that would need A's tile in C's layout);
- ``B``: read straight from memory (a weight, or any tensor), possibly stored
  transposed (``[..., N, K]``, as ``nn.Linear`` keeps it), or stored quantised
  (``PackedWeight``: integer elements and per-block scales, decoded in
  registers by the quantiser's helper - ``PackedOperand``);
- the *epilogue*: every value that depends on the product, plus what it reads,
  in C's domain ``[..., M, N]`` (bias, activation, residual add, a norm over
  ``N``); every output of the group is an epilogue value.

When ``B`` has no batch dims (a linear layer's weight), all leading dims of A
and C are rows of one big ``M``; otherwise the batch dims become the second
grid axis. Each load gets strides for the domain it is read in, so one input
(a residual that is also the normalised input) can be read in both.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from autofuser import GroupProgram, GroupRefused, ProductLayoutSpec, Value, device_limits
from autofuser.kernel import AttrRef, PackedOperand, domain_strides, dot_block, fp32_precision, read_view, triton_cdiv

#: Bytes of one row of A (K padded to a power of 2) up to which a program keeps its
#: rows of A on chip instead of streaming them in BLOCK_K steps, and computes their
#: norm in one go: K <= 256 for 16-bit operands, K <= 128 for fp32 (fp32 rows of 256
#: spill registers and lose to streaming: BENCHMARKS.md, "Measurements behind rules in
#: the code").
RESIDENT_ROW_BYTES = 512


#: Streaming multiprocessors a plan for the CPU interpreter assumes where a strategy sizes
#: something by the chip (H100/H200: 132).
SMS_WITHOUT_GPU = device_limits("cpu").multiprocessors


def multiprocessors(without_gpu: int = SMS_WITHOUT_GPU) -> int:
    """Streaming multiprocessors of the current CUDA device; ``without_gpu`` where there is
    none (plans made for the CPU interpreter): a strategy that sizes its grid or orders its
    configs by the chip's width says what a CPU plan should assume."""
    if torch.cuda.is_available():
        return device_limits().multiprocessors
    return without_gpu


def keeps_rows(k: int, operand_dtype) -> bool:
    return dot_block(k) * (2 if operand_dtype is not None else 4) <= RESIDENT_ROW_BYTES


@dataclass
class MatmulLayout:
    dot: Value
    out_domain: tuple[int, ...]  # [..., M, N]
    k: int
    batched: bool  # B varies along the batch dims: they become grid axis 1
    prologue: set[int]  # uids of values computed in A's domain
    load_strides: dict[int, tuple[int, ...]] = field(default_factory=dict)  # load uid -> strides over its domain
    b_strides: tuple[int, ...] = ()  # over out_domain[:-2] + (K, N)
    operand_dtype: Optional[torch.dtype] = None  # None: fp32 operands
    precision: str = "ieee"  # fp32 products: "tf32" where torch allows it, else autofuser.kernel.STRICT_FP32
    epilogue_reduces: bool = False  # a reduction over N after the product: one program holds all of N
    prologue_reduces: bool = False  # a norm over K before the product
    b_packed: Optional[PackedOperand] = None  # B stored quantised

    @property
    def a_domain(self) -> tuple[int, ...]:
        return self.out_domain[:-1] + (self.k,)

    @property
    def resident(self) -> bool:
        """Whether a program keeps its rows of A on chip, their norm computed in one go (a
        prologue reduction over a short K), instead of passes over K in BLOCK_K steps."""
        return self.prologue_reduces and keeps_rows(self.k, self.operand_dtype)

    @property
    def block_k(self) -> Optional[int]:
        """The K tile when the rows are resident (the whole padded K), else ``None``: a config's."""
        return dot_block(self.k, self.b_packed) if self.resident else None

    @property
    def n(self) -> int:
        return self.out_domain[-1]

    @property
    def rows(self) -> int:
        dims = self.out_domain[-2:-1] if self.batched else self.out_domain[:-1]
        n = 1
        for s in dims:
            n *= s
        return n

    @property
    def batch(self) -> int:
        n = 1
        for s in self.out_domain[:-2] if self.batched else ():
            n *= s
        return n


#: Under autocast, a single product converts its fp32 weight once per call
#: (``convert_weight_once``) where its programs would read at least this many weight
#: elements in all: the weight's elements times its row tiles of WEIGHT_READ_ROWS rows
#: (every row tile reads the weight's columns it needs in fp32 and converts them).
#: Below, the conversion's own launch costs more than it saves; well above it (linear +
#: GELU of 90168 x 256 -> 512 reads about 9e7), reading the weight in bf16 is clearly
#: faster: BENCHMARKS.md, "Measurements behind rules in the code".
CONVERT_ONCE_MIN_READS = 1 << 24
WEIGHT_READ_ROWS = 128


def lay_out_matmul(program: GroupProgram, values: dict[int, Value]) -> None:
    """Lay out a group with one matrix product (see module doc); registered as the
    ``ProductLayoutSpec`` for one product (``PRODUCT_LAYOUT``)."""
    dots = [v for v in values.values() if v.op == "dot"]
    if len(dots) != 1:
        raise GroupRefused("several_products", f"{len(dots)} matrix products in one group")
    dot = dots[0]
    a, b = dot.args
    if b.op != "load":
        raise GroupRefused("computed_weight", "the product's second operand must be read from memory")

    prologue = set(collect_uids(a))
    depends = depending_on(values, dot)
    outputs_from(program, values, depends, dot, prologue, "the product")

    # With column_dims = c > 1 the product's columns span c trailing dims (a 1x1
    # convolution over [B, C, H, W]); every tensor of the epilogue and B is laid out
    # over the full domain, then its c column strides merge into one.
    columns = dot.column_dims
    full_domain = tuple(dot.shape)
    out_domain = full_domain[: len(full_domain) - columns] + (math.prod(full_domain[len(full_domain) - columns :]),)
    rank = len(full_domain)
    k = a.shape[-1]
    a_domain = out_domain[:-1] + (k,)
    layout = MatmulLayout(dot=dot, out_domain=out_domain, k=k, batched=False, prologue=prologue)

    for v in values.values():
        if v.op == "reduce":
            in_prologue = v.uid in prologue
            last = len(v.args[0].shape) - 1
            if v.dims != (last,) or not v.keepdim or v.args[0].shape[-1] == 1 or (columns > 1 and not in_prologue):
                where = "before" if in_prologue else "after"
                raise GroupRefused(
                    "unsupported_reduction",
                    f"a reduction {where} the product must run over the last dim with keepdim"
                    + ("" if in_prologue else ", and the product's columns must be one dim"),
                )
        if v.op in ("pointwise", "reduce", "load") and len(v.shape) > rank:
            raise GroupRefused("shape_mismatch", "a value has more dims than the product")

    packed_only_as_weights(values, (b,))
    for v in values.values():
        if v.op != "load" or v is b:
            continue
        shape, stride = read_view(program.inputs[program.input_of_load[v.uid]], v.shape)
        if v.uid in prologue:
            check_fits(shape, a_domain)
            layout.load_strides[v.uid] = domain_strides(shape, stride, a_domain)
        else:
            layout.load_strides[v.uid] = _column_strides(shape, stride, full_domain, columns)

    b_domain = full_domain[: rank - 1 - columns] + (k,) + full_domain[rank - columns :]
    layout.b_strides, layout.b_packed = weight_operand(program, b, dot, b_domain, columns)
    layout.batched = any(layout.b_strides[:-2])

    layout.operand_dtype = product_operand_dtype(dot)
    layout.precision = dot.fp32_precision or fp32_precision()
    if math.prod(b.shape) * triton_cdiv(layout.rows, WEIGHT_READ_ROWS) >= CONVERT_ONCE_MIN_READS:
        convert_weight_once(program, b, layout.operand_dtype)

    layout.epilogue_reduces = any(v.op == "reduce" and v.uid not in prologue for v in values.values())
    layout.prologue_reduces = any(v.op == "reduce" and v.uid in prologue for v in values.values())
    install_layout(program, layout, full_domain, columns)


def _column_strides(shape, stride, domain, columns: int) -> tuple[int, ...]:
    """Strides of a tensor over ``domain``, its last ``columns`` dims merged into one.

    The merge needs the tensor to walk those dims as one: ``stride[d] == size[d+1]
    * stride[d+1]`` between neighbours (a broadcast over all of them, stride 0,
    merges too); a tensor that doesn't (a column slice, a broadcast over some of
    them) refuses the group.
    """
    check_fits(shape, domain)
    strides = domain_strides(shape, stride, domain)
    if columns == 1:
        return strides
    head, tail = list(strides[: len(strides) - columns]), strides[len(strides) - columns :]
    sizes = domain[len(domain) - columns :]
    walked = [(size, st) for size, st in zip(sizes, tail) if size != 1]
    for (_, outer), (size, inner) in zip(walked, walked[1:]):
        if outer != size * inner:
            raise GroupRefused(
                "strided_columns",
                f"a tensor of shape {list(shape)} and strides {list(stride)} "
                f"doesn't walk the product's {columns} column dims as one",
            )
    return tuple(head + [walked[-1][1] if walked else 0])


def packed_only_as_weights(values: dict[int, Value], weights: tuple[Value, ...]) -> None:
    """A quantised weight is decoded only where a product reads it as its second operand."""
    for v in values.values():
        if v.op == "load" and v.packed is not None and not any(v is w for w in weights):
            raise GroupRefused("packed_weight", "a quantised weight is read other than as a product's weight")


def weight_operand(
    program: GroupProgram, load: Value, dot: Value, domain: tuple[int, ...], columns: int = 1
) -> tuple[tuple[int, ...], Optional[PackedOperand]]:
    """The weight's strides over ``domain`` (``[..., K, N]``, its last ``columns`` dims
    merged into one), and its scales if it is stored quantised."""
    meta = program.inputs[program.input_of_load[load.uid]]
    packed = load.packed
    # A packed weight's elements are stored with K padded: index them by the logical shape.
    if packed is not None:
        shape, stride = list(load.shape), list(meta.stride)
    else:
        shape, stride = map(list, read_view(meta, load.shape))
    if dot.transpose_b:
        shape[-2:], stride[-2:] = shape[-2:][::-1], stride[-2:][::-1]
    strides = _column_strides(tuple(shape), tuple(stride), domain, columns)
    if packed is None:
        return strides, None
    if not dot.transpose_b or len(load.shape) != 2:
        raise GroupRefused("packed_weight", "a quantised weight must be a matrix stored [N, K] (as nn.Linear keeps it)")
    if packed.dtype in (torch.float16, torch.bfloat16) and packed.dtype != dot.dtype:
        raise GroupRefused("packed_weight", f"a weight dequantised to {packed.dtype} feeds a {dot.dtype} product")
    index = program.scales_of_load[load.uid]
    scales = program.inputs[index]
    s_shape, s_stride = list(scales.shape), list(scales.stride)
    s_shape[-2:], s_stride[-2:] = s_shape[-2:][::-1], s_stride[-2:][::-1]
    blocks = s_shape[-2]
    s_domain = domain[:-2] + (blocks, domain[-1])
    check_fits(tuple(s_shape), s_domain)
    return strides, PackedOperand(
        scales=index,
        strides=domain_strides(s_shape, s_stride, s_domain),
        blocks=blocks,
        block=packed.block,
        decode=packed.decode,
        exact_tf32=packed.exact_tf32,
    )


def depending_on(values: dict[int, Value], root: Value) -> set[int]:
    """``root`` and every value computed from it (uids grow in creation order)."""
    found: set[int] = set()
    for v in sorted(values.values(), key=lambda v: v.uid):
        if v is root or any(x.uid in found for x in v.args):
            found.add(v.uid)
    return found


def outputs_from(
    program: GroupProgram, values: dict[int, Value], after: set[int], product: Value, before: set[int], what: str
) -> None:
    """Every output is computed from ``product``, and nothing after it reads a value from ``before``."""
    for out, value in zip(program.outputs, program.output_values):
        if value.uid not in after:
            raise GroupRefused("prologue_output", f"output {out.name} is not computed from {what}")
    for uid in after:
        v = values[uid]
        if v is not product and any(x.uid in before for x in v.args):
            raise GroupRefused("prologue_reused", f"a value from before {what} is also used after it")


def install_layout(program: GroupProgram, layout, out_domain: tuple[int, ...], columns: int = 1) -> None:
    """Attach ``layout`` to ``program``; every output must cover the whole product
    (``out_domain``, whose last ``columns`` dims the layout walks as one)."""
    program.domain = layout.out_domain
    program.reduced_dims = ()
    program.product_layout = layout
    rank = len(out_domain)
    for tensor in program.outputs:
        check_fits(tensor.shape, out_domain)
        padded = (1,) * (rank - len(tensor.shape)) + tuple(tensor.shape)
        if any(s == 1 and d != 1 for s, d in zip(padded, out_domain)):
            raise GroupRefused("output_broadcasts", f"output {tensor.name} is smaller than the product")
        tensor.domain_stride = _column_strides(tensor.shape, tensor.stride, out_domain, columns)


def check_fits(shape, domain) -> None:
    pad = len(domain) - len(shape)
    if pad < 0 or any(s not in (1, d) for s, d in zip(shape, domain[pad:])):
        raise GroupRefused(
            "shape_mismatch", f"a tensor of shape {list(shape)} does not fit the product's {list(domain)}"
        )


def collect_uids(root: Value) -> list[int]:
    seen: list[int] = []
    stack = [root]
    found: set[int] = set()
    while stack:
        v = stack.pop()
        if v.uid in found:
            continue
        found.add(v.uid)
        seen.append(v.uid)
        stack.extend(v.args)
    return seen


def product_operand_dtype(dot: Value) -> Optional[torch.dtype]:
    dtype = dot.dtype or torch.float32
    if dtype in (torch.float16, torch.bfloat16):
        return dtype
    if dtype != torch.float32:
        raise GroupRefused("unsupported_dtype", f"products in {dtype}")
    return None


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def convert_weight_once(program: GroupProgram, load: Value, operand: Optional[torch.dtype]) -> None:
    """An fp32 parameter that a 16-bit product reads (autocast) is converted by the
    launcher, once per call, rather than by each program of the kernel: every program
    reads the whole weight, so a kernel of 2000 programs reads it 2000 times from L2,
    and in fp32 that is twice the bytes. Rounding is the same (to nearest even, as
    autocast's own cast). A kernel's configs that read the weight once per program
    anyway convert it themselves (``KernelSource.converts_casts``)."""
    slot = program.input_of_load[load.uid]
    tensor = program.inputs[slot]
    if operand is None or load.packed is not None or tensor.dtype != torch.float32 or tensor.cast_from is not None:
        return
    if not isinstance(tensor.source, AttrRef):
        return  # an activation: converting it would be a pass over memory of its own
    if tuple(tensor.stride) != contiguous_strides(tensor.shape):
        return  # .to() would hand the kernel a contiguous copy, not the strides it was written for
    if sum(1 for k in program.input_of_load.values() if k == slot) != 1:
        return  # read elsewhere in the group too, in fp32
    program.inputs[slot] = dataclasses.replace(tensor, dtype=operand, cast_from=torch.float32)


PRODUCT_LAYOUT = ProductLayoutSpec(
    name="matmul",
    description="one product: a prologue in A's domain, the weight read from memory, an epilogue in C's domain.",
    products=1,
    lay_out=lay_out_matmul,
)
