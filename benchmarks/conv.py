"""Convolutional blocks at the sizes of the zoo's U-Net and FNO on the airfoil grid.

On B x C x 221 x 51 (B = 20, the zoo's batch), in one run on one GPU:

- conv 3x3 + batch norm (eval) + GELU, C -> C for C = 32, 64, 128 (U-Net's
  levels), and with stride 2: AutoFuser's implicit GEMM with the epilogue, or,
  where that lost to cuDNN at compile time, cuDNN plus a fused BN + GELU kernel
  (the ``kept`` column says which);
- conv 1x1 + bias + residual + GELU over a channels-last view (an FNO layer's
  1x1 path), C = 32, 64;
- bilinear upsampling from 110 x 25 + cat with the skip (U-Net's decoder step);
- instance norm + GELU;

each in fp32 (cuDNN's default TF32 for convolutions on every side) and in bf16
under ``torch.autocast``; under eager, ``torch.compile`` in each mode of
``--compile-modes`` (default: the default mode and reduce-overhead, timed as
its CUDA-graph replays) and AutoFuser. Every output is checked against eager before it is timed; the floor is the bytes
the block must move at the measured copy bandwidth.

    python benchmarks/conv.py --out bench-results/
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _compile_modes import add_compile_modes_argument, compile_key, compile_keys_in  # noqa: E402
from matmul import _flat, _line, _ms, column_title, measure, run_header  # noqa: E402  (shared timing, checks and table row)

BATCH, H, W = 20, 221, 51


def _trained(norm):
    with torch.no_grad():
        norm.running_mean.normal_(0, 0.1)
        norm.running_var.uniform_(0.5, 2.0)
    return norm


class ConvBnGelu(nn.Module):
    def __init__(self, c, stride=1):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, stride=stride, padding=1, bias=False)
        self.norm = _trained(nn.BatchNorm2d(c))

    def forward(self, x):
        return F.gelu(self.norm(self.conv(x)))


class PointwiseConvResidual(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 1)

    def forward(self, x_last, spectral):
        return F.gelu(spectral + self.conv(x_last.permute(0, 3, 1, 2)))


class UpsampleCat(nn.Module):
    def forward(self, low, skip):
        return torch.cat((skip, F.interpolate(low, size=skip.shape[-2:], mode="bilinear")), dim=1)


class InstanceNormGelu(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm = nn.InstanceNorm2d(c, affine=True)

    def forward(self, x):
        return F.gelu(self.norm(x))


def _cases(device):
    """(name, width, model, inputs, bytes moved at fp32)."""

    def rand(*shape):
        return torch.randn(*shape, device=device)

    for c in (32, 64, 128):
        x = rand(BATCH, c, H, W)
        yield "conv3x3+BN+GELU", c, ConvBnGelu(c), (x,), 2 * x.numel() * 4
    x = rand(BATCH, 64, H, W)
    yield "conv3x3 stride 2+BN+GELU", 64, ConvBnGelu(64, stride=2), (x,), x.numel() * 4 * 5 // 4
    for c in (32, 64):
        x, spectral = rand(BATCH, H, W, c), rand(BATCH, c, H, W)
        yield "conv1x1+residual+GELU", c, PointwiseConvResidual(c), (x, spectral), 3 * x.numel() * 4
    low, skip = rand(BATCH, 64, 110, 25), rand(BATCH, 32, H, W)
    yield "upsample+cat", 96, UpsampleCat(), (low, skip), (low.numel() + skip.numel() + BATCH * 96 * H * W) * 4
    x = rand(BATCH, 64, H, W)
    yield "instance norm+GELU", 64, InstanceNormGelu(64), (x,), 2 * x.numel() * 4


@contextlib.contextmanager
def precision(mode):
    if mode == "bf16":
        with torch.autocast("cuda", dtype=torch.bfloat16):
            yield
    else:
        yield


def _bandwidth(device):
    x = torch.randn(2**28, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / (_ms(lambda: y.copy_(x)) * 1e-3)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--modes", default="fp32,bf16")
    parser.add_argument("--tune-budget", type=float, default=8.0, help="AutoFuser tuning seconds per group")
    add_compile_modes_argument(parser)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("conv.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bandwidth = _bandwidth(device)
    systems = ["eager", *(compile_key(mode) for mode in args.compile_modes), "autofuser"]
    rows = []
    for case, width, model, inputs, fp32_bytes in _cases(device):
        torch.manual_seed(0)
        model = model.to(device).eval()
        for mode in args.modes.split(","):
            moved = fp32_bytes // (2 if mode == "bf16" else 1)
            row = {"case": case, "width": width, "mode": mode, "floor_ms": 1e3 * moved / bandwidth}
            with precision(mode), torch.no_grad():
                expected = _flat(model(*inputs))
                for system in systems:
                    row[system] = measure(system, model, inputs, expected, args.tune_budget)
                    if system == "autofuser" and "groups" in row[system]:
                        row["kept"] = ", ".join(g["strategy"] for g in row[system]["groups"] if g["fused"]) or "eager"
            rows.append(row)
            print(f"{_line(row, systems)} kept: {row.get('kept', '-')}", file=sys.stderr, flush=True)
            (out / "conv.partial.json").write_text(json.dumps(rows, indent=1))
    result = {
        **run_header(bandwidth),
        "shape": [BATCH, "C", H, W],
        "cases": rows,
    }
    (out / "conv.json").write_text(json.dumps(result, indent=1))
    header = (
        f"B x C x {H} x {W}, B = {BATCH}; {result['gpu']}, {result['date']}, torch {result['torch']}, "
        f"Triton {result['triton']}; copy {bandwidth / 1e9:.0f} GB/s. Time in ms (speedup over eager); "
        "'kept': AutoFuser's fused groups."
    )
    table = "\n".join([header, "", *rows_table(rows)])
    (out / "conv.md").write_text(table + "\n")
    print(table)
    return 0


def rows_table(rows) -> list[str]:
    """The markdown table of ``rows`` (as ``conv.json`` holds them): a column per system the rows have."""
    systems = ["eager", *compile_keys_in(rows), "autofuser"]
    return [
        "| case | C | precision | floor | " + " | ".join(column_title(s) for s in systems) + " | kept |",
        "|---|---|---|---|" + "---|" * (len(systems) + 1),
        *(f"{_line(row, systems)} {row.get('kept', '-')} |" for row in rows),
    ]


if __name__ == "__main__":
    raise SystemExit(main())
