"""Softmax attention written out, made one attention call: a graph pass.

``softmax(q @ k^T * scale) @ v`` written out computes the same function as
``F.scaled_dot_product_attention(q, k, v, scale=scale)``. The forward fuses either
form into the same online-softmax kernel (``match.py``). The backward is where the
forms part: a group's backward is traced from its ops as the graph holds them
(docs/training.md), so the written-out chain's backward recomputes
its [..., N, M] scores and holds several tensors that size (a score's gradient,
the probabilities), where the call's backward is a flash-style kernel
(recomputing the scores tile by tile from a saved log-sum-exp). On the softmax
Transformer's mesh (N = 11271, 8 heads) each such tensor is 4 GB in fp32.

The chain is rewritten only where it is exactly that function: ``k`` transposed
by its last two dims (``transpose``/``mT``), scalings of the scores by Python
numbers (``*``, ``/``), a softmax over the last dim without a ``dtype``, and a
product with ``v``; every value in between read by the next step alone (one read
elsewhere needs the scores in memory anyway); nothing written in place between
the scores' product and the last one (the call reads q, k and v where the last
product is); 4-d ``q``, ``k``, ``v`` with the same leading dims (the shapes torch's
fused kernels take); q, k, v and the result of one dtype; a row-major result; at
least ``MIN_KEYS`` keys. A mask, a bias or dropout between them leaves the chain as
it is; so does a short attention, whose scores are small, and which may be part of
a larger pattern another strategy fuses whole (Transolver's attention among its 32
or 64 slices, ``slice.py``).

The call is ``flash_op.flash_attention``, whose backward is this plugin's own flash
kernels (``flash.py``), not torch's SDPA:

- fp16 and bf16 (a 16-bit model, or fp32 inputs' projections under autocast): under
  bf16 autocast, where torch picks cuDNN's attention, the Transformer rewritten to
  SDPA had gradients 77% off eager's (eager's own error against a strict-fp32 run:
  0.6%). ``benchmarks/sdpa_grad_probe.py`` traced it to cuDNN's backward, which
  returns wrong gradients when the output's gradient is row-major (as the row-major
  copy this rewrite needs hands it) rather than in the layout of cuDNN's own output
  (BENCHMARKS.md, "Training"). The call computes the scores in fp32 where the chain
  rounds them to 16 bits before its softmax (eager's SDPA does the same), so its
  results are nearer float64's than the chain's own. Only where the graph is
  compiled with gradients on: an inference graph gains nothing by it (the forward
  kernel is the same), and its groups are then checked against the chain as the
  user wrote it.
- fp32 (autocast off: under autocast the products' results are 16-bit), with or
  without gradients: on the softmax Transformer's attention the flash kernels'
  forward and backward were faster than torch's fp32 (memory-efficient) ones and
  nearer float64 (``sdpa_grad_probe.py``; BENCHMARKS.md, "Training").

Head widths past ``flash.MAX_HEAD_WIDTH`` leave the chain as it is.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx
import torch.nn.functional as F

from autofuser.kernel import fp32_precision, tensor_meta

from .flash import MAX_HEAD_WIDTH
from .flash_op import flash_attention
from .match import softmax_dim

PRODUCTS = (torch.matmul, operator.matmul)
#: Fewest keys (the scores' last dim) of a chain rewritten; below, it stays as written.
MIN_KEYS = 256
MAX_SCALINGS = 4  # scalings of the scores walked between the product and the softmax
#: The dtypes of a chain that becomes a ``flash_attention`` call (see the module's doc).
DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
SCALINGS = {operator.mul: "mul", torch.mul: "mul", operator.truediv: "div", torch.div: "div"}


#: Functions that write into their first argument (``x += y`` on a traced value, ``x[i] = y``).
IN_PLACE_FUNCTIONS = frozenset(
    getattr(operator, f"i{name}")
    for name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift")
) | {operator.setitem}


def _writes_in_place(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Whether ``node`` may write into a tensor it reads: an in-place method (``mul_``), an
    augmented assignment or item assignment, an ``out=`` argument, or a module of torch's
    with ``inplace=True``."""
    if "out" in node.kwargs:
        return True
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.startswith("__")
    if node.op == "call_function":
        return node.target in IN_PLACE_FUNCTIONS
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(str(node.target)), "inplace", False))
    return False


def _written_between(gm: torch.fx.GraphModule, first: torch.fx.Node, last: torch.fx.Node) -> bool:
    """Whether a node after ``first`` and before ``last`` (in the graph's order) writes in
    place: the call, put where ``last`` is, would read q, k and v after that write, where the
    chain read q and k before it."""
    node = first.next
    while node is not last and node.op != "root":
        if _writes_in_place(gm, node):
            return True
        node = node.next
    return False


def _only_user(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _operands(node: torch.fx.Node) -> Optional[tuple]:
    """(a, b) of a product node ``a @ b`` written as ``torch.matmul``, ``@`` or ``.matmul``."""
    if node.op == "call_function" and node.target in PRODUCTS and len(node.args) == 2 and not node.kwargs:
        return node.args
    if node.op == "call_method" and node.target == "matmul" and len(node.args) == 2 and not node.kwargs:
        return node.args
    return None


def _transposed(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    """``k`` of a node that is ``k`` with its last two dims swapped (a view), else ``None``."""
    if not isinstance(node, torch.fx.Node):
        return None
    if node.op == "call_function" and node.target is getattr and node.args[1:] == ("mT",):
        source = node.args[0]
        return source if isinstance(source, torch.fx.Node) else None
    transpose = (node.op == "call_method" and node.target == "transpose") or (
        node.op == "call_function" and node.target is torch.transpose
    )
    if not transpose or len(node.args) != 3 or node.kwargs:
        return None
    source, d0, d1 = node.args
    meta = tensor_meta(source) if isinstance(source, torch.fx.Node) else None
    if meta is None or not all(isinstance(d, int) and not isinstance(d, bool) for d in (d0, d1)):
        return None
    rank = len(meta.shape)
    return source if {d0 % rank, d1 % rank} == {rank - 2, rank - 1} else None


def _scaling(node: torch.fx.Node, scores: torch.fx.Node) -> Optional[float]:
    """The factor a node multiplies ``scores`` by (``scores * c``, ``c * scores``, ``scores / c``)."""
    kind = SCALINGS.get(node.target) if node.op == "call_function" else None
    if kind is None and node.op == "call_method" and node.target in ("mul", "div"):
        kind = node.target
    if kind is None or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    number = (int, float)
    if kind == "mul":
        other = b if a is scores else a if b is scores else None
        if isinstance(other, number) and not isinstance(other, bool):
            return float(other)
        return None
    if a is scores and isinstance(b, number) and not isinstance(b, bool) and b != 0:
        return 1.0 / float(b)
    return None


def _no_dtype(node: torch.fx.Node) -> bool:
    """A softmax node without a ``dtype`` argument (its result in its input's dtype)."""
    if node.kwargs.get("dtype") is not None:
        return False
    if node.op == "call_method":
        return len(node.args) <= 2  # x.softmax(dim, dtype)
    if node.op == "call_function":
        return len(node.args) <= (3 if node.target is F.softmax else 2)  # F.softmax(x, dim, _stacklevel, dtype)
    return True  # nn.Softmax has no dtype


def _row_major(shape, stride) -> bool:
    expected, step = [], 1
    for size in reversed(shape):
        expected.append(step)
        step *= max(size, 1)
    return all(size == 1 or s == e for size, s, e in zip(shape, stride, reversed(expected)))


def _chain(gm: torch.fx.GraphModule, softmax: torch.fx.Node) -> Optional[tuple]:
    """(q, k, v, scale, output node, the chain's nodes) of the written-out attention
    around ``softmax``, or ``None`` where it is not exactly one."""
    dim = softmax_dim(softmax, gm)
    meta = tensor_meta(softmax)
    if meta is None or dim == "?" or dim is None or dim % len(meta.shape) != len(meta.shape) - 1:
        return None
    if not _no_dtype(softmax) or not softmax.args or not isinstance(softmax.args[0], torch.fx.Node):
        return None
    output = _only_user(softmax)
    pv = _operands(output) if output is not None else None
    if pv is None or pv[0] is not softmax or not isinstance(pv[1], torch.fx.Node):
        return None
    scale, walk, chain = 1.0, softmax.args[0], [output, softmax]
    for _ in range(MAX_SCALINGS + 1):
        if _operands(walk) is not None:
            break
        operand = next((a for a in walk.args if isinstance(a, torch.fx.Node)), None)
        factor = _scaling(walk, operand) if operand is not None else None
        if factor is None or _only_user(walk) is None:
            return None
        chain.append(walk)
        scale, walk = scale * factor, operand
    else:
        return None
    scores = walk
    if _only_user(scores) is None:
        return None
    q, k_t = _operands(scores)
    k = _transposed(k_t)
    if not isinstance(q, torch.fx.Node) or k is None or _only_user(k_t) is None:
        return None
    chain += [scores, k_t]
    if _written_between(gm, scores, output):
        return None
    v = pv[1]
    metas = [tensor_meta(n) for n in (q, k, v, output)]
    if any(m is None for m in metas):
        return None
    mq, mk, mv, mo = metas
    if not all(len(m.shape) == 4 for m in metas):
        return None
    if not (tuple(mq.shape[:2]) == tuple(mk.shape[:2]) == tuple(mv.shape[:2])):
        return None
    if mq.shape[-1] != mk.shape[-1] or mk.shape[-2] != mv.shape[-2] or mk.shape[-2] < MIN_KEYS:
        return None
    if max(mq.shape[-1], mv.shape[-1]) > MAX_HEAD_WIDTH:
        return None
    if not (mq.dtype == mk.dtype == mv.dtype == mo.dtype) or mo.dtype not in DTYPES:
        return None  # one dtype throughout: fp32 with autocast off, or a 16-bit chain
    if not _row_major(tuple(mo.shape), tuple(mo.stride)):
        return None
    return q, k, v, scale, output, chain


def rewrite_written_out_attention(gm: torch.fx.GraphModule, gradients: bool = True) -> int:
    """Each written-out softmax attention in ``gm`` as one ``flash_attention`` call (in
    16 bits only with ``gradients`` on; see the module's doc); returns how many were
    rewritten."""
    rewritten, erased = 0, set()
    for node in list(gm.graph.nodes):
        if node in erased or softmax_dim(node, gm) is None:
            continue
        found = _chain(gm, node)
        if found is None:
            continue
        q, k, v, scale, output, chain = found
        if tensor_meta(output).dtype != torch.float32 and not gradients:
            continue  # the 16-bit call serves the backward alone; the forward's kernel is the same
        with gm.graph.inserting_before(output):
            dtype = tensor_meta(output).dtype
            # fp32: the precision this compile chose for products, kept when the kernels launch.
            extra = {"precision": fp32_precision()} if dtype == torch.float32 else {}
            call = gm.graph.call_function(flash_attention, (q, k, v), {"scale": scale, **extra})
        call.meta.update({key: output.meta[key] for key in output.meta if key != "tensor_meta"})
        call.meta["tensor_meta"] = output.meta["tensor_meta"]
        output.replace_all_uses_with(call)
        for dead in chain:  # each after the nodes that read it
            gm.graph.erase_node(dead)
            erased.add(dead)
        rewritten += 1
    return rewritten
