"""Backward conformance: every pointwise and row-reduction lowering, trained through.

For each lowering spec of the elementwise and reduction plugins with samples (and the
conv plugin's cat, stack and max-pool), each
float dtype and its first sample, the first reference form is wrapped in a module,
fused with gradients on, and its input gradients (the backward graph of its group,
traced by ``autofuser_core.backward`` and fused by the same plugins) compared with
eager's under the spec's tolerance, float64 as the judge where eager is the one off.
``test_backward_graphs_fuse`` requires the ops whose backward is pointwise or a row
reduction to have run that backward in kernels.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_conformance import DEVICE, FLOAT_DTYPES, PLUGINS, Wrapper, _tensor_args, build_case

import autofuser

#: The conv plugin's ops that move values (each input read from its slice, a window)
#: have the pointwise ops' backward check too.
FAMILIES = ("elementwise.", "reduction.", "conv.cat", "conv.stack", "conv.max_pool")
#: Ops whose backward graph holds pointwise ops or row sums that must run as kernels.
MUST_FUSE_BACKWARD = (
    "elementwise.gelu",
    "elementwise.silu",
    "elementwise.sigmoid",
    "elementwise.tanh",
    "elementwise.exp",
    "elementwise.sin",
    "elementwise.cos",
    "elementwise.div",
    "elementwise.softplus",
    "reduction.softmax",
    "reduction.log_softmax",
    "reduction.layer_norm",
    "reduction.rms_norm",
    "reduction.var",
)


def _specs():
    return [
        spec
        for spec in sorted(PLUGINS.registry.lowerings.values(), key=lambda s: s.name)
        if spec.samples is not None and spec.name.startswith(FAMILIES)
    ]


def _differentiable(spec, dtype, index: int) -> bool:
    """Whether the spec's first reference form's result on sample ``index`` has a gradient
    (compares give bools, a cast of a bool input has none)."""
    sample = spec.samples(dtype)[index]
    reference = spec.references[0]
    if isinstance(reference, torch.nn.Module):
        reference = copy.deepcopy(reference).to(dtype=dtype)
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in _tensor_args(sample.args, sample.kwargs)]
    out = Wrapper(reference, sample.args, sample.kwargs)(*leaves)
    return isinstance(out, torch.Tensor) and out.requires_grad


def _cases():
    """Every sample in fp32 (awkward shapes, broadcasting), the first in fp16 and bf16."""
    for spec in _specs():
        for dtype_name in spec.dtypes:
            if dtype_name not in FLOAT_DTYPES:
                continue
            dtype = FLOAT_DTYPES[dtype_name]
            count = len(spec.samples(dtype)) if dtype_name == "float32" else 1
            for s in range(count):
                if _differentiable(spec, dtype, s):
                    yield pytest.param(spec.name, dtype_name, s, id=f"{spec.name}-{dtype_name}-sample{s}")


def _gradients(module, tensors, grad_seed: int):
    """Gradients of ``module(*tensors)`` (weighted by fresh random values) with respect to
    every floating-point tensor; ``None`` where the output needs none."""
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
    out = module(*leaves)
    if not (isinstance(out, torch.Tensor) and out.requires_grad):
        return None, None
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out)
    wanted = [t for t in leaves if t.requires_grad]
    found = torch.autograd.grad(out, wanted, weights, allow_unused=True)
    return out, [torch.zeros_like(t) if g is None else g for t, g in zip(wanted, found)]


def run_case(spec_name: str, dtype_name: str, sample_index: int = 0):
    spec, dtype, model, args, kwargs = build_case(spec_name, dtype_name, sample_index, 0, seed=2000)
    model.train()
    tensors = _tensor_args(args, kwargs)
    fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
    try:
        expected_out, expected = _gradients(model, tensors, 7)
    except RuntimeError:
        # Eager's own backward refuses the sample (clamp's, for bounds broadcast against the
        # input, writes the input's gradient in place): the same op on the inputs broadcast
        # first is the reference, its gradients summed back to each input's shape.
        model = Broadcasting(model)
        expected_out, expected = _gradients(model, tensors, 7)
    assert expected is not None, f"{spec_name}: eager's output needs no gradient"
    got_out, got = _gradients(fused, tensors, 7)
    report = fused.report()
    assert got is not None and len(got) == len(expected)
    torch.testing.assert_close(got_out.detach(), expected_out.detach(), equal_nan=True, **_tol(spec, got_out))
    exact = None
    float_inputs = [x for x in tensors if x.is_floating_point()]
    for k, (ours, theirs) in enumerate(zip(got, expected)):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        tol = _tol(spec, theirs)
        if torch.allclose(ours.float(), theirs.float(), equal_nan=True, **tol):
            continue
        # Off eager: right only if eager is the one further from the float64 gradient.
        if exact is None:
            wide = [t.double() if t.is_floating_point() else t for t in tensors]
            ref64 = copy.deepcopy(spec.references[0])
            if isinstance(ref64, torch.nn.Module):
                ref64 = ref64.to(device=DEVICE, dtype=torch.float64)
            wide_args = tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
            wrapped = Wrapper(ref64, wide_args, kwargs).train()
            _, exact = _gradients(Broadcasting(wrapped) if isinstance(model, Broadcasting) else wrapped, wide, 7)
        # Where float64's gradient is NaN ours must be too, except at NaN inputs: there
        # torch's decompositions, which a backward graph is made of, and its kernels differ
        # (elu's gradient at NaN is g * 1, eager's NaN), and the forward's NaN output is
        # what reaches the loss.
        nan = torch.isnan(exact[k])
        at_nan_input = torch.isnan(float_inputs[k]) if float_inputs[k].shape == nan.shape else torch.zeros_like(nan)
        assert torch.equal((torch.isnan(ours) | at_nan_input) & nan, nan), f"gradient {k}: float64's NaN is not NaN"
        mine = (ours.double() - exact[k]).abs().masked_fill(nan, 0)
        eager = (theirs.double() - exact[k]).abs().masked_fill(nan, 0)
        assert mine.max() <= eager.max(), (
            f"gradient {k} off eager's, and no nearer float64: {mine.max():.3g} vs eager's {eager.max():.3g}\n{report}"
        )
    return report


class Broadcasting(torch.nn.Module):
    """``module`` on its tensors broadcast against each other first."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *tensors):
        return self.module(*torch.broadcast_tensors(*tensors))


def _tol(spec, tensor):
    tol = spec.tolerance(tensor.dtype)
    return dict(atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize("spec_name,dtype_name,sample_index", list(_cases()))
def test_gradients_match_eager(spec_name, dtype_name, sample_index):
    report = run_case(spec_name, dtype_name, sample_index)
    if not any(g.reason_code == "alias_output" for g in report.skipped):  # a no-op (x.float() on fp32)
        assert any(spec_name in g.ops for g in report.fused if g.phase == "forward"), str(report)


@pytest.mark.parametrize("spec_name", MUST_FUSE_BACKWARD)
def test_backward_graphs_fuse(spec_name):
    """Those ops' backward graphs run in kernels: groups of the backward phase fused."""
    report = run_case(spec_name, "float32")
    assert any(g.phase == "backward" for g in report.fused), str(report)
