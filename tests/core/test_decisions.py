"""Speed decisions that hold where the model runs (docs/verification.md, "Noise"): a
verdict inside the noise of its timings is measured again and then provisional (the
original runs, nothing final is cached), a fused forward that loses in its first calls
in use is switched back, and a cached verdict without a record of how it was measured is
measured again. A stand-in timer gives noisy times on the interpreter."""

from __future__ import annotations

import copy
import itertools
import json

import pytest
import torch

import autofuser
from autofuser_core import in_use, timing
from autofuser_core.fuse import FORWARD_MARGIN, FORWARD_ROUNDS

from _helpers import StandInTimer


def _model_and_input():
    model = torch.nn.Sequential(torch.nn.LayerNorm(19), torch.nn.GELU()).eval()
    return model, torch.randn(3, 7, 19)


def _noisy_timer(use_timer, fused_ms, eager_ms, in_use_ms=None) -> StandInTimer:
    """Whole forwards timed by a stand-in clock: the fused forward (a GraphModule) takes
    ``fused_ms()`` ms a measurement, the original ``eager_ms()``; ``in_use_ms(fused)`` ms a
    call in use (None: not checked in use)."""
    return use_timer(
        StandInTimer(
            tune=False,
            forward=lambda fn: fused_ms() if isinstance(fn, torch.fx.GraphModule) else eager_ms(),
            in_use=in_use_ms,
        )
    )


def _calls(fused, model, x, n: int, original_runs: list) -> list[bool]:
    """``n`` calls without gradients, each checked against eager; per call, whether it ran the original."""
    ran = []
    with torch.no_grad():
        for _ in range(n):
            before = len(original_runs)
            torch.testing.assert_close(fused(x), model(x))
            ran.append(len(original_runs) > before)
    return ran


def _records(root) -> dict:
    (entry,) = (root / "verdicts").glob("*.json")
    return json.loads(entry.read_text())["records"]


# ---------------------------------------------------------------------------
# The rule
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "candidate, baseline, verdict",
    [
        ([0.5, 0.5], [1.0, 1.0], True),  # no spread: the lead decides
        ([0.99, 0.99], [1.0, 1.0], False),  # 1% ahead, short of the 2% margin
        ([0.9, 1.05], [1.0, 1.0], None),  # 10% ahead, but the rounds differ by 17%
        ([0.5, 0.6], [1.0, 1.03], True),  # a 50% lead clear of a 20% spread
        ([1.6, 1.5], [1.0, 1.1], False),  # slower by far more than the spread
        ([1.01, 1.0], [1.0, 1.02], None),  # even, with 2% of noise: either side could win
    ],
)
def test_a_lead_within_the_spread_of_the_margin_is_unclear(candidate, baseline, verdict):
    found = timing.Rounds()
    found.candidate, found.baseline = candidate, baseline
    assert found.verdict(FORWARD_MARGIN) is verdict
    spread = max((max(t) - min(t)) / min(t) for t in (candidate, baseline))
    assert found.spread == pytest.approx(spread) and found.rounds == 2


@pytest.mark.parametrize(
    "candidate, baseline, verdict",
    [
        ([0.8, 0.81, 0.8, 0.8], [1.0, 1.6, 1.0, 1.01], True),  # one stalled round of four: a 20% lead stands
        ([0.8, 1.3, 0.8, 0.81], [1.0, 1.0, 1.01, 1.0], True),  # the same on the fused side
        ([0.8, 0.81, 0.8, 0.8], [1.0, 1.6, 1.5, 1.01], None),  # two slow rounds are noise, not a stall
        ([0.8, 0.8, 0.8], [1.0, 1.0, 1.6], True),  # three: the slowest is left out too
    ],
)
def test_one_stalled_round_of_three_or_more_does_not_make_a_verdict_unclear(candidate, baseline, verdict):
    """Each side counts its best round, so one slow round (a stall) is already ignored for
    the times; left out of the spread too, it can't alone hold back a clear lead."""
    found = timing.Rounds()
    found.candidate, found.baseline = candidate, baseline
    assert found.verdict(FORWARD_MARGIN) is verdict
    kept = [sorted(t)[:-1] for t in (candidate, baseline)]
    assert found.spread == pytest.approx(max((max(t) - min(t)) / min(t) for t in kept))


# ---------------------------------------------------------------------------
# At compile time
# ---------------------------------------------------------------------------


def test_a_forward_verdict_inside_the_noise_is_measured_again_then_provisional(tmp_path, use_timer, original_runs):
    """The fused forward 10% ahead in its best round, but its rounds differ by 17%: it is
    timed again (FORWARD_ROUNDS more rounds of each side), still inside the noise, so the
    original runs and the report says why. The cache keeps it as provisional, and a
    second module on that cache measures again instead of reading it."""
    fused_times = itertools.cycle([0.9, 1.05])
    timer = _noisy_timer(use_timer, lambda: next(fused_times), lambda: 1.0)
    model, x = _model_and_input()
    fused = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False)
    assert _calls(fused, model, x, 3, original_runs) == [True] * 3
    first = 2 * FORWARD_ROUNDS + 1  # alternating rounds after one eager call
    assert len(timer.forwards) == first + 2 * FORWARD_ROUNDS, timer.forwards
    notes = " ".join(fused.report().notes)
    assert fused.report().fused, str(fused.report())
    assert "a lead of 10.0% within the timings' spread (16.7%, 4 rounds of each, measured twice)" in notes, notes
    assert "the original runs, a provisional verdict (not cached as final)" in notes, notes
    records = _records(tmp_path)
    assert records["forward_plain"]["provisional"] is True and records["forward_plain"]["rounds"] == 4

    again = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False)
    _calls(again, model, x, 1, original_runs)
    assert len(timer.forwards) == 2 * (first + 2 * FORWARD_ROUNDS), "a provisional verdict must be measured again"
    assert "read from the cache" not in " ".join(again.report().notes)


def test_a_clear_verdict_is_cached_as_final_with_how_it_was_measured(tmp_path, use_timer, original_runs):
    """Steady times: one measurement decides, and the entry says how (not provisional, not
    yet confirmed in use); a second module reads it without timing."""
    timer = _noisy_timer(use_timer, lambda: 0.5, lambda: 1.0)
    model, x = _model_and_input()
    fused = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False)
    assert _calls(fused, model, x, 2, original_runs) == [False, False]
    record = _records(tmp_path)["forward_plain"]
    assert record["provisional"] is False and record["in_use"] is False and record["spread"] == 0.0
    assert "best of 2 rounds" in record["method"]
    timed = len(timer.forwards)
    again = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False)
    assert _calls(again, model, x, 2, original_runs) == [False, False]
    assert len(timer.forwards) == timed
    assert "whole-forward times read from the cache (measured when first compiled)" in again.report().notes


@pytest.mark.parametrize(
    "tamper, warned",
    [
        (lambda entry: entry.pop("records"), False),  # the older format: times only
        (lambda entry: entry["records"]["forward_plain"].update(provisional="no"), True),
        (lambda entry: entry["records"]["forward_plain"].update(rounds=True), True),
        (lambda entry: entry["records"]["forward_plain"].update(spread=-0.5), True),
        (lambda entry: entry["records"]["forward_plain"].pop("in_use"), True),
        (lambda entry: entry["records"].update({"../x": entry["records"]["forward_plain"]}), True),
        (lambda entry: entry["times"].update(eager_ms=float("inf")), True),
    ],
)
def test_a_cached_verdict_without_a_sound_record_is_measured_again(tmp_path, use_timer, tamper, warned):
    """The cache folder is not trusted: an entry whose records are missing (written before
    they were kept) is measured again, with a note; one whose records or times are
    malformed is warned about as corrupt and measured again."""
    timer = _noisy_timer(use_timer, lambda: 0.5, lambda: 1.0)
    model, x = _model_and_input()
    with torch.no_grad():
        autofuser.fuse(model, cache_dir=str(tmp_path), progress=False)(x)
        timed = len(timer.forwards)
        (path,) = (tmp_path / "verdicts").glob("*.json")
        entry = json.loads(path.read_text())
        tamper(entry)
        path.write_text(json.dumps(entry))
        again = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False)
        if warned:
            with pytest.warns(UserWarning, match="corrupt or foreign cache entry"):
                torch.testing.assert_close(again(x), model(x))
        else:
            torch.testing.assert_close(again(x), model(x))
            assert any("no record of how they were measured" in n for n in again.report().notes)
    assert len(timer.forwards) == 2 * timed, "the tampered verdict must be measured again"
    assert _records(tmp_path)["forward_plain"]["provisional"] is False  # and filed anew, whole


# ---------------------------------------------------------------------------
# In use: the first calls after compiling
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("in_use_faster", [False, True])
def test_a_fused_forward_that_won_at_compile_is_settled_by_its_first_calls_in_use(
    tmp_path, use_timer, original_runs, in_use_faster
):
    """Faster back to back at compile time; in use slower (a busy GPU when it was timed),
    or faster: the calls follow the plan, the next settles, and a fused forward that lost
    is switched back to the original, the report says so. Results are eager's all along.
    The verdict, confirmed in use, is cached: a second module neither times nor checks."""
    in_use_ms = (lambda fused: 0.5 if fused else 1.0) if in_use_faster else (lambda fused: 1.5 if fused else 1.0)
    timer = _noisy_timer(use_timer, lambda: 0.5, lambda: 1.0, in_use_ms)
    model, x = _model_and_input()
    fused = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False)
    ran = _calls(fused, model, x, 1 + len(in_use.PLAN) + 3, original_runs)
    assert ran[0] is False  # the compiling call runs what it compiled
    assert ran[1 : 1 + len(in_use.PLAN)] == [runner == "original" for runner in in_use.PLAN]
    assert ran[1 + len(in_use.PLAN) :] == [not in_use_faster] * 3
    assert not fused.checking_in_use
    notes = " ".join(fused.report().notes)
    assert "the forward is checked again in its first calls in use" in notes, notes
    if in_use_faster:
        assert "0.500 ms fused vs 1.000 ms original per call, blocks spread 0.0%: the fused model runs" in notes
    else:
        assert (
            "forward in use, 2 blocks of 4 calls on each side: 1.500 ms fused vs 1.000 ms original per call, "
            "blocks spread 0.0%: the original runs (switched back from the fused model, which won at compile time)"
        ) in notes, notes
    record = _records(tmp_path)["forward_plain"]
    assert record["in_use"] is True and record["provisional"] is False

    marks, forwards = len(timer.marks), len(timer.forwards)
    again = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False)
    assert _calls(again, model, x, 3, original_runs) == [not in_use_faster] * 3
    assert (len(timer.marks), len(timer.forwards)) == (marks, forwards)
    assert not again.checking_in_use
    if in_use_faster:
        assert "whole-forward times read from the cache (measured in use)" in again.report().notes


def test_a_provisional_forward_verdict_is_settled_in_use(tmp_path, use_timer, original_runs):
    """Inside the noise at compile time, the original runs; the first calls in use time
    both sides, and a fused forward clearly faster there takes over for good."""
    fused_times = itertools.cycle([0.9, 1.05])
    _noisy_timer(use_timer, lambda: next(fused_times), lambda: 1.0, lambda fused: 0.5 if fused else 1.0)
    model, x = _model_and_input()
    fused = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False)
    ran = _calls(fused, model, x, 1 + len(in_use.PLAN) + 3, original_runs)
    assert ran[0] is True  # the compile's provisional verdict: the original
    assert ran[1 : 1 + len(in_use.PLAN)] == [runner == "original" for runner in in_use.PLAN]
    assert ran[1 + len(in_use.PLAN) :] == [False] * 3
    assert "forward in use, 2 blocks of 4 calls" in " ".join(fused.report().notes)
    record = _records(tmp_path)["forward_plain"]
    assert record["in_use"] is True and record["provisional"] is False


def test_one_stalled_block_in_use_costs_a_second_plan_not_the_fused_model(tmp_path, use_timer, original_runs):
    """The fused forward 50% ahead in every block, but one block of the original stalled
    (three times as slow): with two blocks a side the lead is inside that spread, so the
    plan runs again; over four blocks the stall is one block of four, left out of the
    spread, and the fused model runs, confirmed, not provisional."""
    original_calls = iter([3.0] * 4)  # the original's first block stalls; every later call is 1.0 ms
    timer = _noisy_timer(use_timer, lambda: 0.5, lambda: 1.0, lambda fused: 0.5 if fused else next(original_calls, 1.0))
    # The plan's first call warms the original up: the stall then lands in its first block.
    notes = _fused_confirmed_after_two_plans(tmp_path, original_runs)
    assert "4 blocks of 4 calls on each side: 0.500 ms fused vs 1.000 ms original per call" in notes, notes
    assert "provisional" not in notes, notes
    assert len(timer.marks) > 0


def _fused_confirmed_after_two_plans(tmp_path, original_runs) -> str:
    """Fuse the model, make the calls of two plans in use and two more, check that the fused
    model runs after them with a confirmed (not provisional) verdict filed; the report's notes."""
    model, x = _model_and_input()
    fused = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False)
    plans = in_use.MAX_ROUNDS * len(in_use.PLAN)
    ran = _calls(fused, model, x, 1 + plans + 2, original_runs)
    assert ran[1 + plans :] == [False, False], "the fused model runs after the second plan"
    notes = " ".join(fused.report().notes)
    assert "the fused model runs" in notes, notes
    record = _records(tmp_path)["forward_plain"]
    assert record["in_use"] is True and record["provisional"] is False
    return notes


def test_blocks_in_use_that_separate_settle_a_lead_inside_a_noisy_spread(tmp_path, use_timer, original_runs):
    """A noisy host: the fused blocks spread wider than their lead (0.5 to 0.95 ms against
    the original's 1.0), so the lead is inside the spread after either plan; but over four
    blocks a side every fused block beats every block of the original by more than the
    margin, and the fused model runs, a confirmed verdict."""
    fused_calls = iter([0.5] * 4 + [0.95] * 4 + [0.9] * 4 + [0.92] * 4)
    _noisy_timer(use_timer, lambda: 0.5, lambda: 1.0, lambda fused: next(fused_calls, 0.6) if fused else 1.0)
    notes = _fused_confirmed_after_two_plans(tmp_path, original_runs)
    assert "4 blocks of 4 calls on each side" in notes, notes


def test_a_verdict_inside_the_noise_in_use_is_not_cached_as_final(tmp_path, use_timer, original_runs):
    """Blocks in use that differ by more than the fused lead: the plan runs twice, the
    original runs, and the verdict is filed as provisional: a second module on the cache
    measures and checks again."""
    fused_calls = iter([0.6] * 4 + [1.0] * 4 + [0.6] * 4 + [1.0] * 4)  # its blocks: 0.6 and 1.0 ms
    timer = _noisy_timer(use_timer, lambda: 0.5, lambda: 1.0, lambda fused: next(fused_calls, 1.0) if fused else 1.0)
    model, x = _model_and_input()
    fused = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False)
    plans = in_use.MAX_ROUNDS * len(in_use.PLAN)
    ran = _calls(fused, model, x, 1 + plans + 2, original_runs)
    assert ran[1 + plans :] == [True, True]
    assert "is inside that spread: the original runs, provisionally" in " ".join(fused.report().notes)
    record = _records(tmp_path)["forward_plain"]
    assert record["in_use"] is True and record["provisional"] is True
    forwards = len(timer.forwards)
    again = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False)
    _calls(again, model, x, 1, original_runs)
    assert len(timer.forwards) > forwards and again.checking_in_use


class _NormChain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(23)

    def forward(self, x):
        return torch.nn.functional.gelu(self.ln(x * 1.5 - 0.25)) + x


def test_a_provisional_training_step_runs_the_original_until_its_calls_in_use_decide(
    tmp_path, use_timer, original_runs
):
    """With gradients on: the whole fused step inside the noise of its rounds at compile
    time, so the original runs (the compiling call too) and the step goes on probation;
    faster in use, the fused step takes over. Gradients are eager's throughout."""
    step_times = itertools.cycle([0.9, 1.05])
    use_timer(
        StandInTimer(
            tune=False,
            forward=lambda fn: next(step_times) if getattr(fn, "fused", False) else 1.0,
            in_use=lambda fused: 0.5 if fused else 1.0,
        )
    )
    model, x = _NormChain(), torch.randn(3, 5, 23)
    reference = copy.deepcopy(model)
    fused = autofuser.fuse(model, cache_dir=str(tmp_path), progress=False)
    optimisers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, reference)]
    ran = []
    for _ in range(1 + len(in_use.PLAN) + 3):
        before = len(original_runs)
        for module, optimiser in zip((fused, reference), optimisers):
            optimiser.zero_grad()
            module(x).square().mean().backward()
            optimiser.step()
        ran.append(len(original_runs) > before)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)
    assert ran[0] is True
    assert ran[1 : 1 + len(in_use.PLAN)] == [runner == "original" for runner in in_use.PLAN]
    assert ran[1 + len(in_use.PLAN) :] == [False] * 3
    notes = " ".join(fused.report().notes)
    assert "a provisional verdict (not cached as final); its first calls in use decide" in notes, notes
    assert "training step in use, 2 blocks of 4 calls on each side" in notes and "the fused model runs" in notes
    record = _records(tmp_path)["step"]
    assert record["in_use"] is True and record["provisional"] is False
