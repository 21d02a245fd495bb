"""The ``fft.spectral_mix`` strategy and its Triton kernel writer.

One kernel computes a whole ``spectral_mix`` node (``spectral.py``): mode
truncation, the complex channel mixing of every kept mode, and the zero
padding of the rest of the output spectrum. Grid: (blocks of ``BLOCK_P``
modes of the spectrum, blocks of ``BLOCK_O`` output channels, batch
entries). One program:

1. derives each mode's coordinates in the spectrum and, per region, whether
   the mode is in it (a later region wins where two overlap, as a later slice
   assignment does);
2. for every input channel ``i``: loads the mode's real and imaginary part of
   ``x[b, i]`` (masked: modes outside every region are never read), and, per
   region, the weight ``w[i, o, mode - start]`` masked to the modes that
   region owns - so one accumulator serves every region, and where no region
   owns a mode the weights read as zero;
3. accumulates ``(xr + i xi)(wr + i wi)`` as real arithmetic in fp32:
   ``re += xr wr - xi wi``, ``im += xr wi + xi wr``;
4. stores both parts of every mode, the zero padding included.

Shapes and strides are compile-time constants, as in every AutoFuser kernel.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field

import torch

from autofuser import GroupProgram, GroupRefused, KernelSource, StrategySpec, program_from_nodes
from autofuser.kernel import INT32_LIMIT, MAX_GRID_YZ

from .spectral import Region, spectral_mix

#: fp32 accumulators (real and imaginary) per thread before registers spill.
ACC_PER_THREAD = 128

CONFIGS = [
    # (BLOCK_P, BLOCK_O, num_warps), most promising first: tuning stops at its budget
    (64, 32, 4),
    (128, 16, 4),
    (32, 32, 4),
    (64, 16, 2),
    (128, 32, 8),
    (32, 64, 4),
    (256, 16, 8),
    (64, 64, 8),
    (32, 16, 2),
    (16, 32, 2),
]


@dataclass
class SpectralProgram(GroupProgram):
    """A ``spectral_mix`` group: which input is the spectrum, which are the weights."""

    regions: tuple[Region, ...] = ()
    spectrum_input: int = 0
    weight_inputs: list[int] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)

    def bytes_after(self) -> int:
        """The kernel reads only the kept modes of the spectrum, and every weight once per batch entry."""
        spectrum = self.inputs[self.spectrum_input]
        spatial = spectrum.shape[2:-1]
        kept = _kept_modes(self.regions, spatial)
        read = spectrum.nbytes * kept // max(math.prod(spatial), 1)
        return read + sum(self.inputs[k].nbytes for k in self.weight_inputs) + self.outputs[0].nbytes


def _kept_modes(regions, spatial) -> int:
    """How many modes some region covers."""
    covered = torch.zeros(tuple(spatial), dtype=torch.bool)
    for _, ranges, _ in regions:
        covered[tuple(slice(start, stop) for start, stop in ranges)] = True
    return int(covered.sum())


def propose(view):
    return [[node] for node in view.nodes if node.op == "call_function" and node.target is spectral_mix]


def compose(view, nodes) -> SpectralProgram:
    if len(nodes) != 1 or nodes[0].target is not spectral_mix:
        raise GroupRefused("not_spectral", "the group is not one spectral_mix node")
    node = nodes[0]
    spectrum, *weights = node.args
    regions = node.kwargs["regions"]
    replaced = node.meta.get("autofuser_plugin_fft_replaced", [])
    base = program_from_nodes(nodes, op_names={node: "fft.spectral_mix"}, summary=_summary(node, regions))
    sources = [t.source for t in base.inputs]
    program = SpectralProgram(
        **{f.name: getattr(base, f.name) for f in dataclasses.fields(GroupProgram)},
        regions=regions,
        spectrum_input=sources.index(spectrum),
        weight_inputs=[sources.index(w) for w in weights],
        replaced=list(replaced),
    )
    for tensor in program.inputs + program.outputs:
        if tensor.dtype != torch.float32 or tensor.shape[-1] != 2:
            raise GroupRefused("unsupported_layout", f"{tensor.name} is not the real view of a complex64 tensor")
    return program


def _summary(node, regions) -> str:
    spectrum = node.args[0].meta["tensor_meta"]
    weight = node.args[1].meta["tensor_meta"]
    spatial = "x".join(str(s) for s in spectrum.shape[2:-1])
    kept = ", ".join("[" + ", ".join(f"{a}:{b}" for a, b in ranges) + "]" for _, ranges, _ in regions)
    return (
        f"mode truncation to {kept}, complex channel mixing {weight.shape[0]} -> {weight.shape[1]}, "
        f"zero padding to {spatial}: one kernel between the FFTs"
    )


def accepts(program):
    if not isinstance(program, SpectralProgram):
        return ("not_spectral", "the group was not composed by the spectral_mix strategy")
    if program.outputs[0].shape[0] > MAX_GRID_YZ:
        return (
            "batch_too_large",
            f"{program.outputs[0].shape[0]} batch entries exceed the grid's third axis ({MAX_GRID_YZ})",
        )
    return None


def is_valid(program, config):
    threads = 32 * config["num_warps"]
    held = 2 * config["BLOCK_P"] * config["BLOCK_O"]
    if held / threads > ACC_PER_THREAD:
        return f"{held // threads} accumulators per thread would spill registers"
    out_channels = program.outputs[0].shape[1]
    if math.ceil(out_channels / config["BLOCK_O"]) > MAX_GRID_YZ:
        return "too many channel blocks for the grid's second axis"
    return None


def configs(program):
    return [{"BLOCK_P": p, "BLOCK_O": o, "num_warps": w, "num_stages": 1} for p, o, w in CONFIGS]


def _next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def default_config(program):
    """Blocks covering the channels and up to 128 modes (few programs: the interpreter stays quick)."""
    modes = math.prod(program.outputs[0].shape[2:-1])
    block_o = min(32, max(2, _next_power_of_2(program.outputs[0].shape[1])))
    block_p = min(128, max(16, _next_power_of_2(modes)))
    for p in (block_p, 64, 32, 16):
        config = {"BLOCK_P": min(p, block_p), "BLOCK_O": block_o, "num_warps": 4, "num_stages": 1}
        if is_valid(program, config) is None:
            return config
    return {"BLOCK_P": 16, "BLOCK_O": 16, "num_warps": 4, "num_stages": 1}


def generate(program: SpectralProgram, helpers) -> KernelSource:
    return write_spectral_kernel(program)


def _term(coordinate: str, stride: int) -> str:
    return coordinate if stride == 1 else f"{coordinate} * {stride}"


def write_spectral_kernel(program: SpectralProgram) -> KernelSource:
    """The Triton source for one ``spectral_mix`` group; see the module doc."""
    x = program.inputs[program.spectrum_input]
    out = program.outputs[0]
    batch, in_channels, *spatial = x.shape[:-1]
    out_channels = out.shape[1]
    modes = math.prod(spatial)
    wide = any(
        sum((s - 1) * st for s, st in zip(t.shape, t.stride)) + 1 > INT32_LIMIT
        for t in program.inputs + program.outputs
    )
    lines: list[str] = []
    emit = lines.append

    emit(f"b = tl.program_id(2){'.to(tl.int64)' if wide else ''}  # batch entry")
    emit("p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)  # flat mode index in the spectrum")
    emit("o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)  # output channel")
    emit(f"p_ok = p < {modes}")
    emit(f"o_ok = o < {out_channels}")
    for d, size in enumerate(spatial):
        inner = math.prod(spatial[d + 1 :])
        coordinate = "p" if inner == 1 else f"(p // {inner})"
        emit(f"c{d} = {coordinate}" + (f" % {size}" if d > 0 else "") + f"  # coordinate along spatial dim {d}")
    for r, (_, ranges, _) in enumerate(program.regions):
        bounds = " & ".join(f"(c{d} >= {a}) & (c{d} < {b})" for d, (a, b) in enumerate(ranges))
        emit(f"region{r} = p_ok & {bounds}")
    # A mode belongs to the last region containing it (later assignments overwrite earlier ones).
    owners = []
    for r in range(len(program.regions)):
        later = [f"region{s}" for s in range(r + 1, len(program.regions))]
        if later:
            emit(f"own{r} = region{r} & (({' | '.join(later)}) == 0)")
        else:
            emit(f"own{r} = region{r}")
        owners.append(f"own{r}")
    emit(f"read = {' | '.join(owners)}  # modes outside every region are zero padding: never read")
    xs = x.stride
    emit("x_off = " + " + ".join([_term("b", xs[0])] + [_term(f"c{d}", xs[2 + d]) for d in range(len(spatial))]))
    weight_offsets = []
    for r, (k, ranges, weight_dims) in enumerate(program.regions):
        w = program.inputs[program.weight_inputs[k]]
        terms = [_term("o[:, None]", w.stride[1])]
        for j, d in enumerate(weight_dims):
            start = ranges[d][0]
            coordinate = f"c{d}" if start == 0 else f"(c{d} - {start})"
            terms.append(_term(f"{coordinate}[None, :]", w.stride[2 + j]))
        emit(f"w{r}_off = " + " + ".join(terms))
        emit(f"w{r}_mask = o_ok[:, None] & own{r}[None, :]")
        weight_offsets.append((f"in{program.weight_inputs[k]}", w.stride))
    emit("acc_re = tl.zeros((BLOCK_O, BLOCK_P), dtype=tl.float32)")
    emit("acc_im = tl.zeros((BLOCK_O, BLOCK_P), dtype=tl.float32)")
    emit(f"for i in range({in_channels}):  # contracted input channel")
    emit(f"    x_ptr = in{program.spectrum_input} + x_off + {_term('i', xs[1])}")
    emit("    xr = tl.load(x_ptr, mask=read, other=0.0)[None, :]")
    emit(f"    xi = tl.load(x_ptr + {xs[-1]}, mask=read, other=0.0)[None, :]")
    # Each mode takes the weight of the one region that owns it, then one complex product:
    # adding every region's (masked, zero) product would turn an infinite x into NaN.
    emit("    wr = tl.zeros((BLOCK_O, BLOCK_P), dtype=tl.float32)")
    emit("    wi = tl.zeros((BLOCK_O, BLOCK_P), dtype=tl.float32)")
    for r, (name, ws) in enumerate(weight_offsets):
        emit(f"    w_ptr = {name} + {_term('i', ws[0])} + w{r}_off")
        emit(f"    wr = tl.where(w{r}_mask, tl.load(w_ptr, mask=w{r}_mask, other=0.0), wr)")
        emit(f"    wi = tl.where(w{r}_mask, tl.load(w_ptr + {ws[-1]}, mask=w{r}_mask, other=0.0), wi)")
    emit("    acc_re += xr * wr - xi * wi")
    emit("    acc_im += xr * wi + xi * wr")
    os_ = out.stride
    emit(
        "out_off = "
        + " + ".join(
            [_term("b", os_[0]), _term("o[:, None]", os_[1])]
            + [_term(f"c{d}[None, :]", os_[2 + d]) for d in range(len(spatial))]
        )
    )
    emit("mask = o_ok[:, None] & p_ok[None, :]")
    emit("tl.store(out0 + out_off, acc_re, mask=mask)")
    emit(f"tl.store(out0 + out_off + {os_[-1]}, acc_im, mask=mask)")

    params = [f"in{k}" for k in range(len(program.inputs))] + ["out0", "BLOCK_P: tl.constexpr", "BLOCK_O: tl.constexpr"]
    body = "\n".join("    " + line for line in lines)
    digest = hashlib.sha256(f"{', '.join(params)}\n{body}".encode()).hexdigest()[:10]
    name = f"af_fft_spectral_mix_{digest}"
    header = [
        f"# Generated by autofuser-plugin-fft (fft.spectral_mix strategy). Replaces fx node "
        f"{program.nodes[0].name}, which stands for:"
    ]
    header += [f"#   {original}" for original in program.replaced] or ["#   (the spectral_mix call itself)"]
    header.append(
        f"# spectrum in{program.spectrum_input}{list(x.shape)} -> out0{list(out.shape)} (real views: "
        "last dim is real, imaginary)"
    )
    for r, (k, ranges, weight_dims) in enumerate(program.regions):
        header.append(
            f"# region {r}: modes {[f'{a}:{b}' for a, b in ranges]}, weight in{program.weight_inputs[k]} "
            f"over spatial dims {list(weight_dims)}"
        )
    source = (
        "\n".join(header) + "\nimport triton\nimport triton.language as tl\n\n\n"
        f"@triton.jit\ndef {name}({', '.join(params)}):\n{body}\n"
    )

    def grid(config):
        return (-(-modes // config["BLOCK_P"]), -(-out_channels // config["BLOCK_O"]), batch)

    return KernelSource(name=name, source=source, layout="spectral", grid=grid)


SPECTRAL_STRATEGY = StrategySpec(
    name="fft.spectral_mix",
    description="Mode truncation, complex channel mixing and zero padding between an FFT and its inverse, one kernel.",
    priority=1,
    block_params=("BLOCK_P", "BLOCK_O"),
    propose=propose,
    compose=compose,
    accepts=accepts,
    configs=configs,
    is_valid=is_valid,
    default_config=default_config,
    generate=generate,
)
