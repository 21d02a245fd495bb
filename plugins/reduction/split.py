"""The split reduction: reductions over rows too long for one program, in two kernels.

The row-reduction strategy (``strategy.py``) holds whole rows in registers and
refuses rows of more than ``MAX_TILE`` elements (``row_too_long``). Those are
typically the weight and bias gradients of a norm in a training backward: a sum
over every point of a ``[B, N, C]`` tensor down to ``[C]``. This strategy takes
such groups when every reduction in them reads only values computed before any
reduction (no reduction of a reduction's result: a layer norm over a too-long row
stays refused, ``nested_reduction``), and runs them as a chain
(``autofuser.kernel.chain_module``) of two kernels:

1. ``partials``, grid (blocks of ``BLOCK_M`` outer rows) x (``SPLITS`` splits of
   the reduced elements): each program walks its split ``BLOCK_R`` reduced
   elements at a time, computes the pointwise prologue on the fly, accumulates
   every reduction of the group in an fp32 tile (one pass over the input serves
   them all: a weight and a bias gradient together), reduces the tile once at
   the end and stores one partial per outer row into scratch ``[K, SPLITS,
   outer]``. Prologue values that are outputs (read outside the group) are
   stored as they are computed;
2. ``combine``, grid (blocks of outer rows): adds the splits' partials in a
   fixed order (sum and mean; max and min take the larger or smaller, NaN
   propagating as torch does), then computes the epilogue (a mean's division,
   casts, ops with per-row operands) and stores the outputs.

The tile is oriented by memory: where the reduced dims are the outer ones in
memory (the weight gradient: the kept channel dim is contiguous, the reduced
points are strided by it) the kept dim runs along the vector lanes (tile
``[BLOCK_R, BLOCK_M]``, reduced along axis 0), so each load is a run of
contiguous channels; otherwise (a mean over many points of each channel in a
channel-first layout) the reduced elements run along the lanes (``[BLOCK_M,
BLOCK_R]``, reduced along axis 1).

With dynamic dims (docs/dynamic.md) sizes, strides and counts are written
through ``sized``; the launcher derives each split's share of the reduced
elements (``CHUNK``) from the count at launch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from autofuser import KernelSource, StrategySpec
from autofuser.kernel import (
    INT32_LIMIT,
    POINTER_TYPES,
    TL_DTYPES,
    ValueEmitter,
    chain_digest,
    chain_module,
    chain_stages,
    collect_values,
    emit_offsets,
    kernel_header,
    next_power_of_2,
    size_parameters,
    sized,
    split_chunk,
    stored,
    used_helpers,
)

from . import strategy as row_strategy

#: Elements of a tile per live value (the accumulators, the loads, the prologue's values).
TILE_LIMIT = 8192
#: Multiprocessors of the GPU the split count is planned for (an H100 SXM has 132).
MULTIPROCESSORS = 132
#: Programs per multiprocessor the configs aim the first kernel's grid at.
PROGRAMS_PER_SM = (4, 2, 8)
#: Splits at most: the combining kernel reads ``SPLITS`` partials per output element.
MAX_SPLITS = 1024
#: Outer rows per program of the combining kernel.
COMBINE_BLOCK = 128
WARPS = (4, 8, 2)
#: What the neutral element of each reduction is in an accumulator.
NEUTRAL = {"sum": "0.0", "max": 'float("-inf")', "min": 'float("inf")'}


@dataclass(frozen=True)
class SplitPlan:
    """How a group's values fall into the two kernels."""

    reductions: tuple  # the reduce values (over the reduced dims), in order: their partials' slots
    row_outputs: tuple[int, ...]  # outputs stored by the first kernel (prologue values over whole rows)
    final_outputs: tuple[int, ...]  # outputs stored by the combining kernel
    row_inputs: frozenset[int]  # inputs that vary along the reduced dims
    lanes_on_outer: bool  # the tile's vector lanes run along the kept dims


def _varies_along(strides, program) -> bool:
    return any(strides[d] != 0 and program.domain[d] > 1 for d in program.reduced_dims)


def _operands_first(roots) -> list:
    """Every value ``roots`` depend on, each after its operands."""
    order, seen = [], set()
    stack = [(v, False) for v in reversed(roots)]
    while stack:
        v, expanded = stack.pop()
        if expanded:
            order.append(v)
        elif v.uid not in seen:  # marked when expanded: its operands are then pushed above it
            seen.add(v.uid)
            stack.append((v, True))
            stack.extend((a, False) for a in v.args)
    return order


def plan_split(program) -> tuple[Optional[SplitPlan], Optional[tuple[str, str]]]:
    """The program's ``SplitPlan``, or a refusal ``(reason_code, sentence)``."""
    values = collect_values(program.output_values)
    if any(v.op in ("shifted", "dot") for v in values.values()):
        return None, ("split_unsupported", "the group reads shifted values or multiplies matrices")
    row_inputs = frozenset(
        k for k, t in enumerate(program.inputs) if t.read and _varies_along(t.domain_stride, program)
    )
    is_reduction = {
        uid: v.op == "reduce" and uid not in program.identity_reduces and bool(program.reduced_dims)
        for uid, v in values.items()
    }
    after: dict[int, bool] = {}  # uid -> computed from a reduction's result
    along: dict[int, bool] = {}  # uid -> varies along the reduced dims (before any reduction)
    nested = rows_again = False
    for v in _operands_first(program.output_values):
        if v.op == "load":
            after[v.uid] = False
            along[v.uid] = program.input_of_load.get(v.uid) in row_inputs
        elif is_reduction[v.uid]:
            nested = nested or after[v.args[0].uid]
            after[v.uid], along[v.uid] = True, False
        else:
            after[v.uid] = any(after[a.uid] for a in v.args)
            along[v.uid] = any(along[a.uid] for a in v.args)
            rows_again = rows_again or (after[v.uid] and along[v.uid])
    if nested:
        return None, (
            "nested_reduction",
            "a reduction reads another reduction's result (a norm or softmax over rows of "
            f"{program.reduced_numel} elements): the split reduction computes each in one pass",
        )
    if rows_again:
        return None, (
            "reads_rows_again",
            "a value after a reduction varies along the reduced dims (x - x.mean() over a long row): "
            "it would need another pass over the rows",
        )
    reductions = tuple(v for v in _operands_first(program.output_values) if is_reduction[v.uid])
    row_outputs, final_outputs = [], []
    for k, (t, v) in enumerate(zip(program.outputs, program.output_values)):
        if along[v.uid]:
            row_outputs.append(k)
        elif _varies_along(t.domain_stride, program):
            return None, ("split_unsupported", f"output {t.name} repeats a reduced value along the reduced dims")
        else:
            final_outputs.append(k)
    # Orient the tile by the bytes the first kernel moves: for each tensor read or written
    # over whole rows, is its contiguous dim a kept one or a reduced one?
    votes = {True: 0, False: 0}
    for t in [program.inputs[k] for k in row_inputs] + [program.outputs[k] for k in row_outputs]:
        walked = [(abs(s), d) for d, s in enumerate(t.domain_stride) if s != 0 and program.domain[d] > 1]
        if walked:
            votes[min(walked)[1] not in program.reduced_dims] += t.nbytes
    plan = SplitPlan(
        reductions, tuple(row_outputs), tuple(final_outputs), row_inputs, lanes_on_outer=votes[True] > votes[False]
    )
    return plan, None


def propose(view):
    """The row strategy's groups whose rows are too long for it (the others would only
    crowd the report with refusals), and unions of those that read a common input (a
    weight gradient's ``(g * xhat).sum((0, 1))`` beside the bias gradient's
    ``g.sum((0, 1))``): the union reads that input once for both. Growing along
    producer-consumer edges never joins such siblings."""
    groups = row_strategy.propose(view)
    long_rows = []
    for group in groups:
        try:
            program = view.compose(group)
        except Exception:  # noqa: BLE001 - refused here, refused with its reason when the planner composes it
            continue
        if program.reduced_numel > row_strategy.MAX_TILE:
            long_rows.append(group)
    return long_rows + _join_siblings(view, long_rows)


def _outside_inputs(group) -> set:
    members = set(group)
    return {p for n in group for p in n.all_input_nodes if p not in members}


def _join_siblings(view, groups: list) -> list:
    """Unions of ``groups`` that share an input, grown greedily in graph order while the
    union composes into one domain, straddles no barrier and makes no cycle."""
    joined = []
    pending = [list(g) for g in groups]
    while pending:
        current = pending.pop(0)
        grew = False
        for other in list(pending):
            if not _outside_inputs(current) & _outside_inputs(other):
                continue
            union = sorted(current + other, key=view.order.__getitem__)
            if view.straddles_barrier(union) or view.creates_cycle(set(union)):
                continue
            try:
                view.compose(union)
            except Exception:  # noqa: BLE001 - not one domain (other reduced dims): kept apart
                continue
            current, grew = union, True
            pending.remove(other)
        if grew:
            joined.append(current)
    return joined


def accepts(program):
    # Read at call time: tests lower the row strategy's limit to send small rows here.
    if program.reduced_numel <= row_strategy.MAX_TILE:
        return (
            "row_fits",
            f"rows of {program.reduced_numel} elements fit in one program: the row_reduction strategy takes them",
        )
    if program.cross_reduces:
        return ("cross_sums", "sums over the kept rows beside the row reductions are written by the rows' kernel")
    _, refusal = plan_split(program)
    return refusal


def _lanes_on_outer(program) -> bool:
    plan, _ = plan_split(program)
    return plan is not None and plan.lanes_on_outer


def splits_for(program, config, per_sm: int) -> int:
    """Splits that give the first kernel's grid about ``per_sm`` programs per multiprocessor,
    each split at least one ``BLOCK_R`` step long."""
    blocks = math.ceil(program.outer_numel / config["BLOCK_M"])
    steps = math.ceil(program.reduced_numel / config["BLOCK_R"])
    wanted = math.ceil(per_sm * MULTIPROCESSORS / blocks)
    return max(1, min(wanted, steps, MAX_SPLITS))


def _tiles(program) -> list[tuple[int, int]]:
    """(BLOCK_M, BLOCK_R) pairs, the most promising first: the lanes' axis wide, the other
    as long as the tile allows (``TILE_LIMIT``, read at call time)."""
    outer = next_power_of_2(program.outer_numel)
    reduced = next_power_of_2(program.reduced_numel)
    tiles = [min(t, TILE_LIMIT) for t in (4096, 8192, 2048)]
    pairs = []
    if _lanes_on_outer(program):
        for m in (128, 64, 256, 32, 16):
            m = min(m, outer, TILE_LIMIT)
            pairs += [(m, max(1, min(reduced, tile // m))) for tile in tiles]
    else:
        for r in (2048, 1024, 4096, 512):
            r = min(r, reduced, TILE_LIMIT)
            pairs += [(max(1, min(outer, tile // r)), r) for tile in tiles]
    return list(dict.fromkeys(pairs))


def configs(program):
    out = []
    for per_sm in PROGRAMS_PER_SM:
        for m, r in _tiles(program):
            for w in WARPS:
                config = {"BLOCK_M": m, "BLOCK_R": r, "num_warps": w}
                config["SPLITS"] = splits_for(program, config, per_sm)
                out.append(config)
    unique = {tuple(sorted(c.items())): c for c in out}
    return list(unique.values())


def is_valid(program, config):
    refusal = row_strategy.tile_refusal(program, config["BLOCK_M"], config["BLOCK_R"], config["num_warps"], TILE_LIMIT)
    if refusal is not None:
        return refusal
    if config["BLOCK_R"] > 1 and config["BLOCK_R"] // 2 >= program.reduced_numel:
        return "a step longer than the rows"
    if not 1 <= config["SPLITS"] <= MAX_SPLITS:
        return f"splits must be between 1 and {MAX_SPLITS}"
    if (config["SPLITS"] - 1) * config["BLOCK_R"] >= program.reduced_numel:
        return "more splits than steps of BLOCK_R reduced elements"
    return None


def default_config(program):
    m, r = _tiles(program)[0]
    tile = m * r
    warps = 1 if tile <= 256 else 2 if tile <= 1024 else 4 if tile <= 4096 else 8
    config = {"BLOCK_M": m, "BLOCK_R": r, "num_warps": warps}
    config["SPLITS"] = splits_for(program, config, PROGRAMS_PER_SM[0])
    return config


# ---------------------------------------------------------------------------
# The kernels
# ---------------------------------------------------------------------------


class _Stage(ValueEmitter):
    """The values of one kernel of the chain; ``loads`` maps an input to its tile's name
    (a load is written where it is first needed, by ``load_line``)."""

    def __init__(self, program, load_line, indent: int):
        super().__init__()
        self.program = program
        self.load_line = load_line
        self.indent = indent
        self.head: list[str] = []  # before the loop over the reduced elements
        self.body: list[str] = []  # inside it (the first kernel) or after the combine (the second)
        self.count = 0
        self.loads: dict[int, str] = {}

    def emit(self, line: str) -> None:
        self.body.append("    " * self.indent + line)

    def fresh(self) -> str:
        self.count += 1
        return f"v{self.count}"

    def load(self, v) -> str:
        k = self.program.input_of_load[v.uid]
        if k not in self.loads:
            self.loads[k] = self.load_line(self, k)
        return self.loads[k]

    def reduce(self, v, arg: str) -> str:
        if v.uid in self.program.identity_reduces or not self.program.reduced_dims:
            name = self.fresh()
            self.emit(f"{name} = {arg}  # reduction over size-1 dims")
            return name
        raise ValueError("the split reduction combines its reductions itself")  # seeded in ``names``


def _store(t, res: str) -> str:
    return res if t.dtype == torch.bool else stored(res, t.dtype, TL_DTYPES[t.dtype])


def _partials_stage(program, plan: SplitPlan, wide: bool):
    """The first kernel's ``(params, blocks, lines)``."""
    outer_dims = [d for d in range(len(program.domain)) if d not in program.reduced_dims]
    reduced_dims = list(program.reduced_dims)
    tensors = program.inputs + program.outputs
    n_outer, n_red = sized(program.outer_numel), sized(program.reduced_numel)
    if plan.lanes_on_outer:
        tile, axis = "(BLOCK_R, BLOCK_M)", 0
        outer_index, red_index = "[None, :]", "[:, None]"
    else:
        tile, axis = "(BLOCK_M, BLOCK_R)", 1
        outer_index, red_index = "[:, None]", "[None, :]"
    cast64 = ".to(tl.int64)" if wide else ""

    head: list[str] = []

    def emit_head(line: str) -> None:
        head.append("    " + line)

    emit_head(f"pid_m = tl.program_id(0){cast64}")
    emit_head(f"split = tl.program_id(1){cast64}")
    outer_offs = _outer_offsets(
        program, outer_dims, tensors, emit_head, f"(pid_m * BLOCK_M + tl.arange(0, BLOCK_M)){outer_index}", n_outer
    )

    def load_line(stage: _Stage, k: int) -> str:
        t = program.inputs[k]
        cast = "" if t.dtype == torch.bool else ".to(tl.float32)"
        if k in plan.row_inputs:
            off = " + ".join(x for x in (outer_offs[k], red_offs[k]) if x)
            stage.emit(f"x{k} = tl.load(in{k} + {off}, mask=mask, other=0){cast}")
        elif outer_offs[k] is None:  # one element for every program: read once, before the loop
            emit_head(f"x{k} = tl.load(in{k}){cast}")
        else:
            emit_head(f"x{k} = tl.load(in{k} + {outer_offs[k]}, mask=outer_mask, other=0){cast}")
        return f"x{k}"

    s = _Stage(program, load_line, indent=2)
    for j, v in enumerate(plan.reductions):
        neutral = NEUTRAL[v.reduce_op]
        emit_head(f"acc{j} = tl.full({tile}, {neutral}, tl.float32)  # {v.reduce_op} over this split")
        if v.reduce_op != "sum":
            emit_head(f"nan{j} = tl.zeros({tile}, tl.int32)  # where a NaN was read (max and min drop it)")
    s.emit(f"red = split * CHUNK + r0 + tl.arange(0, BLOCK_R){red_index}  # reduced elements")
    s.emit(f"mask = outer_mask & (red < {n_red})")
    red_offs = emit_offsets(
        s.emit,
        [program.domain[d] for d in reduced_dims],
        [[t.domain_stride[d] for d in reduced_dims] for t in tensors],
        "red",
        "c",
    )
    for j, v in enumerate(plan.reductions):
        arg = s.value(v.args[0])
        if v.args[0].is_bool:
            arg = f"{arg}.to(tl.float32)"
        if v.reduce_op == "sum":
            s.emit(f"acc{j} += tl.where(mask, {arg}, 0.0)")
        else:
            pick = "maximum" if v.reduce_op == "max" else "minimum"
            s.emit(f"acc{j} = tl.{pick}(acc{j}, tl.where(mask, {arg}, {NEUTRAL[v.reduce_op]}))")
            s.emit(f"nan{j} = tl.maximum(nan{j}, tl.where(mask & ({arg} != {arg}), 1, 0))")
    base = len(program.inputs)
    for k in plan.row_outputs:
        t = program.outputs[k]
        res = s.value(program.output_values[k])
        off = " + ".join(x for x in (outer_offs[base + k], red_offs[base + k]) if x)
        s.emit(f"tl.store(out{k} + {off}, tl.broadcast_to({_store(t, res)}, {tile}), mask=mask)")
    lines = head + ["    for r0 in range(0, CHUNK, BLOCK_R):"] + s.body
    keep = "[None, :]" if plan.lanes_on_outer else "[:, None]"
    for j, v in enumerate(plan.reductions):
        total = f"tl.{v.reduce_op}(acc{j}, axis={axis}){keep}"
        if v.reduce_op != "sum":
            total = f'tl.where(tl.max(nan{j}, axis={axis}){keep} > 0, float("nan"), {total})'
        lines.append(f"    part{j} = {total}")
        lines.append(f"    tl.store(partial + ({j} * SPLITS + split) * {n_outer} + outer, part{j}, mask=outer_mask)")
    params = [f"in{k}" for k in range(len(program.inputs))] + [f"out{k}" for k in range(len(program.outputs))]
    return params + ["partial"], ["BLOCK_M", "BLOCK_R", "CHUNK", "SPLITS"], lines


def _outer_offsets(program, outer_dims, tensors, emit, index: str, n_outer: str) -> list:
    """Emit the kept rows' index ``outer`` (``index``), its mask, and each tensor's offset
    along the kept dims; return the offsets (``emit_offsets``)."""
    emit(f"outer = {index}  # kept rows")
    emit(f"outer_mask = outer < {n_outer}")
    return emit_offsets(
        emit,
        [program.domain[d] for d in outer_dims],
        [[t.domain_stride[d] for d in outer_dims] for t in tensors],
        "outer",
        "o",
    )


def _combine_stage(program, plan: SplitPlan, wide: bool):
    """The second kernel's ``(params, blocks, lines)``."""
    outer_dims = [d for d in range(len(program.domain)) if d not in program.reduced_dims]
    tensors = program.inputs + program.outputs
    n_outer = sized(program.outer_numel)
    cast64 = ".to(tl.int64)" if wide else ""
    lines: list[str] = []

    def emit_head(line: str) -> None:
        lines.append("    " + line)

    outer_offs = _outer_offsets(
        program, outer_dims, tensors, emit_head, f"tl.program_id(0){cast64} * BLOCK_F + tl.arange(0, BLOCK_F)", n_outer
    )
    for j, v in enumerate(plan.reductions):
        emit_head(f"r{j} = tl.full((BLOCK_F,), {NEUTRAL[v.reduce_op]}, tl.float32)")
    emit_head("for s in range(0, SPLITS):  # in a fixed order: the same sums on every run")
    for j, v in enumerate(plan.reductions):
        emit_head(f"    p{j} = tl.load(partial + ({j} * SPLITS + s) * {n_outer} + outer, mask=outer_mask, other=0)")
        if v.reduce_op == "sum":
            emit_head(f"    r{j} += p{j}")
        else:
            pick = "maximum" if v.reduce_op == "max" else "minimum"
            emit_head(f'    r{j} = tl.where((p{j} != p{j}) | (r{j} != r{j}), float("nan"), tl.{pick}(r{j}, p{j}))')

    def load_line(stage: _Stage, k: int) -> str:
        t = program.inputs[k]
        cast = "" if t.dtype == torch.bool else ".to(tl.float32)"
        if outer_offs[k] is None:
            stage.emit(f"x{k} = tl.load(in{k}){cast}")
        else:
            stage.emit(f"x{k} = tl.load(in{k} + {outer_offs[k]}, mask=outer_mask, other=0){cast}")
        return f"x{k}"

    s = _Stage(program, load_line, indent=1)
    s.names.update({v.uid: f"r{j}" for j, v in enumerate(plan.reductions)})
    base = len(program.inputs)
    for k in plan.final_outputs:
        t = program.outputs[k]
        res = s.value(program.output_values[k])
        off = outer_offs[base + k] or "outer * 0"
        s.emit(f"tl.store(out{k} + {off}, tl.broadcast_to({_store(t, res)}, (BLOCK_F,)), mask=outer_mask)")
    params = [f"in{k}" for k in range(len(program.inputs))] + [f"out{k}" for k in range(len(program.outputs))]
    return params + ["partial"], ["BLOCK_F", "SPLITS"], lines + s.body


def generate(program, helpers):
    plan, refusal = plan_split(program)
    if plan is None:
        raise ValueError(f"split_reduction cannot write this group: {refusal}")
    tensors = program.inputs + program.outputs
    max_extent = max(
        [math.prod(program.domain)]
        + [sum((s - 1) * abs(st) for s, st in zip(program.domain, t.domain_stride)) + 1 for t in tensors]
        + [sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride)) + 1 for t in tensors]
        + [len(plan.reductions) * MAX_SPLITS * program.outer_numel]
    )
    # A later shape of a dynamic dim's class runs this source with sizes up to its bucket,
    # twice this shape's at most: index in int64 wherever that could pass int32.
    wide = max_extent * 2 > INT32_LIMIT
    partials = _partials_stage(program, plan, wide)
    combine = _combine_stage(program, plan, wide)
    bodies = "\n".join("\n".join(lines) for _, _, lines in (partials, combine))
    helper_text = used_helpers(helpers, bodies)
    n_outer, n_red = sized(program.outer_numel), sized(program.reduced_numel)
    run_time = size_parameters()  # every size named above (docs/dynamic.md)
    inputs = [f"in{k}" for k in range(len(program.inputs))]
    outputs = [f"out{k}" for k in range(len(program.outputs))]
    # The name hashes what the launcher runs too: a process reuses a module by its name.
    launcher = f"{n_outer} {n_red} {len(plan.reductions)} {run_time}"
    name = f"af_split_reduction_{chain_digest(helper_text, bodies, repr(partials[0]), launcher)}"
    stage_names = [f"{name}_partials", f"{name}_combine"]
    types = {f"in{k}": POINTER_TYPES[t.dtype] for k, t in enumerate(program.inputs)}
    types.update({f"out{k}": POINTER_TYPES[t.dtype] for k, t in enumerate(program.outputs)})
    types["partial"] = "*fp32"
    functions, stages = chain_stages(stage_names, (partials, combine), types, run_time)
    passed = ["".join(f"{s}={s}, " for s in stage.get("sizes", ())) for stage in stages]
    tensors_args = ", ".join(inputs + outputs)
    launch = [
        f"chunk = {split_chunk(n_red, 'SPLITS', 'BLOCK_R')}  # reduced elements per split",
        f"partial = torch.empty(({len(plan.reductions)}, SPLITS, {n_outer}), dtype=torch.float32, device=out0.device)",
        f"{stage_names[0]}[(triton.cdiv({n_outer}, BLOCK_M), SPLITS)]({tensors_args}, partial, {passed[0]}"
        "BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, CHUNK=chunk, SPLITS=SPLITS, num_warps=num_warps, num_stages=num_stages)",
        f"{stage_names[1]}[(triton.cdiv({n_outer}, {COMBINE_BLOCK}),)]({tensors_args}, partial, {passed[1]}"
        f"BLOCK_F={COMBINE_BLOCK}, SPLITS=SPLITS, num_warps=num_warps)",
    ]
    signature = ", ".join(
        inputs + outputs + ["*", "BLOCK_M", "BLOCK_R", "SPLITS", "num_warps=4", "num_stages=2"] + run_time
    )
    named_red = f"config[{n_red!r}]" if n_red != str(program.reduced_numel) else program.reduced_numel
    derived = {
        "CHUNK": split_chunk(named_red, "config['SPLITS']", "config['BLOCK_R']"),
        "BLOCK_F": str(COMBINE_BLOCK),
    }
    orientation = "kept dims along the lanes" if plan.lanes_on_outer else "reduced dims along the lanes"
    header = kernel_header(
        program,
        "split_reduction strategy, a chain of two kernels",
        [
            f"domain {list(program.domain)}, reduced dims {list(program.reduced_dims)}; "
            f"{len(plan.reductions)} reduction(s) in one pass, {orientation}"
        ],
    )
    source = chain_module(
        header, helper_text, functions, name, launch, signature, stages, derived, tuple(inputs + outputs)
    )
    return KernelSource(name=name, source=source, layout="reduction_chain", grid=lambda config: (1,))


SPLIT_REDUCTION_STRATEGY = StrategySpec(
    name="split_reduction",
    description=(
        "Reductions over rows too long for one program (a norm's weight and bias gradients): "
        "splits of each row summed into partials, then combined, with the prologue and epilogue."
    ),
    block_params=("BLOCK_M", "BLOCK_R", "SPLITS"),
    propose=propose,
    accepts=accepts,
    configs=configs,
    is_valid=is_valid,
    default_config=default_config,
    generate=generate,
    max_tuned_configs=12,
    dynamic_sizes=True,  # sizes through ``sized``; the launcher derives CHUNK from the count at launch
)
