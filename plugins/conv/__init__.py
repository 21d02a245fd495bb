"""Convolutional layers as fused kernels: 1x1 convolutions (``Conv1d``/``2d``/
``3d`` and ``F.conv*d`` with kernel 1) as channel-dim matrix products read in
place, so the matmul strategies fuse their bias, activation and residual; batch
norm in eval mode as a per-channel scale and shift that joins the product's
epilogue (or any pointwise chain); instance norm and group norm as row
reductions over the spatial dims that join the row-reduction strategy."""

from autofuser import hookimpl
from autofuser_core.oplib import collect_specs

from . import ops


@hookimpl
def autofuser_register_lowerings(register):
    for spec in collect_specs(ops):
        register(spec)
