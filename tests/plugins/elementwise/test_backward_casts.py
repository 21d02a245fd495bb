"""A traced backward spells each cast (autocast's among them) as ``aten._to_copy`` naming
the device its input is on already; such a cast is a cast, and joins the backward's
groups, where a real device move stays eager. Gradients against eager's on fresh random
inputs, bf16 autocast on the CPU, batch 1 and 3 at odd sizes."""

from __future__ import annotations

import copy
import zlib

import pytest
import torch

import autofuser

from _models import FeedForward

#: bf16 autocast: both sides round products to bf16 (8 bits of mantissa).
BF16 = dict(atol=2e-2, rtol=2e-2)


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


@pytest.mark.parametrize("batch", [1, 3])
def test_autocast_casts_of_a_traced_backward_join_its_groups(batch):
    model = FeedForward(width=12, hidden=20)  # under autocast: bf16 products, an fp32 norm
    reference = copy.deepcopy(model)
    fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
    x = torch.randn(batch, 19, 12)
    for module in (reference, fused):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(x)
        out.float().square().mean().backward()
    for got, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, expected.grad, **BF16)
    report = fused.report()
    backward = [g for g in report.fused if g.phase == "backward"]
    assert any("elementwise.to_copy" in g.ops for g in backward), str(report)
    moves = [u for u in report.unfused_nodes if u.phase == "backward" and u.reason_code == "device_move"]
    assert not moves, moves


def _traced(name: str, device: str, *inputs: torch.fx.Node, graph: torch.fx.Graph) -> torch.fx.Node:
    """A node: a graph input without inputs, else a call reading them; traced on
    ``device`` (its ``meta["val"]``), or not traced at all where ``device`` is empty."""
    node = graph.create_node("call_function", torch.neg, inputs, name=name) if inputs else graph.placeholder(name)
    if device:
        node.meta["val"] = torch.empty(2, device=device)
    return node


@pytest.mark.parametrize(
    "source_device, between, result_device, named, is_cast",
    [
        ("cpu", False, "cpu", "cpu", True),
        ("cpu", True, "cpu", "cpu", True),  # a node a graph pass made, without a traced value
        ("meta", False, "cpu", "cpu", False),  # the input lives elsewhere: a move
        ("meta", True, "cpu", "cpu", False),
        ("cpu", False, "cpu", "meta", False),  # named another device than the result's
        ("", False, "cpu", "cpu", False),  # nothing traced to judge by
        ("mixed", True, "cpu", "cpu", False),  # a pass-made node reading a CPU scalar and another device
    ],
)
def test_a_copy_naming_its_inputs_own_device_is_a_cast_and_any_other_a_move(
    source_device, between, result_device, named, is_cast
):
    from types import SimpleNamespace

    from autofuser_plugins.elementwise.ops.cast import _where_it_is

    graph = torch.fx.Graph()
    if source_device == "mixed":
        scalar, other = _traced("scalar", "cpu", graph=graph), _traced("grad", "meta", graph=graph)
        source = graph.create_node("call_function", torch.mul, (scalar, other), name="made")
        between = False
    else:
        source = _traced("x", source_device, graph=graph)
    if between:
        source = _traced("made", "", source, graph=graph)
    copy_node = graph.create_node("call_function", torch.ops.aten._to_copy.default, (source,), name="copy")
    copy_node.meta["val"] = torch.empty(2, device=result_device)
    assert _where_it_is(SimpleNamespace(node=copy_node), torch.device(named)) is is_cast
