"""A synthetic Airfoil task: potential flow around Joukowski airfoils.

The standard Airfoil benchmark (Geo-FNO's NACA set: Euler flow on a 221 x 51
structured mesh, coordinates in, one flow field out) cannot be downloaded here,
so this module generates a task of the same shape with a closed-form answer.

Geometry. A circle in the zeta-plane with centre ``mu = -t + i c`` (``t`` sets
the thickness, ``c`` the camber) passing through ``zeta = 1`` has radius
``R = |1 - mu|``. The Joukowski map ``z = zeta + 1/zeta`` sends it to an airfoil
with a sharp trailing edge at ``z = 2`` (``zeta = 1``, where ``dz/dzeta = 0``).

Mesh. An O-mesh: polar lines of that circle, ``zeta_ij = mu + r_j e^{i theta_i}``
with ``H`` angles starting half a cell after the trailing edge (so no node sits
on the singular point) and ``W`` radii growing geometrically from ``R`` (the
wall, ``j = 0``) to ``FAR_FIELD * R``, mapped through the Joukowski map. The map
is conformal away from ``zeta = 1``, so the mesh is orthogonal and every cell
keeps its orientation.

Flow. Uniform flow of speed ``U = 1`` at angle of attack ``alpha`` past the
circle, with circulation ``Gamma``, has the complex velocity

    dW/dzeta = U (e^{-i alpha} - R^2 e^{i alpha} / (zeta - mu)^2) + i Gamma / (2 pi (zeta - mu)).

The Kutta condition - the flow leaves the sharp trailing edge smoothly, i.e.
``dW/dzeta = 0`` at ``zeta = 1`` - fixes ``Gamma = 4 pi U R sin(alpha + beta)``
with ``beta = arcsin(c / R)`` (``1 - mu = R e^{-i beta}``). In the airfoil plane
``u - i v = (dW/dzeta) / (dz/dzeta)`` with ``dz/dzeta = 1 - 1/zeta^2``; the
target is the speed ``|u - i v|``. Far away it tends to ``U``.

Sample. Per sample (its own generator, seeded from ``seed`` and its index, so
a set of ``n`` samples is a prefix of any larger set with the same seed):
``alpha`` uniform in [-4, 10] degrees, ``t`` in [0.06, 0.16], ``c`` in
[0, 0.12]. The coordinates are rotated by ``-alpha`` (the free stream then
blows along +x and the airfoil carries its angle of attack, so the input
coordinates determine the answer) and scaled by 1/4 (chord about 1). Speed
is invariant under both.
"""

from __future__ import annotations

import math

import torch

FAR_FIELD = 40.0  # outer radius / circle radius (about 10 chords)
COORD_SCALE = 0.25  # the Joukowski chord is about 4
ALPHA_DEG = (-4.0, 10.0)
THICKNESS = (0.06, 0.16)
CAMBER = (0.0, 0.12)
TEST_SEED = 20240521
TRAIN_SEED = 0


def kutta_circulation(alpha: torch.Tensor, mu: torch.Tensor, speed: float = 1.0) -> torch.Tensor:
    """Circulation that puts the rear stagnation point on the trailing edge ``zeta = 1``."""
    radius = (1 - mu).abs()
    beta = -torch.angle(1 - mu)
    return 4 * math.pi * speed * radius * torch.sin(alpha + beta)


def circle_velocity(zeta: torch.Tensor, alpha: torch.Tensor, mu: torch.Tensor, speed: float = 1.0) -> torch.Tensor:
    """``dW/dzeta`` of the flow past the circle (complex; broadcasts over its arguments)."""
    radius2 = (1 - mu).abs() ** 2
    gamma = kutta_circulation(alpha, mu, speed)
    rel = zeta - mu
    rotation = torch.exp(1j * alpha)
    return speed * (rotation.conj() - radius2 * rotation / rel**2) + 1j * gamma / (2 * math.pi * rel)


def airfoil_flow(alpha: torch.Tensor, mu: torch.Tensor, mesh: tuple[int, int] = (221, 51)):
    """Mesh and speed for airfoils ``mu`` [n] (complex128) at angles ``alpha`` [n] (radians).

    Returns (z [n, H, W] complex128 in the airfoil frame, speed [n, H, W] float64).
    """
    height, width = mesh
    alpha, mu = alpha[:, None, None], mu[:, None, None]
    radius = (1 - mu).abs()
    trailing_edge = torch.angle(1 - mu)
    i = torch.arange(height, dtype=torch.float64)[None, :, None]
    j = torch.arange(width, dtype=torch.float64)[None, None, :]
    theta = trailing_edge + 2 * math.pi * (i + 0.5) / height
    r = radius * FAR_FIELD ** (j / (width - 1))
    zeta = mu + r * torch.exp(1j * theta)
    z = zeta + 1 / zeta
    velocity = circle_velocity(zeta, alpha, mu) / (1 - 1 / zeta**2)
    return z, velocity.abs()


def sample_parameters(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(alpha [n] radians, mu [n] complex128) of samples 0..n-1 of ``seed``."""
    draws = (
        torch.stack(
            [
                torch.rand(3, generator=torch.Generator().manual_seed(seed * 1_000_003 + k), dtype=torch.float64)
                for k in range(n)
            ]
        )
        if n
        else torch.zeros(0, 3, dtype=torch.float64)
    )
    lo, hi = ALPHA_DEG
    alpha = torch.deg2rad(lo + (hi - lo) * draws[:, 0])
    thickness = THICKNESS[0] + (THICKNESS[1] - THICKNESS[0]) * draws[:, 1]
    camber = CAMBER[0] + (CAMBER[1] - CAMBER[0]) * draws[:, 2]
    return alpha, torch.complex(-thickness, camber)


def make_dataset(n_samples: int, seed: int, mesh: tuple[int, int] = (221, 51)) -> tuple[torch.Tensor, torch.Tensor]:
    """``n_samples`` airfoils of ``seed``: (coords [n, H, W, 2] float32, speed [n, H, W, 1] float32).

    ``coords[k, i, j]`` is mesh node (i around the airfoil, j outwards; j = 0 on
    the wall) in the frame where the free stream blows along +x with speed 1.
    """
    alpha, mu = sample_parameters(n_samples, seed)
    z, speed = airfoil_flow(alpha, mu, mesh)
    z = z * torch.exp(-1j * alpha)[:, None, None] * COORD_SCALE
    coords = torch.stack((z.real, z.imag), dim=-1)
    return coords.float(), speed[..., None].float()


def test_set(n: int = 8, mesh: tuple[int, int] = (221, 51)) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed test set: the first ``n`` samples of ``TEST_SEED``."""
    return make_dataset(n, TEST_SEED, mesh)


test_set.__test__ = False  # type: ignore[attr-defined]  # not a pytest test


def relative_l2(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of ``||prediction - target||_2 / ||target||_2`` (per sample, fp32)."""
    prediction, target = prediction.float(), target.float()
    error = (prediction - target).flatten(1).norm(dim=1)
    return (error / target.flatten(1).norm(dim=1)).mean()
