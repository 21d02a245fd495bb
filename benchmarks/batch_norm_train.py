"""Batch norm in training mode with its activation, forward + backward, on a GPU: eager
(cuDNN's batch norm, then the activation), the conv plugin's kernels
(``plugins/conv/batch_norm_train.py``) and ``torch.compile`` of the same module in
each mode of ``--compile-modes`` (default: the default mode and reduce-overhead).

At the zoo's convolutional sizes on the airfoil grid (batch 20; U-Net's levels
32 x 221 x 51 down to 256 x 27 x 6), channels-last (as the zoo's U-Net runs) and
row-major, fp32 and bf16, GELU and ReLU. Each system's output, x's gradient, the
weight's and bias's gradients and the running statistics are checked against eager
first (relative L2); then the median of timed steps (forward and backward of a
random upstream gradient). The floor is the bytes the kernels must move (forward
two reads and a write of x, backward two reads of x and of the output's gradient
and a write) at the measured copy bandwidth.

    python benchmarks/batch_norm_train.py [--out DIR] [--compile-modes default,reduce-overhead]
        [--layouts channels_last,contiguous] [--dtypes fp32,bf16]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import torch.nn as nn

from autofuser.cli import comma_separated
from autofuser_plugins.conv.batch_norm_train import batch_norm_act

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conv import _bandwidth  # noqa: E402  (the copy bandwidth, as the conv blocks' floors take it)

from _compile_modes import add_compile_modes_argument, compile_key, compiled  # noqa: E402
from matmul import _ms, run_header  # noqa: E402  (the suites' timer and JSON header)

BATCH = 20
#: (channels, height, width): U-Net's levels on the 221 x 51 airfoil grid.
LEVELS = [(32, 221, 51), (64, 110, 25), (128, 55, 12), (256, 27, 6)]
ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LAYOUTS = ("channels_last", "contiguous")


def _choices(allowed: tuple[str, ...], what: str):
    """An argparse type: comma-separated names, each one of ``allowed``."""
    return functools.partial(comma_separated, allowed=allowed, what=what)


class Eager(nn.Module):
    def __init__(self, channels: int, activation: str):
        super().__init__()
        self.norm = nn.BatchNorm2d(channels)
        self.act = ACTIVATIONS[activation]()

    def forward(self, x):
        return self.act(self.norm(x))


class Plugin(nn.Module):
    """The same module through ``batch_norm_act`` (what the conv plugin's pass writes)."""

    def __init__(self, eager: Eager, activation: str):
        super().__init__()
        self.norm, self.activation = eager.norm, activation

    def forward(self, x):
        n = self.norm
        return batch_norm_act(
            x, n.weight, n.bias, n.running_mean, n.running_var, n.num_batches_tracked, n.momentum, n.eps,
            self.activation, 0.01,
        )  # fmt: skip


def _step(fn, norm, x, grad):
    def run():
        x.grad = None
        for p in norm.parameters():
            p.grad = None
        fn(x).backward(grad)

    return run


def _results(fn, norm, x, grad) -> list[torch.Tensor]:
    """One step from the module's state: the output, x's, the weight's and the bias's
    gradients, and the running statistics after it (copies: a CUDA-graph replay
    overwrites its outputs)."""
    x.grad = None
    out = fn(x)
    out.backward(grad)
    results = [out, x.grad, norm.weight.grad, norm.bias.grad, norm.running_mean, norm.running_var]
    return [t.detach().clone() for t in results]


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-30))


def _build(system: str, state: dict, channels: int, activation: str, device):
    """``(fn, norm)``: what ``system`` runs, and the batch norm whose state it updates."""
    module = Eager(channels, activation).to(device)
    module.load_state_dict(state)  # every system starts from the same weights and statistics
    if system == "plugin":
        return Plugin(module, activation), module.norm
    if system.startswith("torch.compile"):
        torch._dynamo.reset()
        return compiled(module, system.partition(" ")[2] or "default"), module.norm
    if system != "eager":
        raise ValueError(f"unknown system {system!r}")
    return module, module.norm


def case(
    channels, height, width, layout, dtype, activation, systems, bandwidth, device="cuda", batch=BATCH, timed=True
) -> dict:
    """One row: each system's largest relative error against eager's results and, when
    ``timed``, its median step in ms."""
    torch.manual_seed(0)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    x = (torch.randn(batch, channels, height, width, device=device) * 2 + 1).to(dtype, memory_format=fmt)
    x.requires_grad_()
    grad = torch.randn_like(x)
    state = Eager(channels, activation).to(device).state_dict()
    with torch.no_grad():
        state["norm.weight"].normal_()
        state["norm.bias"].normal_()
    row = {"channels": channels, "size": f"{height}x{width}", "layout": layout, "dtype": str(dtype)[6:],
           "activation": activation}  # fmt: skip
    row["floor_ms"] = 7 * x.numel() * x.element_size() / bandwidth * 1e3
    expected = None
    for system in systems:
        try:
            fn, norm = _build(system, {k: v.clone() for k, v in state.items()}, channels, activation, device)
            results = _results(fn, norm, x, grad)
            expected = results if expected is None else expected  # eager's, the first system
            row[f"{system}_err"] = max(_relative(g, e) for g, e in zip(results, expected))
            if timed:
                row[f"{system}_ms"] = _ms(_step(fn, norm, x, grad))
        except Exception as err:  # one system's failure is a cell, not a crash
            row[f"{system}_error"] = f"{type(err).__name__}: {err}"[:200]
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    add_compile_modes_argument(parser)
    parser.add_argument("--layouts", default="channels_last,contiguous", type=_choices(LAYOUTS, "layout"))
    parser.add_argument("--dtypes", default="fp32,bf16", type=_choices(tuple(DTYPES), "dtype"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    systems = ["eager", "plugin"] + [compile_key(mode) for mode in args.compile_modes]
    bandwidth = _bandwidth("cuda")
    print("| level | layout | dtype | activation | floor ms | " + " | ".join(systems) + " |")
    rows = []
    for (channels, height, width), layout, dtype, activation in [
        (level, layout, dtype, activation)
        for level in LEVELS
        for layout in args.layouts
        for dtype in (DTYPES[name] for name in args.dtypes)
        for activation in (("gelu", "relu") if level == LEVELS[0] else ("gelu",))
    ]:
        row = case(channels, height, width, layout, dtype, activation, systems, bandwidth)
        rows.append(row)
        cells = " | ".join(
            f"{row[f'{s}_ms']:.3f} ({row['eager_ms'] / row[f'{s}_ms']:.2f}x, err {row[f'{s}_err']:.1e})"
            if f"{s}_ms" in row and "eager_ms" in row
            else row.get(f"{s}_error", "-")
            for s in systems
        )
        head = f"| {channels} x {row['size']} | {layout} | {row['dtype']} | {activation} | {row['floor_ms']:.3f}"
        print(f"{head} | {cells} |", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {
            **run_header(bandwidth),
            "batch": BATCH,
            "rows": rows,
        }
        (args.out / "batch_norm_train.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
