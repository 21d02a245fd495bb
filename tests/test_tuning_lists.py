"""The order and length of the strategies' tuning lists. Every config tuned is a
Triton compile on a cold first call, so large kernels list their usual winners
first and tune only the first few (``StrategySpec.max_tuned_configs``); products
sort their list by how well each tile fits the product's shape."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autofuser
from autofuser import SpecError, StrategySpec
from autofuser_core.compile import _tuning_configs
from autofuser_core.planner import plan_fusion_groups
from autofuser_plugins.matmul import strategy as products
from autofuser_plugins.mlp import chain


def _kept(model: nn.Module, x: torch.Tensor, strategy: str):
    gm = autofuser.capture(model, x)
    return [c for c in plan_fusion_groups(gm, autofuser.load_plugins().registry).kept if c.strategy.name == strategy]


def _tiles(configs) -> list[tuple[int, int]]:
    return [(c["BLOCK_M"], c["BLOCK_N"]) for c in configs]


def test_a_one_column_product_tries_the_narrowest_tiles_first():
    [candidate] = _kept(nn.Linear(96, 1), torch.randn(3, 221, 96), "matmul")
    tuned = _tuning_configs(candidate)
    assert len(tuned) == products.MAX_TUNED_CONFIGS
    assert {n for _, n in _tiles(tuned[:2])} == {32}, _tiles(tuned)  # 31 padding columns, not 127
    assert _tiles(tuned[:2]) == [(32, 32), (64, 32)]  # then the tile count: 21 programs before 11


def test_a_product_of_few_rows_tries_the_tiles_that_fill_the_chip_first():
    [candidate] = _kept(nn.Linear(64, 256), torch.randn(1, 37, 64), "matmul")
    tiles = _tiles(_tuning_configs(candidate))
    programs = [-(-37 // m) * -(-256 // n) for m, n in tiles]
    assert programs == sorted(programs, reverse=True), tiles  # all under one per SM: most first
    assert tiles[0] == (32, 32)


def test_a_large_product_keeps_the_listed_order_with_padded_tiles_last():
    [candidate] = _kept(nn.Linear(128, 128), torch.randn(4, 8000, 128), "matmul")
    everything = [c for c in products.configs(candidate.program)
                  if products.is_valid(candidate.program, c) is None]
    listed = [(m, n) for m, n, *_ in products.CONFIGS]
    tiles = _tiles(everything)
    assert [t for t in tiles if t[1] <= 128] == [t for t in listed if t[1] <= 128 and t in tiles]
    assert all(n == 256 for _, n in tiles[-2:]), tiles  # 128 padding columns each
    assert _tuning_configs(candidate) == everything[:products.MAX_TUNED_CONFIGS]


class _ChainBlock(nn.Module):
    def __init__(self, width: int = 64):
        super().__init__()
        self.norm, self.lin1, self.lin2 = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x):
        return self.out(x + self.lin2(torch.relu(self.lin1(self.norm(x)))))


def test_a_row_chain_tunes_its_usual_winners_first_and_at_most_eight():
    [candidate] = _kept(_ChainBlock(), torch.randn(2, 37, 64), "row_chain")
    program = candidate.program
    listed = chain.configs(program)
    valid = [c for c in listed if chain.is_valid(program, c) is None]
    assert len(valid) > chain.MAX_TUNED_CONFIGS
    tuned = _tuning_configs(candidate)
    assert tuned == valid[:chain.MAX_TUNED_CONFIGS]
    first = (chain.FIRST_CONFIGS[0][0], chain.FIRST_CONFIGS[0][2])
    assert (tuned[0]["BLOCK_M"], tuned[0]["num_warps"]) == first
    assert len({str(sorted(c.items())) for c in listed}) == len(listed)  # no config twice


def test_max_tuned_configs_must_be_positive():
    fields = dict(name="s", propose=lambda view: [], configs=lambda p: [], default_config=lambda p: {},
                  generate=lambda p, h: None)
    assert StrategySpec(**fields, max_tuned_configs=3).max_tuned_configs == 3
    assert StrategySpec(**fields).max_tuned_configs is None
    with pytest.raises(Exception, match="max_tuned_configs"):
        StrategySpec(**fields, max_tuned_configs=0)


def test_the_bundled_caps():
    registry = autofuser.load_plugins().registry
    caps = {name: s.max_tuned_configs for name, s in registry.strategies.items()}
    assert caps["row_chain"] == chain.MAX_TUNED_CONFIGS == 8
    assert caps["matmul"] == caps["linear_epilogue"] == caps["layernorm_linear"] == products.MAX_TUNED_CONFIGS
    assert caps["softmax_attention"] == 6
    assert caps["row_reduction"] is None  # small kernels: their whole list is tuned
