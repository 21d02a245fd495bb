"""Whether torch multiplies fp32 in TF32, read and set through either of its APIs.

Torch has two ways to say it. The legacy flags: ``torch.backends.cuda.matmul.allow_tf32``
and ``torch.set_float32_matmul_precision`` for cuBLAS products,
``torch.backends.cudnn.allow_tf32`` for cuDNN's convolutions. And, from torch 2.9, an
``fp32_precision`` attribute per backend ("tf32", "ieee", "bf16" for oneDNN, or "none":
as the enclosing one says, up to ``torch.backends.fp32_precision``; reading one gives
the value in force, the enclosing one's where it is "none"). The legacy setters write
the newer attributes too; but once a program sets the matmul one itself (or anything
writes it), torch refuses the legacy reads (a ``RuntimeError`` naming the mix). Kernels
match eager's rule, so the core reads it on every call: through the legacy flags (the
cheapest read) where torch answers them, else the newer attributes; and it writes
(``strict_fp32``) only through the API the program uses.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

#: The newer API's backends, each after the one it inherits from ("" the generic one).
BACKENDS = (
    "",
    "cuda.matmul",
    "cudnn",
    "cudnn.conv",
    "cudnn.rnn",
    "mkldnn",
    "mkldnn.matmul",
    "mkldnn.conv",
    "mkldnn.rnn",
)


def _backend(path: str) -> Optional[Any]:
    """The object holding ``path``'s ``fp32_precision`` (torch 2.9+), or None."""
    found: Any = torch.backends
    for part in path.split(".") if path else ():
        found = getattr(found, part, None)
    return found if found is not None and hasattr(found, "fp32_precision") else None


def tf32_allowed(kind: str = "matmul") -> bool:
    """Whether eager multiplies fp32 ``kind`` ("matmul": cuBLAS products; "conv": cuDNN
    convolutions) in TF32."""
    try:
        if kind == "matmul":
            return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"
        return bool(torch.backends.cudnn.allow_tf32)
    except RuntimeError:  # the program set the newer API itself: torch refuses the legacy reads
        backend = _backend("cuda.matmul" if kind == "matmul" else "cudnn.conv")
        return backend is not None and backend.fp32_precision == "tf32"


def fp32_settings() -> tuple:
    """Everything of torch's fp32 product settings that decides eager's arithmetic (a key,
    read on every call: the legacy flags, the cheapest read, where torch answers them)."""
    try:
        return (
            torch.backends.cuda.matmul.allow_tf32,
            torch.get_float32_matmul_precision(),
            torch.backends.cudnn.allow_tf32,
        )
    except RuntimeError:  # "none" all the way up is torch's default, IEEE: the same as "ieee"
        return tuple("ieee" if value == "none" else value for _, value in _newer_state())


def _newer_state() -> list[tuple[Any, str]]:
    return [(backend, str(backend.fp32_precision)) for backend in map(_backend, BACKENDS) if backend is not None]


def _restore_newer(state: list[tuple[Any, str]]) -> None:
    """Each backend as it read before, enclosing ones first: "none" (inheriting) where that
    reads the same, else the value itself. What each reads is restored exactly; a backend
    that inherited may be left holding its value (torch does not always read an
    inherited value back as the enclosing one's)."""
    for backend, value in state:
        backend.fp32_precision = "none"
        if backend.fp32_precision != value:
            backend.fp32_precision = value


@contextlib.contextmanager
def strict_fp32() -> Iterator[None]:
    """fp32 products and convolutions without TF32 (nor oneDNN's bf16) inside the block,
    through the API the program uses (writing the other would make torch refuse the
    program's own reads afterwards), torch's settings as they read before after it."""
    try:
        legacy = (
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
            torch.get_float32_matmul_precision(),
        )
    except RuntimeError:  # the program set the newer API to "tf32": torch refuses the legacy reads
        newer = _newer_state()
        try:
            for backend, _ in newer:
                backend.fp32_precision = "ieee"
            yield
        finally:
            _restore_newer(newer)
        return
    try:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = legacy[:2]
        torch.set_float32_matmul_precision(legacy[2])
