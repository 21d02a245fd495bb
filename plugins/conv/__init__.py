"""Convolutional layers as fused kernels: 1x1 convolutions (``Conv1d``/``2d``/
``3d`` and ``F.conv*d`` with kernel 1) as channel-dim matrix products read in
place, so the matmul strategies fuse their bias, activation and residual; small
kernels (3x3, 3x3x3; any stride, padding, dilation) as implicit GEMM with the
same epilogue (the ``implicit_gemm`` strategy); batch
norm in eval mode as a per-channel scale and shift that joins the product's
epilogue (or any pointwise chain); instance norm and group norm as row
reductions over the spatial dims that join the row-reduction strategy;
upsampling (interpolation, transposed convolutions with stride == kernel) with
the cat and pointwise ops after it as one kernel that reads the low-resolution
input directly (the ``upsample_fused`` strategy); batch norm by the batch's
statistics (training mode) with the activation after it as the plugin's own
kernels (``batch_norm_pass.py``, ``batch_norm_train.py``); a convolution whose
input the model copies out of the channels-last layout reads that layout as it is
(``layout_pass.py``); with gradients on, a convolution cuDNN runs adds its bias
after it, so its gradient is a fused column sum (``bias_pass.py``)."""

from autofuser import GRADIENTS_KEY, collect_specs, hookimpl

from . import ops
from .batch_norm_pass import rewrite_batch_norms
from .bias_pass import convolution_biases_apart
from .convolution import CONV_STRATEGY
from .layout_pass import feed_convolutions_channels_last
from .options import ConvOptions
from .strategy import UPSAMPLE_STRATEGY


@hookimpl
def autofuser_transform_graph(gm, options):
    if getattr(options, "batch_norm_kernels", True):
        rewrite_batch_norms(gm)
    if getattr(options, "conv_channels_last", True):
        feed_convolutions_channels_last(gm)
    if getattr(options, "conv_bias_apart", True) and gm.meta.get(GRADIENTS_KEY, False):
        convolution_biases_apart(gm)  # after the layout pass, which reads the convolutions' readers


@hookimpl
def autofuser_register_options(register):
    register(ConvOptions)


@hookimpl
def autofuser_register_lowerings(register):
    for spec in collect_specs(ops):
        register(spec)


@hookimpl
def autofuser_register_strategies(register):
    register(UPSAMPLE_STRATEGY)
    register(CONV_STRATEGY)
