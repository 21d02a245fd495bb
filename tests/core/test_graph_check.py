"""The check a captured training step must pass where eager itself is not deterministic
(``cudagraphs.as_close_as_itself``): a replay may differ from an uncaptured step by as much
as two uncaptured steps differ (an atomic sum's rounding), or by a rounding of the result's
norm where they agree (an algorithm a library picks while capturing), no more; steps that
differ by more than a rounding (random draws) are never replayed. Runs on CPU tensors: the check
is plain arithmetic."""

from __future__ import annotations

import pytest
import torch

from autofuser_core.cudagraphs import SELF_DIFFERENCE_FACTOR, as_close_as_itself


def _rounded(x: torch.Tensor, share: float) -> torch.Tensor:
    """``x`` with a rounding-sized difference on a few elements, as an atomic sum gives."""
    y = x.clone()
    flat = y.view(-1)
    picks = torch.randperm(flat.numel())[:7]
    flat[picks] += share * flat[picks].abs().clamp_min(1e-3) * torch.randn(7).sign()
    return y


def test_a_replay_as_close_as_eager_is_to_itself_passes():
    torch.manual_seed(0)
    grad = torch.randn(37, 111)
    once, again = grad, _rounded(grad, 2e-7)
    replayed = _rounded(grad, 2e-7)
    itself = float((once - again).abs().max())
    assert float((replayed - once).abs().max()) <= SELF_DIFFERENCE_FACTOR * itself
    assert as_close_as_itself([replayed, None], [once, None], [again, None])


def test_a_replay_farther_than_eager_is_from_itself_fails():
    torch.manual_seed(1)
    grad = torch.randn(5, 1, 43)
    once, again = grad, _rounded(grad, 1e-7)
    wrong = grad.clone()
    wrong[0, 0, 3] += 0.01
    assert not as_close_as_itself([wrong], [once], [again])


def test_steps_that_draw_random_numbers_are_never_as_close_as_themselves():
    torch.manual_seed(2)
    x = torch.randn(64, 29)
    dropped = [torch.nn.functional.dropout(x, 0.3) for _ in range(3)]
    assert not as_close_as_itself(dropped[:1], dropped[1:2], dropped[2:])


def test_a_result_of_pure_rounding_is_weighed_against_all_results_norm():
    """A gradient that is zero in exact arithmetic (a bias before a batch norm) holds only
    rounding, different in every run: weighed against a share of all gradients' norm it is
    no random draw. A replay off by its own size, or a draw in the large result, still fails."""
    from autofuser_core.cudagraphs import SELF_NORM_FLOOR, _total_norm

    torch.manual_seed(4)
    grad = torch.randn(31, 17)
    zero_once, zero_again = 1e-7 * torch.randn(19), 1e-7 * torch.randn(19)
    once, again = [grad, zero_once], [_rounded(grad, 1e-7), zero_again]
    floor = SELF_NORM_FLOOR * _total_norm(once)
    assert not as_close_as_itself([grad, zero_once.clone()], once, again)  # against its own norm
    assert as_close_as_itself([grad, zero_again.clone()], once, again, floor=floor)
    assert not as_close_as_itself([grad, zero_once + 10 * zero_once.abs().max()], once, again, floor=floor)
    drawn = [torch.nn.functional.dropout(grad, 0.01), zero_again]
    assert not as_close_as_itself([grad, zero_once], once, drawn, floor=floor)


def test_integer_and_missing_results_must_be_the_same():
    torch.manual_seed(3)
    grad = torch.randn(9, 13)
    index = torch.arange(9)
    assert as_close_as_itself([grad, index], [grad, index], [_rounded(grad, 1e-7), index])
    assert not as_close_as_itself([grad, index + 1], [grad, index], [_rounded(grad, 1e-7), index])
    assert not as_close_as_itself([grad, None], [grad, index], [grad, index])
    assert not as_close_as_itself([grad], [grad, index], [grad, index])


def _views_of(forward, model, x, params):
    """``TrainingGraph._through_aliases`` on CPU tensors (the parts of it that need no CUDA):
    the forward's result, and the gradients it gathers for ``upstream``."""
    from autofuser_core.cudagraphs import TrainingGraph

    graph = TrainingGraph.__new__(TrainingGraph)
    graph.forward, graph.model, graph.template, graph.tensor_slots = forward, model, [x], [0]
    graph.static_inputs, graph.grad_inputs = [x], [0] if x.requires_grad else []
    graph.params = params
    found, wrt = graph._through_aliases()
    return graph, found, wrt


def test_captured_gradients_are_taken_at_views_made_in_the_step_and_equal_eager():
    """``TrainingGraph._through_aliases``: the capture asks for gradients at views of the
    inputs and aliases of the parameters made in the step itself (an earlier step's
    accumulators belong to the stream that step ran on), swapped into every module that holds them: the
    forward's, and the model's, whose modules a fused kernel reads its parameters from
    without the forward's attributes. A parameter also read around the modules (a closure)
    gets that share added. The gathered gradients equal eager's, and every module holds
    its own parameters again after, a module under two paths and a tied weight included."""
    import torch.nn as nn

    torch.manual_seed(2)
    shared = nn.Linear(13, 13)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.again = shared, shared  # one module under two paths
            self.inner = nn.Sequential(nn.Linear(13, 7), nn.Tanh())
            self.scale = nn.Parameter(torch.rand(7) + 0.5)
            self.frozen = nn.Parameter(torch.randn(7), requires_grad=False)

        def forward(self, x):
            h = self.again(torch.tanh(self.first(x)))
            return self.inner(h) * self.scale + self.frozen

    net = Net()
    kernel_reads = net.inner[0]  # held the way a fused kernel holds its owner module

    class Rewritten(nn.Module):  # stands in for the rewritten graph: not the model's modules
        def forward(self, x):
            h = shared(torch.tanh(shared(x)))
            pre = torch.nn.functional.linear(h, kernel_reads.weight, kernel_reads.bias)
            # net.scale read through its attribute, and once more around the modules
            return torch.tanh(pre) * net.scale + net.frozen + 0.1 * around.sum()

    around = net.scale  # a reference taken before the step: not swapped
    params = [p for p in net.parameters() if p.requires_grad]
    x = torch.randn(3, 5, 13, requires_grad=True)
    graph, found, wrt = _views_of(Rewritten(), net, x, params)
    assert wrt[0] is not x and wrt[0]._base is x
    aliases = wrt[1 : 1 + len(params)]
    assert all(w is not p and w.is_leaf and w.data_ptr() == p.data_ptr() for w, p in zip(aliases, params))
    upstream = torch.randn_like(found)
    got = graph.gathered(torch.autograd.grad(found, wrt, upstream, allow_unused=True))
    reference = Rewritten()(x)
    expected = torch.autograd.grad(reference, [x, *params], upstream)
    torch.testing.assert_close(found, reference, rtol=0, atol=0)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)
    for module in (shared, net.first, net.again, kernel_reads):
        assert all(type(p) is nn.Parameter for p in module._parameters.values())
    assert net.first.weight is shared.weight and dict(net.named_parameters())["scale"] is net.scale


def test_the_modules_get_their_parameters_back_when_the_forward_raises():
    import torch.nn as nn

    from autofuser_core.cudagraphs import _reading_through

    layer = nn.Linear(3, 3)
    weight = layer.weight
    views = {id(p): p.view_as(p) for p in layer.parameters()}
    try:
        with _reading_through([layer], views):
            assert layer.weight is views[id(weight)]
            raise ValueError("the forward failed")
    except ValueError:
        pass
    assert layer.weight is weight and all(type(p) is nn.Parameter for p in layer.parameters())


def test_a_refused_replay_names_the_result_that_failed_and_by_how_much():
    from autofuser_core.cudagraphs import SELF_DIFFERENCE_LIMIT, _refusal

    torch.manual_seed(3)
    grad = torch.randn(5, 43)
    once, again = grad, _rounded(grad, 1e-7)
    wrong = grad.clone()
    wrong[2, 7] += 0.01
    text = _refusal([grad.clone(), wrong, None], [grad, once, None], [grad.clone(), again, None], 0.0)
    assert text.startswith("result 1: replayed off by 0.01")
    assert "two uncaptured steps by" in text and f"norm {float(grad.double().norm()):.3g}" in text
    assert _refusal([None], [None], [None], 0.0) is None
    # A result whose uncaptured runs differ by more than a rounding (a random draw) is named
    # as such, even where another result's replay is farther off against its runs.
    small = torch.full((4,), 1e-3)
    drawn = small + SELF_DIFFERENCE_LIMIT * 10 * small.norm()
    text = _refusal([small, wrong], [small, once], [drawn, again], 0.0)
    assert text.startswith("result 0:") and "uncaptured steps differ by more than" in text


@pytest.mark.parametrize("sixteen_bit", [False, True], ids=["fp32", "16-bit"])
def test_a_replay_may_differ_by_a_rounding_where_uncaptured_steps_do_not(sixteen_bit):
    """A library may pick another algorithm while capturing (cuBLAS without its workspace):
    a replay then differs by a rounding from two uncaptured steps that agree bit for bit.
    Up to ``REPLAY_ROUNDING`` of the result's norm passes; farther, or a wrong value, fails."""
    from autofuser_core.cudagraphs import REPLAY_ROUNDING, as_close_as_itself

    torch.manual_seed(4)
    grad = torch.randn(37, 111)
    rounding = REPLAY_ROUNDING["16-bit" if sixteen_bit else "fp32"]
    norm = float(grad.norm())
    near = grad.clone()
    near[3, 5] += 0.5 * rounding * norm
    assert as_close_as_itself([near], [grad], [grad.clone()], rounding)
    assert not as_close_as_itself([near], [grad], [grad.clone()], 0.0)  # without the allowance: bit for bit
    far = grad.clone()
    far[3, 5] += 2 * rounding * norm
    assert not as_close_as_itself([far], [grad], [grad.clone()], rounding)
    wrong = grad.clone()
    wrong[0] = 0.0  # a kernel the replay skipped
    assert not as_close_as_itself([wrong], [grad], [grad.clone()], rounding)
    big = torch.randn(1 << 24)
    tile = big.clone()
    tile[4096:4352] = 0.0  # one 256-element tile of 16 million skipped: its largest error hides in the norm
    assert float((tile - big).abs().max()) < REPLAY_ROUNDING["16-bit"] * float(big.norm())
    assert not as_close_as_itself([tile], [big], [big.clone()], rounding)


def test_the_rounding_follows_the_precision_the_step_computes_in():
    from autofuser_core.cudagraphs import _precision

    assert _precision("cpu", [torch.randn(3)]) == "fp32"  # no TF32 on a CPU
    cudnn = torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = True  # torch's default: convolutions in TF32
        assert _precision("cuda", [torch.randn(3)]) == "tf32"
        torch.backends.cudnn.allow_tf32 = False
        if not torch.backends.cuda.matmul.allow_tf32:
            assert _precision("cuda", [torch.randn(3)]) == "fp32"
    finally:
        torch.backends.cudnn.allow_tf32 = cudnn
    assert _precision("cpu", [torch.randn(3), torch.randn(3).bfloat16()]) == "16-bit"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _precision("cpu", [torch.randn(3)]) == "16-bit"


def _bf16_rounded(x: torch.Tensor, share: float) -> torch.Tensor:
    """``x`` with ``share`` of its elements, its largest among them, moved by one bf16 unit:
    a 16-bit atomic sum's rounding, run to run."""
    y = x.clone().view(-1)
    picks = torch.randperm(y.numel())[: max(1, int(share * y.numel()))]
    picks = torch.cat([picks, y.abs().topk(3).indices])
    y[picks] += y[picks].abs() * 2.0**-8 * torch.randn(len(picks)).sign()
    return y.view_as(x)


def test_sixteen_bit_steps_may_differ_from_themselves_by_16_bit_units():
    """A bf16 step's uncaptured runs differ by a unit at a third of the elements, a few
    of which hold most of the norm (a weight gradient's largest elements): past
    ``SELF_DIFFERENCE_LIMIT`` of the norm, within ``SELF_ROUNDING["16-bit"]`` of it in L2.
    Such a step is replayed when its replay is as close; in fp32 the same spread is
    not a rounding; a random draw is not one in 16 bits either."""
    from autofuser_core.cudagraphs import SELF_DIFFERENCE_LIMIT, SELF_ROUNDING, _refusal

    torch.manual_seed(5)
    grad = torch.randn(32, 17) * 0.1
    grad[:3, 0] = torch.tensor([900.0, -700.0, 600.0])  # a few elements hold most of the norm
    once, again, replayed = grad, _bf16_rounded(grad, 0.3), _bf16_rounded(grad, 0.3)
    assert float((again - once).abs().max()) > SELF_DIFFERENCE_LIMIT * float(once.norm())
    sixteen = SELF_ROUNDING["16-bit"]
    assert _refusal([replayed], [once], [again], 1e-3, sixteen) is None
    text = _refusal([replayed], [once], [again], 1e-5, SELF_ROUNDING["fp32"])
    assert text is not None and "uncaptured steps differ by more than" in text
    # TF32 units are 8 times finer than bf16's; a step's roundings add up to a few of them.
    again32, replayed32 = (grad + (_bf16_rounded(grad, 0.3) - grad) / 2 for _ in range(2))
    assert float((again32 - once).abs().max()) > SELF_DIFFERENCE_LIMIT * float(once.norm())
    assert _refusal([replayed32], [once], [again32], 1e-4, SELF_ROUNDING["tf32"]) is None
    stale = replayed.clone()
    stale[:3, 0] *= 1.05  # read from a buffer of another step: its largest values moved too
    assert _refusal([stale], [once], [again], 1e-3, sixteen) is not None
    torch.manual_seed(6)
    x = torch.randn(64, 29)
    dropped = [torch.nn.functional.dropout(x, 0.01) for _ in range(3)]
    text = _refusal(dropped[:1], dropped[1:2], dropped[2:], 1e-3, sixteen)
    assert text is not None and f"{sixteen:g} of it in L2" in text
