"""The reduction plugin's op lowerings, checked without the fusion pipeline.

Every reference form of every spec is traced with ``torch.fx.symbolic_trace``,
shape-propagated, and its node lowered through the registry. The returned IR
must have the node's output shape, and - evaluated here with torch standing
in for ``tl`` (see ``evaluate``) - must match eager within the spec's
tolerance for that dtype. The generic conformance test runs the same specs
through the real kernels; this file pins down the lowerings on their own,
plus the argument combinations that must be refused.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.passes.shape_prop import ShapeProp

import autofuser
from autofuser_core.ir import AttrRef, LoweringContext, LoweringRefused, Value

DTYPES = (torch.float32, torch.float16, torch.bfloat16)

EXPECTED_TARGETS = {
    "reduction.sum": {torch.sum, "sum"},
    "reduction.mean": {torch.mean, "mean"},
    "reduction.amax": {torch.amax, "amax"},
    "reduction.amin": {torch.amin, "amin"},
    "reduction.var": {torch.var, "var"},
    "reduction.std": {torch.std, "std"},
    "reduction.softmax": {
        F.softmax,
        torch.softmax,
        torch.special.softmax,
        "softmax",
        torch.nn.Softmax,
        torch.ops.aten._softmax.default,
    },
    "reduction.log_softmax": {
        F.log_softmax,
        torch.log_softmax,
        torch.special.log_softmax,
        "log_softmax",
        torch.nn.LogSoftmax,
        torch.ops.aten._log_softmax.default,
    },
    "reduction.layer_norm": {F.layer_norm, torch.layer_norm},
    "reduction.layer_norm_module": {torch.nn.LayerNorm},
    "reduction.rms_norm": {F.rms_norm, torch.rms_norm},
    "reduction.rms_norm_module": {torch.nn.RMSNorm},
}


@pytest.fixture(scope="module")
def plugin_set():
    return autofuser.load_plugins(["reduction"])


def _specs():
    return sorted(autofuser.load_plugins(["reduction"]).registry.lowerings.values(), key=lambda s: s.name)


# ---------------------------------------------------------------------------
# Tracing a reference and lowering its node
# ---------------------------------------------------------------------------


class _Wrapper(torch.nn.Module):
    """Calls ``fn`` (a callable or a module, which becomes a call_module node)
    on the first ``arity`` inputs; the unused placeholders default to None."""

    def __init__(self, fn, arity: int):
        super().__init__()
        self.fn = fn
        self.arity = arity

    def forward(self, a, b=None, c=None, d=None, e=None):
        return self.fn(*(a, b, c, d, e)[: self.arity])


def _trace(fn, *tensors):
    gm = torch.fx.symbolic_trace(_Wrapper(fn, len(tensors)))
    ShapeProp(gm).propagate(*tensors)
    return gm


def _claimed_node(plugin_set, gm):
    nodes = [n for n in gm.graph.nodes if plugin_set.registry.lowering_for(n, gm) is not None]
    assert len(nodes) == 1, f"expected one claimed node, found {nodes} in\n{gm.graph}"
    return nodes[0]


def _lower(plugin_set, fn, *tensors):
    """(spec, node, Value, graph module) for the one claimed node of ``fn``."""
    gm = _trace(fn, *tensors)
    node = _claimed_node(plugin_set, gm)
    spec = plugin_set.registry.lowering_for(node, gm)
    value = spec.lower(LoweringContext(node, gm, {}), *node.args, **node.kwargs)
    return spec, node, value, gm


class _TorchAsTl:
    """What the lowerings' templates use of ``triton.language``, in torch."""

    exp, log, sqrt, rsqrt, abs = torch.exp, torch.log, torch.sqrt, torch.rsqrt, torch.abs
    exp2, log2, floor = torch.exp2, torch.log2, torch.floor
    where, maximum, minimum = torch.where, torch.maximum, torch.minimum
    float32, float16, bfloat16 = torch.float32, torch.float16, torch.bfloat16


def evaluate(value: Value, gm: torch.fx.GraphModule, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The IR's result in fp32 torch, as a kernel computes it before the final rounding."""
    if value.op == "const":
        return torch.tensor(value.constant, dtype=torch.float32)
    if value.op == "load":
        if isinstance(value.source, AttrRef):
            tensor = operator.attrgetter(value.source.path)(gm)
        else:
            assert value.source.op == "placeholder", f"load of {value.source.format_node()}"
            tensor = inputs[value.source.name]
        return tensor.detach().float()
    args = [evaluate(a, gm, inputs) for a in value.args]
    if value.op == "pointwise":
        names = {f"v{i}": a for i, a in enumerate(args)}
        return eval(value.template.format(*names), {"tl": _TorchAsTl}, names)
    if value.op == "reduce":
        reduce = {"sum": torch.sum, "max": torch.amax, "min": torch.amin}[value.reduce_op]
        return reduce(args[0], dim=value.dims, keepdim=value.keepdim)
    raise AssertionError(f"unknown IR op {value.op}")


# ---------------------------------------------------------------------------
# Registration and spec contents
# ---------------------------------------------------------------------------


def test_every_spec_registers_with_its_targets(plugin_set):
    lowerings = plugin_set.registry.lowerings
    assert set(lowerings) == set(EXPECTED_TARGETS)
    for name, targets in EXPECTED_TARGETS.items():
        assert set(lowerings[name].targets) == targets, name
        assert lowerings[name].kind == "reduction"
        assert lowerings[name].plugin == "reduction"


def test_no_target_is_claimed_twice(plugin_set):
    seen: dict = {}
    for spec in plugin_set.registry.lowerings.values():
        for target in spec.targets:
            assert target not in seen, f"{target} claimed by {seen.get(target)} and {spec.name}"
            seen[target] = spec.name


def test_max_and_min_are_not_claimed(plugin_set):
    claimed = {t for s in plugin_set.registry.lowerings.values() for t in s.targets}
    assert not claimed & {torch.max, torch.min, "max", "min"}


@pytest.mark.parametrize("spec", _specs(), ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_samples_fit_every_reference(spec, dtype):
    samples = spec.samples(dtype)
    assert samples and spec.references
    assert {"float32", "float16", "bfloat16"} <= set(spec.tolerances)
    for sample in samples:
        for arg in sample.args:
            assert arg.dtype == dtype and arg.device.type == "cpu"
            assert bool((arg != 0).any()), "samples must not be zeros"
        for reference in spec.references:
            out = reference(*sample.args, **sample.kwargs)
            assert isinstance(out, torch.Tensor) and out.is_floating_point()


def test_samples_are_fresh(plugin_set):
    spec = plugin_set.registry.lowerings["reduction.softmax"]
    first, second = spec.samples(torch.float32)[0].args[0], spec.samples(torch.float32)[0].args[0]
    assert not torch.equal(first, second)


# ---------------------------------------------------------------------------
# Every reference form: lowered shape, and the IR's numbers against eager
# ---------------------------------------------------------------------------


def _reference_cases():
    for spec in _specs():
        for index in range(len(spec.references)):
            for dtype in DTYPES:
                yield pytest.param(spec.name, index, dtype, id=f"{spec.name}-ref{index}-{str(dtype)[6:]}")


@pytest.mark.parametrize("name, index, dtype", list(_reference_cases()))
def test_reference_lowers_to_eager_shape_and_values(plugin_set, name, index, dtype):
    spec = plugin_set.registry.lowerings[name]
    reference = spec.references[index]
    tolerance = spec.tolerance(dtype)
    for sample in spec.samples(dtype):
        tensors = sample.args
        claimed_spec, node, value, gm = _lower(plugin_set, reference, *tensors)
        assert claimed_spec is spec
        assert isinstance(value, Value)
        assert value.shape == tuple(node.meta["tensor_meta"].shape), sample.note

        eager = reference(*tensors)
        placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        fused = evaluate(value, gm, dict(zip(placeholders, tensors))).to(eager.dtype)
        assert fused.shape == eager.shape
        error = (fused.float() - eager.float()).abs()
        bound = tolerance.atol + tolerance.rtol * eager.float().abs()
        assert bool((error <= bound).all()), (
            f"{sample.note}: max error {error.max().item():.3g} over tolerance {tolerance}"
        )


def _dag(value: Value) -> list[Value]:
    found, stack, seen = [], [value], set()
    while stack:
        v = stack.pop()
        if v.uid not in seen:
            seen.add(v.uid)
            found.append(v)
            stack.extend(v.args)
    return found


def _depends_on(value: Value, target: Value) -> bool:
    return value is target or any(_depends_on(a, target) for a in value.args)


@pytest.mark.parametrize("name", sorted(EXPECTED_TARGETS))
def test_only_the_final_reduction_drops_dims(plugin_set, name):
    """Intermediate reductions keep their dims (they broadcast back over the
    input); a reduction that drops dims is the op's last, followed only by
    pointwise steps in its reduced shape; all reductions share their dims."""
    spec = plugin_set.registry.lowerings[name]
    sample = spec.samples(torch.float32)[1]
    for reference in spec.references:
        _, _, value, _ = _lower(plugin_set, reference, *sample.args)
        values = _dag(value)
        reductions = [v for v in values if v.op == "reduce"]
        assert reductions and len({r.dims for r in reductions}) == 1
        dropping = [r for r in reductions if not r.keepdim]
        assert len(dropping) <= 1
        for r in dropping:
            assert all(v.shape == r.shape for v in values if _depends_on(v, r))


def test_rms_norm_default_eps_matches_eager_for_half_types(plugin_set):
    """eps=None is float32's epsilon for float16/bfloat16 too (torch upcasts):
    tiny inputs, where eps dominates, tell the two choices apart."""
    for dtype in (torch.float16, torch.bfloat16):
        x = (torch.randn(4, 33) * 1e-3).to(dtype)
        _, _, value, gm = _lower(plugin_set, lambda x: F.rms_norm(x, (33,)), x)
        fused = evaluate(value, gm, {"a": x}).to(dtype)
        torch.testing.assert_close(fused, F.rms_norm(x, (33,)))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x.softmax(-1, dtype=torch.float16),
        lambda x: torch.log_softmax(x, 1, torch.bfloat16),
        lambda x: x.sum(-1, dtype=torch.float16),
        lambda x: torch.mean(x, 0, dtype=torch.bfloat16),
    ],
    ids=["softmax_f16", "log_softmax_bf16", "sum_f16", "mean_bf16"],
)
def test_downcasting_dtype_argument_rounds_the_input_as_eager(plugin_set, fn):
    # Positive inputs: eager's CPU sum/mean with a half dtype= accumulate in
    # that dtype, and on cancelling rows differ from any float accumulation.
    x = torch.rand(3, 37) * 4 + 1
    _, _, value, gm = _lower(plugin_set, fn, x)
    expected = fn(x)
    fused = evaluate(value, gm, {"a": x}).to(expected.dtype)
    # Within the output dtype's tolerance, for the same reason.
    tolerance = plugin_set.registry.lowering_for(_claimed_node(plugin_set, gm), gm).tolerance(expected.dtype)
    torch.testing.assert_close(fused, expected, atol=tolerance.atol, rtol=tolerance.rtol)


@pytest.mark.parametrize(
    "fn, x",
    [
        # The mean is 1000x the spread: E[x^2] - E[x]^2 would cancel to noise.
        (lambda x: x.var(-1), 1000 + torch.randn(3, 37)),
        (lambda x: torch.std(x, 1, keepdim=True), 1000 + torch.randn(4, 129)),
        # Normalised values keep the input's absolute rounding (1000 has an ulp
        # of 6e-5), so layer norm's offset is smaller.
        (lambda x: F.layer_norm(x, (37,)), 100 + torch.randn(3, 37)),
        # exp(80) overflows fp32 without the max subtraction.
        (lambda x: x.softmax(-1), 80 * torch.randn(3, 37)),
        (lambda x: F.log_softmax(x, dim=1), 80 * torch.randn(2, 5, 17)),
    ],
    ids=["var_offset", "std_offset", "layer_norm_offset", "softmax_large", "log_softmax_large"],
)
def test_numerically_hard_inputs(plugin_set, fn, x):
    _, _, value, gm = _lower(plugin_set, fn, x)
    fused = evaluate(value, gm, {"a": x})
    assert torch.isfinite(fused).all()
    torch.testing.assert_close(fused, fn(x), atol=1e-4, rtol=1e-3)


def test_module_weights_are_read_at_call_time(plugin_set):
    norm = torch.nn.LayerNorm(37)
    _, _, value, gm = _lower(plugin_set, norm, torch.randn(2, 37))
    loads = set()
    stack = [value]
    while stack:
        v = stack.pop()
        if v.op == "load":
            loads.add(v.source)
        stack.extend(v.args)
    assert {AttrRef("fn.weight"), AttrRef("fn.bias")} <= loads


# ---------------------------------------------------------------------------
# What must stay eager
# ---------------------------------------------------------------------------


class _SubclassedNorm(torch.nn.LayerNorm):
    def forward(self, x):
        return super().forward(x) * 2


REFUSED = {
    "sum_of_ints": (lambda x: torch.sum(x, -1), (torch.randint(0, 9, (3, 37)),)),
    "sum_of_bools": (lambda x: x.sum(-1), (torch.randn(3, 37) > 0,)),
    "sum_to_int_dtype": (lambda x: x.sum(-1, dtype=torch.int64), (torch.randn(3, 37),)),
    "sum_to_float64": (lambda x: torch.sum(x, -1, dtype=torch.float64), (torch.randn(3, 37),)),
    "sum_empty_dim_list": (lambda x: x.sum(dim=[]), (torch.randn(3, 37),)),
    "sum_of_empty_tensor": (lambda x: x.sum(-1), (torch.randn(0, 37),)),
    "sum_of_0d_tensor": (lambda x: x.sum(), (torch.randn(()),)),
    "amax_out": (lambda x, y: torch.amax(x, -1, out=y), (torch.randn(3, 37), torch.randn(3))),
    "var_without_degrees_of_freedom": (lambda x: x.var(0), (torch.randn(1, 129),)),
    "var_correction_too_large": (lambda x: x.var(-1, correction=9), (torch.randn(4, 9),)),
    "std_without_degrees_of_freedom": (lambda x: torch.std(x, 0, True), (torch.randn(1, 129),)),
    "softmax_implicit_dim": (lambda x: F.softmax(x), (torch.randn(3, 37),)),
    "softmax_module_implicit_dim": (torch.nn.Softmax(), (torch.randn(3, 37),)),
    "softmax_float64": (lambda x: x.softmax(-1, dtype=torch.float64), (torch.randn(3, 37),)),
    "softmax_of_float64": (lambda x: x.softmax(-1), (torch.randn(3, 37, dtype=torch.float64),)),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused(plugin_set, case):
    fn, tensors = REFUSED[case]
    with pytest.raises(LoweringRefused) as refused:
        _lower(plugin_set, fn, *tensors)
    assert refused.value.code and refused.value.reason


def test_module_subclass_overriding_forward_is_refused(plugin_set):
    """A tracer that keeps a LayerNorm subclass as a leaf still gets no LayerNorm maths for it."""

    class LeafTracer(torch.fx.Tracer):
        def is_leaf_module(self, module, name):
            return isinstance(module, _SubclassedNorm) or super().is_leaf_module(module, name)

    root = _Wrapper(_SubclassedNorm(37), 1)
    gm = torch.fx.GraphModule(root, LeafTracer().trace(root))
    ShapeProp(gm).propagate(torch.randn(3, 37))
    node = _claimed_node(plugin_set, gm)
    spec = plugin_set.registry.lowering_for(node, gm)
    with pytest.raises(LoweringRefused, match="overrides"):
        spec.lower(LoweringContext(node, gm, {}), *node.args, **node.kwargs)


def test_torch_max_with_dim_stays_unclaimed(plugin_set):
    gm = _trace(lambda x: torch.max(x, -1)[0], torch.randn(3, 37))
    assert all(plugin_set.registry.lowering_for(n, gm) is None for n in gm.graph.nodes)
