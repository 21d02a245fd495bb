"""Helpers of the function-leaf capture tests, in a module file of their own (a
solver's ``linalg.py``): each branches on tensor values, so tracing it fails."""

import torch


def stable_cholesky(a: torch.Tensor, jitter: float = 1e-6, tries: int = 4) -> torch.Tensor:
    """Cholesky factor of ``a``, with growing jitter on the diagonal until it is finite."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    for attempt in range(tries):
        try:
            factor = torch.linalg.cholesky(a + (jitter * 10**attempt) * eye)
            if torch.isnan(factor).any():
                raise RuntimeError("NaN in the Cholesky factor")
            return factor
        except RuntimeError:
            continue
    raise RuntimeError("not positive definite even with jitter")


def clamp_rows(x: torch.Tensor, limit: float = 4.0) -> torch.Tensor:
    """Rows longer than ``limit`` scaled back to it, only when there are any."""
    norm = x.norm(dim=-1, keepdim=True)
    if (norm > limit).any():
        x = x * (limit / norm.clamp_min(limit))
    return x


def centred_keys(k: torch.Tensor) -> torch.Tensor:
    """Traceable itself; only the helper it calls branches."""
    k = k - k.mean(dim=-2, keepdim=True)
    return clamp_rows(k) * 0.5
