"""``benchmarks/sdpa_grad_probe.py`` on the CPU: its float64 reference is right (checked
against autograd of the written-out attention in float64), the backends the CPU has
and the attention plugin's own kernels give gradients near it in both layouts of the
output's gradient, and the backends it lacks are reported, not raised."""

from __future__ import annotations

import pytest
import torch

from _helpers import benchmark_scripts


@pytest.fixture(scope="module")
def probe():
    with benchmark_scripts("sdpa_grad_probe") as module:
        yield module


def test_the_reference_is_autograd_of_the_written_out_attention_in_float64(probe):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 37, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 3, 37, 8, dtype=torch.float64)
    expected = torch.autograd.grad(torch.softmax(q @ k.transpose(-2, -1) * 0.3, -1) @ v, (q, k, v), grad)
    for got, want in zip(probe.reference(q.float(), k.float(), v.float(), grad, 0.3), expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_each_backend_and_layout_is_a_row_near_the_reference_or_a_reason(probe, capsys):
    argv = ["--points", "41", "--heads", "2", "--width", "16", "--dtypes", "fp32,bf16", "--device", "cpu"]
    assert probe.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines[:-1] if line.strip()]
    assert len(rows) == 2 * len(probe._backends()) * 2, lines
    math_rows = [line for line in rows if line.split()[1] == "math"]
    assert len(math_rows) == 4 and all("n/a" not in line for line in math_rows), math_rows
    plugin_rows = [line for line in rows if line.split()[1] == probe.PLUGIN]
    assert len(plugin_rows) == 4 and all("n/a" not in line for line in plugin_rows), plugin_rows
    for line in math_rows + plugin_rows:
        errors = [float(word) for word in line.split()[4:10:2]]
        assert len(errors) == 3 and max(errors) < (1e-5 if line.startswith("float32") else 2e-2), line
