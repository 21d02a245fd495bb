import cProfile, pstats, io, time, torch
from autofuser_plugins.conv.batch_norm_train import batch_norm_act
import torch.nn as nn
dev = "cuda"
for dtype in (torch.float32,):
    x = torch.randn(20, 64, 110, 25, device=dev).to(dtype, memory_format=torch.channels_last).requires_grad_()
    g = torch.randn_like(x)
    n = nn.BatchNorm2d(64).to(dev)
    def plug():
        return batch_norm_act(x, n.weight, n.bias, n.running_mean, n.running_var, n.num_batches_tracked, n.momentum, n.eps, "gelu", 0.01)
    def eager():
        return torch.nn.functional.gelu(n(x))
    for name, fn in (("eager", eager), ("plugin", plug)):
        for _ in range(20): fn().backward(g)
        torch.cuda.synchronize()
        for what in ("fwd", "fwd+bwd"):
            t = time.perf_counter()
            for _ in range(200):
                y = fn()
                if what == "fwd+bwd": y.backward(g)
            host = (time.perf_counter() - t) / 200 * 1e6
            torch.cuda.synchronize()
            print(f"{name} {what}: {host:.1f} us host per call (200 calls)")
    pr = cProfile.Profile(); pr.enable()
    for _ in range(200): plug().backward(g)
    pr.disable(); torch.cuda.synchronize()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22); print(s.getvalue()[:6000])
