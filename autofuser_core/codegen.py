"""The Triton source writer: one n-dimensional indexing scheme for every
strategy.

A ``GroupProgram`` gives a domain ``S``, the reduced dims ``R`` and, for every
input and output, one stride per dim of ``S`` (0 where it broadcasts). The
writer:

1. drops size-1 dims and merges neighbouring dims that every tensor walks
   contiguously (so a plain contiguous chain indexes with one flat offset);
2. tiles the domain in one of two layouts:
   - ``flat``: a 1-D block of ``BLOCK`` elements over all dims (no reductions);
   - ``rows``: ``BLOCK_M`` rows of outer dims by ``BLOCK_R`` columns that cover
     all of ``R``, so a reduction is one ``tl.sum``/``tl.max`` along axis 1
     and everything after it uses the row's result from registers;
3. derives each dim's coordinate once per program (``//`` and ``%`` by
   constants) and each tensor's offset as the sum of coordinate x stride,
   loading ``[BLOCK_M, 1]`` or ``[1, BLOCK_R]`` tiles where a tensor is
   constant along the other axis;
4. emits the expression DAG one line per value, computing in fp32, and stores
   each output in its own dtype through its own strides.

Shapes and strides are compile-time constants: kernels are specialised, like
the rest of the compiled graph, on the real input shapes. Where a dimension is
dynamic (docs/dynamic.md), every integer derived from its size is written
through ``sized`` instead: the name of a run-time argument of the kernel
(``KernelSource.sizes`` holds this program's values), so one source serves
every size of that dimension; ``BLOCK_R`` then comes from the size's bucket.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, cast

import torch
import torch.fx

from .dynamic import size_parameters, sized
from .group import (
    GroupProgram,
    GroupRefused,
    KernelTensor,
    collect_values,
    cross_sum_of,
    domain_strides,
    read_view,
)
from .ir import Value
from .rounding import CORE_HELPERS, stored

TL_DTYPES = {
    torch.float32: "tl.float32",
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.bool: "tl.int1",
}
INT32_LIMIT = 2**31 - 1
#: CUDA's limits on a launch grid: axis 0 up to 2**31 - 1 programs, axes 1 and 2 up to
#: MAX_GRID_YZ each. A grid past them fails to launch ("invalid argument"); a kernel writer
#: folds a long axis into axis 0 or refuses its group.
MAX_GRID_YZ = 65535


class GridTooLarge(ValueError):
    """A kernel's launch grid past CUDA's limits (``KernelSource.launch_grid``)."""


@dataclass
class KernelSource:
    """A generated kernel: its source text, entry-point name and launch grid."""

    name: str
    source: str
    layout: str  # "flat" | "rows"
    grid: Callable[[dict], tuple[int, ...]]
    constexprs: dict[str, int] = field(default_factory=dict)  # fixed by the layout, not tuned
    # Configs whose kernel converts the inputs the launcher would convert
    # (``KernelTensor.cast_from``) itself: they take them as they arrive.
    converts_casts: Callable[[dict], bool] = lambda config: False
    # Run-time sizes by parameter name (``sz0``...): the sizes of this program that derive
    # from a dynamic dimension, passed at every launch (docs/dynamic.md). Empty for a
    # kernel specialised on its shapes.
    sizes: dict[str, int] = field(default_factory=dict)
    # The size buckets of the dynamic dims those sizes derive from: tuning is keyed by them.
    size_buckets: tuple[int, ...] = ()
    # Outputs the kernel writes as partial rows (``GroupProgram.cross_reduces``): for each,
    # the launcher passes an fp32 buffer of one row of the output's size per program and
    # stores the rows' sum in the output (``launch.kernel_outputs``).
    partial_outputs: tuple[int, ...] = ()

    def launch_grid(self, config: dict) -> tuple[int, ...]:
        """The grid of a launch with ``config``, checked against CUDA's limits (``MAX_GRID_YZ``):
        a grid past them raises ``GridTooLarge`` naming the kernel, the axis and the fix, where
        the launch itself would fail with CUDA's bare "invalid argument"."""
        grid = tuple(int(n) for n in self.grid(config))
        limits = (INT32_LIMIT, MAX_GRID_YZ, MAX_GRID_YZ)
        for axis, (n, most) in enumerate(zip(grid, limits)):
            if not 0 <= n <= most:
                raise GridTooLarge(
                    f"kernel {self.name}: its grid {grid} has {n} programs on axis {axis}, past CUDA's limit of "
                    f"{most}; its strategy must fold that axis into axis 0 (or refuse the group): the group "
                    "stays eager"
                )
        if len(grid) > len(limits):
            raise GridTooLarge(f"kernel {self.name}: its grid {grid} has {len(grid)} axes; a launch has at most 3")
        return grid

    def launch_args(self, config: dict) -> dict:
        """The keyword arguments of a launch with ``config``: the layout's fixed sizes win over a config's."""
        return {**config, **self.constexprs, **self.sizes}

    def output_dtypes(self, program) -> list:
        """What the kernel writes each output as: its dtype, fp32 for a partial output."""
        return [torch.float32 if k in self.partial_outputs else t.dtype for k, t in enumerate(program.outputs)]

    def casts(self, program, config: dict) -> list:
        """(slot, dtype) of each input the launcher converts before a launch with ``config``."""
        if self.converts_casts(config):
            return []
        return [(slot, t.dtype) for slot, t in enumerate(program.inputs) if t.cast_from is not None]

    def input_dtypes(self, program, config: dict) -> list:
        """What the kernel itself takes with ``config``: each input's dtype after the launcher's casts."""
        converted = dict(self.casts(program, config))
        return [converted.get(slot, t.cast_from or t.dtype) for slot, t in enumerate(program.inputs)]

    @property
    def source_hash(self) -> str:
        """Digest of the code, without the leading comment block that names the
        fx nodes: every repeat of a layer generates the same code, and must share
        one tuning entry rather than be tuned again per layer."""
        lines = self.source.splitlines(keepends=True)
        start = 0
        while start < len(lines) and lines[start].startswith("#"):
            start += 1
        return hashlib.sha256("".join(lines[start:]).encode()).hexdigest()


def op_label(node: torch.fx.Node) -> str:
    """What ``node`` computes, for a kernel's inline comments: the same for every repeat of
    a layer, where its name is not. The comments are part of the kernel's name digest and
    of Triton's cache key, so a node name there would compile each layer's copy again."""
    if node.op == "call_module":
        owner = node.graph.owning_module
        if owner is None:  # a graph outside any module: nothing to name
            return "module"
        try:
            return type(owner.get_submodule(cast(str, node.target))).__name__
        except (AttributeError, TypeError):
            return "module"
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


def used_helpers(helpers: Optional[dict[str, str]], body: str) -> str:
    """The source of the helper functions ``body`` calls (plugins' and the core's)."""
    available = {**CORE_HELPERS, **(helpers or {})}
    return "\n\n".join(text for name, text in sorted(available.items()) if f"{name}(" in body)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _coalesce(sizes: list[int], strides: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """Merge neighbouring dims (outer to inner) that every tensor walks contiguously."""
    keep = [i for i, s in enumerate(sizes) if s != 1]
    sizes = [sizes[i] for i in keep]
    strides = [[t[i] for i in keep] for t in strides]
    merged_sizes: list[int] = []
    merged_strides: list[list[int]] = [[] for _ in strides]
    for d, size in enumerate(sizes):
        if merged_sizes and all(t[d] * size == m[-1] for t, m in zip(strides, merged_strides)):
            # stride[prev] == stride[d] * size[d]: prev and d walk as one dim
            merged_sizes[-1] *= size
            for t, m in zip(strides, merged_strides):
                m[-1] = t[d]
        else:
            merged_sizes.append(size)
            for t, m in zip(strides, merged_strides):
                m.append(t[d])
    return merged_sizes, merged_strides


def memory_order(dims: list[int], program: GroupProgram) -> list[int]:
    """``dims`` reordered so that consecutive flat indices walk the outputs' memory
    (largest stride outermost), which makes a flat kernel's loads and stores coalesced
    where the tensors are permuted views (a channels-last ``permute`` before a cast,
    say); inputs break ties the outputs leave (a dim of size 1, a broadcast output).
    Walking the dims in their logical order instead would stride every access of such a
    tensor by its channel count. Any order is correct: each element is independent."""
    ranked = program.outputs + sorted(program.inputs, key=lambda t: -math.prod(t.shape))

    def key(d: int) -> tuple:
        return tuple(-abs(t.domain_stride[d]) for t in ranked)

    return sorted(dims, key=key)


def emit_offsets(
    emit: Callable[[str], None], sizes: list[int], site_strides: list[list[int]], index: str, prefix: str
) -> list[Optional[str]]:
    """Emit the coordinates of ``index`` over dims of ``sizes`` (outer to inner) and
    return, per site, the offset expression ``sum(coord * stride)`` (``None``: 0)."""
    sizes, strides = _coalesce(list(sizes), [list(t) for t in site_strides])
    coords = []
    for i, size in enumerate(sizes):
        divisor = math.prod(sizes[i + 1 :])
        expr = index if divisor == 1 else f"({index} // {sized(divisor)})"
        if i > 0:
            expr = f"({expr} % {sized(size)})"
        name = f"{prefix}{i}"
        emit(f"{name} = {expr}")
        coords.append(name)
    offsets: list[Optional[str]] = []
    for t in strides:
        terms = [c if st == 1 else f"{c} * {sized(st)}" for c, st in zip(coords, t) if st != 0]
        offsets.append(" + ".join(terms) if terms else None)
    return offsets


#: Each row reduction's starting value (what a masked-off lane contributes).
REDUCTION_NEUTRAL = {"sum": "0.0", "max": 'float("-inf")', "min": 'float("inf")'}


def row_reduction(op: str, full: str, mask: str) -> str:
    """``op`` along axis 1 of the tile ``full`` over the lanes in ``mask``, kept as
    ``[rows, 1]``. max/min propagate NaN as torch does (``tl.max`` alone drops it)."""
    reduced = f"tl.{op}(tl.where({mask}, {full}, {REDUCTION_NEUTRAL[op]}), axis=1)[:, None]"
    if op == "sum":
        return reduced
    has_nan = f"tl.max(tl.where({mask} & ({full} != {full}), 1, 0), axis=1)[:, None] > 0"
    return f'tl.where({has_nan}, float("nan"), {reduced})'


def literal(value) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    if math.isinf(value):
        return 'float("inf")' if value > 0 else 'float("-inf")'
    if math.isnan(value):
        return 'float("nan")'
    return repr(float(value))


class ValueEmitter:
    """Writes a DAG of IR values as Triton lines, each value once: the one
    emitter every strategy's kernel goes through.

    What every layout shares is here: a value already written is reused by its
    name (``names``, by uid; seed it with values the caller computed), a
    constant is a literal, and a pointwise op is one line, its template applied
    to its operands' names. Where a load reads, how a reduction reduces and how
    a product multiplies depend on the kernel's tiling, so a subclass writes
    them - ``load(v)``, ``reduce(v, arg)`` (``arg``: the operand's name, already
    written) and ``dot(v)`` - each returning its result's name. ``emit`` (one
    line at the emitter's indent) and ``fresh`` (a new name) are the
    subclass's too. Operands are written before the value's own name is taken.
    """

    def __init__(self, names: Optional[dict[int, str]] = None):
        self.names: dict[int, str] = dict(names or {})

    def emit(self, line: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} must say where its lines go (emit)")

    def fresh(self) -> str:
        raise NotImplementedError(f"{type(self).__name__} must say how it names values (fresh)")

    def value(self, v: Value) -> str:
        """The name holding ``v``, writing ``v`` and what it needs if not yet written."""
        if v.uid in self.names:
            return self.names[v.uid]
        if v.op == "const":
            if v.size is not None and sized(v.size) != str(v.size):
                # an element count of a dynamic dim: taken at run time
                return f"({sized(v.size)} - {v.size_less})" if v.size_less else sized(v.size)
            return literal(v.constant)
        if v.op == "load":
            name = self.load(v)
        elif v.op == "pointwise":
            operands = [self.value(a) for a in v.args]
            name = self.fresh()
            self.emit(f"{name} = {v.template.format(*operands)}")
        elif v.op == "reduce":
            name = self.reduce(v, self.value(v.args[0]))
        elif v.op == "dot":
            name = self.dot(v)
        elif v.op == "shifted":
            name = self.shifted(v)
        else:
            raise ValueError(f"unknown IR op {v.op!r}")
        self.names[v.uid] = name
        return name

    def load(self, v: Value) -> str:
        raise ValueError(f"{type(self).__name__} cannot read inputs here")

    def reduce(self, v: Value, arg: str) -> str:
        raise ValueError(f"{type(self).__name__} cannot reduce here ({v.reduce_op})")

    def dot(self, v: Value) -> str:
        raise ValueError(f"{type(self).__name__} cannot write a matrix product here")

    def shifted(self, v: Value) -> str:
        # A strategy whose groups may hold shifted reads refuses them when it composes or
        # accepts a group; reaching this means one did not, and the group stays eager.
        raise ValueError(
            f"{type(self).__name__} cannot read values at shifted coordinates (ctx.read_shifted): "
            "its strategy must refuse groups that hold them"
        )


class _Writer(ValueEmitter):
    def __init__(self, program: GroupProgram, layout: str):
        super().__init__()
        self.program = program
        self.layout = layout
        self.lines: list[str] = []
        self.count = 0
        self.loads: dict[int, str] = {}  # input index -> the name of its tile
        # Shifted coordinates and range checks by expression: the taps of windows that
        # overlap move the same coordinate the same way, once is enough.
        self.shifted_names: dict[str, str] = {}

    def emit(self, line: str) -> None:
        self.lines.append("    " + line)

    def fresh(self) -> str:
        self.count += 1
        return f"v{self.count}"

    # -- indexing -----------------------------------------------------------

    def axis_offsets(
        self, dims: list[int], index: str, prefix: str, tensors: list[KernelTensor]
    ) -> list[Optional[str]]:
        """Coordinates along ``dims`` from the linear ``index``; returns each tensor's offset expr."""
        sizes = [self.program.domain[d] for d in dims]
        strides = [[t.domain_stride[d] for d in dims] for t in tensors]
        return emit_offsets(self.emit, sizes, strides, index, prefix)

    # -- values ---------------------------------------------------------------

    def load(self, v: Value) -> str:
        return self.loads[self.program.input_of_load[v.uid]]

    def reduce(self, v: Value, arg: str) -> str:
        name = self.fresh()
        if self.layout != "rows" or not self.program.reduced_dims or v.uid in self.program.identity_reduces:
            self.emit(f"{name} = {arg}  # reduction over size-1 dims")
        else:
            full = f"tl.broadcast_to({arg}, (BLOCK_M, BLOCK_R))"
            if v.args[0].is_bool:
                full = f"{full}.to(tl.float32)"
            if v.uid in self.program.cross_reduces:
                # this program's rows summed: one partial row of the output
                self.emit(f"{name} = tl.sum(tl.where(mask, {full}, 0.0), axis=0)[None, :]")
            else:
                self.emit(f"{name} = {row_reduction(v.reduce_op, full, 'mask')}")
        return name


@dataclass(frozen=True)
class Coordinate:
    """A tile's coordinate along one dim of the domain, for kernels with shifted reads.

    ``expr`` is a name in the kernel or, where ``axis`` is ``None``, an integer literal
    (a dim of size 1, a shifted read at a fixed coordinate); ``axis`` is the tile axis it
    varies along (``"flat"``, ``"row"`` or ``"col"``); ``valid`` names the masks of the
    lanes whose coordinate lies inside every operand a shifted read in ``fill`` mode
    read it from (out there it is out of range, and a load along it must be masked)."""

    expr: str
    axis: Optional[str]
    valid: tuple[str, ...] = ()


class _AtCoordinates(ValueEmitter):
    """Writes values at one set of coordinates (``coords``, one per dim of the domain):
    the group's own, or those a shifted read (``ctx.read_shifted``) moves them to, where
    the values below it are computed again. Each load reads through its own strides at
    these coordinates, masked to the tile (``base_masks``, by axis) and to the range of
    the dims it walks."""

    def __init__(self, writer: "_Writer", coords: list[Coordinate], base_masks: dict[str, str], top: bool):
        super().__init__()
        self.w, self.coords, self.base_masks, self.top = writer, coords, base_masks, top
        self.loaded: dict[tuple, str] = {}

    def emit(self, line: str) -> None:
        self.w.emit(line)

    def fresh(self) -> str:
        return self.w.fresh()

    def load(self, v: Value) -> str:
        k = self.w.program.input_of_load[v.uid]
        tensor = self.w.program.inputs[k]
        # right-aligned to these coordinates (domain_strides reads only their number)
        strides = domain_strides(*read_view(tensor, v.shape), [0] * len(self.coords))
        key = (k, strides)
        if key in self.loaded:
            return self.loaded[key]
        terms, masks = [], []
        for c, st in zip(self.coords, strides):
            if st == 0 or c.expr == "0":
                continue
            terms.append(c.expr if st == 1 else f"{c.expr} * {sized(st)}")
            if c.axis is not None:  # a fixed coordinate is inside the operand it was resolved for
                masks.append(self.base_masks[c.axis])
                masks.extend(c.valid)
        cast = "" if tensor.dtype == torch.bool else ".to(tl.float32)"
        name = f"x{k}_{self.fresh()}"
        if not terms:
            self.emit(f"{name} = tl.load(in{k}){cast}")
        else:
            mask = " & ".join(dict.fromkeys(masks)) or None
            mask_arg = f", mask={mask}, other=0" if mask else ""
            self.emit(f"{name} = tl.load(in{k} + {' + '.join(terms)}{mask_arg}){cast}")
        self.loaded[key] = name
        return name

    def named(self, expr: str) -> str:
        """A name holding ``expr``, written once per kernel."""
        if expr not in self.w.shifted_names:
            self.w.shifted_names[expr] = self.fresh()
            self.emit(f"{self.w.shifted_names[expr]} = {expr}")
        return self.w.shifted_names[expr]

    def reduce(self, v: Value, arg: str) -> str:
        if not self.top:  # group.py refuses these (shifted_reduction)
            raise ValueError("a reduction below a shifted read")
        return self.w.reduce(v, arg)

    def shifted(self, v: Value) -> str:
        """``v.args[0]`` at the coordinates ``v.shift`` moves these to (see ``ctx.read_shifted``)."""
        operand, shift = v.args[0], v.shift
        assert shift is not None
        lead = len(self.coords) - len(v.shape)
        if shift.reshaped:
            inner = self._reshaped_coordinates(list(self.coords[lead:]), v.shape, operand.shape)
            return _AtCoordinates(self.w, inner, self.base_masks, top=False).value(operand)
        moved = list(self.coords)
        in_range: list[str] = []  # this read's own range checks (fill mode)
        fixed = dict(shift.fixed_dims)
        operand_shape = [n for d, n in enumerate(operand.shape) if d not in fixed]
        for d in shift.new_dims:
            operand_shape.insert(d, 1)
        for j, (n_out, n_in, scale, offset) in enumerate(zip(v.shape, operand_shape, shift.scales, shift.offsets)):
            d = lead + j
            outer = self.coords[d] if n_out != 1 else Coordinate("0", None, self.coords[d].valid)
            if scale == 1 and offset == 0 and n_in == n_out:
                continue
            if outer.axis is None:
                at = _shift_constant(scale * int(outer.expr) + offset, n_in, shift.mode)
                if at is None:  # a fill read wholly outside its operand: only the fill
                    return self.value(v.args[1])
                moved[d] = Coordinate(str(at), None, outer.valid)
                continue
            expr, check = _shift_expression(outer.expr, n_out, n_in, scale, offset, shift.mode)
            name = self.named(expr)
            valid = outer.valid
            if check:
                check_name = self.named(check.format(name))
                in_range.append(check_name)
                valid = valid + (check_name,)
            moved[d] = Coordinate(name, outer.axis, valid)
        # The operand's own coordinates: without the dims it lacks (new_dims), with those
        # the result lacks at their fixed index; the values below it align to them.
        inner = [c for j, c in enumerate(moved[lead:]) if j not in shift.new_dims]
        for d, index in shift.fixed_dims:
            inner.insert(d, Coordinate(str(index), None))
        result = _AtCoordinates(self.w, inner, self.base_masks, top=False).value(operand)
        if not in_range:
            return result
        fill = self.value(v.args[1])
        name = self.fresh()
        self.emit(f"{name} = tl.where({' & '.join(in_range)}, {result}, {fill})")
        return name

    def _reshaped_coordinates(
        self, coords: list[Coordinate], out_shape: tuple[int, ...], in_shape: tuple[int, ...]
    ) -> list[Coordinate]:
        """The operand's coordinates (one per dim of ``in_shape``) at the same row-major
        position as ``coords`` in ``out_shape`` (``ctx.read_reshaped``). The dims are cut
        into runs whose element counts agree on both sides (``[b, n, h, d] -> [b, n, h*d]``:
        b, n, then h and d against h*d), so only the dims that a run merges or splits are
        divided: each run's position is its output coordinates' row-major index, and each
        operand coordinate its quotient and remainder."""
        runs: list[tuple[list[int], list[int]]] = []
        i = k = 0
        while i < len(out_shape) or k < len(in_shape):
            outs: list[int] = []
            ins: list[int] = []
            n_out = n_in = 1
            # at least one dim a side, then the smaller count grows until the two agree;
            # trailing size-1 dims join the last run
            while True:
                if i < len(out_shape) and (not outs or n_out < n_in or (n_out == n_in and k >= len(in_shape))):
                    n_out *= out_shape[i]
                    outs.append(i)
                    i += 1
                elif k < len(in_shape) and (not ins or n_in < n_out or (n_out == n_in and i >= len(out_shape))):
                    n_in *= in_shape[k]
                    ins.append(k)
                    k += 1
                else:
                    break
            runs.append((outs, ins))
        inner: list[Coordinate] = []
        for outs, ins in runs:
            terms: list[str] = []
            axes: list[str] = []
            valid: list[str] = []
            constant, weight = 0, 1
            for j in reversed(outs):
                n = out_shape[j]
                c = coords[j] if n != 1 else Coordinate("0", None, coords[j].valid)
                valid.extend(c.valid)
                if c.axis is None:
                    constant += int(c.expr) * weight
                else:
                    axes.append(c.axis)
                    terms.append(c.expr if weight == 1 else f"{c.expr} * {weight}")
                weight *= n
            if not terms:
                position = None
            else:
                position = " + ".join(reversed(terms)) + (f" + {constant}" if constant else "")
                if " " in position:  # more than one coordinate's name as it is
                    position = self.named(position)
            # a coordinate built from several tile axes is valid where each of them is
            axis = axes[0] if axes else None
            masks = tuple(dict.fromkeys(valid + [self.base_masks[a] for a in axes[1:]]))
            below = 1
            for k in ins:
                below *= in_shape[k]
            for k in ins:
                n = in_shape[k]
                below //= n
                if n == 1:
                    inner.append(Coordinate("0", None, masks))
                elif position is None:
                    inner.append(Coordinate(str(constant // below % n), None, masks))
                else:
                    expr = position if below == 1 else f"{position} // {below}"
                    if k != ins[0]:  # the run's first dim needs no remainder: position < its count
                        expr = f"({expr}) % {n}"
                    inner.append(Coordinate(expr if expr == position else self.named(expr), axis, masks))
        return inner


def _shift_constant(at: int, n: int, mode: str) -> Optional[int]:
    """Where a read at fixed coordinate ``at`` of a dim of size ``n`` lands (``None``: outside, fill)."""
    if mode == "fill":
        return at if 0 <= at < n else None
    if mode == "wrap":
        return at % n
    if mode == "clamp":
        return min(max(at, 0), n - 1)
    return (n - 1) - abs((n - 1) - abs(at))  # reflect: at most one mirroring (ctx.read_shifted checks)


def _shift_expression(coord: str, n_out: int, n_in: int, scale: int, offset: int, mode: str) -> tuple[str, str]:
    """The operand coordinate read at output coordinate ``coord`` (in ``[0, n_out)``), and,
    in ``fill`` mode, the check (a template over its name) that it lies in ``[0, n_in)``:
    empty where it always does."""
    low, high = offset, scale * (n_out - 1) + offset
    if mode == "wrap" and low < 0:
        # Triton's % keeps the dividend's sign: shift by whole periods so it never is negative.
        offset += -(low // n_in) * n_in
        low, high = offset, scale * (n_out - 1) + offset
    expr = coord if scale == 1 else f"{coord} * {scale}"
    if offset:
        expr = f"{expr} + {offset}" if offset > 0 else f"{expr} - {-offset}"
    if mode == "wrap":
        return (f"({expr}) % {n_in}" if high >= n_in else expr), ""
    if mode == "clamp":
        if low < 0:
            expr = f"tl.maximum({expr}, 0)"
        if high > n_in - 1:
            expr = f"tl.minimum({expr}, {n_in - 1})"
        return expr, ""
    if mode == "reflect":
        if low < 0:
            expr = f"tl.abs({expr})"
        if high > n_in - 1:
            expr = f"{n_in - 1} - tl.abs({n_in - 1} - ({expr}))"
        return expr, ""
    checks = (["({0} >= 0)"] if low < 0 else []) + ([f"({{0}} < {n_in})"] if high > n_in - 1 else [])
    return expr, " & ".join(checks)


def _emit_coordinates(
    w: "_Writer", dims: list[int], index: str, prefix: str, axis: str, coords: list[Coordinate]
) -> None:
    """One coordinate per dim of ``dims`` (outer to inner) from the linear ``index``, into ``coords``."""
    sizes = [w.program.domain[d] for d in dims]
    for i, d in enumerate(dims):
        divisor = math.prod(sizes[i + 1 :])
        expr = index if divisor == 1 else f"({index} // {sized(divisor)})"
        if i > 0:
            expr = f"({expr} % {sized(sizes[i])})"
        name = f"{prefix}{d}"
        w.emit(f"{name} = {expr}")
        coords[d] = Coordinate(name, axis)


def _store_offset(coords: list[Coordinate], strides: tuple[int, ...]) -> Optional[str]:
    terms = [c.expr if st == 1 else f"{c.expr} * {sized(st)}" for c, st in zip(coords, strides) if st and c.expr != "0"]
    return " + ".join(terms) or None


def write_kernel(
    program: GroupProgram, layout: str, strategy: str, helpers: Optional[dict[str, str]] = None
) -> KernelSource:
    """Write the Triton source for ``program`` in ``layout`` (``flat`` or ``rows``)."""
    if layout not in ("flat", "rows"):
        raise ValueError(f"unknown layout {layout!r}")
    if layout == "flat" and program.reduced_dims:
        raise ValueError("the flat layout cannot reduce; use rows")
    shifted = any(v.op == "shifted" for v in collect_values(program.output_values).values())
    if program.cross_reduces and shifted:
        raise GroupRefused("cross_sum_shifted", "sums over the rows beside shifted reads are not written")
    w = _Writer(program, layout)
    tensors = program.inputs + program.outputs
    max_extent = max(
        [math.prod(program.domain)]
        + [sum((s - 1) * abs(st) for s, st in zip(program.domain, t.domain_stride)) + 1 for t in tensors]
        + [sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride)) + 1 for t in tensors]
    )
    wide = max_extent > INT32_LIMIT
    pid = "tl.program_id(0).to(tl.int64)" if wide else "tl.program_id(0)"
    outer_dims = [d for d in range(len(program.domain)) if d not in program.reduced_dims]
    n_outer = program.outer_numel
    constexprs: dict[str, int] = {}

    coords = [Coordinate("0", None) for _ in program.domain]
    if shifted and layout == "flat":
        # Shifted reads move coordinates dim by dim: every dim keeps its own coordinate
        # (no merging), and each load is written where a value needs it.
        w.emit(f"offs = {pid} * BLOCK + tl.arange(0, BLOCK)")
        w.emit(f"mask = offs < {sized(n_outer)}")
        walked = memory_order([d for d in outer_dims if program.domain[d] != 1], program)
        _emit_coordinates(w, walked, "offs", "i", "flat", coords)
        top = _AtCoordinates(w, coords, {"flat": "mask"}, top=True)
        results = [top.value(v) for v in program.output_values]
        for k, (t, res) in enumerate(zip(program.outputs, results)):
            store = res if t.dtype == torch.bool else stored(res, t.dtype, TL_DTYPES[t.dtype])
            at = _store_offset(coords, t.domain_stride) or "offs * 0"
            w.emit(f"tl.store(out{k} + {at}, tl.broadcast_to({store}, (BLOCK,)), mask=mask)")
    elif layout == "flat":
        w.emit(f"offs = {pid} * BLOCK + tl.arange(0, BLOCK)")
        w.emit(f"mask = offs < {sized(n_outer)}")
        offsets = w.axis_offsets(memory_order(outer_dims, program), "offs", "i", tensors)
        for k, (t, off) in enumerate(zip(program.inputs, offsets)):
            if not t.read:
                continue
            name = f"in{k}"
            cast = "" if t.dtype == torch.bool else ".to(tl.float32)"
            if off is None:
                w.emit(f"x{k} = tl.load({name}){cast}")
            else:
                w.emit(f"x{k} = tl.load({name} + {off}, mask=mask, other=0){cast}")
            w.loads[k] = f"x{k}"
        out_offsets = offsets[len(program.inputs) :]
        results = [w.value(v) for v in program.output_values]
        for k, (t, off, res) in enumerate(zip(program.outputs, out_offsets, results)):
            store = res if t.dtype == torch.bool else stored(res, t.dtype, TL_DTYPES[t.dtype])
            w.emit(f"tl.store(out{k} + {off or 'offs * 0'}, tl.broadcast_to({store}, (BLOCK,)), mask=mask)")
    else:
        n_cols = program.reduced_numel
        block_r = next_power_of_2(n_cols)
        constexprs["BLOCK_R"] = block_r
        w.emit(f"rows = ({pid} * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]")
        w.emit("cols = tl.arange(0, BLOCK_R)[None, :]")
        w.emit(f"row_mask = rows < {sized(n_outer)}")
        w.emit(f"col_mask = cols < {sized(n_cols)}")
        w.emit("mask = row_mask & col_mask")
        if shifted:
            _emit_coordinates(w, [d for d in outer_dims if program.domain[d] != 1], "rows", "r", "row", coords)
            _emit_coordinates(w, list(program.reduced_dims), "cols", "c", "col", coords)
            top = _AtCoordinates(w, coords, {"row": "row_mask", "col": "col_mask"}, top=True)
            results = [top.value(v) for v in program.output_values]
            for k, (t, res) in enumerate(zip(program.outputs, results)):
                store = res if t.dtype == torch.bool else stored(res, t.dtype, TL_DTYPES[t.dtype])
                if all(t.domain_stride[d] == 0 for d in program.reduced_dims):
                    tile, mask = "(BLOCK_M, 1)", "row_mask"
                else:
                    tile, mask = "(BLOCK_M, BLOCK_R)", "mask"
                at = _store_offset(coords, t.domain_stride) or (
                    "rows * 0" if mask == "row_mask" else "rows * 0 + cols * 0"
                )
                w.emit(f"tl.store(out{k} + {at}, tl.broadcast_to({store}, {tile}), mask={mask})")
        else:
            row_offs = w.axis_offsets(outer_dims, "rows", "r", tensors)
            col_offs = w.axis_offsets(list(program.reduced_dims), "cols", "c", tensors)
            for k, t in enumerate(program.inputs):
                if not t.read:
                    continue
                cast = "" if t.dtype == torch.bool else ".to(tl.float32)"
                ro, co = row_offs[k], col_offs[k]
                if ro is None and co is None:
                    w.emit(f"x{k} = tl.load(in{k}){cast}")
                else:
                    off = " + ".join(x for x in (ro, co) if x)
                    m = "mask" if ro and co else ("row_mask" if ro else "col_mask")
                    w.emit(f"x{k} = tl.load(in{k} + {off}, mask={m}, other=0){cast}")
                w.loads[k] = f"x{k}"
            # a cross sum's partial rows are stored unrounded: the launcher's sum rounds once
            results = [w.value(cross_sum_of(program, k) or v) for k, v in enumerate(program.output_values)]
            base = len(program.inputs)
            for k, (t, res) in enumerate(zip(program.outputs, results)):
                ro, co = row_offs[base + k], col_offs[base + k]
                store = res if t.dtype == torch.bool else stored(res, t.dtype, TL_DTYPES[t.dtype])
                reduced_output = all(t.domain_stride[d] == 0 for d in program.reduced_dims)
                if cross_sum_of(program, k) is not None:
                    # one fp32 row per program, columns in the order of the output's elements
                    w.emit(
                        f"tl.store(out{k} + {pid} * {sized(n_cols)} + cols, "
                        f"tl.broadcast_to({res}, (1, BLOCK_R)), mask=col_mask)"
                    )
                elif reduced_output:
                    tile = f"tl.broadcast_to({store}, (BLOCK_M, 1))"
                    w.emit(f"tl.store(out{k} + {ro or 'rows * 0'}, {tile}, mask=row_mask)")
                else:
                    off = " + ".join(x for x in (ro, co) if x) or "rows * 0 + cols * 0"
                    w.emit(f"tl.store(out{k} + {off}, tl.broadcast_to({store}, (BLOCK_M, BLOCK_R)), mask=mask)")
    return _finish(program, w, layout, strategy, helpers, constexprs, n_outer)


def _finish(
    program: GroupProgram,
    w: _Writer,
    layout: str,
    strategy: str,
    helpers: Optional[dict[str, str]],
    constexprs: dict[str, int],
    n_outer: int,
) -> KernelSource:
    """``w``'s body as a named kernel module with its launch grid."""
    block = "BLOCK" if layout == "flat" else "BLOCK_M"

    def grid(config, n=n_outer):
        return (triton_cdiv(n, config[block]),)

    params = [f"in{k}" for k in range(len(program.inputs))] + [f"out{k}" for k in range(len(program.outputs))]
    params += size_parameters()  # run-time sizes of dynamic dims (none where the kernel is specialised)
    blocks = ["BLOCK: tl.constexpr"] if layout == "flat" else ["BLOCK_M: tl.constexpr", "BLOCK_R: tl.constexpr"]
    header = strategy_header(program, layout, strategy)
    body = "\n".join(w.lines)
    helper_text = used_helpers(helpers, body)
    source_for_hash = f"{helper_text}\n{', '.join(params + blocks)}\n{body}"
    digest = hashlib.sha256(source_for_hash.encode()).hexdigest()[:10]
    stem = "_".join(dict.fromkeys(op_stem(op) for op in program.op_names))[:48].strip("_")
    name = f"af_{layout}_{stem}_{digest}"
    source = (
        f"{header}\nimport triton\nimport triton.language as tl\n\n\n"
        + (helper_text + "\n\n\n" if helper_text else "")
        + f"@triton.jit\ndef {name}({', '.join(params + blocks)}):\n{body}\n"
    )
    partial = tuple(k for k in range(len(program.outputs)) if cross_sum_of(program, k) is not None)
    return KernelSource(
        name=name, source=source, layout=layout, grid=grid, constexprs=constexprs, partial_outputs=partial
    )


def op_stem(op_name: str) -> str:
    """The part of an op's name that goes into a kernel's name (``torch.nn.functional.gelu`` -> ``gelu``)."""
    return "".join(c if c.isalnum() else "_" for c in op_name.rsplit(".", 1)[-1])


def strategy_header(program: GroupProgram, layout: str, strategy: str) -> str:
    """``kernel_header`` titled with the strategy and layout, detailing the domain."""
    return kernel_header(
        program,
        f"{strategy} strategy, {layout} layout",
        [f"domain {list(program.domain)}, reduced dims {list(program.reduced_dims)}"],
    )


def kernel_header(program: GroupProgram, title: str, details: list[str]) -> str:
    """The comment block that opens a kernel module: the fx nodes it replaces (with
    shapes and dtypes), ``details`` (one comment line each), and every argument.
    Strategies that write their own modules use it too; the tuning key ignores it."""
    lines = [f"# Generated by AutoFuser ({title}). Replaces these fx nodes:"]
    for node, op in zip(program.nodes, program.op_names):
        meta = node.meta.get("tensor_meta")
        shape = list(meta.shape) if meta is not None else "?"
        dtype = str(meta.dtype).removeprefix("torch.") if meta is not None else "?"
        lines.append(f"#   {node.name:<24} {op:<28} {shape} {dtype}")
    lines += [f"# {line}" for line in details]
    lines.append(
        "# inputs:  "
        + ", ".join(
            f"in{k}={t.name}{list(t.shape)}" + ("" if t.read else " (not read)") for k, t in enumerate(program.inputs)
        )
    )
    lines.append("# outputs: " + ", ".join(f"out{k}={t.name}{list(t.shape)}" for k, t in enumerate(program.outputs)))
    return "\n".join(lines)


def triton_cdiv(a: int, b: int) -> int:
    """``a / b`` rounded up, for host code: plain integers, where newer Triton's
    ``triton.cdiv`` is a constexpr function, several times slower to call from Python."""
    return (a + b - 1) // b


def cdiv_text(a: str, b: str) -> str:
    """The text of ``a / b`` rounded up, for host code a generated launcher runs on every
    call (``triton_cdiv``'s arithmetic, written out)."""
    return f"(({a}) + ({b}) - 1) // ({b})"
