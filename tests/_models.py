"""Small models several test files build."""

import torch
import torch.nn.functional as F
from torch import nn

from autofuser.zoo import airfoil
from autofuser.zoo.models import MESHES, MODELS, TINY_BATCH


class FeedForward(nn.Module):
    """A transformer block's feed-forward half: layer norm, linear, GELU, linear, residual."""

    def __init__(self, width: int = 24, hidden: int = 40):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def tiny_input(name: str, seed: int = 0) -> torch.Tensor:
    """A batch of generated airfoils (``TINY_BATCH``, the tiny mesh) in zoo model ``name``'s layout."""
    coords, _ = airfoil.make_dataset(TINY_BATCH, seed, MESHES["tiny"])
    return MODELS[name].inputs(coords)
