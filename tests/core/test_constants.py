"""Values no input reaches are computed once while compiling (``autofuser_core/constants.py``)."""

from __future__ import annotations

import torch

import autofuser


def _fuse(model):
    return autofuser.fuse(model, progress=False, tune=False, verify_speed=False)


class GridInput(torch.nn.Module):
    """FNO's lift: coordinates next to the normalised mesh indices."""

    def __init__(self):
        super().__init__()
        self.lift = torch.nn.Linear(4, 5)

    def forward(self, x):
        batch, height, width, _ = x.shape
        gi = torch.linspace(0, 1, height, device=x.device, dtype=x.dtype)
        gj = torch.linspace(0, 1, width, device=x.device, dtype=x.dtype)
        grid = torch.stack(torch.meshgrid(gi, gj, indexing="ij"), dim=-1)
        return torch.nn.functional.gelu(self.lift(torch.cat((x, grid.expand(batch, -1, -1, -1)), dim=-1)))


def test_grid_positions_are_folded_and_the_model_still_computes_eagers_values():
    model = GridInput()
    fused = _fuse(model)
    for batch, height, width in ((1, 13, 7), (3, 13, 7), (2, 5, 11)):
        x = torch.randn(batch, height, width, 2)
        with torch.no_grad():
            torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-5)
    report = fused.report()
    targets = [n.target for n in report.graph]
    assert not [t for t in targets if "linspace" in t or "meshgrid" in t or "stack" in t], targets
    assert any("computed once while compiling" in note for note in report.notes), report.notes
    assert "linspace" in " ".join(report.notes)
    # stored outside the state dict: the fused module's state is the model's
    assert set(fused.state_dict()) == set(model.state_dict())


class ReturnsAConstant(torch.nn.Module):
    def forward(self, x):
        positions = torch.arange(6, dtype=torch.float32) * 0.5
        return x * 2.0, positions


def test_a_value_the_caller_receives_is_not_folded():
    model = ReturnsAConstant()
    fused = _fuse(model)
    x = torch.randn(4, 6)
    with torch.no_grad():
        first = fused(x)[1]
        first.add_(100.0)  # the caller owns what it receives
        second = fused(x)[1]
    torch.testing.assert_close(second, torch.arange(6, dtype=torch.float32) * 0.5)
    assert not fused.report().notes or not any("computed once" in n for n in fused.report().notes)


class WritesIntoAConstant(torch.nn.Module):
    def forward(self, x):
        table = torch.zeros(5) + 1.0
        table.mul_(3.0)  # a write: the value is not the same on every call
        return x + table


class ScalesByAParameter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor([0.5, 2.0, -1.0]))

    def forward(self, x):
        return x * (self.scale * 2.0).exp()


def test_written_values_and_parameters_are_not_folded():
    x = torch.randn(7, 5)
    model = WritesIntoAConstant()
    fused = _fuse(model)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x))
        torch.testing.assert_close(fused(x), model(x))
    assert "mul_" in [n.target.split(".")[-1] for n in fused.report().graph]
    model = ScalesByAParameter()
    fused = _fuse(model)
    x = torch.randn(9, 3)
    with torch.no_grad():
        fused(x)
        model.scale.add_(0.25)  # an optimiser step: the next call reads the new value
        torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-5)


class FillsABuffer(torch.nn.Module):
    """A zero buffer filled by slice assignment, then read: FNO's spectrum without the fft plugin."""

    def forward(self, x):
        spectrum = torch.zeros(x.shape[0], 8)
        spectrum[:, :3] = x[:, :3] * 2.0
        return x[:, :1] * torch.sin(spectrum)


def test_a_value_written_into_later_is_not_folded_nor_what_is_computed_from_it():
    model = FillsABuffer()
    fused = _fuse(model)
    for seed in range(2):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            torch.testing.assert_close(fused(x), model(x))
    notes = " ".join(fused.report().notes)
    assert "computed once" not in notes, notes


def test_a_fold_that_changes_the_outputs_is_undone(monkeypatch):
    """The safety net under the rules: were a write missed (here every op is taken for
    pure), the folded graph's outputs differ from the captured graph's and the fold is
    undone, named in the report's notes."""
    import autofuser_core.constants as constants

    monkeypatch.setattr(constants, "barrier_reason", lambda node, gm: None)
    model = FillsABuffer()
    fused = _fuse(model)
    x = torch.randn(5, 4)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x))
    notes = " ".join(fused.report().notes)
    assert "not folded into constants: the folded graph's outputs differ" in notes, notes
