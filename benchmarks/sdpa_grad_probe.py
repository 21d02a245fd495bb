"""Which of torch's SDPA backends give right gradients, with which output-gradient layout,
and how fast each is beside the attention plugin's flash kernels.

A written-out softmax attention rewritten as one SDPA call made row-major (a copy)
trained with gradients 77% off eager's under bf16 autocast on an H100 (BENCHMARKS.md,
Training). The row-major copy hands the backward an output gradient in another layout
than the output's own ([B, N, heads, D] memory for the fused backends). This probe
separates the suspects: for each dtype, each backend torch has for the shape (cuDNN,
flash, memory-efficient, math) and the attention plugin's own flash kernels
(``flash_op.flash_attention``, what written-out chains become), and each layout of the
output's gradient (the output's own strides, or row-major), it computes dq, dk and dv
and their relative L2 error against a float64 reference computed head by head; on CUDA
also the forward and backward's time (median of 5). Its findings decide which call
``written_out.py`` writes:

    python benchmarks/sdpa_grad_probe.py [--points 11271] [--heads 8] [--width 16] [--dtypes bf16,fp16,fp32]

Prints one line per case (``n/a`` where the backend does not take it) and a JSON
summary. On a CPU it runs the math and flash backends at the sizes given.
"""

from __future__ import annotations

import argparse
import json
from typing import Optional

import torch
import torch.nn.functional as F

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _backends() -> dict:
    from torch.nn.attention import SDPBackend

    names = {"math": "MATH", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
    found = {name: getattr(SDPBackend, member) for name, member in names.items() if hasattr(SDPBackend, member)}
    return {**found, PLUGIN: None}


#: The row of the attention plugin's own kernels.
PLUGIN = "autofuser"


def _attention(backend, leaves, scale: float):
    if backend is None:
        from autofuser_plugins.attention.flash_op import flash_attention

        return flash_attention(*leaves, scale=scale)
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(*leaves, scale=scale)


def _step(backend, leaves, scale: float, layout: str, grad):
    out = _attention(backend, leaves, scale)
    upstream = grad.contiguous() if layout == "row-major" else torch.empty_like(out).copy_(grad)
    return out, torch.autograd.grad(out, leaves, upstream)


def _milliseconds(step, repeats: int = 5) -> float:
    """The median time of ``step()`` on the GPU, after two calls that compile and warm."""
    for _ in range(2):
        step()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def reference(q, k, v, grad, scale: float) -> list[torch.Tensor]:
    """dq, dk, dv in float64, one head at a time (a head's scores fit where all do not)."""
    out = [torch.empty(t.shape, dtype=torch.float64, device=t.device) for t in (q, k, v)]
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            leaves = [t[b, h].double().requires_grad_() for t in (q, k, v)]
            p = torch.softmax(leaves[0] @ leaves[1].T * scale, dim=-1)
            found = torch.autograd.grad(p @ leaves[2], leaves, grad[b, h].double())
            for target, value in zip(out, found):
                target[b, h] = value
    return out


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected).norm() / expected.norm().clamp_min(1e-300))


def probe(points: int, heads: int, width: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> list[dict]:
    generator = torch.Generator(device=device).manual_seed(seed)
    shape = (1, heads, points, width)
    # Made as the model makes them: [B, N, heads * D] projections viewed [B, heads, N, D].
    q, k, v = (
        torch.randn(1, points, heads * width, generator=generator, device=device)
        .view(1, points, heads, width)
        .transpose(1, 2)
        .to(dtype)
        for _ in range(3)
    )
    grad = torch.randn(shape, generator=generator, device=device).to(dtype)
    scale = width**-0.5
    expected = reference(q, k, v, grad, scale)
    rows = []
    for name, backend in _backends().items():
        for layout in ("output's", "row-major"):
            row: dict = {"dtype": str(dtype).removeprefix("torch."), "backend": name, "grad layout": layout}
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            try:
                out, found = _step(backend, leaves, scale, layout, grad)
            except (RuntimeError, ValueError) as err:
                row["error"] = str(err).splitlines()[0][:120]
                rows.append(row)
                continue
            row["output strides"] = list(out.stride())
            row.update({f"d{n}": relative(g, e) for n, g, e in zip("qkv", found, expected)})
            if device.type == "cuda":
                row["ms"] = _milliseconds(lambda: _step(backend, leaves, scale, layout, grad))
            rows.append(row)
    return rows


def _line(row: dict) -> str:
    head = f"{row['dtype']:9} {row['backend']:10} {row['grad layout']:10}"
    if "error" in row:
        return f"{head} n/a ({row['error']})"
    timed = f"  {row['ms']:.2f} ms" if "ms" in row else ""
    return head + " " + "  ".join(f"{n} {row[n]:.2e}" for n in ("dq", "dk", "dv")) + timed


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=11271)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--dtypes", default="bf16,fp16,fp32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    rows = []
    for key in args.dtypes.split(","):
        if key not in DTYPES:
            parser.error(f"--dtypes: {key!r} is none of {', '.join(DTYPES)}")
        for row in probe(args.points, args.heads, args.width, DTYPES[key], torch.device(args.device)):
            print(_line(row), flush=True)
            rows.append(row)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
