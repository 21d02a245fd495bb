"""The kernel-writing API: what a strategy uses to turn the IR of its group
(``autofuser.GroupProgram``) into the source of a Triton kernel.

Every bundled strategy writes its kernels with these names alone, as a third
party's would. Whatever the tiling, IR values become Triton lines through one
emitter, ``ValueEmitter``: it writes each value once, constants and pointwise
ops the same way everywhere, and asks its subclass only how a load, a
reduction and a product are written at that kernel's tiles. Three levels, from
the whole kernel down:

- ``write_kernel`` writes a complete kernel for a group without products: one
  program per tile of rows, the domain's dims flattened to offsets
  (``emit_offsets``), reductions along a row (``row_reduction``);
- for groups with products, ``TileWriter`` collects a kernel's lines and
  ``TileBlock`` writes the values of one straight-line block at a tile axis
  (``rows`` x ``ks`` or ``rows`` x ``cols``); ``dot_line`` and ``as_operand``
  multiply tiles the way eager would, ``weight_tile`` loads (and decodes) a
  weight tile, ``emit_prepasses`` computes a prologue's row statistics,
  ``emit_stores`` writes each output, and ``assemble_kernel`` names the kernel
  and adds its header;
- the pieces under both: dtypes (``TL_DTYPES``), literals, rounding to a low
  precision dtype (``rounded``, ``stored`` in generated text; ``round_bf16``, a
  ``@triton.jit`` function, in hand-written kernels), the header naming the fx nodes a
  kernel replaces (``kernel_header``), helpers a kernel calls
  (``used_helpers``), and host-side arithmetic (``triton_cdiv``, and
  ``cdiv_text`` for a generated launcher's text);
- kernel chains, several kernels run as one group by a host-side launcher
  with a kernel's interface that allocates their scratch buffers
  (``chain_stages``, ``chain_module``, ``split_chunk``, ``chain_digest``,
  ``POINTER_TYPES``): the attention chains and the split reduction.

What a group is made of (``GroupProgram``, ``KernelTensor``, ``Value``) and how
to refuse one (``GroupRefused``) are in ``autofuser`` itself.
"""

from autofuser_core.chain import POINTER_TYPES, chain_digest, chain_module, chain_stages, jit_function, split_chunk
from autofuser_core.codegen import (
    INT32_LIMIT,
    MAX_GRID_YZ,
    TL_DTYPES,
    GridTooLarge,
    ValueEmitter,
    cdiv_text,
    emit_offsets,
    kernel_header,
    literal,
    next_power_of_2,
    op_label,
    op_stem,
    row_reduction,
    strategy_header,
    triton_cdiv,
    used_helpers,
    write_kernel,
)
from autofuser_core.dynamic import literal_sizes, size_parameters, sized
from autofuser_core.group import (
    MAX_PRODUCTS,
    ROUNDED_DTYPES,
    STRICT_FP32,
    attr_tensor,
    collect_values,
    domain_strides,
    fp32_precision,
    product_count,
    read_view,
)
from autofuser_core.ir import AttrRef, PackedWeight, tensor_meta
from autofuser_core.jit_helpers import round_bf16
from autofuser_core.rounding import interpreting, rounded, stored
from autofuser_core.tf32 import tf32_allowed
from autofuser_core.tiles import (
    PackedOperand,
    TileBlock,
    TileWriter,
    all_values,
    as_operand,
    assemble_kernel,
    dot_block,
    dot_line,
    emit_prepasses,
    emit_stores,
    index_term,
    needs_int64,
    weight_tile,
)

__all__ = [
    "INT32_LIMIT",
    "MAX_GRID_YZ",
    "GridTooLarge",
    "POINTER_TYPES",
    "MAX_PRODUCTS",
    "ROUNDED_DTYPES",
    "STRICT_FP32",
    "TL_DTYPES",
    "AttrRef",
    "PackedOperand",
    "PackedWeight",
    "TileBlock",
    "TileWriter",
    "ValueEmitter",
    "all_values",
    "as_operand",
    "assemble_kernel",
    "attr_tensor",
    "chain_digest",
    "chain_module",
    "chain_stages",
    "collect_values",
    "domain_strides",
    "dot_block",
    "dot_line",
    "emit_offsets",
    "emit_prepasses",
    "emit_stores",
    "fp32_precision",
    "index_term",
    "interpreting",
    "jit_function",
    "kernel_header",
    "literal",
    "literal_sizes",
    "needs_int64",
    "next_power_of_2",
    "op_label",
    "op_stem",
    "product_count",
    "read_view",
    "round_bf16",
    "rounded",
    "row_reduction",
    "size_parameters",
    "sized",
    "split_chunk",
    "stored",
    "strategy_header",
    "tensor_meta",
    "tf32_allowed",
    "triton_cdiv",
    "cdiv_text",
    "used_helpers",
    "weight_tile",
    "write_kernel",
]
