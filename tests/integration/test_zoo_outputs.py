"""The zoo's tiny models compute what they computed when ``tests/data/zoo_outputs.json``
was recorded (``tests/record_zoo_outputs.py``, which says how to re-record).

A change to how AutoFuser is organised (files split, code moved between the core
and the plugins, names and comments in kernels) must not change a single number:
each case is fused again under Triton's interpreter and must give the recorded
fused groups (strategy and ops, exactly) and the recorded output, to within
1e-6 relative plus 1e-6 of the output's largest magnitude. The eager output is
checked the same way first, so that a change in the model or its inputs is not
taken for one in AutoFuser.

The cases run by default, chosen for the strategies they cover while the file
stays under a minute on two loaded CPU cores: galerkin (linear attention, row
chains), transformer (softmax attention, a product), transolver (slice
attention, implicit GEMM, an MLP chain), factformer (linear epilogues, row
reductions, elementwise groups), fno without and with the FFT plugin (the
spectral mix), ffno, unet (convolutions as implicit GEMMs, fused
upsampling), ufno (strided convolutions with batch norm beside the spectral
convolution) and upt (cross-attention to latent tokens, sine-cosine
features). gnot and lsm, the slowest to fuse (a third of a minute each on a
loaded machine) and made of strategies the others cover, are recorded too and
run with ``AUTOFUSER_ZOO_OUTPUTS_ALL=1``.
"""

from __future__ import annotations

import json
import math
import os

import pytest
from record_zoo_outputs import CASES, RECORD, compute

RTOL = 1e-6
ATOL = 1e-6  # times the output's largest magnitude
SLOW = {"gnot", "lsm"}
RUN_ALL = os.environ.get("AUTOFUSER_ZOO_OUTPUTS_ALL", "") not in ("", "0")

RECORDED = json.loads(RECORD.read_text())


def _close(got: float, expected: float, atol: float) -> bool:
    if math.isnan(expected):
        return math.isnan(got)
    return got == expected or abs(got - expected) <= atol + RTOL * abs(expected)


def _differences(got: dict, expected: dict) -> list[str]:
    """What differs between two output summaries (``record_zoo_outputs.summarize``)."""
    if (got["shape"], got["dtype"]) != (expected["shape"], expected["dtype"]):
        return [f"shape/dtype {got['shape']} {got['dtype']}, recorded {expected['shape']} {expected['dtype']}"]
    if set(got) != set(expected):
        return [f"summary fields {sorted(got)}, recorded {sorted(expected)}"]
    if "values" in expected:
        pairs = list(zip(got["values"], expected["values"]))
        scale = max((abs(v) for v in expected["values"]), default=0.0)
    else:
        if got["positions"] != expected["positions"]:
            return ["sample positions differ from the recorded ones"]
        pairs = list(zip(got["samples"], expected["samples"]))
        scale = expected["max_abs"]
    atol = ATOL * scale
    problems = []
    bad = [(i, g, e) for i, (g, e) in enumerate(pairs) if not _close(g, e, atol)]
    if bad:
        worst = max(abs(g - e) for _, g, e in bad)
        shown = ", ".join(f"[{i}] {g!r} vs {e!r}" for i, g, e in bad[:5])
        problems.append(
            f"{len(bad)} of {len(pairs)} values differ (largest by {worst:.3g}, tolerance "
            f"{atol:.3g} + {RTOL:g} relative): {shown}"
        )
    if "values" not in expected:
        for key in ("max_abs", "sum", "abs_sum"):
            tol = atol if key == "max_abs" else ATOL * expected["abs_sum"]
            if not _close(got[key], expected[key], tol):
                problems.append(f"{key} {got[key]!r}, recorded {expected[key]!r}")
    return problems


def _group_differences(got: list[dict], expected: list[dict]) -> list[str]:
    """Where the fused groups (strategy and ops) differ from the recorded ones."""
    plain = [[(g["strategy"], g["ops"]) for g in groups] for groups in (got, expected)]
    if plain[0] == plain[1]:
        return []
    problems = [f"{len(got)} fused groups, recorded {len(expected)}"] if len(got) != len(expected) else []
    for i in range(max(len(got), len(expected))):
        now = plain[0][i] if i < len(got) else None
        then = plain[1][i] if i < len(expected) else None
        if now != then:
            problems.append(f"first difference at group {i}: {now}, recorded {then}")
            break
    return problems


def _changed_errors(got: list[dict], expected: list[dict]) -> list[str]:
    """Groups whose verification error moved: where to look when an output changed."""
    return [
        f"group {i} {g['strategy']} {g['ops']}: max_error {g['max_error']!r}, recorded {e['max_error']!r}"
        for i, (g, e) in enumerate(zip(got, expected))
        if (g["strategy"], g["ops"]) == (e["strategy"], e["ops"]) and g["max_error"] != e["max_error"]
    ]


def test_every_case_is_recorded():
    assert list(RECORDED) == [case for case, _, _ in CASES]


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            case,
            marks=pytest.mark.skipif(case in SLOW and not RUN_ALL, reason="slow; AUTOFUSER_ZOO_OUTPUTS_ALL=1 runs it"),
        )
        for case, _, _ in CASES
    ],
)
def test_fused_zoo_output_is_the_recorded_one(case):
    expected = RECORDED[case]
    got = compute(case)
    assert (got["model"], got["plugins"]) == (expected["model"], expected["plugins"])
    eager = _differences(got["eager"], expected["eager"])
    assert not eager, f"{case}: the eager output changed (the model or its inputs, not AutoFuser):\n" + "\n".join(eager)
    problems = _group_differences(got["groups"], expected["groups"])
    fused = _differences(got["fused"], expected["fused"])
    if fused:
        problems += ["fused output: " + p for p in fused] + _changed_errors(got["groups"], expected["groups"])
    assert not problems, f"{case}:\n" + "\n".join(problems)
