"""AutoFuser demo: fuse a small transformer-style block and print the report.

With no GPU, the kernels run on the CPU under Triton's interpreter (slow, but
the same kernels a GPU would run). Run: ``python examples/demo.py``.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before kernels are built

import autofuser  # noqa: E402


class Block(torch.nn.Module):
    """Pre-norm attention-and-MLP block, the shape of most transformer PDE solvers."""

    def __init__(self, width: int = 48, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.norm2 = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 2 * width), torch.nn.GELU(), torch.nn.Linear(2 * width, width)
        )

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        scores = torch.softmax(q @ k.transpose(-2, -1) * (c // self.heads) ** -0.5, dim=-1)
        x = x + self.proj((scores @ v).transpose(1, 2).reshape(b, n, c))
        return x + self.mlp(self.norm2(x))


def main() -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = Block().to(device).eval()
    x = torch.randn(2, 37, 48, device=device)
    fused = autofuser.fuse(model)
    with torch.no_grad():
        expected = model(x)
        got = fused(x)
    print(fused.report())
    print(f"\nmax |fused - eager| = {(got - expected).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
