"""The spectral convolution around an FFT, found in a captured graph and
replaced by one functional op, ``spectral_mix``.

FNO-style layers write their spectral convolution with a mutation::

    x_ft = torch.fft.rfft2(x)
    out_ft = torch.zeros(b, o, h, w // 2 + 1, dtype=torch.cfloat)      # or zeros_like(x_ft)
    out_ft[:, :, :m1, :m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :m1, :m2], w1)
    out_ft[:, :, -m1:, :m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -m1:, :m2], w2)
    y = torch.fft.irfft2(out_ft, s=(h, w))

Between the two FFTs: mode truncation (the slices of ``x_ft``), the complex
channel mixing of each kept mode (the einsums), and zero padding back to the
full spectrum (the zeros and the slice assignments). ``find_spectral_mixes``
recognises that pattern and ``rewrite_spectral_mixes`` replaces it with::

    out_ft = view_as_complex(spectral_mix(view_as_real(x_ft), view_as_real(w1), view_as_real(w2), regions=...))

``spectral_mix`` is an ordinary function computing exactly the same values
(it is the eager fallback, the reference the kernel is checked against, and
what autograd differentiates); the plugin's strategy generates it as one
Triton kernel. It works on real views (``[..., 2]``: real and imaginary
parts), because kernels read real tensors.

The pattern is taken only when it can't change the result: the buffer is a
fresh zero complex64 tensor, nothing reads it before the last assignment,
each assigned value is an einsum ``b i S, i o T -> b o S`` (``T`` a subset of
the spatial letters ``S``) of the same slice of the same spectrum, used
nowhere else, and nothing that might write into memory runs between the
first slice and the last assignment. Anything else stays as it was.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx

from autofuser import annotate_node

#: One region of the output spectrum: the weight it uses (index into ``weights``),
#: its range per spatial dim, and the spatial dims the weight has (in the weight's order).
Region = tuple[int, tuple[tuple[int, int], ...], tuple[int, ...]]


def spectral_mix(
    spectrum: torch.Tensor,
    *weights: torch.Tensor,
    regions: tuple[Region, ...],
    stride: Optional[tuple[int, ...]] = None,
) -> torch.Tensor:
    """Mode truncation, complex channel mixing and zero padding, on real views.

    :param spectrum: ``view_as_real`` of a complex ``[B, I, *S]`` spectrum, so ``[B, I, *S, 2]``.
    :param weights: ``view_as_real`` of complex weights ``[I, O, *T]``, ``T`` the
        extents of the spatial dims the weight has.
    :param regions: ``(weight index, ((start, stop) per spatial dim), weight's spatial dims)``;
        where regions overlap, the later one wins (as later slice assignments do).
    :param stride: the complex result's strides (``zeros_like`` keeps its model's
        layout, and what follows the FFT may depend on it); ``None``: contiguous.
    :return: ``view_as_real`` of the complex ``[B, O, *S]`` result: in each region
        ``out[b, o, s] = sum_i x[b, i, s] * w[i, o, s - start]``, zero elsewhere.
    """
    x = torch.view_as_complex(spectrum)
    batch, _, *spatial = x.shape
    out_channels = weights[0].shape[1]
    shape = (batch, out_channels, *spatial)
    if stride is None:
        out = torch.zeros(shape, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty_strided(shape, stride, dtype=x.dtype, device=x.device).zero_()
    letters = "xyzuvw"[: len(spatial)]
    for k, ranges, weight_dims in regions:
        index = (slice(None), slice(None)) + tuple(slice(start, stop) for start, stop in ranges)
        equation = f"bi{letters},io{''.join(letters[d] for d in weight_dims)}->bo{letters}"
        out[index] = torch.einsum(equation, x[index], torch.view_as_complex(weights[k]))
    return torch.view_as_real(out)


@dataclass
class SpectralMix:
    """One recognised pattern: what ``spectral_mix`` needs, and the nodes it replaces."""

    buffer: torch.fx.Node  # the zeros the regions are assigned into
    spectrum: torch.fx.Node
    weights: list[torch.fx.Node]
    regions: tuple[Region, ...]
    replaced: list[torch.fx.Node]  # assignments, einsums and slices, in graph order


def _meta(node: Any):
    meta = node.meta.get("tensor_meta") if isinstance(node, torch.fx.Node) else None
    return meta if meta is not None and hasattr(meta, "shape") else None


def _ranges(index: Any, shape: tuple[int, ...]) -> Optional[tuple[tuple[int, int], ...]]:
    """``(start, stop)`` per dim of ``shape`` for an index made only of step-1 slices, else ``None``."""
    if not isinstance(index, tuple):
        index = (index,)
    if len(index) > len(shape) or not all(isinstance(s, slice) for s in index):
        return None
    out = []
    for size, s in zip(shape, index + (slice(None),) * (len(shape) - len(index))):
        if not all(v is None or isinstance(v, int) for v in (s.start, s.stop, s.step)):
            return None
        start, stop, step = s.indices(size)
        if step != 1 or stop <= start:
            return None
        out.append((start, stop))
    return tuple(out)


def _einsum_operands(node: torch.fx.Node) -> Optional[tuple[str, Any, Any]]:
    if node.op != "call_function" or node.target is not torch.einsum or node.kwargs:
        return None
    equation, *operands = node.args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if not isinstance(equation, str) or len(operands) != 2:
        return None
    return equation.replace(" ", ""), operands[0], operands[1]


def _weight_dims(equation: str, rank: int) -> Optional[tuple[int, ...]]:
    """For ``b i S, i o T -> b o S`` (any letters): the positions in ``S`` of ``T``'s letters."""
    if "->" not in equation or "." in equation:
        return None
    inputs, result = equation.split("->")
    parts = inputs.split(",")
    if len(parts) != 2:
        return None
    a, w = parts
    if len(a) != rank or len(result) != rank or len(set(a)) != rank or len(set(w)) != len(w):
        return None
    batch, contracted, spatial = a[0], a[1], a[2:]
    if len(w) < 2 or w[0] != contracted or w[1] in a or result != batch + w[1] + spatial:
        return None
    if any(letter not in spatial for letter in w[2:]):
        return None
    return tuple(spatial.index(letter) for letter in w[2:])


_IN_PLACE_OPERATORS = {
    operator.setitem,
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.ipow,
    operator.iand,
    operator.ior,
    operator.ixor,
}


def _may_write(node: torch.fx.Node) -> bool:
    """Could ``node`` write into memory? (In-place ops, ``out=``, ``inplace=True``; a module call might.)"""
    if node.op == "call_module":
        return True
    if node.op not in ("call_function", "call_method"):
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if node.target in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.startswith("__")):
        return True
    return node.kwargs.get("out") is not None or node.kwargs.get("inplace") is True


def _match(buffer: torch.fx.Node, order: dict[torch.fx.Node, int]) -> Optional[SpectralMix]:
    meta = _meta(buffer)
    if meta is None or meta.dtype != torch.complex64 or len(meta.shape) < 3:
        return None
    shape = tuple(meta.shape)
    assignments = sorted(
        (u for u in buffer.users if u.op == "call_function" and u.target is operator.setitem), key=order.__getitem__
    )
    if not assignments:
        return None
    last = order[assignments[-1]]
    readers = [u for u in buffer.users if u not in assignments]
    if any(order[u] < last for u in readers):
        return None  # read while being filled: not a pure function of its assignments
    spectrum, weights, regions, replaced = None, [], [], []
    for assign in assignments:
        if assign.users or len(assign.args) != 3 or assign.args[0] is not buffer or assign.kwargs:
            return None
        _, index, value = assign.args
        ranges = _ranges(index, shape)
        if ranges is None or ranges[0] != (0, shape[0]) or ranges[1] != (0, shape[1]):
            return None  # only mode truncation: every batch entry and channel
        operands = _einsum_operands(value) if isinstance(value, torch.fx.Node) else None
        if operands is None or len(value.users) != 1:
            return None
        equation, sliced, weight = operands
        weight_dims = _weight_dims(equation, len(shape))
        if (
            weight_dims is None
            or not isinstance(sliced, torch.fx.Node)
            or sliced.op != "call_function"
            or sliced.target is not operator.getitem
            or len(sliced.users) != 1
            or not isinstance(weight, torch.fx.Node)
        ):
            return None
        source, source_index = sliced.args
        source_meta, weight_meta = _meta(source), _meta(weight)
        if source_meta is None or weight_meta is None or spectrum not in (None, source):
            return None
        if source_meta.dtype != torch.complex64 or weight_meta.dtype != torch.complex64:
            return None
        batch, in_channels, *spatial = source_meta.shape
        if (batch, *spatial) != (shape[0], *shape[2:]) or _ranges(source_index, tuple(source_meta.shape)) != (
            (0, batch),
            (0, in_channels),
            *ranges[2:],
        ):
            return None  # the einsum must read the same modes it writes
        extents = tuple(stop - start for start, stop in ranges[2:])
        if tuple(weight_meta.shape) != (in_channels, shape[1], *(extents[d] for d in weight_dims)):
            return None
        spectrum = source
        if weight not in weights:
            weights.append(weight)
        regions.append((weights.index(weight), ranges[2:], weight_dims))
        replaced += [sliced, value, assign]
    replaced.sort(key=order.__getitem__)
    # spectral_mix reads the spectrum and the weights after the last assignment, where the
    # einsums read them earlier: nothing else may run in between (it might write into them).
    members = set(replaced)
    between = list(order)[order[replaced[0]] : order[replaced[-1]]]
    if any(n not in members and _may_write(n) for n in between):
        return None
    return SpectralMix(buffer, spectrum, weights, tuple(regions), replaced)


def find_spectral_mixes(gm: torch.fx.GraphModule) -> list[SpectralMix]:
    """Every zero-filled complex buffer assigned einsum-mixed modes of one spectrum."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (torch.zeros, torch.zeros_like):
            match = _match(node, order)
            if match is not None:
                found.append(match)
    return found


def _meta_tensor(node: torch.fx.Node) -> torch.Tensor:
    meta = _meta(node)
    return torch.empty_strided(tuple(meta.shape), tuple(meta.stride), dtype=meta.dtype, device="meta")


def rewrite_spectral_mixes(gm: torch.fx.GraphModule) -> int:
    """Replace each pattern of ``find_spectral_mixes`` by one ``spectral_mix`` call; returns how many."""
    graph = gm.graph
    matches = find_spectral_mixes(gm)
    for match in matches:
        # After the last assignment, where the buffer's first reader could be.
        anchor = match.replaced[-1]
        real_weights = []
        for weight in match.weights:
            with graph.inserting_after(anchor):
                anchor = graph.call_function(torch.view_as_real, (weight,))
            complex_weight = _meta_tensor(weight)
            annotate_node(anchor, torch.view_as_real(complex_weight), (complex_weight,))  # a view: free
            real_weights.append(anchor)
        with graph.inserting_after(anchor):
            real_spectrum = graph.call_function(torch.view_as_real, (match.spectrum,))
        spectrum = _meta_tensor(match.spectrum)
        annotate_node(real_spectrum, torch.view_as_real(spectrum), (spectrum,))
        with graph.inserting_after(real_spectrum):
            meta = _meta(match.buffer)
            mixed = graph.call_function(
                spectral_mix, (real_spectrum, *real_weights), {"regions": match.regions, "stride": tuple(meta.stride)}
            )
        # What the kernel stands for, for its header comment.
        mixed.meta["autofuser_plugin_fft_replaced"] = [
            f"{n.name} = {getattr(n.target, '__name__', n.target)}" for n in [match.buffer, *match.replaced]
        ]
        real_out = torch.view_as_real(_meta_tensor(match.buffer))
        annotate_node(mixed, real_out)
        with graph.inserting_after(mixed):
            result = graph.call_function(torch.view_as_complex, (mixed,))
        annotate_node(result, torch.view_as_complex(real_out), (real_out,))
        match.buffer.replace_all_uses_with(result, delete_user_cb=lambda user: user not in match.replaced)
        for node in reversed(match.replaced):
            graph.erase_node(node)
        graph.erase_node(match.buffer)
    if matches:
        graph.lint()
    return len(matches)
