"""What a call does besides computing its result (``autofuser_core.effects``): read from
torch's tags and schemas, for calls of torch's functions and for torch's modules that the
capture keeps whole; never from a list of ops, and never by changing the user's module."""

from __future__ import annotations

import copy
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from autofuser_core import effects
from autofuser_core.effects import barrier_reason


def _graph(model: nn.Module, *inputs: torch.Tensor) -> torch.fx.GraphModule:
    """``model``'s graph with each node's metadata, as a capture on real shapes files it.
    ShapeProp runs the model once; a copy of it, so that the model's own state is untouched."""
    gm = torch.fx.symbolic_trace(model)
    shaped = torch.fx.symbolic_trace(copy.deepcopy(model))
    ShapeProp(shaped).propagate(*inputs)
    for node, twin in zip(gm.graph.nodes, shaped.graph.nodes):
        node.meta.update(twin.meta)
    return gm


def _module_barrier(module: nn.Module, shape: tuple[int, ...]) -> Optional[tuple[str, str]]:
    gm = _graph(nn.Sequential(module), torch.randn(shape))
    (node,) = (n for n in gm.graph.nodes if n.op == "call_module")
    return barrier_reason(node, gm)


class _ReadsValues(nn.Module):
    """A module of torch's (by its module path, as fx's leaf rule reads it) whose forward
    branches on a value and writes in place: it neither traces nor runs on meta tensors."""

    __module__ = "torch.nn.modules.probe"

    def forward(self, x):
        if x.sum().item() > 0:
            x = x.add_(1.0)
        return x


_SAMPLES = torch.rand(2, 5, 2)


@pytest.mark.parametrize(
    ("module", "shape", "kind", "words"),
    [
        (nn.Dropout(0.1), (3, 23), "random", "Dropout (in training mode)"),
        (nn.Dropout(0.1).eval(), (3, 23), None, ""),
        (nn.Dropout(0.0), (3, 23), None, ""),
        (nn.Dropout2d(0.2), (2, 3, 5, 7), "random", "Dropout2d"),
        (nn.RReLU(), (3, 23), "random", "RReLU"),
        (nn.RReLU().eval(), (3, 23), None, ""),
        (nn.FractionalMaxPool2d(2, output_size=(2, 3)), (2, 5, 7, 23), "random", "FractionalMaxPool2d"),
        (nn.FractionalMaxPool2d(2, output_size=(2, 3), _random_samples=_SAMPLES), (2, 5, 7, 23), None, ""),
        (nn.BatchNorm1d(5), (3, 5), "mutation", "num_batches_tracked"),
        (nn.BatchNorm2d(5, momentum=None), (2, 5, 3, 7), "mutation", "BatchNorm2d (in training mode)"),
        (nn.BatchNorm1d(5).eval(), (3, 5), None, ""),
        (nn.BatchNorm1d(5, track_running_stats=False), (3, 5), None, ""),
        (nn.InstanceNorm1d(5, track_running_stats=True), (3, 5, 6), "mutation", "running_mean"),
        (nn.InstanceNorm1d(5), (3, 5, 6), None, ""),
        (nn.ReLU(inplace=True), (3, 23), "mutation", "writes into its input"),
        (nn.Hardtanh(inplace=True), (3, 23), "mutation", "writes into its input"),
        (nn.ReLU(), (3, 23), None, ""),
        (nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), (2, 5, 8), "random", "TransformerEncoderLayer"),
        (nn.TransformerEncoderLayer(8, 2, 16, batch_first=True).eval(), (2, 5, 8), None, ""),
        (nn.Linear(23, 7), (3, 23), None, ""),
        (nn.Conv2d(5, 4, 3), (2, 5, 7, 9), None, ""),
        (nn.LayerNorm(23), (3, 23), None, ""),
        (nn.Upsample(scale_factor=2), (2, 5, 3, 7), None, ""),
        (_ReadsValues(), (3, 23), "opaque", "could not run on meta tensors"),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else None,
)
def test_a_module_of_torchs_is_judged_by_what_its_forward_runs(module, shape, kind, words):
    """No list of modules: what the forward runs, traced (or run on meta tensors where it
    can't be), is judged by torch's tags and schemas."""
    found = _module_barrier(module, shape)
    assert (found[0] if found else None) == kind, found
    assert found is None or words in found[1], found


def test_judging_a_module_leaves_it_as_it_was():
    """The trace and the run on meta tensors work on a meta copy: the module's running
    statistics, batch count, parameters and their devices stay as they were."""
    model = nn.Sequential(nn.BatchNorm1d(5), nn.Dropout(0.3), nn.InstanceNorm1d(5, track_running_stats=True))
    x = torch.randn(4, 5, 6)
    gm = _graph(model, x)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reasons = [barrier_reason(n, gm) for n in gm.graph.nodes if n.op == "call_module"]
    assert [r[0] for r in reasons if r] == ["mutation", "random", "mutation"], reasons
    after = model.state_dict()
    assert before.keys() == after.keys()
    for name, value in before.items():
        assert after[name].device == value.device and torch.equal(after[name], value), name
    assert all(isinstance(p, nn.Parameter) and p.device.type == "cpu" for p in model.parameters())


def test_a_verdict_is_kept_per_training_mode():
    """The verdict is kept in the node's metadata, and judged anew where the module's
    training mode changed (a dropout draws in training only)."""
    model = nn.Sequential(nn.Linear(23, 23), nn.Dropout(0.1))
    gm = _graph(model, torch.randn(3, 23))
    node = next(n for n in gm.graph.nodes if n.target == "1")
    assert barrier_reason(node, gm)[0] == "random"
    gm.get_submodule("1").eval()
    assert barrier_reason(node, gm) is None
    gm.get_submodule("1").train()
    assert barrier_reason(node, gm)[0] == "random"


class _Calls(nn.Module):
    def __init__(self, call):
        super().__init__()
        self.call = call
        self.register_buffer("mean", torch.zeros(5))
        self.register_buffer("var", torch.ones(5))

    def forward(self, x):
        return self.call(x, self.mean, self.var)


@pytest.mark.parametrize(
    ("call", "kind"),
    [
        (lambda x, m, v: F.batch_norm(x, m, v, training=True), "mutation"),
        (lambda x, m, v: F.batch_norm(x, m, v, training=False), None),
        (lambda x, m, v: F.batch_norm(x, None, None, training=True), None),
        (lambda x, m, v: torch.batch_norm(x, None, None, m, v, True, 0.1, 1e-5, False), "mutation"),
        (lambda x, m, v: torch.batch_norm(x, None, None, m, v, False, 0.1, 1e-5, False), None),
        (lambda x, m, v: F.instance_norm(x.unsqueeze(-1).repeat(1, 1, 4), m, v, use_input_stats=True), "mutation"),
        (lambda x, m, v: F.relu(x) + m, None),
        (lambda x, m, v: F.softmax(x, -1) * v, None),
        (lambda x, m, v: F.interpolate(x.unsqueeze(0), scale_factor=2.0), None),
    ],
)
def test_a_call_of_torchs_is_judged_by_the_schema_of_its_op(call, kind):
    """``F.batch_norm`` in training writes into the running statistics it is given, though
    the op's schema does not mark them written: torch's ``SchemaInfo`` knows it."""
    gm = _graph(_Calls(call), torch.randn(3, 5))
    kinds = {r[0] for r in (barrier_reason(n, gm) for n in gm.graph.nodes) if r is not None}
    assert kinds == ({kind} if kind else set()), kinds


def test_a_module_whose_code_names_no_such_op_is_neither_traced_nor_run(monkeypatch):
    """``nn.Linear`` names no op that draws or writes: judged without tracing it (the
    planner asks about every module of a model)."""

    def refuse(*args, **kwargs):
        raise AssertionError("traced or run")

    monkeypatch.setattr(effects, "_traced_effect", refuse)
    monkeypatch.setattr(effects, "_run_on_meta", refuse)
    for module, shape in ((nn.Linear(23, 7), (3, 23)), (nn.Conv2d(5, 4, 3), (2, 5, 7, 9)), (nn.GELU(), (3, 23))):
        assert _module_barrier(module, shape) is None


class _Doubled(nn.Module):
    def forward(self, weight):
        return weight * 2


def test_a_parametrised_module_is_judged_without_copying_it_by_pickle():
    """A parametrised module refuses ``copy.copy`` (it pickles only through ``state_dict``):
    its meta copy is made without it, and the module stays as it was."""
    from torch.nn.utils import parametrize

    linear = nn.Linear(23, 7)
    parametrize.register_parametrization(linear, "weight", _Doubled())
    original = linear.parametrizations.weight.original.detach().clone()
    assert _module_barrier(linear, (3, 23)) is None
    assert torch.equal(linear.parametrizations.weight.original, original)
    assert linear.parametrizations.weight.original.device.type == "cpu"


class _KeepsWhatItSees(nn.Module):
    """An activation of the model's own that keeps what it is given."""

    def __init__(self):
        super().__init__()
        self.seen: list = []

    def forward(self, x):
        self.seen.append(x)
        return torch.relu(x)


def test_code_of_the_models_own_inside_a_module_of_torchs_is_not_run_to_judge_it():
    """A hook or an activation of the model's own inside a module of torch's would run on
    meta tensors if the module were traced or run: it stays opaque instead, and nothing of
    the model's own code runs."""
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, activation=_KeepsWhatItSees())
    found = _module_barrier(layer, (2, 5, 8))
    assert found is not None and found[0] == "opaque" and "_KeepsWhatItSees" in found[1], found
    assert layer.activation.seen == []
    hooked = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    gm = _graph(nn.Sequential(hooked), torch.randn(2, 5, 8))
    seen: list = []
    hooked.linear1.register_forward_hook(lambda module, args, out: seen.append(out))
    found = barrier_reason(next(n for n in gm.graph.nodes if n.op == "call_module"), gm)
    assert found is not None and found[0] == "opaque" and "linear1" in found[1], found
    assert seen == []


def test_a_verdict_is_judged_anew_where_a_submodule_changed_its_mode():
    """Monte Carlo dropout: a model in eval mode with its dropouts switched back to training
    draws, and the verdict kept for the eval model does not hide it."""
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True).eval()
    gm = _graph(nn.Sequential(layer), torch.randn(2, 5, 8))
    node = next(n for n in gm.graph.nodes if n.op == "call_module")
    assert barrier_reason(node, gm) is None
    for module in gm.modules():
        if isinstance(module, nn.Dropout):
            module.train()
    found = barrier_reason(node, gm)
    assert found is not None and found[0] == "random", found


def test_a_module_of_torchs_inside_another_is_judged_with_the_shapes_of_the_outer_one():
    """An eval ``nn.TransformerEncoder``: its layers can't be traced alone (their fast-path
    checks read the input), so the encoder runs on meta tensors and is found free of effects,
    not opaque."""
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    assert _module_barrier(encoder, (2, 5, 8)) is None
    found = _module_barrier(encoder.train(), (2, 5, 8))
    assert found is not None and found[0] == "random", found


@pytest.mark.parametrize(
    ("call", "kind"),
    [
        (lambda x: torch.bernoulli(x.sigmoid(), p=0.0), "random"),  # moves the generator on
        (lambda x: F.dropout(x, 0.0, training=True), None),
        (lambda x: F.scaled_dot_product_attention(x, x, x, dropout_p=0.0), None),
    ],
)
def test_a_rate_of_zero_switches_drawing_off_for_a_dropout_only(call, kind):
    class Calls(nn.Module):
        def forward(self, x):
            return call(x)

    gm = _graph(Calls(), torch.randn(2, 3, 5, 7))
    kinds = {r[0] for r in (barrier_reason(n, gm) for n in gm.graph.nodes) if r is not None}
    assert kinds == ({kind} if kind else set()), kinds


def _noise(x):
    return x + 0.01 * torch.randn_like(x)


class _NoisyActivation(nn.Module):
    """An activation of the model's own whose draw is in a helper it calls."""

    def forward(self, x):
        return _noise(x * 2)


class _Holds(nn.Module):
    """A module of torch's (by its module path) whose own code names nothing that draws,
    holding the model's activation."""

    __module__ = "torch.nn.modules.probe"

    def __init__(self):
        super().__init__()
        self.act = _NoisyActivation()

    def forward(self, x):
        return self.act(x) * 2


def test_a_draw_in_a_helper_of_the_models_own_code_inside_a_module_of_torchs_is_seen():
    """The model's own code held by a module of torch's is read through its helpers: the
    module is opaque (not run to be judged), never judged free of effects."""
    found = _module_barrier(_Holds(), (2, 5, 8))
    assert found is not None and found[0] == "opaque", found


class _Writes(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.sigmoid(x)
        if self.how == "in place":
            y.add_(1)
        elif self.how == "augmented":
            y += 1
        elif self.how == "out=":
            torch.mul(x, 2, out=y)
        elif self.how == "draws":
            y = F.dropout(y, 0.5, training=True)
        return y * 2


@pytest.mark.parametrize(
    "how, written", [("in place", "add_"), ("augmented", "iadd"), ("out=", "mul"), ("draws", None), ("none", None)]
)
def test_first_write_names_the_node_that_may_write_and_nothing_else(how, written):
    import autofuser

    # AutoFuser's capture, which records Python's augmented assignment as operator.iadd
    found = autofuser.first_write(autofuser.capture(_Writes(how), torch.randn(3, 5)))
    if written is None:
        assert found is None
    else:
        assert found is not None and found.startswith(written), found
