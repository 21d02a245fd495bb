"""Whether torch multiplies fp32 in TF32, read and set through either of its APIs.

Torch has two ways to say it. The legacy flags: ``torch.backends.cuda.matmul.allow_tf32``
and ``torch.set_float32_matmul_precision`` for cuBLAS products,
``torch.backends.cudnn.allow_tf32`` for cuDNN's convolutions. And, from torch 2.9, an
``fp32_precision`` attribute per backend ("tf32", "ieee", or "none": as the enclosing
one says, up to ``torch.backends.fp32_precision``). Once a program sets the newer one
to "tf32", torch refuses to answer through the legacy flags (a ``RuntimeError`` naming
the mix). Kernels match eager's rule, so the core reads it on every call; here it reads
whichever API answers.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


def _cudnn_conv() -> Any:
    """``torch.backends.cudnn.conv`` (torch 2.9+; None before)."""
    return getattr(torch.backends.cudnn, "conv", None)


def _newer(kind: str) -> str:
    """The newer API's setting for ``kind`` ("matmul" or "conv"), "none" resolved upwards."""
    chain = [torch.backends.cuda.matmul] if kind == "matmul" else [_cudnn_conv(), torch.backends.cudnn]
    for backend in [*chain, torch.backends]:
        value = getattr(backend, "fp32_precision", "none")
        if value != "none":
            return str(value)
    return "ieee"


def tf32_allowed(kind: str = "matmul") -> bool:
    """Whether eager multiplies fp32 ``kind`` ("matmul": cuBLAS products; "conv": cuDNN
    convolutions) in TF32."""
    try:
        if kind == "matmul":
            return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"
        return bool(torch.backends.cudnn.allow_tf32)
    except RuntimeError:  # the newer API set to "tf32": torch refuses the legacy reads
        return _newer(kind) == "tf32"


def fp32_settings() -> tuple:
    """Everything of torch's fp32 product settings that decides eager's arithmetic (a key)."""
    try:
        matmul = torch.get_float32_matmul_precision()
    except RuntimeError:
        matmul = _newer("matmul")
    return tf32_allowed("matmul"), matmul, tf32_allowed("conv")


@contextlib.contextmanager
def strict_fp32() -> Iterator[None]:
    """fp32 products and convolutions without TF32 inside the block, through the API the
    program uses, restored after."""
    try:
        legacy = (
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
            torch.get_float32_matmul_precision(),
        )
    except RuntimeError:
        legacy = None
    if legacy is None:
        backends = (torch.backends.cuda.matmul, _cudnn_conv())
        newer = [getattr(b, "fp32_precision") for b in backends]
        for backend in backends:
            setattr(backend, "fp32_precision", "ieee")
        try:
            yield
        finally:
            for backend, value in zip(backends, newer):
                setattr(backend, "fp32_precision", value)
        return
    try:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = legacy[:2]
        torch.set_float32_matmul_precision(legacy[2])
