"""The model zoo: ``MODELS`` maps a short name to a ``ModelEntry``.

Every model maps the mesh coordinates of the Airfoil task to one output field
(the flow speed). Two input layouts:

- ``"points"``: ``x`` [B, N, 2], N = H * W points in mesh order (row-major over
  the H x W structured mesh); output [B, N, 1];
- ``"grid"``: ``x`` [B, H, W, 2], channels last; output [B, H, W, 1].

``entry.inputs(coords)`` turns a batch of mesh coordinates [B, H, W, 2] into the
model's layout and ``entry.as_grid(out, mesh)`` turns its output back into
[B, H, W, 1].

Configurations: ``"airfoil"`` follows the paper or the standard neural-solver
benchmark on Airfoil (221 x 51 mesh, 2 inputs, 1 output); ``"tiny"`` is the
same code at toy sizes (17 x 9 mesh) for CPU tests under Triton's interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn
from einops import rearrange

from .factformer import FactFormer
from .ffno import FFNO2d
from .fno import FNO2d
from .galerkin import GalerkinTransformer
from .gnot import GNOT
from .lsm import LSM2d
from .transformer import Transformer
from .transolver import Transolver
from .transolver2d import TransolverStructured2D
from .ufno import UFNO2d
from .unet import UNet2d
from .upt import UPT

#: Mesh (H, W) of each configuration: H points around the airfoil, W from the wall outwards.
MESHES: dict[str, tuple[int, int]] = {"airfoil": (221, 51), "tiny": (17, 9)}
TINY_BATCH = 2


@dataclass(frozen=True)
class ModelEntry:
    """One model of the zoo: how to build it and feed it."""

    name: str
    title: str
    paper: str
    family: str  # "transformer" | "neural operator" | "convolutional"
    layout: str  # "points" | "grid"
    batch_size: int  # of the airfoil configuration (the paper's / the standard script's)
    builder: Callable[..., nn.Module]
    configs: Mapping[str, Mapping[str, Any]]
    dtypes: tuple[str, ...] = ("fp32", "bf16")  # bf16: fp32 parameters under torch.autocast
    notes: str = ""
    # The airfoil configuration's batch for a training step (``bench --train``) where eager
    # training does not fit an 80-140 GB GPU at ``batch_size``; None: ``batch_size``.
    train_batch_size: Optional[int] = None

    def make(self, config: str = "airfoil") -> nn.Module:
        """A freshly initialised model of configuration ``config`` ("airfoil" or "tiny")."""
        if config not in self.configs:
            raise KeyError(
                f"model {self.name!r} has no configuration {config!r}; choose one of {', '.join(self.configs)}"
            )
        return self.builder(**self.configs[config])

    def batch(self, config: str = "airfoil", *, train: bool = False) -> int:
        if config != "airfoil":
            return TINY_BATCH
        return (self.train_batch_size or self.batch_size) if train else self.batch_size

    def inputs(self, coords: torch.Tensor) -> torch.Tensor:
        """Mesh coordinates [B, H, W, 2] in this model's input layout."""
        if self.layout == "points":
            return rearrange(coords, "b h w c -> b (h w) c").contiguous()
        return coords

    def as_grid(self, out: torch.Tensor, mesh: tuple[int, int]) -> torch.Tensor:
        """This model's output in the mesh layout [B, H, W, C]."""
        if self.layout == "points":
            return rearrange(out, "b (h w) c -> b h w c", h=mesh[0], w=mesh[1])
        return out


def _transformer_configs() -> dict[str, dict[str, Any]]:
    """Width 128, 8 layers, 8 heads (the neural-solver benchmark's transformers); tiny: 16, 2, 2."""
    return {
        "airfoil": {"width": 128, "layers": 8, "heads": 8, "mlp_ratio": 2},
        "tiny": {"width": 16, "layers": 2, "heads": 2, "mlp_ratio": 2},
    }


MODELS: dict[str, ModelEntry] = {
    entry.name: entry
    for entry in (
        ModelEntry(
            name="galerkin",
            title="Galerkin Transformer",
            family="transformer",
            layout="points",
            batch_size=4,
            paper="Cao, Choose a Transformer: Fourier or Galerkin, NeurIPS 2021",
            builder=GalerkinTransformer,
            configs=_transformer_configs(),
        ),
        ModelEntry(
            name="transformer",
            title="Transformer (softmax attention)",
            family="transformer",
            layout="points",
            batch_size=4,
            paper="Vaswani et al., Attention Is All You Need, NeurIPS 2017",
            builder=Transformer,
            configs=_transformer_configs(),
            notes=(
                "attention written out: the [B, 8, N, N] scores take 16 GB in fp32 at batch 4; a training "
                "step saves them per layer, so it trains at batch 1"
            ),
            train_batch_size=1,
        ),
        ModelEntry(
            name="transolver",
            title="Transolver",
            family="transformer",
            layout="points",
            batch_size=4,
            paper="Wu et al., Transolver: A Fast Transformer Solver for PDEs on General Geometries, ICML 2024",
            builder=Transolver,
            configs={
                "airfoil": {**_transformer_configs()["airfoil"], "slices": 64, "mesh": MESHES["airfoil"]},
                "tiny": {**_transformer_configs()["tiny"], "slices": 8, "mesh": MESHES["tiny"]},
            },
        ),
        ModelEntry(
            name="transolver2d",
            title="Transolver, structured mesh (authors' code)",
            family="transformer",
            layout="points",
            batch_size=8,
            paper="Wu et al., Transolver: A Fast Transformer Solver for PDEs on General Geometries, ICML 2024 "
            "(the authors' Transolver_Structured_Mesh_2D and Airfoil settings)",
            builder=TransolverStructured2D,
            configs={
                "airfoil": {**_transformer_configs()["airfoil"], "slices": 64, "mesh": MESHES["airfoil"]},
                "tiny": {**_transformer_configs()["tiny"], "slices": 8, "mesh": MESHES["tiny"]},
            },
            notes="written as the authors wrote it: the grid's permutes and contiguous copies, the clamped "
            "temperature, the repeated slice norm and the last block's own head",
        ),
        ModelEntry(
            name="gnot",
            title="GNOT",
            family="transformer",
            layout="points",
            batch_size=4,
            paper="Hao et al., GNOT: A General Neural Operator Transformer for Operator Learning, ICML 2023",
            builder=GNOT,
            configs={
                "airfoil": {**_transformer_configs()["airfoil"], "experts": 3},
                "tiny": {**_transformer_configs()["tiny"], "experts": 2},
            },
        ),
        ModelEntry(
            name="factformer",
            title="FactFormer",
            family="transformer",
            layout="grid",
            batch_size=4,
            paper="Li, Shu and Barati Farimani, Scalable Transformer for PDE Surrogate Modeling, NeurIPS 2023",
            builder=FactFormer,
            configs=_transformer_configs(),
        ),
        ModelEntry(
            name="fno",
            title="FNO",
            family="neural operator",
            layout="grid",
            batch_size=20,
            paper="Li et al., Fourier Neural Operator for Parametric PDEs, ICLR 2021 (airfoil set-up of Geo-FNO, 2022)",
            builder=FNO2d,
            configs={
                "airfoil": {"width": 32, "modes": (12, 12), "layers": 4},
                "tiny": {"width": 8, "modes": (4, 3), "layers": 2, "projection": 16},
            },
        ),
        ModelEntry(
            name="ffno",
            title="F-FNO",
            family="neural operator",
            layout="grid",
            batch_size=10,
            paper="Tran et al., Factorized Fourier Neural Operators, ICLR 2023",
            builder=FFNO2d,
            configs={
                "airfoil": {"width": 64, "modes": (32, 16), "layers": 8, "factor": 4},
                "tiny": {"width": 8, "modes": (4, 3), "layers": 2, "factor": 2, "projection": 16},
            },
        ),
        ModelEntry(
            name="unet",
            title="U-Net",
            family="convolutional",
            layout="grid",
            batch_size=20,
            paper="Ronneberger et al., U-Net, MICCAI 2015",
            builder=UNet2d,
            configs={"airfoil": {"width": 32, "depth": 4}, "tiny": {"width": 8, "depth": 2}},
        ),
        ModelEntry(
            name="lsm",
            title="LSM",
            family="neural operator",
            layout="grid",
            batch_size=20,
            paper="Wu et al., Solving High-Dimensional PDEs with Latent Spectral Models, ICML 2023",
            builder=LSM2d,
            configs={
                "airfoil": {"width": 32, "num_token": 4, "num_basis": 12, "depth": 4, "heads": 8},
                "tiny": {"width": 8, "num_token": 4, "num_basis": 4, "depth": 2, "heads": 2, "projection": 16},
            },
            notes="the grid is zero-padded to a multiple of 16 (224 x 64) inside the model and cropped back",
        ),
        ModelEntry(
            name="ufno",
            title="U-FNO",
            family="neural operator",
            layout="grid",
            batch_size=20,
            paper="Wen et al., U-FNO - An enhanced Fourier neural operator-based deep-learning model for "
            "multiphase flow, Advances in Water Resources 2022",
            builder=UFNO2d,
            configs={
                "airfoil": {"width": 32, "modes": (12, 12), "fourier_layers": 3, "ufourier_layers": 3},
                "tiny": {"width": 8, "modes": (4, 3), "fourier_layers": 1, "ufourier_layers": 1, "projection": 16},
            },
            notes="FNO with a U-Net beside the spectral convolution in its last layers; the grid is zero-padded "
            "to a multiple of 8 (224 x 56) inside the model and cropped back",
        ),
        ModelEntry(
            name="upt",
            title="UPT (latent tokens)",
            family="transformer",
            layout="points",
            batch_size=8,
            paper="Alkin et al., Universal Physics Transformers, NeurIPS 2024",
            builder=UPT,
            configs={
                "airfoil": {"width": 512, "latents": 256, "layers": 4, "heads": 8, "mlp_ratio": 4},
                "tiny": {"width": 16, "latents": 8, "layers": 2, "heads": 2, "mlp_ratio": 2},
            },
            notes="points pooled into latent tokens by a perceiver (no supernode message passing), a "
            "transformer on the tokens, a cross-attention decoder at the mesh points",
        ),
    )
}


def parameter_count(model: nn.Module) -> int:
    """Number of real scalars in the parameters (a complex weight counts twice)."""
    return sum(p.numel() * (2 if p.is_complex() else 1) for p in model.parameters())


__all__ = ["MESHES", "MODELS", "ModelEntry", "TINY_BATCH", "parameter_count"]
