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
