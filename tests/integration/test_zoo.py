"""The model zoo (``autofuser.zoo.models``) and the synthetic airfoil task (``autofuser.zoo.airfoil``).

Every model, in its tiny configuration: builds, runs eager with the right
output shape (fp32 and bf16 autocast), and is captured by AutoFuser as one
graph with no opaque part whose output equals eager bit for bit. The airfoil
data: a well-formed O-mesh, a finite positive speed that obeys the Kutta
condition and tends to the free stream far away, and a velocity that is the
derivative of the complex potential.
"""

from __future__ import annotations

import cmath
import contextlib
import math

import pytest
import torch

import autofuser
from autofuser.zoo import airfoil
from autofuser.zoo.models import MESHES, MODELS, TINY_BATCH, parameter_count

from _conv_checks import assert_3x3_convs_split_at_max_reduction
from _models import tiny_input

TINY_MESH = MESHES["tiny"]


def expected_shape(name: str) -> tuple[int, ...]:
    if MODELS[name].layout == "points":
        return (TINY_BATCH, TINY_MESH[0] * TINY_MESH[1], 1)
    return (TINY_BATCH, *TINY_MESH, 1)


# ---------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------


def test_registry_lists_the_twelve_models_with_their_airfoil_settings():
    assert list(MODELS) == [
        "galerkin",
        "transformer",
        "transolver",
        "transolver2d",
        "gnot",
        "factformer",
        "fno",
        "ffno",
        "unet",
        "lsm",
        "ufno",
        "upt",
    ]
    for name, entry in MODELS.items():
        assert entry.layout in ("points", "grid"), name
        assert set(entry.configs) == {"airfoil", "tiny"}, name
        assert "fp32" in entry.dtypes and "bf16" in entry.dtypes, name
        if entry.family == "transformer" and name != "upt":  # UPT: width 512 on latent tokens
            airfoil_config = entry.configs["airfoil"]
            assert (airfoil_config["width"], airfoil_config["layers"], airfoil_config["heads"]) == (128, 8, 8), name
            assert entry.batch_size == (8 if name == "transolver2d" else 4), name
    # the authors' structured-mesh Transolver on Airfoil: 64 slices over the 221 x 51 grid, batch 8
    assert MODELS["transolver2d"].configs["airfoil"]["slices"] == 64
    assert MODELS["transolver2d"].configs["airfoil"]["mesh"] == (221, 51)
    assert MODELS["fno"].configs["airfoil"] == {"width": 32, "modes": (12, 12), "layers": 4}
    assert MODELS["fno"].batch_size == 20
    assert MODELS["lsm"].configs["airfoil"] == {"width": 32, "num_token": 4, "num_basis": 12, "depth": 4, "heads": 8}
    assert MODELS["lsm"].batch_size == 20
    assert MESHES["airfoil"] == (221, 51) and 221 * 51 == 11271


def test_unknown_config_names_the_known_ones():
    with pytest.raises(KeyError, match="airfoil, tiny"):
        MODELS["fno"].make("huge")


def test_fno_airfoil_has_the_known_parameter_count():
    # 4 spectral layers of 2 x 32 x 32 x 12 x 12 complex weights dominate FNO-2d's 2.37M.
    assert parameter_count(MODELS["fno"].make("airfoil")) == 2_368_033


# ---------------------------------------------------------------------------
# Every model, tiny: eager, bf16, capture
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_tiny_model_runs_eager_with_the_right_shape(name):
    torch.manual_seed(0)
    model = MODELS[name].make("tiny").eval()
    x = tiny_input(name)
    with torch.no_grad():
        out = model(x)
    assert out.shape == expected_shape(name) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    grid = MODELS[name].as_grid(out, TINY_MESH)
    assert grid.shape == (TINY_BATCH, *TINY_MESH, 1)


@pytest.mark.parametrize("name", list(MODELS))
def test_tiny_model_runs_under_bf16_autocast(name):
    torch.manual_seed(0)
    model = MODELS[name].make("tiny").eval()
    x = tiny_input(name)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
        reference = model.float()(x)
    assert out.shape == expected_shape(name)
    assert torch.isfinite(out.float()).all()
    assert all(p.dtype in (torch.float32, torch.complex64) for p in model.parameters())
    assert torch.equal(out, reference)  # same autocast region, same result


@pytest.mark.parametrize("name", list(MODELS))
def test_tiny_model_is_captured_whole_and_bit_exact(name):
    torch.manual_seed(0)
    model = MODELS[name].make("tiny").eval()
    x = tiny_input(name)
    gm = autofuser.capture(model, x)
    assert gm.meta["autofuser_opaque"] == {}
    assert not [n for n in gm.graph.nodes if n.op == "call_module" and "autofuser_opaque_reason" in n.meta]
    with torch.no_grad():
        expected = model(x)
        got = gm(x)
    assert torch.equal(got, expected)
    # The graph is specialised on shapes, not on values: another airfoil gives eager's answer too.
    other = tiny_input(name, seed=1)
    with torch.no_grad():
        assert torch.equal(gm(other), model(other))


# ---------------------------------------------------------------------------
# LSM: padding, patches, and what AutoFuser makes of it
# ---------------------------------------------------------------------------


def test_lsm_airfoil_pads_to_224_by_64_and_every_scale_splits_into_14_by_4_patches():
    from autofuser.zoo.models.lsm import NeuralSpectralBlock2d

    model = MODELS["lsm"].make("airfoil").eval()
    assert [block.to_query.in_channels for block in model.process] == [32, 64, 128, 256, 256]
    seen = []
    hooks = [
        block.register_forward_hook(lambda module, args, out: seen.append((args[0].shape, args[1], out.shape)))
        for block in model.modules()
        if isinstance(block, NeuralSpectralBlock2d)
    ]
    x = MODELS["lsm"].inputs(airfoil.make_dataset(1, 0)[0])
    with torch.no_grad():
        out = model(x)
    for hook in hooks:
        hook.remove()
    assert out.shape == (1, 221, 51, 1) and torch.isfinite(out).all()
    sizes = sorted((shape[-2:] for shape, _, _ in seen), reverse=True)
    assert sizes == [(224, 64), (112, 32), (56, 16), (28, 8), (14, 4)]
    assert all(patch == (14, 4) and shape == out_shape for shape, patch, out_shape in seen)


def test_lsm_spectral_block_works_patch_by_patch():
    # Split and merge put every patch back where it came from: the block on the whole map
    # equals the block on each patch alone, and a change in one patch changes only that patch.
    from autofuser.zoo.models.lsm import NeuralSpectralBlock2d

    torch.manual_seed(0)
    block = NeuralSpectralBlock2d(width=8, num_basis=4, num_token=3, heads=2).eval()
    x = torch.randn(2, 8, 10, 9)
    with torch.no_grad():
        whole = block(x, (5, 3))
        for i in range(2):
            for j in range(3):
                rows, cols = slice(5 * i, 5 * i + 5), slice(3 * j, 3 * j + 3)
                torch.testing.assert_close(whole[..., rows, cols], block(x[..., rows, cols], (5, 3)))
        changed = x.clone()
        changed[..., 5:, 3:6] += torch.randn(2, 8, 5, 3)
        diff = (block(changed, (5, 3)) - whole).abs().amax(dim=(0, 1))
    assert diff[5:, 3:6].min() > 0
    diff[5:, 3:6] = 0
    assert diff.max() == 0


LSM_TOLERANCES = {  # as for the convolutional zoo models (tests/plugins/conv/test_conv.py)
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=3e-2, rtol=5e-2),
}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_lsm_fused_matches_eager_with_convolutions_attention_and_upsampling_fused(autocast):
    torch.manual_seed(0)
    model = MODELS["lsm"].make("tiny").eval()
    x, other = tiny_input("lsm"), tiny_input("lsm", seed=1)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        got, expected = fused(x), model(x)
        got_other, expected_other = fused(other), model(other)
    assert got.dtype == expected.dtype == (torch.bfloat16 if autocast else torch.float32)
    for g, e in ((got, expected), (got_other, expected_other)):
        torch.testing.assert_close(g.float(), e.float(), **LSM_TOLERANCES[e.dtype])
    report = fused.report()
    strategies = [g.strategy for g in report.fused]
    # Tiny LSM (depth 2): stem, 2 encoder and 2 decoder double convs, each two 3x3 conv-BN-ReLU;
    # those with a reduction past MAX_REDUCTION are cuDNN's, their BN + ReLU fused alone.
    assert_3x3_convs_split_at_max_reduction(model, report, "elementwise.relu", count=10)
    # Each decoder step's upsampling with the concatenation of its processed skip.
    assert sum(g.ops == ["conv.interpolate", "conv.cat"] for g in report.fused) == 2, str(report)
    # Per scale (3), latent queries -> points and points -> latent tokens, scores never in memory.
    assert strategies.count("softmax_attention") == 6, str(report)
    # The 1x1 convolutions (keys and values, queries per scale; the head) are products.
    assert sum(g.ops == ["conv.conv2d_module"] and g.strategy == "matmul" for g in report.fused) == 7, str(report)


def test_lsm_patches_and_heads_are_traced_through_einops():
    model = MODELS["lsm"].make("tiny").eval()
    gm = autofuser.capture(model, tiny_input("lsm"))
    assert gm.meta["autofuser_opaque"] == {}
    assert not any(str(getattr(n.target, "__module__", "") or "").startswith("einops") for n in gm.graph.nodes)
    permutes: dict[str, list] = {}
    for node in gm.graph.nodes:
        if node.target == "permute":
            scope = list(node.meta.get("nn_module_stack", {}))
            permutes.setdefault(scope[-1] if scope else "", []).append(tuple(node.args[1]))
    for scale in range(3):
        block = permutes[f"process.{scale}"]
        # "b c (nh ph) (nw pw) -> (b nh nw) c ph pw" and back.
        assert block.count((0, 2, 4, 1, 3, 5)) == 1 and block.count((0, 3, 1, 4, 2, 5)) == 1, block
        # "p (heads d) ph pw -> p heads (ph pw) d" for keys, values, queries and back for the output.
        assert block.count((0, 1, 3, 4, 2)) == 3 and block.count((0, 1, 4, 2, 3)) == 1, block


# ---------------------------------------------------------------------------
# Airfoil data
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dataset():
    return airfoil.make_dataset(6, seed=3)


def test_dataset_shapes_dtypes_and_determinism(dataset):
    coords, speed = dataset
    assert coords.shape == (6, 221, 51, 2) and speed.shape == (6, 221, 51, 1)
    assert coords.dtype == speed.dtype == torch.float32
    again = airfoil.make_dataset(6, seed=3)
    assert torch.equal(again[0], coords) and torch.equal(again[1], speed)
    prefix = airfoil.make_dataset(2, seed=3)
    assert torch.equal(prefix[0], coords[:2]) and torch.equal(prefix[1], speed[:2])
    other = airfoil.make_dataset(2, seed=4)
    assert not torch.equal(other[0], coords[:2])
    test_coords, test_speed = airfoil.test_set()
    assert test_coords.shape == (8, 221, 51, 2) and torch.equal(airfoil.test_set(3)[1], test_speed[:3])


def test_speed_is_finite_positive_and_free_stream_far_away(dataset):
    _, speed = dataset
    speed = speed[..., 0]
    assert torch.isfinite(speed).all()
    assert (speed > 0).all()
    outer = speed[:, :, -1]
    assert (outer - 1).abs().max() < 0.03  # U = 1 at 10 chords, up to the circulation's 1/r decay
    wall = speed[:, :, 0]
    assert wall.min() < 0.1  # the front stagnation point
    assert wall.max() < 5  # Kutta condition: no singular speed at the trailing edge
    assert wall.max() > 1.2  # the suction peak


def test_mesh_is_a_well_formed_o_mesh(dataset):
    coords, _ = dataset
    z = torch.complex(coords[..., 0].double(), coords[..., 1].double())
    # Every cell (i, j)-(i+1, j)-(i+1, j+1)-(i, j+1), including the wrap-around one, has the same orientation.
    a, b = z, torch.roll(z, -1, dims=1)
    c, d = b[:, :, 1:], a[:, :, 1:]
    a, b = a[:, :, :-1], b[:, :, :-1]
    area = 0.5 * ((a.conj() * b).imag + (b.conj() * c).imag + (c.conj() * d).imag + (d.conj() * a).imag)
    assert (area < 0).all() or (area > 0).all()
    assert area.abs().min() > 0
    # The wall is a closed airfoil of chord about 1; the outer boundary is about 10 chords away.
    wall = z[:, :, 0]
    chord = wall.real.amax(1) - wall.real.amin(1)
    assert ((chord > 0.85) & (chord < 1.15)).all()
    assert (z[:, :, -1].abs() > 8).all()
    # Each ring lies further from the wall than the one inside it.
    rings = z[0, :, ::5]
    distance = (rings[:, None, :] - wall[0][None, :, None]).abs().amin(dim=(0, 1))
    assert distance[0] == 0 and (distance[1:] > distance[:-1]).all()
    # Distinct nodes: no node repeats the seam.
    assert (wall - torch.roll(wall, 1, dims=1)).abs().min() > 0


def test_wall_is_the_joukowski_image_of_the_circle():
    alpha, mu = airfoil.sample_parameters(3, seed=11)
    z, _ = airfoil.airfoil_flow(alpha, mu, mesh=(64, 5))
    for k in range(3):
        m = complex(mu[k])
        radius = abs(1 - m)
        for i in (0, 17, 40):
            theta = cmath.phase(1 - m) + 2 * math.pi * (i + 0.5) / 64
            zeta = m + radius * cmath.exp(1j * theta)
            assert abs(complex(z[k, i, 0]) - (zeta + 1 / zeta)) < 1e-12


def test_kutta_condition_holds_at_the_trailing_edge():
    alpha, mu = airfoil.sample_parameters(5, seed=7)
    at_trailing_edge = airfoil.circle_velocity(torch.ones(5, dtype=torch.complex128), alpha, mu)
    assert at_trailing_edge.abs().max() < 1e-12


def test_velocity_is_the_derivative_of_the_complex_potential():
    alpha, mu = airfoil.sample_parameters(2, seed=5)
    alpha, mu = alpha[:, None], mu[:, None]
    radius = (1 - mu).abs()
    gamma = airfoil.kutta_circulation(alpha, mu)

    def potential(zeta):
        rel = zeta - mu
        rotation = torch.exp(1j * alpha)
        return rel * rotation.conj() + radius**2 * rotation / rel + 1j * gamma / (2 * math.pi) * torch.log(rel)

    angles = torch.tensor([0.4, 2.0, -2.5])
    zeta = mu + radius * torch.tensor([1.3, 2.0, 5.0], dtype=torch.float64) * torch.exp(1j * angles)
    h = 1e-6
    numeric = (potential(zeta + h) - potential(zeta - h)) / (2 * h)
    torch.testing.assert_close(airfoil.circle_velocity(zeta, alpha, mu), numeric, rtol=1e-7, atol=1e-8)


def test_relative_l2():
    target = torch.rand(3, 5, 4, 1) + 0.5
    assert airfoil.relative_l2(target, target) == 0
    assert torch.isclose(airfoil.relative_l2(1.1 * target, target), torch.tensor(0.1))
    assert torch.isclose(airfoil.relative_l2(torch.zeros_like(target), target), torch.tensor(1.0))
    # Per sample, then averaged: a sample 10x larger does not dominate.
    scaled = target * torch.tensor([1.0, 10.0, 100.0])[:, None, None, None]
    assert torch.isclose(airfoil.relative_l2(1.1 * scaled, scaled), torch.tensor(0.1))
    assert airfoil.relative_l2(target.bfloat16(), target).dtype == torch.float32


def _code(source: str) -> str:
    """A kernel's code without its comments (the header naming fx nodes, inline notes)."""
    lines = [line.split("  # ")[0].rstrip() for line in source.splitlines() if not line.startswith("#")]
    return "\n".join(lines)


@pytest.mark.parametrize("name", ["galerkin", "transolver"])
def test_repeated_layers_share_their_kernels(name):
    """Every layer of a tiny transformer generates the same code for its attention and
    feed-forward: one kernel name (one Triton compile, one tuning) per distinct code,
    not one per layer because a comment names the layer's nodes."""
    model = MODELS[name].make("tiny").eval()
    with torch.no_grad():
        fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
        x = tiny_input(name)
        torch.testing.assert_close(fused(x), model(x), atol=1e-4, rtol=1e-4)
    groups = [g for g in fused.report().fused if g.kernel_source]
    names_by_code: dict[str, set] = {}
    for g in groups:
        names_by_code.setdefault(_code(g.kernel_source), set()).add(g.kernel)
    assert all(len(names) == 1 for names in names_by_code.values()), names_by_code.values()
    attention = {g.kernel for g in groups if "attention" in g.strategy}
    assert len(attention) == 1 and sum("attention" in g.strategy for g in groups) == 2, str(fused.report())


# ---------------------------------------------------------------------------
# U-FNO and the UPT-like model: the patterns they add to the zoo, fused
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("name", "strategies"),
    [
        ("ufno", ["implicit_gemm"]),
        ("upt", ["softmax_attention"]),
        # One compile of the model for both of its patterns.
        ("transolver2d", ["implicit_gemm", "slice_attention"]),
    ],
    ids=[
        "ufno-unet-convolutions",
        "upt-cross-attention",
        "transolver2d-grid-convolutions-and-authors-slice-attention",
    ],
)
def test_new_zoo_patterns_fuse_and_match_eager(name, strategies, autocast):
    """U-FNO's U-Net branch (strided 3 x 3 convolutions with batch norm and LeakyReLU) and
    UPT's cross-attention between points and latent tokens fuse, the structured-mesh
    Transolver's slice attention as its authors wrote it (clamped temperature, repeated
    norm) is one slice-attention chain, and the fused model
    gives eager's output on a fresh airfoil, in fp32 and under bf16 autocast."""
    torch.manual_seed(0)
    model = MODELS[name].make("tiny").eval()
    fused = autofuser.fuse(model, progress=False, tune=False, verify_speed=False)
    x = tiny_input(name, seed=3)
    region = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.no_grad(), region:
        got, expected = fused(x), model(x)
    tolerance = {"atol": 3e-2, "rtol": 3e-2} if autocast else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(got.float(), expected.float(), **tolerance)
    fused_strategies = [g.strategy for g in fused.report().fused]
    for strategy in strategies:
        assert strategy in fused_strategies, str(fused.report())


def test_ufno_pads_to_a_multiple_of_8_and_crops_back():
    """221 x 51 pads to 224 x 56, where the U-Net's three halvings come back to the same
    size; the tiny 17 x 9 to 24 x 16. A point's output depends on the mesh only through
    the model, so the crop returns exactly the mesh's points."""
    from autofuser.zoo.models.ufno import UNetBranch

    model = MODELS["ufno"].make("tiny").eval()
    seen = []
    for module in model.modules():
        if isinstance(module, UNetBranch):
            module.register_forward_hook(lambda m, args, out: seen.append((args[0].shape, out.shape)))
    with torch.no_grad():
        out = model(tiny_input("ufno"))
    assert out.shape == (TINY_BATCH, *TINY_MESH, 1)
    assert seen and all(i[-2:] == (24, 16) and i == o for i, o in seen)
