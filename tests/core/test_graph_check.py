"""The check a captured training step must pass where eager itself is not deterministic
(``cudagraphs.as_close_as_itself``): a replay may differ from an uncaptured step by as much
as two uncaptured steps differ (an atomic sum's rounding), no more, and steps that differ
by more than a rounding (random draws) are never replayed. Runs on CPU tensors: the check
is plain arithmetic."""

from __future__ import annotations

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


def test_integer_and_missing_results_must_be_the_same():
    torch.manual_seed(3)
    grad = torch.randn(9, 13)
    index = torch.arange(9)
    assert as_close_as_itself([grad, index], [grad, index], [_rounded(grad, 1e-7), index])
    assert not as_close_as_itself([grad, index + 1], [grad, index], [_rounded(grad, 1e-7), index])
    assert not as_close_as_itself([grad, None], [grad, index], [grad, index])
    assert not as_close_as_itself([grad], [grad, index], [grad, index])


def test_captured_gradients_are_taken_at_views_made_in_the_step_and_equal_eager():
    """``TrainingGraph._through_views``: the capture asks for gradients at views of the
    inputs and parameters made in the step itself (an earlier step's accumulators belong
    to the stream that step ran on), read through the module's attributes, nested names
    included; they equal the gradients of the parameters themselves. A parameter the
    forward reaches without its attribute keeps its own node, and its gradient is still right."""
    import torch.nn as nn

    from autofuser_core.cudagraphs import TrainingGraph

    torch.manual_seed(2)
    hidden = nn.Parameter(torch.randn(13))  # read from a closure, not an attribute

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(13, 7), nn.Tanh())
            self.scale = nn.Parameter(torch.rand(7) + 0.5)
            self.frozen = nn.Parameter(torch.randn(7), requires_grad=False)

        def forward(self, x, shift):
            return self.inner(x * hidden) * self.scale + self.frozen + shift

    net = Net()
    x, shift = torch.randn(3, 5, 13, requires_grad=True), 0.25
    graph = TrainingGraph.__new__(TrainingGraph)  # the CUDA-free parts only
    graph.forward, graph.template, graph.tensor_slots = net, [x, shift], [0]
    graph.static_inputs, graph.grad_inputs = [x], [0]
    graph.params = [p for p in net.parameters() if p.requires_grad] + [hidden]
    found, wrt = graph._through_views()
    assert len(wrt) == 1 + len(graph.params)
    assert wrt[0] is not x and wrt[0]._base is x
    by_view = [w for w, p in zip(wrt[1:], graph.params) if w is not p]
    assert len(by_view) == len(graph.params) - 1 and all(w.grad_fn is not None for w in by_view)
    assert wrt[-1] is hidden
    upstream = torch.randn_like(found)
    got = torch.autograd.grad(found, wrt, upstream)
    expected = torch.autograd.grad(net(x, shift), [x, *graph.params], upstream)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)
    assert dict(net.named_parameters())["scale"] is net.scale  # the module is left as it was
