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
