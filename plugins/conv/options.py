"""The conv plugin's ``fuse()`` options (``autofuser_register_options``)."""

from pydantic import BaseModel, ConfigDict, Field


class ConvOptions(BaseModel):
    """Options the conv plugin's graph passes read; strict like ``FuseOptions``."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    batch_norm_kernels: bool = Field(
        True,
        strict=True,
        description="Run batch norm by the batch's statistics (training mode, or no running statistics) "
        "with the activation after it as the conv plugin's own kernels, which read and write the "
        "activation fewer times than eager's batch norm and activation (docs/conv.md). Off: "
        "eager's batch norm.",
    )
    conv_channels_last: bool = Field(
        True,
        strict=True,
        description="Feed a 2-D convolution the dense channels-last tensor that the model copies to "
        "row-major for it, where the result is permuted back to channels last and copied "
        "(layout_pass.py): cuDNN then runs in the channels-last layout and both copies go "
        "(docs/conv.md). Off: the model's copies run.",
    )
    conv_bias_apart: bool = Field(
        True,
        strict=True,
        description="With gradients on, add the bias of a convolution cuDNN runs after it "
        "(bias_pass.py), so the pointwise group around the result takes the bias and its "
        "gradient takes the bias's gradient as a column sum, where eager's backward runs a "
        "reduction of its own per convolution (docs/conv.md). Off: cuDNN adds the bias.",
    )
