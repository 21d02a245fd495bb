"""autofuser-plugin-fft: the spectral layers of FNO-style models as Triton kernels.

The FFTs stay library calls (cuFFT); what sits between an FFT and its
inverse - mode truncation, the complex per-mode channel mixing and the zero
padding of the output spectrum - becomes one kernel:

- ``autofuser_transform_graph`` finds the pattern (``spectral.py``) and
  replaces it by one ``spectral_mix`` call;
- ``autofuser_register_lowerings`` claims ``spectral_mix`` as an extern op;
- ``autofuser_register_strategies`` registers the strategy that generates it
  (``kernel.py``).

Installed, it is found through the ``autofuser`` entry-point group; choose it
by name next to the bundled plugins::

    autofuser.fuse(model, plugins=["elementwise", "reduction", "matmul", "fft"])
"""

from __future__ import annotations

import torch

from autofuser import LoweringSpec, Sample, Tolerance, hookimpl

from .kernel import SPECTRAL_STRATEGY
from .spectral import find_spectral_mixes, rewrite_spectral_mixes, spectral_mix

__version__ = "0.1.0"
__all__ = ["find_spectral_mixes", "rewrite_spectral_mixes", "spectral_mix"]


def _lower_spectral_mix(ctx, spectrum, *weights, regions, stride=None):
    # One opaque value: only the fft.spectral_mix strategy, which reads the node itself, generates it.
    return ctx.extern()


def _samples(dtype: torch.dtype) -> list[Sample]:
    """Real views of random complex spectra and weights, odd sizes, overlapping regions included."""

    def real(*shape):
        return torch.view_as_real(torch.randn(*shape, dtype=torch.complex64))

    return [
        Sample(
            args=(real(2, 3, 7, 5), real(3, 4, 2, 3), real(3, 4, 2, 3)),
            kwargs={"regions": ((0, ((0, 2), (0, 3)), (0, 1)), (1, ((5, 7), (0, 3)), (0, 1)))},
            note="FNO: positive and negative rows, both low columns",
        ),
        Sample(
            args=(real(1, 5, 6, 9), real(5, 3, 4)),
            kwargs={"regions": ((0, ((0, 6), (0, 4)), (1,)),)},
            note="F-FNO: a weight along the last axis only, batch 1",
        ),
        Sample(
            args=(real(2, 2, 5, 4), real(2, 3, 4, 2), real(2, 3, 4, 2)),
            kwargs={"regions": ((0, ((0, 4), (0, 2)), (0, 1)), (1, ((1, 5), (0, 2)), (0, 1)))},
            note="overlapping regions: the later one wins",
        ),
    ]


SPECTRAL_MIX = LoweringSpec(
    name="fft.spectral_mix",
    description="Mode truncation, complex channel mixing and zero padding (spectral_mix), an extern op.",
    targets=(spectral_mix,),
    kind="opaque",
    lower=_lower_spectral_mix,
    dtypes=("float32",),
    samples=_samples,
    references=(spectral_mix,),
    # A sum over the input channels of complex products: fp32 products' tolerance.
    tolerances={"float32": Tolerance(atol=1e-4, rtol=1e-4)},
)


@hookimpl
def autofuser_transform_graph(gm, options):
    rewrite_spectral_mixes(gm)


@hookimpl
def autofuser_register_lowerings(register):
    register(SPECTRAL_MIX)


@hookimpl
def autofuser_register_strategies(register):
    register(SPECTRAL_STRATEGY)
