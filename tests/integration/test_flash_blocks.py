"""``benchmarks/flash_blocks.py`` on the CPU: a run's tilings reach the launches
(``_with_blocks``, under the interpreter), and ``apply`` writes a sweep's winners into
a copy of flash.py's tables - the phase a sweep found nothing for keeps the table's
tiling, every other entry stays as it was - and refuses a width the table lacks."""

from __future__ import annotations

import re

import pytest
import torch

from _helpers import benchmark_scripts


@pytest.fixture(scope="module")
def sweep():
    with benchmark_scripts("flash_blocks") as module:
        yield module


def _entries(text: str, table: str) -> dict[str, str]:
    start = text.index(f"{table} = {{")
    body = text[start : text.index("}", start)]
    return dict(re.findall(r"^    (\d+): (\(.*\)),$", body, flags=re.M))


def test_apply_writes_the_winners_into_the_tables(sweep, tmp_path):
    copy = tmp_path / "flash.py"
    copy.write_text(sweep.FLASH_PY.read_text())
    before = {t: _entries(copy.read_text(), t) for t in ("BLOCKS_FP32", "BLOCKS_16BIT")}
    kept_backward = sweep.flash.BLOCKS_16BIT[64][1]
    found = [
        {"width": 16, "dtype": "float32", "forward": {"best": {"blocks": [128, 64, 8, 3]}},
         "backward": {"best": {"blocks": [64, 32, 4, 1]}}},
        {"width": 40, "dtype": "bfloat16", "forward": {"best": {"blocks": [128, 128, 8, 2]}},
         "backward": {"best": None}},
    ]  # fmt: skip
    sweep.apply(found, copy)
    after = {t: _entries(copy.read_text(), t) for t in ("BLOCKS_FP32", "BLOCKS_16BIT")}
    assert after["BLOCKS_FP32"]["16"] == "(Blocks(128, 64, 8, 3), Blocks(64, 32, 4, 1))"
    held, step, warps, stages = kept_backward.__dict__.values()
    assert after["BLOCKS_16BIT"]["64"] == f"(Blocks(128, 128, 8, 2), Blocks({held}, {step}, {warps}, {stages}))"
    for table, key in (("BLOCKS_FP32", "16"), ("BLOCKS_16BIT", "64")):
        assert {k: v for k, v in after[table].items() if k != key} == {
            k: v for k, v in before[table].items() if k != key
        }
    with pytest.raises(SystemExit, match="no entry 512"):
        sweep.apply([{**found[0], "width": 300}], copy)


def test_a_tiling_reaches_every_launch(sweep):
    seen = []
    chooser = sweep.flash.choose_blocks
    q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))

    def run():
        seen.append(sweep.flash.choose_blocks(16, torch.float32, True))
        return sweep.flash.flash_forward(q, k, v, 0.25, False)

    tiling = sweep.flash.Blocks(16, 16, 4, 1)
    out, _ = sweep._with_blocks(tiling, run)[0]
    assert seen == [tiling] and sweep.flash.choose_blocks is chooser
    expected = torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
