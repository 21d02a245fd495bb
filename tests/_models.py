"""Small models several test files build."""

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    """A transformer block's feed-forward half: layer norm, linear, GELU, linear, residual."""

    def __init__(self, width: int = 24, hidden: int = 40):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))
