"""A fused training step replayed as two CUDA graphs (``cudagraphs.TrainingGraph``):
outputs and gradients equal to launching op by op, a returned output or gradient never
overwritten by a later replay, gradients accumulated over several backwards, a second
call before the first's backward run uncaptured, and parameters replaced or frozen
noticed. GPU only: a CUDA graph needs a device."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autofuser
from autofuser_core.cudagraphs import TrainingGraph, try_training_graph

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Block(nn.Module):
    def __init__(self, width: int = 37):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 3 * width)
        self.down = nn.Linear(3 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def _pair(seed: int = 0):
    torch.manual_seed(seed)
    model = Block().cuda()
    twin = Block().cuda()
    twin.load_state_dict(model.state_dict())
    return model, twin


def _graph(model, x) -> TrainingGraph:
    graph, why = try_training_graph(model, (x,), model)
    assert graph is not None, why
    return graph


def _train_side_by_side(graph: TrainingGraph, model, twin, shape: tuple, steps: int) -> None:
    """``steps`` backwards through replays of ``graph`` and through ``twin``, without
    zero_grad: every call replayed, and the summed gradients equal."""
    start = graph.generation
    for _ in range(steps):
        x = torch.randn(*shape, device="cuda")
        graph(x).square().mean().backward()
        twin(x).square().mean().backward()
    assert graph.generation == start + steps
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_replayed_steps_train_as_eager_does_and_never_overwrite_results():
    model, twin = _pair()
    x0 = torch.randn(3, 101, 37, device="cuda", requires_grad=True)
    graph = _graph(model, x0)
    start = graph.generation  # the capture's check replayed once
    opt, opt_twin = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(twin.parameters(), lr=1e-2)
    kept = []
    for step in range(4):
        x = torch.randn(3, 101, 37, device="cuda", requires_grad=True)
        x_twin = x.detach().clone().requires_grad_()
        target = torch.randn(3, 101, 37, device="cuda")
        out, ref = graph(x), twin(x_twin)
        assert graph.generation == start + step + 1  # replayed, not run uncaptured
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        F.mse_loss(out, target).backward()
        F.mse_loss(ref, target).backward()
        torch.testing.assert_close(x.grad, x_twin.grad, rtol=0, atol=0)
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
        kept.append((out.detach(), ref.detach(), [p.grad for p in model.parameters()], _grads(twin)))
        opt.step(), opt_twin.step()
        opt.zero_grad(set_to_none=True), opt_twin.zero_grad(set_to_none=True)
    for out, ref, grads, ref_grads in kept:  # later replays wrote into none of them
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=0, atol=0)


def test_gradients_accumulate_over_backwards_of_replayed_calls():
    model, twin = _pair(1)
    graph = _graph(model, torch.randn(2, 57, 37, device="cuda"))
    _train_side_by_side(graph, model, twin, (2, 57, 37), 3)  # no zero_grad between: .grad sums the three


def test_a_call_before_the_last_ones_backward_runs_uncaptured_and_both_are_right():
    model, twin = _pair(2)
    graph = _graph(model, torch.randn(1, 33, 37, device="cuda"))
    start = graph.generation
    a, b = torch.randn(1, 33, 37, device="cuda"), torch.randn(1, 33, 37, device="cuda")
    first = graph(a)
    second = graph(b)  # the first's backward is still to come: this one must not replay
    assert graph.generation == start + 1 and graph.pending == 1
    (first.sum() + 2 * second.sum()).backward()
    (twin(a).sum() + 2 * twin(b).sum()).backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)
    assert graph.pending == 0
    dropped = graph(a)  # its autograd graph dropped without a backward: the next call replays again
    del dropped
    graph(b)
    assert graph.generation == start + 3


def test_replaced_or_frozen_parameters_run_uncaptured():
    model, twin = _pair(3)
    x = torch.randn(2, 45, 37, device="cuda")
    graph = _graph(model, x)
    start = graph.generation
    model.up.weight.requires_grad_(False)
    twin.up.weight.requires_grad_(False)
    graph(x).sum().backward()
    twin(x).sum().backward()
    assert graph.generation == start and model.up.weight.grad is None
    torch.testing.assert_close(model.down.weight.grad, twin.down.weight.grad)
    model.up.weight.requires_grad_(True)
    model.down.weight = nn.Parameter(model.down.weight.detach().clone())
    graph(x)
    assert graph.generation == start


def test_an_input_needing_a_gradient_it_was_captured_without_runs_uncaptured():
    model, twin = _pair(5)
    graph = _graph(model, torch.randn(2, 45, 37, device="cuda"))
    start = graph.generation
    x = torch.randn(2, 45, 37, device="cuda", requires_grad=True)
    x_twin = x.detach().clone().requires_grad_()
    graph(x).sum().backward()
    twin(x_twin).sum().backward()
    assert graph.generation == start
    torch.testing.assert_close(x.grad, x_twin.grad)


def test_a_step_captured_while_an_earlier_steps_autograd_graph_lives_replays_and_trains_as_eager():
    """A user's last loss keeps its autograd graph alive, and with it each parameter's
    gradient accumulator, on the stream that step ran on (the default one): capturing must
    not reach that stream, or capture fails."""
    model, twin = _pair(7)
    x = torch.randn(2, 45, 37, device="cuda")
    kept = model(x).square().mean()
    kept.backward()
    model.zero_grad(set_to_none=True)
    graph = _graph(model, x)
    _train_side_by_side(graph, model, twin, (2, 45, 37), 2)
    del kept


def test_random_ops_are_not_captured():
    class Dropped(Block):
        def forward(self, x):
            return F.dropout(super().forward(x), 0.3, training=True)

    model = Dropped().cuda()
    graph, why = try_training_graph(model, (torch.randn(2, 45, 37, device="cuda"),), model)
    assert graph is None and "differs" in why


@pytest.mark.parametrize("earlier_loss", [False, True], ids=["fresh", "earlier loss alive"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_fused_training_step_with_graphs_matches_eager(dtype, earlier_loss, tmp_path):
    """With ``earlier_loss``, an eager step's loss is still alive when the fused model
    compiles and captures (the parameters' accumulators belong to the default stream):
    the step is still captured."""
    model, twin = _pair(4)
    kept = None
    if earlier_loss:
        kept = model(torch.randn(4, 211, 37, device="cuda")).square().mean()
        kept.backward()
        model.zero_grad(set_to_none=True)
    fused = autofuser.fuse(model, cache_dir=tmp_path, progress=False)
    opt, opt_twin = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(twin.parameters(), lr=1e-3)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == "fp32" else dict(rtol=4e-2, atol=4e-2)
    for _ in range(5):
        x, target = torch.randn(4, 211, 37, device="cuda"), torch.randn(4, 211, 37, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            out, ref = fused(x), twin(x)
        F.mse_loss(out.float(), target).backward()
        F.mse_loss(ref.float(), target).backward()
        torch.testing.assert_close(out.float(), ref.float(), **tol)
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **tol)
        opt.step(), opt_twin.step()
        opt.zero_grad(set_to_none=True), opt_twin.zero_grad(set_to_none=True)
    notes = " ".join(fused.report().notes)
    assert "CUDA graph" in notes or fused.report().runs_original, notes
    if earlier_loss:
        assert "no CUDA graph" not in notes, notes
    del kept


def test_gradients_of_gradients_through_a_replayed_call_match_eager():
    """create_graph=True, as a physics-informed loss takes derivatives of the output by
    the input and trains on them: the replayed call's backward runs uncaptured, with history."""
    model, twin = _pair(6)
    x0 = torch.randn(2, 31, 37, device="cuda", requires_grad=True)
    graph = _graph(model, x0)
    x = torch.randn(2, 31, 37, device="cuda", requires_grad=True)
    x_twin = x.detach().clone().requires_grad_()
    (dx,) = torch.autograd.grad(graph(x).square().sum(), x, create_graph=True)
    (dx_twin,) = torch.autograd.grad(twin(x_twin).square().sum(), x_twin, create_graph=True)
    torch.testing.assert_close(dx, dx_twin, rtol=1e-5, atol=1e-5)
    dx.square().mean().backward()
    dx_twin.square().mean().backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    assert graph.pending == 0


def test_a_group_step_is_timed_as_a_replayed_graph_or_not_at_all():
    """``timing.graph_ms``: a forward and backward captured as one graph and its replays
    timed; a step that syncs the host can't be captured (None), and the device is left
    usable."""
    from autofuser_core.timing import TrainingStep, graph_ms

    model = Block().cuda()
    x = torch.randn(3, 29, 37, device="cuda", requires_grad=True)
    step = TrainingStep(model, list(model.parameters()))
    ms = graph_ms(step, x)
    assert ms is not None and 0 < ms < 100
    synced = TrainingStep(lambda t: model(t) * float(t.sum()), list(model.parameters()))
    assert graph_ms(synced, x) is None
    assert graph_ms(step, x.cpu()) is None  # not on a GPU
    assert torch.isfinite(model(x)).all()
