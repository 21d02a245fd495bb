"""``batch_norm_act``: batch norm in training mode with its activation, as the conv
plugin's own autograd functions and kernels (``plugins/conv/batch_norm_train.py``,
``plugins/conv/batch_norm_kernels.py``).

The output, x's gradient, the weight's and the bias's gradients (from a random
upstream gradient) and the running mean and variance after the call are judged
against eager ``F.batch_norm(training=True)`` and the activation module computed in
float64 on the same inputs upcast; ``num_batches_tracked`` must count up by one.
fp32 must be no more than 4x as far from float64 as eager fp32 is (plus a floor);
16-bit results have per-dtype tolerances instead: eager rounds the normalised value
to 16 bits before the activation (in bf16 that flips ReLU's mask near zero, so eager
is far off there) while the kernels apply it in fp32 and round once.

Inputs are not centred (``randn * 2 + 3``), on awkward shapes: ``[N, C]``, ``[1, C,
L]``, 4-d and 5-d with odd sizes; every activation, fp32, fp16 and bf16, 16-bit
inputs with fp32 parameters. A small ``BLOCK`` and many programs per multiprocessor
split each channel among several programs that each loop several blocks (asserted,
not assumed). Non-contiguous inputs give the contiguous copy's result; missing
affine parameters, running statistics or ``num_batches_tracked`` are handled as eager
handles them. The torch reference path (a CPU without Triton) agrees with the
kernels; second derivatives (``create_graph=True``) match eager's double backward
(batch norm written out in torch ops where eager has none); bad input raises
``ValueError``; the forward's statistics are the batch's mean and biased variance.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autofuser_plugins.conv import batch_norm_kernels, batch_norm_train
from autofuser_plugins.conv.batch_norm_train import batch_norm_act

from _helpers import reference_path_only

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ACTIVATIONS = batch_norm_kernels.ACTIVATIONS
#: Not the defaults, so that each one is seen to reach the computation.
SLOPE, MOMENTUM, EPS = 0.2, 0.3, 1e-3
#: 16-bit results (each rounded once from fp32, fp16 keeping 11 bits and bf16 8): the
#: largest error against float64 relative to the reference's largest magnitude, and the
#: error's L2 norm relative to the reference's. About twice the half rounding step and
#: the measured L2 (2e-4 in fp16, 1.7e-3 in bf16); the L2 bound catches what is wrong
#: everywhere by less than a rounding step (a scale off by 1%).
TOLERANCES = {torch.float16: (1e-3, 5e-4), torch.bfloat16: (8e-3, 4e-3)}
#: The L2 bound averages rounding down only over many values: the per-channel results
#: (a handful) are judged by their largest error alone.
L2_MIN_VALUES = 64
#: fp32: at most this multiple of eager fp32's own error against float64, plus a floor
#: (eager can be exact by chance on a small tensor).
EAGER_MULTIPLE, FP32_FLOOR = 4.0, 1e-6
#: Second derivatives, fp32 against eager float64 (relative to the largest entry).
SECOND_ORDER_TOLERANCE = 1e-4

EAGER_ACTIVATIONS = {
    "none": nn.Identity(),
    "relu": nn.ReLU(),
    "leaky_relu": nn.LeakyReLU(SLOPE),
    "gelu": nn.GELU(),  # exact (erf), as the kernels compute it
    "silu": nn.SiLU(),
}
RESULTS = ("out", "dx", "dweight", "dbias", "running_mean", "running_var")

SHAPES = [
    pytest.param((7, 6), id="7x6"),  # BatchNorm1d on [N, C]
    pytest.param((1, 4, 37), id="1x4x37"),  # batch 1
    pytest.param((3, 5, 13, 7), id="3x5x13x7"),
    pytest.param((2, 3, 5, 4, 3), id="2x3x5x4x3"),
]
DTYPE_IDS = dict(ids=lambda t: str(t).removeprefix("torch."))


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh random data in every test, reproducible from the test's name."""
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


def make_inputs(shape, dtype, param_dtype=None, weight=True, bias=True, stats=True):
    """x (not centred) and a random upstream gradient of ``shape``; per-channel weight,
    bias and running statistics far from their initial values (``param_dtype``, x's by
    default), each None where not asked for; ``num_batches_tracked`` at 5."""
    param_dtype = param_dtype or dtype
    channels = shape[1]

    def per_channel(values):
        return values.to(device=DEVICE, dtype=param_dtype)

    return dict(
        x=(torch.randn(shape, device=DEVICE) * 2 + 3).to(dtype),
        weight=per_channel(torch.randn(channels) * 0.5 + 1) if weight else None,
        bias=per_channel(torch.randn(channels)) if bias else None,
        running_mean=per_channel(torch.randn(channels)) if stats else None,
        running_var=per_channel(torch.rand(channels) + 0.5) if stats else None,
        num_batches_tracked=torch.tensor(5, device=DEVICE) if stats else None,
        dout=torch.randn(shape, device=DEVICE).to(dtype),
    )


def _copies(inputs, dtype=None):
    """Fresh leaves (x, weight, bias) and running statistics, cast to ``dtype`` if given."""

    def copy(t):
        return None if t is None else t.detach().clone().to(dtype or t.dtype)

    leaves = [copy(inputs[name]) for name in ("x", "weight", "bias")]
    for t in leaves:
        if t is not None:
            t.requires_grad_()
    return leaves, copy(inputs["running_mean"]), copy(inputs["running_var"])


def _gradients(out, leaves, dout):
    present = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(out, present, dout))
    return [None if t is None else next(grads) for t in leaves]


def run_ours(inputs, activation, momentum=MOMENTUM, eps=EPS):
    """``batch_norm_act`` on copies of the inputs: the results named in ``RESULTS``
    (None where absent) and ``num_batches_tracked`` after the call."""
    (x, weight, bias), running_mean, running_var = _copies(inputs)
    tracked = inputs["num_batches_tracked"]
    tracked = None if tracked is None else tracked.clone()
    out = batch_norm_act(x, weight, bias, running_mean, running_var, tracked, momentum, eps, activation, SLOPE)
    assert out.shape == x.shape and out.dtype == x.dtype
    # x's layout where x is dense (row-major, channels-last), else row-major
    assert out.stride() == batch_norm_kernels.empty_result(x, x.dtype).stride()
    grads = _gradients(out, [x, weight, bias], inputs["dout"])
    for grad, like in zip(grads, (x, weight, bias)):
        assert (grad is None) == (like is None)
        assert grad is None or (grad.shape == like.shape and grad.dtype == like.dtype)
    return dict(zip(RESULTS, [out.detach(), *grads, running_mean, running_var])), tracked


def run_eager(inputs, activation, dtype=None, momentum=MOMENTUM, eps=EPS):
    """The same with eager ``F.batch_norm`` and the activation module, every tensor cast
    to ``dtype`` where given (float64: the judge)."""
    (x, weight, bias), running_mean, running_var = _copies(inputs, dtype)
    # torch's CUDA batch norm backward (batch_norm_backward_reduce) makes the bias's
    # gradient with the weight's tensor options, so a bias without a weight fails there
    # with "tensor does not have a device" (seen on an H100, torch 2.11): eager gets a
    # constant weight of ones instead, the same batch norm.
    no_weight = weight is None and bias is not None and x.is_cuda
    affine = torch.ones(x.shape[1], dtype=bias.dtype, device=x.device) if no_weight else weight
    y = F.batch_norm(x, running_mean, running_var, affine, bias, training=True, momentum=momentum, eps=eps)
    out = EAGER_ACTIVATIONS[activation](y)
    grads = _gradients(out, [x, weight, bias], inputs["dout"].to(dtype or x.dtype))
    return dict(zip(RESULTS, [out.detach(), *grads, running_mean, running_var]))


def error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest error relative to the reference's largest magnitude; absolute where the
    reference is all zeros (a second derivative that vanishes)."""
    largest = ref.abs().max().item()
    return (x.double() - ref).abs().max().item() / (largest if largest > 0 else 1.0)


def l2_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def check(ours, eager, judge, names=RESULTS):
    """Every result of ours against the float64 judge: fp32 ones within
    ``EAGER_MULTIPLE`` of eager's error (eager's result in fp32 too), 16-bit ones within
    their dtype's tolerances."""
    for name in names:
        got, ref = ours[name], judge[name]
        assert (got is None) == (ref is None), name
        if got is None:
            continue
        if got.dtype == torch.float32:
            assert eager[name].dtype == torch.float32, name
            theirs = error(eager[name], ref)
            bound = EAGER_MULTIPLE * theirs + FP32_FLOOR
            assert error(got, ref) <= bound, f"{name}: error {error(got, ref):.2e}, eager fp32's {theirs:.2e}"
        else:
            largest, norm = TOLERANCES[got.dtype]
            assert error(got, ref) <= largest, f"{name}: error {error(got, ref):.2e} over {largest:.0e}"
            if got.numel() >= L2_MIN_VALUES:
                assert l2_error(got, ref) <= norm, f"{name}: L2 error {l2_error(got, ref):.2e} over {norm:.0e}"


def run_and_check(inputs, activation):
    """Ours, eager and float64 on the same inputs; every result checked, and
    ``num_batches_tracked`` counted up by one where there are running statistics."""
    ours, tracked = run_ours(inputs, activation)
    check(ours, run_eager(inputs, activation), run_eager(inputs, activation, torch.float64))
    if inputs["num_batches_tracked"] is not None:
        expected = inputs["num_batches_tracked"] + (1 if inputs["running_mean"] is not None else 0)
        assert torch.equal(tracked, expected), (tracked, expected)
    return ours


# ---------------------------------------------------------------------------
# Results against eager and float64
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, **DTYPE_IDS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_every_activation_matches_eager_and_float64(activation, dtype):
    """Output, gradients, running statistics and the batch count on a 4-d input."""
    run_and_check(make_inputs((3, 5, 13, 7), dtype), activation)


@pytest.mark.parametrize("dtype", DTYPES, **DTYPE_IDS)
@pytest.mark.parametrize("activation", ["leaky_relu", "silu"])
@pytest.mark.parametrize("shape", [p for p in SHAPES if p.id != "3x5x13x7"])
def test_awkward_shapes_match_eager_and_float64(shape, activation, dtype):
    """``[N, C]``, ``[1, C, L]`` and 5-d inputs (the 4-d one is above)."""
    run_and_check(make_inputs(shape, dtype), activation)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], **DTYPE_IDS)
def test_16bit_input_with_fp32_parameters_and_statistics(dtype):
    """A 16-bit x with fp32 affine parameters and running statistics (a module kept in
    fp32 under a 16-bit input): the parameters' gradients and the statistics stay fp32
    and are judged as fp32 results, x's output and gradient in x's dtype."""
    ours = run_and_check(make_inputs((2, 3, 9, 5), dtype, param_dtype=torch.float32), "gelu")
    assert ours["out"].dtype == ours["dx"].dtype == dtype
    assert all(ours[name].dtype == torch.float32 for name in RESULTS[2:])


@pytest.mark.parametrize(
    "wrong, dtype",
    [
        (dict(momentum=MOMENTUM * 1.05), torch.float32),
        (dict(eps=EPS * 1.5), torch.float32),
        (dict(momentum=MOMENTUM * 1.05), torch.bfloat16),  # eps's 6e-5 is below bf16's step
    ],
    ids=["momentum-float32", "eps-float32", "momentum-bfloat16"],
)
def test_a_wrong_momentum_or_eps_is_caught(wrong, dtype):
    """The positive control: ours run with a momentum 5% off or an eps 50% off (1.5e-3
    against a variance near 4: the output 6e-5 off) must fail the check that the right
    ones pass."""
    inputs = make_inputs((3, 5, 13, 7), dtype)
    eager, judge = run_eager(inputs, "silu"), run_eager(inputs, "silu", torch.float64)
    check(run_ours(inputs, "silu")[0], eager, judge)
    with pytest.raises(AssertionError):
        check(run_ours(inputs, "silu", **wrong)[0], eager, judge)


# ---------------------------------------------------------------------------
# The kernels' splits, blocks and layouts
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], **DTYPE_IDS)
@pytest.mark.parametrize(
    "programs_per_sm, expected_splits, blocks_per_split",
    [(64, 10, 1), (5, 3, 4)],
    ids=["10-splits-of-1-block", "3-splits-of-4-blocks"],
)
def test_a_channel_split_among_programs_looping_blocks(
    monkeypatch, programs_per_sm, expected_splits, blocks_per_split, dtype
):
    """``BLOCK`` 32 and one multiprocessor: each channel's 297 values (3 x 9 x 11) are
    split among several programs (10: a combine over a padded 16; or 3 of 128, 128 and 41
    values, each program's loop running 4, 4 and 2 blocks), and the normalisation's
    programs take 32 values each, the last one partial. The split is recorded from
    ``_splits`` in forward and backward, not assumed."""
    monkeypatch.setattr(batch_norm_kernels, "BLOCK", 32)
    monkeypatch.setattr(batch_norm_kernels, "PROGRAMS_PER_SM", programs_per_sm)
    monkeypatch.setattr(batch_norm_kernels, "_multiprocessors", lambda device: 1)
    real_splits, seen = batch_norm_kernels._splits, []

    def spy(x, channels, per_channel, block):
        chunk, splits = real_splits(x, channels, per_channel, block)
        seen.append((block, chunk, splits))
        return chunk, splits

    monkeypatch.setattr(batch_norm_kernels, "_splits", spy)
    run_and_check(make_inputs((3, 2, 9, 11), dtype), "silu")
    assert seen == [(32, 32 * blocks_per_split, expected_splits)] * 2, seen  # forward, backward


def test_channels_last_tiles_split_among_programs(monkeypatch):
    """Channels-last with 70 channels: two channel tiles (64, then 6 masked to their
    channels) and each channel's 105 rows split among 27 programs of 4 rows each (``BLOCK``
    64, many programs per multiprocessor), recorded from ``_splits``, not assumed."""
    monkeypatch.setattr(batch_norm_kernels, "BLOCK", 64)
    monkeypatch.setattr(batch_norm_kernels, "PROGRAMS_PER_SM", 64)
    monkeypatch.setattr(batch_norm_kernels, "_multiprocessors", lambda device: 1)
    real_splits, seen = batch_norm_kernels._splits, []

    def spy(x, channel_blocks, per_channel, block):
        chunk, splits = real_splits(x, channel_blocks, per_channel, block)
        seen.append((channel_blocks, block, chunk, splits))
        return chunk, splits

    monkeypatch.setattr(batch_norm_kernels, "_splits", spy)
    inputs = make_inputs((3, 70, 5, 7), torch.float32)
    inputs["x"] = inputs["x"].to(memory_format=torch.channels_last)
    inputs["dout"] = inputs["dout"].to(memory_format=torch.channels_last)
    run_and_check(inputs, "silu")
    assert seen == [(2, 1, 4, 27)] * 2, seen  # forward, backward


def test_strided_parameters_and_statistics():
    """Weight, bias and running statistics as strided views (columns of ``[C, 2]``
    tensors, as a model may slice them out of one parameter): read by channel through
    their strides, the statistics updated in place, the other column untouched. Eager
    is judged on contiguous copies (the same values): its CPU backward gives x a wrong
    gradient for a strided weight (torch 2.13)."""
    inputs = make_inputs((4, 6, 9), torch.float32)
    x = inputs["x"].clone().requires_grad_()
    wide = {
        name: torch.stack([inputs[name], torch.randn_like(inputs[name])], dim=1)
        for name in ("weight", "bias", "running_mean", "running_var")
    }
    leaves = {name: wide[name].clone().requires_grad_() for name in ("weight", "bias")}
    weight, bias = leaves["weight"][:, 0], leaves["bias"][:, 0]
    running_mean, running_var = wide["running_mean"][:, 0], wide["running_var"][:, 0]
    assert weight.stride() == bias.stride() == running_mean.stride() == (2,)
    others = [wide[name][:, 1].clone() for name in ("running_mean", "running_var")]
    out = batch_norm_act(x, weight, bias, running_mean, running_var, None, MOMENTUM, EPS, "gelu", SLOPE)
    dx, dweight, dbias = torch.autograd.grad(out, [x, leaves["weight"], leaves["bias"]], inputs["dout"])
    ours = dict(
        out=out.detach(),
        dx=dx,
        dweight=dweight[:, 0],
        dbias=dbias[:, 0],
        running_mean=running_mean,
        running_var=running_var,
    )
    assert not dweight[:, 1].any() and not dbias[:, 1].any()
    assert all(torch.equal(wide[name][:, 1], other) for name, other in zip(("running_mean", "running_var"), others))
    check(ours, run_eager(inputs, "gelu"), run_eager(inputs, "gelu", torch.float64))


@pytest.mark.parametrize(
    "layout",
    ["channels_last", "transposed", "channels_last_3d", "sliced"],
)
def test_a_non_contiguous_input_gives_its_contiguous_copys_result(layout):
    """x and the upstream gradient as non-contiguous tensors (``channels_last``, a
    ``[N, C, L]`` view of an ``[N, L, C]`` tensor, ``channels_last_3d``): channels
    innermost in memory, so the statistics kernels walk tiles of several channels; or a
    strided slice, read through a row-major copy. The
    same output, gradients and running statistics as their contiguous copies (to
    rounding: the sums run in another order), the output and x's gradient in x's own
    layout (as eager's batch norm keeps it; row-major for the slice), and the float64
    check passes."""
    if layout == "transposed":
        x = (torch.randn(2, 19, 5, device=DEVICE) * 2 + 3).transpose(1, 2)
        dout = torch.randn(2, 19, 5, device=DEVICE).transpose(1, 2)
    elif layout == "sliced":  # not dense: read through a row-major copy, results row-major
        x = (torch.randn(3, 4, 21, device=DEVICE) * 2 + 3)[:, :, ::2]
        dout = torch.randn(3, 4, 21, device=DEVICE)[:, :, ::2]
    else:
        shape, fmt = {
            "channels_last": ((3, 5, 6, 7), torch.channels_last),
            "channels_last_3d": ((2, 3, 5, 4, 3), torch.channels_last_3d),
        }[layout]
        x = (torch.randn(shape, device=DEVICE) * 2 + 3).to(memory_format=fmt)
        dout = torch.randn(shape, device=DEVICE).to(memory_format=fmt)
    assert not x.is_contiguous() and not dout.is_contiguous()
    inputs = make_inputs(tuple(x.shape), torch.float32)  # the parameters and running statistics
    strided = run_ours({**inputs, "x": x, "dout": dout}, "gelu")
    contiguous = run_ours({**inputs, "x": x.contiguous(), "dout": dout.contiguous()}, "gelu")
    for name in RESULTS:
        if strided[0][name] is not None:
            torch.testing.assert_close(strided[0][name], contiguous[0][name], atol=1e-5, rtol=1e-5, msg=name)
    assert torch.equal(strided[1], contiguous[1])
    expected = x.contiguous().stride() if layout == "sliced" else x.stride()
    assert strided[0]["out"].stride() == expected and strided[0]["dx"].stride() == expected
    if layout != "sliced":  # eager's own CPU backward refuses the slice's strides (oneDNN)
        run_and_check({**inputs, "x": x, "dout": dout}, "gelu")


# ---------------------------------------------------------------------------
# What may be left out
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], **DTYPE_IDS)
@pytest.mark.parametrize(
    "weight, bias", [(False, False), (False, True), (True, False)], ids=["affine-false", "no-weight", "no-bias"]
)
def test_without_affine_parameters(weight, bias, dtype):
    """weight and/or bias None: as eager's batch norm without them (silu's curvature
    makes the bias's absence matter to the gradients)."""
    run_and_check(make_inputs((3, 4, 5, 6), dtype, weight=weight, bias=bias), "silu")


def test_frozen_parameters_get_no_gradient():
    """A weight and a bias that don't require gradients (a frozen norm): x's gradient
    alone (the function's backward is asked for no parameter's), as eager's."""
    inputs = make_inputs((4, 3, 11), torch.float32)
    weight, bias = inputs["weight"], inputs["bias"]
    x = inputs["x"].clone().requires_grad_()
    out = batch_norm_act(x, weight, bias, None, None, None, MOMENTUM, EPS, "silu", SLOPE)
    (got,) = torch.autograd.grad(out, x, inputs["dout"])
    x = inputs["x"].clone().requires_grad_()
    out = F.silu(F.batch_norm(x, None, None, weight, bias, training=True, eps=EPS))
    (expected,) = torch.autograd.grad(out, x, inputs["dout"])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_without_running_statistics_nothing_is_updated():
    """running_mean and running_var None (``track_running_stats=False``): the batch's
    statistics, and ``num_batches_tracked``, given all the same, is left as it was."""
    inputs = make_inputs((4, 3, 11), torch.float32, stats=False)
    inputs["num_batches_tracked"] = torch.tensor(5, device=DEVICE)
    ours = run_and_check(inputs, "relu")  # checks that num_batches_tracked stays at 5
    assert ours["running_mean"] is None and ours["running_var"] is None


def test_without_num_batches_tracked_the_statistics_are_updated():
    """``num_batches_tracked`` None (a functional call): the running statistics are
    still updated as eager updates them."""
    inputs = make_inputs((4, 3, 11), torch.float32)
    inputs["num_batches_tracked"] = None
    ours = run_and_check(inputs, "leaky_relu")
    assert not torch.equal(ours["running_mean"], inputs["running_mean"])
    assert not torch.equal(ours["running_var"], inputs["running_var"])


# ---------------------------------------------------------------------------
# The torch reference path
# ---------------------------------------------------------------------------


def _reference_only(monkeypatch) -> list[str]:
    """The functions as on a CPU without Triton (``_triton_runs`` False); returns the
    names of the reference functions as they are called (the kernels raise)."""
    monkeypatch.setattr(batch_norm_train, "_triton_runs", lambda x: False)
    references = ("reference_forward", "reference_backward")
    return reference_path_only(monkeypatch, batch_norm_train, references, batch_norm_kernels, ("forward", "backward"))


def _agree(reference, kernels, names=RESULTS):
    """fp32 to rounding, 16-bit to one rounding step (the reference rounds as the kernels do)."""
    for name in names:
        if reference[name] is None:
            assert kernels[name] is None, name
            continue
        loose = reference[name].dtype != torch.float32
        tolerance = dict(atol=1e-2, rtol=2**-7) if loose else dict(atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(reference[name], kernels[name], **tolerance, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], **DTYPE_IDS)
@pytest.mark.parametrize(
    "activation",
    ["none", "leaky_relu", "gelu"],
)
def test_the_torch_reference_path_matches_the_kernels(monkeypatch, activation, dtype):
    """Where Triton can't run (a CPU without the interpreter) the functions compute in
    torch ops (``reference_forward``/``reference_backward``): through ``batch_norm_act``
    and autograd, on the same inputs, they agree with the kernels and pass the float64
    check themselves. Spies make sure each path really ran."""
    inputs = make_inputs((2, 3, 5, 4, 3), dtype)
    kernels, _ = run_ours(inputs, activation)
    calls = _reference_only(monkeypatch)
    reference = run_and_check(inputs, activation)
    assert calls == ["reference_forward", "reference_backward"], calls
    _agree(reference, kernels)


def run_forward_only(inputs, activation):
    """``batch_norm_act`` without gradients: out and the running statistics."""
    (x, weight, bias), running_mean, running_var = _copies(inputs)
    with torch.no_grad():
        out = batch_norm_act(x, weight, bias, running_mean, running_var, None, MOMENTUM, EPS, activation, SLOPE)
    return dict(out=out, running_mean=running_mean, running_var=running_var)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], **DTYPE_IDS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_the_torch_reference_forward_matches_the_kernels(monkeypatch, activation, dtype):
    """The reference path's forward (output and running statistics) for every activation,
    against the kernels' and float64."""
    inputs = make_inputs((3, 4, 10), dtype)
    kernels = run_forward_only(inputs, activation)
    calls = _reference_only(monkeypatch)
    reference = run_forward_only(inputs, activation)
    assert calls == ["reference_forward"], calls
    names = ("out", "running_mean", "running_var")
    _agree(reference, kernels, names)
    check(reference, run_eager(inputs, activation), run_eager(inputs, activation, torch.float64), names)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], **DTYPE_IDS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_the_reference_functions_match_the_kernels(activation, dtype):
    """``reference_forward`` and ``reference_backward`` called as plain functions (the
    maths of the torch path) give the kernels' ``(out, mean, var)`` and ``(dx, dweight,
    dbias)``."""
    inputs = make_inputs((2, 3, 7, 5), dtype)
    x, weight, bias, dout = inputs["x"], inputs["weight"], inputs["bias"], inputs["dout"]
    args = (EPS, activation, SLOPE)
    got = batch_norm_kernels.forward(x, weight, bias, None, None, None, MOMENTUM, *args)
    expected = batch_norm_train.reference_forward(x, weight, bias, *args)
    _, mean, var = got
    got += batch_norm_kernels.backward(dout, x, weight, bias, mean, var, *args)
    expected += batch_norm_train.reference_backward(dout, x, weight, bias, mean, var, *args)
    names = ("out", "mean", "var", "dx", "dweight", "dbias")
    _agree(dict(zip(names, expected)), dict(zip(names, got)), names)


# ---------------------------------------------------------------------------
# Second derivatives
# ---------------------------------------------------------------------------


def _gradient_of_a_loss_of_gradients(runner, inputs, dtype, activation):
    """A scalar function of the first gradients (``create_graph=True``), differentiated
    again: its gradients with respect to x, the weight and the bias (those given) and the
    upstream gradient (zeros where the loss doesn't depend on one)."""
    (x, weight, bias), _, _ = _copies(inputs, dtype)
    dout = inputs["dout"].detach().to(dtype).requires_grad_()
    leaves = [t for t in (x, weight, bias) if t is not None]
    first = torch.autograd.grad(runner(x, weight, bias, activation), leaves, dout, create_graph=True)
    generator = torch.Generator(device="cpu").manual_seed(7)  # the same weights for both runners
    loss = sum((g * g).sum() + (g * torch.randn(g.shape, generator=generator).to(g)).sum() for g in first)
    return torch.autograd.grad(loss, [*leaves, dout], allow_unused=True, materialize_grads=True)


def _ours(x, weight, bias, activation):
    return batch_norm_act(x, weight, bias, None, None, None, MOMENTUM, EPS, activation, SLOPE)


def _eager(x, weight, bias, activation):
    return EAGER_ACTIVATIONS[activation](F.batch_norm(x, None, None, weight, bias, training=True, eps=EPS))


def _written_out(x, weight, bias, activation):
    """Batch norm in plain torch ops (eager's double backward fails without a weight)."""
    dims = [0, *range(2, x.dim())]
    var, mean = torch.var_mean(x, dims, keepdim=True, correction=0)
    y = (x - mean) / torch.sqrt(var + EPS)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return EAGER_ACTIVATIONS[activation](y)


def _second_order_check(got, expected, names):
    for name, g, e in zip(names, got, expected):
        assert g.dtype == torch.float32, name
        assert error(g, e) <= SECOND_ORDER_TOLERANCE, (name, error(g, e))


def test_the_written_out_judge_matches_eager():
    """``_written_out``, the judge where eager's double backward can't be, agrees with
    eager's where both run (float64, weight and bias given)."""
    inputs = make_inputs((2, 3, 5, 4), torch.float32)
    got = _gradient_of_a_loss_of_gradients(_written_out, inputs, torch.float64, "gelu")
    expected = _gradient_of_a_loss_of_gradients(_eager, inputs, torch.float64, "gelu")
    for g, e in zip(got, expected):
        assert error(g, e) <= 1e-12


@pytest.mark.parametrize("activation", ["none", "gelu", "silu", "leaky_relu"])
def test_second_derivatives_match_eager(activation):
    """fp32 second derivatives through the functions' own backward against eager's
    double backward in float64 (the bias's vanishes without an activation's curvature)."""
    inputs = make_inputs((2, 3, 5, 4), torch.float32)
    got = _gradient_of_a_loss_of_gradients(_ours, inputs, torch.float32, activation)
    expected = _gradient_of_a_loss_of_gradients(_eager, inputs, torch.float64, activation)
    _second_order_check(got, expected, ("x", "weight", "bias", "dout"))


@pytest.mark.parametrize(
    "weight, bias",
    [
        pytest.param(False, False, id="affine-false"),
        pytest.param(False, True, id="no-weight"),
        pytest.param(True, False, id="no-bias"),
    ],
)
def test_second_derivatives_without_affine_parameters(weight, bias):
    """The same with the weight and/or the bias left out, against batch norm written out
    in float64 torch ops (the double backward pairs each first gradient with its incoming
    gradient: with one parameter absent the pairs must still line up)."""
    inputs = make_inputs((2, 3, 5, 4), torch.float32, weight=weight, bias=bias)
    got = _gradient_of_a_loss_of_gradients(_ours, inputs, torch.float32, "silu")
    expected = _gradient_of_a_loss_of_gradients(_written_out, inputs, torch.float64, "silu")
    names = ["x"] + ["weight"] * weight + ["bias"] * bias + ["dout"]
    _second_order_check(got, expected, names)


# ---------------------------------------------------------------------------
# Bad input, and the statistics the backward reads
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, activation, stats, message",
    [
        ((4, 3, 5), "tanh", "both", "activation 'tanh' is not one of none, relu, leaky_relu, gelu, silu"),
        ((1, 3), "relu", "both", r"more than 1 value per channel when training, got input size \[1, 3\]"),
        ((1, 3, 1), "relu", "both", r"more than 1 value per channel when training, got input size \[1, 3, 1\]"),
        ((6,), "relu", "neither", r"more than 1 value per channel when training, got input size \[6\]"),
        ((4, 3, 5), "relu", "mean", "give both running statistics or neither"),
        ((4, 3, 5), "relu", "var", "give both running statistics or neither"),
    ],
    ids=["activation", "one-value-2d", "one-value-3d", "no-channels", "mean-alone", "var-alone"],
)
def test_bad_input_raises(shape, activation, stats, message):
    """A ``ValueError`` naming the problem, before anything is updated."""
    channels = shape[1] if len(shape) > 1 else 1
    x = torch.randn(shape, device=DEVICE)
    running_mean = torch.randn(channels, device=DEVICE) if stats in ("both", "mean") else None
    running_var = torch.rand(channels, device=DEVICE) + 0.5 if stats in ("both", "var") else None
    before = [None if t is None else t.clone() for t in (running_mean, running_var)]
    tracked = torch.tensor(5, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        batch_norm_act(x, None, None, running_mean, running_var, tracked, MOMENTUM, EPS, activation, SLOPE)
    assert tracked.item() == 5
    for t, b in zip((running_mean, running_var), before):
        assert t is None or torch.equal(t, b)


@pytest.mark.parametrize("weight, bias", [(True, True), (False, False)], ids=["affine", "none"])
def test_the_forward_statistics_are_the_batch_mean_and_biased_variance(weight, bias):
    """What the backward reads back: each channel's mean and biased variance, fp32."""
    inputs = make_inputs((2, 3, 5), torch.float32, weight=weight, bias=bias)
    x, w, b = inputs["x"], inputs["weight"], inputs["bias"]
    _, mean, var = batch_norm_kernels.forward(x, w, b, None, None, None, MOMENTUM, EPS, "silu", SLOPE)
    expected_var, expected_mean = torch.var_mean(x.double(), (0, 2), correction=0)
    torch.testing.assert_close(mean.double(), expected_mean, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(var.double(), expected_var, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(2, 3, 4, 5),
        lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        lambda: torch.randn(2, 3, 4, 5, 6).to(memory_format=torch.channels_last_3d),
        lambda: torch.randn(7, 6),
        lambda: torch.randn(2, 9, 5).transpose(1, 2),
        lambda: torch.randn(3, 4, 21)[:, :, ::2],
        lambda: torch.randn(1, 3, 4, 5).to(memory_format=torch.channels_last),
        lambda: torch.randn(2, 3, 5, 4).transpose(2, 3),
        lambda: torch.randn(3, 2, 4, 1, 5),
    ],
    ids=["rows", "channels-last", "channels-last-3d", "2d", "transposed", "sliced", "batch1", "spatial-swap", "size1"],
)
def test_the_result_layout_from_metadata_is_the_one_the_kernels_write(make):
    """``result_strides`` (plain arithmetic on shape and strides, which the graph pass asks
    of captured metadata) agrees with the layout the kernels really read and write - the
    ``[N, C, S]`` rows torch's reshape gives, re-viewed as x's shape - up to the strides of
    dims of size 1, which are never stepped along."""
    x = make()
    written = torch.empty_like(batch_norm_kernels._rows(x)).view(x.shape).stride()
    computed = batch_norm_kernels.result_strides(tuple(x.shape), x.stride())
    assert [s for s, n in zip(computed, x.shape) if n != 1] == [s for s, n in zip(written, x.shape) if n != 1]
    assert batch_norm_kernels.empty_result(x, x.dtype).stride() == computed
