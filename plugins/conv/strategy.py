"""The ``upsample_fused`` strategy: an upsampling, the concatenations and
pointwise ops after it, as one flat kernel that reads the low-resolution input
directly - the upsampled tensor never reaches memory.

A group starts at an upsampling node (``F.interpolate``, ``nn.Upsample``, a
``ConvTranspose`` with stride == kernel) and
follows its single consumer while that is a ``cat`` (whose other inputs are
read from memory, or are upsamplings too) or a pointwise op (any lowering of
kind ``pointwise``: activations, a residual add, batch norm in eval mode).
Only the last node's result leaves the group.

The kernel walks the output's elements in ``BLOCK``-sized flat blocks; each
element's coordinates are derived once, and every value is computed at the
coordinates where the output needs it: a ``cat`` selects its inputs by the
coordinate along its dim (each input's loads masked to its own range), an
upsampling maps its spatial coordinates to source indices (and linear weights)
with ATen's formulas (``resampling.py``). Results round to each node's eager
dtype, as everywhere.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from autofuser import GroupProgram, GroupRefused, KernelSource, KernelTensor, StrategySpec, Value, program_from_nodes
from autofuser.kernel import (
    TL_DTYPES,
    AttrRef,
    ValueEmitter,
    attr_tensor,
    collect_values,
    needs_int64,
    read_view,
    rounded,
    stored,
    tensor_meta,
    triton_cdiv,
    used_helpers,
)

from .resampling import Resample, TransposedConv, parse_upsampling

RESAMPLE_OPS = ("conv.interpolate", "conv.upsample_module", "conv.conv_transpose", "conv.conv_transpose_module")
CAT_OPS = ("conv.cat",)
#: (BLOCK, num_warps) pairs tuned for an upsampling kernel, of the twelve of 256-2048 x
#: 2/4/8 warps tuned before: the pairs that won in the zoo's LSM on an H200 ((1024, 2)
#: most often, then (512, 2) and (1024, 4)), the U-Net's picks (512 and 1024 with 8
#: warps), and (2048, 4) for larger outputs. Each pair tuned is a Triton compile.
CONFIGS = ((512, 2), (1024, 2), (1024, 4), (2048, 4), (512, 8), (1024, 8))
ROUNDED = (torch.float16, torch.bfloat16)


@dataclass
class ResampleProgram(GroupProgram):
    """A composed upsampling group: each member's part, for the kernel writer."""

    resamples: dict = field(default_factory=dict)  # node -> Resample
    cats: dict = field(default_factory=dict)  # node -> (dim, [input nodes])
    pointwise: dict = field(default_factory=dict)  # node -> lowered Value
    slot: dict = field(default_factory=dict)  # fx node or AttrRef -> input index


def follow_chain(view, start: torch.fx.Node, cats: bool = True) -> list[torch.fx.Node]:
    """``start`` and the cats (with ``cats``) and pointwise ops that follow it, one
    consumer after another, each the single user of the one before."""
    group = [start]
    current = start
    while len(current.users) == 1:
        user = next(iter(current.users))
        spec = view.lowering_of.get(user)
        if spec is None:
            break
        if spec.name in CAT_OPS and cats:
            siblings = [n for n in user.all_input_nodes if n is not current and n not in group]
            extra = [
                n
                for n in siblings
                if n in view.lowering_of and view.lowering_of[n].name in RESAMPLE_OPS and len(n.users) == 1
            ]
            group.extend(extra)
        elif (
            spec.kind != "pointwise"
            or any(v.op in ("reduce", "dot", "extern", "shifted") for v in _values(view.lowered[user]))
            or (tensor_meta(user).shape != tensor_meta(start).shape and not cats)
        ):
            break
        group.append(user)
        current = user
    return group


def _values(root: Value) -> list[Value]:
    return list(collect_values([root]).values())


def propose(view):
    return [
        follow_chain(view, node)
        for node in view.nodes
        if node in view.lowering_of and view.lowering_of[node].name in RESAMPLE_OPS
    ]


def compose_members(view, nodes, program: GroupProgram, fields: dict) -> None:
    """Fill ``fields`` (``resamples``, ``cats``, ``pointwise``) from ``nodes`` and add the
    parameters the pointwise members read to ``program.inputs``; nodes already in
    ``fields`` are skipped."""
    members = set(program.nodes)
    known = {t.source for t in program.inputs}
    for node in nodes:
        if any(node in part for part in fields.values()):
            continue
        name = view.lowering_of[node].name
        if name in RESAMPLE_OPS:
            resample = parse_upsampling(node, view.gm)
            if isinstance(resample, str):
                raise GroupRefused("unsupported_argument", resample)
            if resample.source in members:
                raise GroupRefused("computed_source", "an upsampling reads its input from memory, not from the group")
            if isinstance(resample, TransposedConv):
                for ref in (resample.weight, resample.bias):
                    if isinstance(ref, AttrRef) and ref not in known:
                        tensor = attr_tensor(view.gm, ref.path)
                        program.inputs.append(
                            KernelTensor(ref, tuple(tensor.shape), tensor.dtype, tuple(tensor.stride()))
                        )
                        known.add(ref)
            fields["resamples"][node] = resample
        elif name in CAT_OPS:
            fields["cats"][node] = _cat_parts(node)
        else:
            value = view.lowered[node]
            for v in _values(value):
                if v.op == "load" and isinstance(v.source, AttrRef) and v.source not in known:
                    tensor = attr_tensor(view.gm, v.source.path)
                    program.inputs.append(
                        KernelTensor(v.source, tuple(tensor.shape), tensor.dtype, tuple(tensor.stride()))
                    )
                    known.add(v.source)
                if v.op == "load" and v.source in members and tuple(v.shape) != tuple(tensor_meta(v.source).shape):
                    raise GroupRefused("viewed_value", f"{node.name} reads {v.source.name} with another shape")
            fields["pointwise"][node] = value


def single_output(program: GroupProgram, nodes) -> None:
    if len(program.outputs) != 1 or program.outputs[0].source is not nodes[-1]:
        raise GroupRefused("several_outputs", "a value inside the group is also used outside it")


def compose(view, nodes):
    program = program_from_nodes(nodes, {n: view.lowering_of[n].name for n in nodes})
    single_output(program, nodes)
    fields = dict(resamples={}, cats={}, pointwise={})
    compose_members(view, nodes, program, fields)
    slot = {t.source: k for k, t in enumerate(program.inputs)}
    ops = ", ".join(dict.fromkeys(getattr(r, "mode", "transposed-convolution") for r in fields["resamples"].values()))
    summary = (
        f"{ops} upsampling"
        + (" + cat" if fields["cats"] else "")
        + (" + pointwise" if fields["pointwise"] else "")
        + ", the upsampled tensor never written"
    )
    return ResampleProgram(**{**program.__dict__, "summary": summary}, slot=slot, **fields)


def _cat_parts(node: torch.fx.Node) -> tuple[int, list[torch.fx.Node]]:
    tensors = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    rank = len(tensor_meta(node).shape)
    return dim % rank, list(tensors)


def accepts(program):
    if not isinstance(program, ResampleProgram):
        return ("not_upsampling", "the group was not composed by the upsampling strategy")
    return None


class ChainWriter:
    """Emits each member's value at the coordinates where the output needs it."""

    def __init__(self, program: ResampleProgram, known: Optional[dict] = None, indent: int = 1):
        self.program = program
        self.lines: list[str] = []
        self.count = itertools.count(1)
        self.memo: dict = {}
        self.known = dict(known or {})  # member node -> the name of its value, computed by the caller
        self.indent = indent

    def emit(self, line: str) -> None:
        self.lines.append("    " * self.indent + line)

    def fresh(self) -> str:
        return f"v{next(self.count)}"

    def load(self, source, shape, coords: tuple[str, ...], mask: str) -> str:
        """Input ``source`` read as ``shape`` at ``coords`` (right-aligned, size-1 dims broadcast)."""
        key = ("load", source, tuple(shape), coords, mask)
        if key in self.memo:
            return self.memo[key]
        index = self.program.slot[source]
        tensor = self.program.inputs[index]
        _, strides = read_view(tensor, shape)
        coords = coords[len(coords) - len(shape) :] if shape else ()
        terms = [c if st == 1 else f"{c} * {st}" for c, st, size in zip(coords, strides, shape) if size != 1 and st]
        name = f"x{index}_{self.fresh()}"
        cast = "" if tensor.dtype == torch.bool else ".to(tl.float32)"
        if terms:
            self.emit(f"{name} = tl.load(in{index} + {' + '.join(terms)}, mask={mask}, other=0){cast}")
        else:
            self.emit(f"{name} = tl.load(in{index}){cast}")
        self.memo[key] = name
        return name

    def node(self, node: torch.fx.Node, coords: tuple[str, ...], mask: str) -> str:
        """``node``'s value (a member, or an input read from memory) at ``coords``."""
        if node in self.known:
            return self.known[node]
        if node not in self.program.nodes:
            return self.load(node, tuple(tensor_meta(node).shape), coords, mask)
        key = ("node", node, coords, mask)
        if key in self.memo:
            return self.memo[key]
        p = self.program
        if node in p.resamples and isinstance(p.resamples[node], TransposedConv):
            value = self.transposed_conv(p.resamples[node], tensor_meta(node).dtype, coords, mask)
        elif node in p.resamples:
            value = self.resample(p.resamples[node], coords, mask)
        elif node in p.cats:
            value = self.cat(*p.cats[node], coords, mask)
        else:
            value = self.value(p.pointwise[node], coords, mask)
        dtype = tensor_meta(node).dtype
        if dtype in ROUNDED:
            rounded_name = self.fresh()
            self.emit(f"{rounded_name} = {rounded(value, dtype)}")
            value = rounded_name
        self.memo[key] = value
        return value

    def value(self, v: Value, coords: tuple[str, ...], mask: str) -> str:
        """The pointwise DAG ``v`` at ``coords``, written afresh (its loads are memoised)."""
        return _ValuesAt(self, coords, mask).value(v)

    def cat(self, dim: int, parts: list[torch.fx.Node], coords: tuple[str, ...], mask: str) -> str:
        offset, values, bounds = 0, [], []
        for part in parts:
            size = tensor_meta(part).shape[dim]
            shifted = coords[:dim] + (f"({coords[dim]} - {offset})" if offset else coords[dim],) + coords[dim + 1 :]
            inside = [
                f"({coords[dim]} >= {offset})" if offset else "",
                f"({coords[dim]} < {offset + size})" if part is not parts[-1] else "",
            ]
            values.append(self.node(part, shifted, " & ".join([mask] + [c for c in inside if c])))
            bounds.append(offset + size)
            offset += size
        result = values[-1]
        for value, bound in zip(reversed(values[:-1]), reversed(bounds[:-1])):
            name = self.fresh()
            self.emit(f"{name} = tl.where({coords[dim]} < {bound}, {value}, {result})")
            result = name
        return result

    def store(self, coords: tuple[str, ...], mask: str, tile: str = "") -> None:
        """Compute the group's output at ``coords`` and store it through its own strides."""
        out = self.program.outputs[0]
        result = stored(self.node(out.source, coords, mask), out.dtype, TL_DTYPES[out.dtype])
        if tile:
            result = f"tl.broadcast_to({result}, {tile})"
        offset = " + ".join(
            c if st == 1 else f"{c} * {st}" for c, st, size in zip(coords, out.stride, out.shape) if size != 1
        )
        self.emit(f"tl.store(out0 + {offset or '0'}, {result}, mask={mask})")

    def assemble(
        self, prefix: str, strategy: str, blocks: list[str], notes: list[str], helpers, grid, layout: str
    ) -> KernelSource:
        """The kernel module: a header naming the fx nodes it replaces, the helpers it
        calls, and the ``@triton.jit`` function over ``in*``, ``out0`` and ``blocks``."""
        p = self.program
        params = [f"in{k}" for k in range(len(p.inputs))] + ["out0"] + [f"{b}: tl.constexpr" for b in blocks]
        body = "\n".join(self.lines)
        helper_text = used_helpers(helpers, body)
        digest = hashlib.sha256(f"{helper_text}\n{params}\n{body}".encode()).hexdigest()[:10]
        name = f"af_{prefix}_{digest}"
        header = [f"# Generated by AutoFuser ({strategy} strategy): {p.summary}. Replaces these fx nodes:"]
        for node, op in zip(p.nodes, p.op_names):
            meta = tensor_meta(node)
            header.append(f"#   {node.name:<24} {op:<28} {list(meta.shape)} {str(meta.dtype).removeprefix('torch.')}")
        header += notes
        header.append("# inputs:  " + ", ".join(f"in{k}={t.name}{list(t.shape)}" for k, t in enumerate(p.inputs)))
        header.append(f"# output:  out0={p.outputs[0].name}{list(p.outputs[0].shape)}")
        source = (
            "\n".join(header)
            + "\nimport triton\nimport triton.language as tl\n\n\n"
            + (helper_text + "\n\n\n" if helper_text else "")
            + f"@triton.jit\ndef {name}({', '.join(params)}):\n{body}\n"
        )
        return KernelSource(name=name, source=source, layout=layout, grid=grid)

    def transposed_conv(self, t: TransposedConv, dtype, coords: tuple[str, ...], mask: str) -> str:
        """``bias[o] + sum_c x[b, c, y // k] * W[c, o, y % k]``: one input pixel per output pixel."""
        b, o, spatial = coords[0], coords[1], coords[2:]
        source = tuple(f"({c} // {k})" for c, k in zip(spatial, t.kernel))
        tap = tuple(f"({c} % {k})" for c, k in zip(spatial, t.kernel))
        acc = self.fresh()
        self.emit(f"{acc} = ({b} * 0 + {o} * 0 + {spatial[-1]} * 0).to(tl.float32)")
        self.emit(f"for ci in range({t.in_channels}):")
        self.indent += 1
        x = self.load(t.source, tuple(tensor_meta(t.source).shape), (b, "ci") + source, mask)
        w = self.load(t.weight, (t.in_channels, t.out_channels) + t.kernel, ("ci", o) + tap, mask)
        if dtype in ROUNDED:  # autocast: the weight rounds to the product's dtype as in eager
            w = rounded(w, dtype)
        self.emit(f"{acc} += {x} * {w}")
        self.indent -= 1
        # The loop's loads (at channel "ci") don't exist after it.
        self.memo = {k: v for k, v in self.memo.items() if not (k[0] == "load" and "ci" in k[3])}
        if t.bias is not None:
            bias = self.load(t.bias, (t.out_channels,) + (1,) * len(spatial), coords[1:], mask)
            self.emit(f"{acc} += {bias}")
        return acc

    def resample(self, r: Resample, coords: tuple[str, ...], mask: str) -> str:
        lead = coords[:2]
        per_dim = []  # per spatial dim: [(index expr, weight expr or None)]
        for d, c in enumerate(coords[2:]):
            if r.in_sizes[d] == r.out_sizes[d]:
                per_dim.append([(c, None)])
            elif not r.linear:
                index = self.fresh()
                self.emit(f"{index} = {r.nearest_index(d, c)}")
                per_dim.append([(index, None)])
            else:
                src, i0, i1, w1 = self.fresh(), self.fresh(), self.fresh(), self.fresh()
                self.emit(f"{src} = {r.linear_position(d, c)}")
                self.emit(f"{i0} = {src}.to(tl.int32)")
                self.emit(f"{i1} = {i0} + tl.where({i0} < {r.in_sizes[d] - 1}, 1, 0)")
                self.emit(f"{w1} = tl.minimum(tl.maximum({src} - {i0}.to(tl.float32), 0.0), 1.0)")
                per_dim.append([(i0, f"(1.0 - {w1})"), (i1, w1)])
        shape = tuple(tensor_meta(r.source).shape)
        terms = []
        for taps in itertools.product(*per_dim):
            x = self.load(r.source, shape, lead + tuple(i for i, _ in taps), mask)
            weights = [w for _, w in taps if w is not None]
            terms.append(" * ".join(weights + [x]))
        name = self.fresh()
        self.emit(f"{name} = {' + '.join(terms)}")
        return name


class _ValuesAt(ValueEmitter):
    """A member's IR values at one point of the output: ``coords`` (one name per
    output dim), right-aligned to each value's shape, size-1 dims at 0."""

    def __init__(self, writer: ChainWriter, coords: tuple[str, ...], mask: str):
        super().__init__()
        self.w, self.coords, self.mask = writer, coords, mask

    def emit(self, line: str) -> None:
        self.w.emit(line)

    def fresh(self) -> str:
        return self.w.fresh()

    def load(self, v: Value) -> str:
        shape = tuple(v.shape)
        here = self.coords[len(self.coords) - len(shape) :] if shape else ()
        here = tuple("0" if s == 1 else c for s, c in zip(shape, here))
        if isinstance(v.source, torch.fx.Node) and v.source in self.w.program.nodes:
            return self.w.node(v.source, here, self.mask)
        return self.w.load(v.source, shape, self.coords, self.mask)


def write_upsample_kernel(program: ResampleProgram, strategy: str, helpers=None) -> KernelSource:
    out = program.outputs[0]
    shape = out.shape
    numel = math.prod(shape)
    w = ChainWriter(program)
    wide = needs_int64(program)
    w.emit(f"offs = tl.program_id(0){'.to(tl.int64)' if wide else ''} * BLOCK + tl.arange(0, BLOCK)")
    w.emit(f"mask = offs < {numel}")
    coords = []
    for d, size in enumerate(shape):
        inner = math.prod(shape[d + 1 :])
        expr = "offs" if inner == 1 else f"(offs // {inner})"
        w.emit(f"c{d} = {expr} % {size}" if d > 0 else f"c{d} = {expr}")
        coords.append(f"c{d}")
    w.store(tuple(coords), "mask")

    def grid(config):
        return (triton_cdiv(numel, config["BLOCK"]),)

    return w.assemble("upsample", strategy, ["BLOCK"], [], helpers, grid, "flat")


def configs(program):
    return [{"BLOCK": b, "num_warps": warps} for b, warps in CONFIGS]


def is_valid(program, config):
    per_thread = config["BLOCK"] // (32 * config["num_warps"])
    if per_thread < 1:
        return f"BLOCK {config['BLOCK']} leaves threads idle with {config['num_warps']} warps"
    if per_thread > 16:
        return f"{per_thread} elements per thread, each with several gathers, would spill registers"
    return None


def default_config(program):
    return {"BLOCK": 1024, "num_warps": 4}


def generate(program, helpers):
    return write_upsample_kernel(program, "upsample_fused", helpers)


UPSAMPLE_STRATEGY = StrategySpec(
    name="upsample_fused",
    description="An upsampling with the cat and pointwise ops after it, reading the low-resolution input directly.",
    priority=1,
    block_params=("BLOCK",),
    propose=propose,
    compose=compose,
    accepts=accepts,
    configs=configs,
    is_valid=is_valid,
    default_config=default_config,
    generate=generate,
)
