"""The order and length of the strategies' tuning lists. Every config tuned is a
Triton compile on a cold first call, so large kernels list their usual winners
first and tune only the first few (``StrategySpec.max_tuned_configs``); products
sort their list by how well each tile fits the product's shape."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autofuser
from autofuser import StrategySpec
from autofuser_core.planner import plan_fusion_groups
from autofuser_core.tuning import _tuning_configs
from autofuser_plugins.attention import strategy as attention
from autofuser_plugins.matmul import strategy as products
from autofuser_plugins.matmul.mlp import chain

from _models import FeedForward


def _kept(model: nn.Module, x: torch.Tensor, strategy: str):
    gm = autofuser.capture(model, x)
    return [c for c in plan_fusion_groups(gm, autofuser.load_plugins().registry).kept if c.strategy.name == strategy]


def _tiles(configs) -> list[tuple[int, int]]:
    return [(c["BLOCK_M"], c["BLOCK_N"]) for c in configs]


def test_a_one_column_product_tries_the_narrowest_tiles_first():
    [candidate] = _kept(nn.Linear(96, 1), torch.randn(3, 221, 96), "matmul")
    tuned = _tuning_configs(candidate)[0]
    assert len(tuned) == products.MAX_TUNED_CONFIGS
    assert {n for _, n in _tiles(tuned[:2])} == {32}, _tiles(tuned)  # 31 padding columns, not 127
    assert _tiles(tuned[:2]) == [(32, 32), (64, 32)]  # then the tile count: 21 programs before 11


def test_a_product_of_few_rows_tries_the_tiles_that_fill_the_chip_first():
    [candidate] = _kept(nn.Linear(64, 256), torch.randn(1, 37, 64), "matmul")
    tiles = _tiles(_tuning_configs(candidate)[0])
    programs = [-(-37 // m) * -(-256 // n) for m, n in tiles]
    assert programs == sorted(programs, reverse=True), tiles  # all under one per SM: most first
    assert tiles[0] == (32, 32)


def test_a_large_product_keeps_the_listed_order_with_padded_tiles_last():
    [candidate] = _kept(nn.Linear(128, 128), torch.randn(4, 8000, 128), "matmul")
    everything = [c for c in products.configs(candidate.program) if products.is_valid(candidate.program, c) is None]
    listed = [(m, n) for m, n, *_ in products.CONFIGS]
    tiles = _tiles(everything)
    assert [t for t in tiles if t[1] <= 128] == [t for t in listed if t[1] <= 128 and t in tiles]
    assert all(n == 256 for _, n in tiles[-2:]), tiles  # 128 padding columns each
    assert _tuning_configs(candidate)[0] == everything[: products.MAX_TUNED_CONFIGS]


def test_a_little_padding_does_not_push_wide_tiles_back():
    """200 columns: 32-wide tiles compute 224, 128-wide ones 256 - within PADDING_SLACK,
    so a large product keeps trying its 128 x 128 tiles first."""
    [candidate] = _kept(nn.Linear(96, 200), torch.randn(8, 4000, 96), "matmul")
    assert 256 <= products.PADDING_SLACK * 224
    assert _tiles(_tuning_configs(candidate)[0])[:2] == [(128, 128), (128, 128)]


def test_rows_streamed_through_a_norm_try_the_widest_column_tiles_first():
    """Layer norm + linear with fp32 rows of 256 (too long to stay on chip): every column
    tile reads each row of its block once per statistics pass and once for the product, so
    the list puts the fewest tiles across a row first - and still tunes the old winners."""
    model = nn.Sequential(nn.LayerNorm(256), nn.Linear(256, 512))
    [candidate] = _kept(model, torch.randn(4, 2000, 256), "layernorm_linear")
    assert candidate.program.product_layout.prologue_reduces and not candidate.program.product_layout.resident
    tiles = _tiles(_tuning_configs(candidate)[0])
    across = [-(-512 // n) for _, n in tiles]
    assert across == sorted(across) and across[0] == 2, tiles
    assert (128, 128) in tiles, tiles


def test_rows_on_chip_keep_the_listed_order():
    """K = 64: the norm's rows stay on chip and are read once, so tile width costs nothing."""
    model = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 512))
    [candidate] = _kept(model, torch.randn(4, 2000, 64), "layernorm_linear")
    assert candidate.program.product_layout.resident
    tiles = _tiles(_tuning_configs(candidate)[0])
    listed = [(m, n) for m, n, *_ in products.CONFIGS]
    assert tiles == [t for t in listed if t in tiles][: len(tiles)], tiles


def _chain_block() -> nn.Module:
    """A feed-forward block and a linear after it: three products in row space, one chain."""
    return nn.Sequential(FeedForward(64, 128), nn.Linear(64, 64))


def test_a_row_chain_tunes_its_usual_winners_first_and_at_most_eight():
    [candidate] = _kept(_chain_block(), torch.randn(2, 37, 64), "row_chain")
    program = candidate.program
    listed = chain.configs(program)
    valid = [c for c in listed if chain.is_valid(program, c) is None]
    assert len(valid) > chain.MAX_TUNED_CONFIGS
    tuned = _tuning_configs(candidate)[0]
    assert tuned == valid[: chain.MAX_TUNED_CONFIGS]
    first = (chain.FIRST_CONFIGS[0][0], chain.FIRST_CONFIGS[0][2])
    assert (tuned[0]["BLOCK_M"], tuned[0]["num_warps"]) == first


def test_max_tuned_configs_must_be_positive():
    fields = dict(
        name="s", propose=lambda view: [], configs=lambda p: [], default_config=lambda p: {}, generate=lambda p, h: None
    )
    assert StrategySpec(**fields, max_tuned_configs=3).max_tuned_configs == 3
    assert StrategySpec(**fields).max_tuned_configs is None
    with pytest.raises(Exception, match="max_tuned_configs"):
        StrategySpec(**fields, max_tuned_configs=0)


def test_the_bundled_caps():
    registry = autofuser.load_plugins().registry
    caps = {name: s.max_tuned_configs for name, s in registry.strategies.items()}
    assert caps["row_chain"] == chain.MAX_TUNED_CONFIGS == 8
    assert caps["matmul"] == caps["linear_epilogue"] == caps["layernorm_linear"] == products.MAX_TUNED_CONFIGS
    assert caps["softmax_attention"] == attention.MAX_TUNED_CONFIGS == 3
    assert caps["row_reduction"] is None  # small kernels: their whole list is tuned


def test_tuning_stats_reports_winners_caps_and_writes_every_timing(tmp_path, capsys):
    """benchmarks/tuning_stats.py over cache folders as AutoFuser writes them: the winner's
    place, what a cap would cost, and (``--json``) every first-round entry's timings."""
    import importlib.util
    import json
    from pathlib import Path

    from autofuser_core.cache import write_tuning

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "tuning_stats.py"
    spec = importlib.util.spec_from_file_location("tuning_stats", path)
    stats = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stats)

    def entry(folder, kernel, times, limit=None):
        timings = [{"config": {"BLOCK_M": 16 * (i + 1)}, "ms": ms} for i, ms in enumerate(times)]
        best = min(range(len(times)), key=times.__getitem__)
        write_tuning(tmp_path / folder, {"kernel": kernel}, timings[best]["config"], timings, config_limit=limit)

    entry("a", "af_mm_linear_1", [2.0, 1.0, 1.5])
    entry("a", "af_chain_linear_gelu_2", [1.0, 3.0])
    entry("b", "af_mm_linear_3", [4.0, 3.0, 2.0])
    entry("b", "af_mm_linear_4", [9.0, 1.0], limit=4)  # a re-planning round's: not a full list
    out = tmp_path / "all.json"
    assert stats.main([str(tmp_path / "a"), str(tmp_path / "b"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    mm = next(line for line in text.splitlines() if line.startswith("af_mm "))
    assert mm.split()[1:3] == ["2", "3.0"] and "[1, 2]" in mm, mm  # two kernels, winners 2nd and 3rd
    assert "100.0/ 100%" in mm  # cap 1: 2.0 vs 1.0 and 4.0 vs 2.0, both twice as slow
    dumped = json.loads(out.read_text())
    assert sorted(e["kernel"] for e in dumped) == ["af_chain_linear_gelu_2", "af_mm_linear_1", "af_mm_linear_3"]
    assert [t["ms"] for t in next(e for e in dumped if e["kernel"] == "af_mm_linear_3")["timings"]] == [4.0, 3.0, 2.0]


def test_tune_all_configs_tunes_past_the_cap_and_is_cached_apart():
    import types

    from autofuser_core.fuse import FuseOptions
    from autofuser_core.tuning import _tuning_key

    [candidate] = _kept(_chain_block(), torch.randn(2, 37, 64), "row_chain")
    capped, _ = _tuning_configs(candidate)
    every, _ = _tuning_configs(candidate, every=True)
    assert len(capped) == chain.MAX_TUNED_CONFIGS < len(every) and every[: len(capped)] == capped
    source = types.SimpleNamespace(name="af_chain_x", source_hash="0" * 64)
    plain = _tuning_key(source, torch.device("cpu"), FuseOptions())
    whole = _tuning_key(source, torch.device("cpu"), FuseOptions(tune_all_configs=True))
    assert "all_configs" not in plain and whole == {**plain, "all_configs": True}


def test_bench_passes_tune_all_configs_to_fuse(monkeypatch):
    import argparse

    from autofuser.zoo import harness

    seen = {}
    monkeypatch.setattr(harness, "run_bench", lambda names, **kwargs: seen.update(kwargs) or {"markdown": ""})
    parser = argparse.ArgumentParser()
    harness.add_arguments(parser)
    args = parser.parse_args(["--models", "fno", "--device", "cpu", "--tune-all-configs", "--tune-budget", "1"])
    assert harness.run_from_args(args) == 0
    assert seen["fuse_options"] == {"tune_budget_s": 1.0, "tune_all_configs": True}
    assert harness.run_from_args(parser.parse_args(["--models", "fno", "--device", "cpu"])) == 0
    assert seen["fuse_options"] == {}


def test_a_product_with_a_norm_over_its_columns_sorts_by_tile_count_alone():
    """A norm after the product needs a whole row in one program (no BLOCK_N): every
    config computes the same columns, so few rows try the configs with most programs first."""
    model = nn.Sequential(nn.Linear(64, 96), nn.LayerNorm(96))
    [candidate] = _kept(model, torch.randn(1, 300, 64), "linear_epilogue")
    assert candidate.program.product_layout.epilogue_reduces
    tuned, _ = _tuning_configs(candidate)
    assert 0 < len(tuned) <= products.MAX_TUNED_CONFIGS and all("BLOCK_N" not in c for c in tuned)
    block_m = [c["BLOCK_M"] for c in tuned]
    assert block_m == sorted(block_m), block_m  # 300 rows: smaller row blocks, more programs, first
