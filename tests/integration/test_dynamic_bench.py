"""``benchmarks/dynamic.py``'s pieces that decide what it measures and what it concludes:
the sequence of point counts, the steady counts, and the ratios against the issue's
targets. The whole run (a worker process per system, each compiling under the
interpreter) takes minutes on a CPU, so it is a manual smoke check, not a test."""

from __future__ import annotations

import pytest

from _helpers import benchmark_scripts


@pytest.fixture(scope="module")
def dynamic():
    with benchmark_scripts("dynamic") as module:
        yield module


def test_counts_are_distinct_inclusive_seeded_and_shuffled(dynamic):
    every = dynamic.draw_counts(7, 41, 47, seed=3)
    assert sorted(every) == list(range(41, 48))  # both ends drawn: the range is inclusive
    drawn = dynamic.draw_counts(50, 4096, 16384, seed=0)
    assert len(set(drawn)) == 50 and all(4096 <= n <= 16384 for n in drawn)
    assert drawn == dynamic.draw_counts(50, 4096, 16384, seed=0)
    assert drawn != sorted(drawn) and drawn != dynamic.draw_counts(50, 4096, 16384, seed=1)
    assert dynamic.steady_counts_of([90, 41, 77, 63, 52], 3) == [41, 63, 90]
    assert dynamic.steady_counts_of([90, 41, 77], 1) == [77]


def _call(points, seconds, compile_s=None):
    return {"points": points, "first_call_s": seconds, "compiled": compile_s is not None, "compile_s": compile_s}


def test_summary_ratios_targets_and_failures(dynamic):
    counts = [70, 45, 88]
    settings = {"counts": counts, "steady_counts": [45, 88], "model": "galerkin", "config": "tiny", "batch": 4}
    settings.update(dtype="fp32", min_points=40, max_points=90, seed=0)
    mismatch = "autofuser: first call on 45 points: relative error 0.5 against eager > 0.0001"
    results = {
        "eager": {"calls": [_call(n, 0.01) for n in counts], "steady": {"45": {"ms": 2.0}, "88": {"ms": 3.0}}},
        dynamic.DYNAMIC: {
            "calls": [_call(70, 1.5, 1.25), _call(45, 1.0, 0.75), _call(88, 0.25)],
            "steady": {"45": {"ms": 1.05, "rel_err": 1e-7}, "88": {"ms": 1.5, "rel_err": 2e-7}},
            "mismatches": [mismatch],
        },
        dynamic.SPECIALISED: {
            "calls": [_call(70, 1.25, 1.0)],
            "steady": {"45": {"ms": 1.0, "rel_err": 1e-7}, "88": {"ms": 1.25, "rel_err": 1e-7}},
        },
    }
    summary = dynamic.summarize(settings, results)
    assert summary["one_cold_compile_s"] == 1.25
    mine = summary["systems"][dynamic.DYNAMIC]
    assert mine["first_calls_total_s"] == 2.75 and mine["compiles"] == 2 and mine["compile_s_total"] == 2.0
    assert mine["first_calls_vs_one_cold_compile"] == pytest.approx(2.2)
    assert summary["steady_vs_specialised"] == {"45": pytest.approx(1.05), "88": pytest.approx(1.2)}
    assert summary["targets"] == {"first_calls": False, "steady": False}
    result = {"settings": settings, "summary": summary, "systems": results, "notes": [], "device": "cpu"}
    result["mismatches"] = [mismatch]
    text = "\n".join(dynamic.summary_lines(result))
    assert "2.20 (target <= 2): NOT met" in text and "1.200 at 88" in text
    assert f"**FAILED** {mismatch}" in text
    # A system missing a first call has no total, and no verdict is drawn from it.
    results[dynamic.DYNAMIC]["calls"].pop()
    assert dynamic.summarize(settings, results)["targets"]["first_calls"] is None
