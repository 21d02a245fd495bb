"""GPU check: conv.group_norm's fp16 conformance sample 1 (one group over 3x4x9x5, the
first reference form), fused and eager, each against float64 on the same fp16 inputs.
Which of the two is farther from the exact result where they differ?

    python3 benchmarks/probes/check_group_norm.py"""
import torch
import torch.nn.functional as F

import autofuser


class Norm(torch.nn.Module):
    def forward(self, x, w, b):
        return F.group_norm(x, 1, w, b, eps=1e-3)


spec = autofuser.load_plugins().registry.lowerings["conv.group_norm"]
torch.manual_seed(1001)  # the conformance test's seed for sample 1
sample = spec.samples(torch.float16)[1]
x, w, b = (a.cuda() for a in sample.args)
model = Norm().eval()
with torch.no_grad():
    eager = model(x, w, b).float()
    fused = autofuser.fuse(model, progress=False)
    got = fused(x, w, b).float()
    exact = F.group_norm(x.double(), 1, w.double(), b.double(), eps=1e-3)
print("fused groups:", [(g.strategy, g.fused) for g in fused.report().groups])
for name, out in (("eager", eager), ("fused", got)):
    err = (out.double() - exact).abs()
    print(f"{name}: max |err| {err.max().item():.3g}, mean {err.mean().item():.3g}")
differ = (eager != got).nonzero()
print(f"{len(differ)} of {got.numel()} elements differ between eager and fused")
for index in differ[:8].tolist():
    i = tuple(index)
    print(i, f"exact {exact[i].item():.6f} eager {eager[i].item():.6f} fused {got[i].item():.6f}")
