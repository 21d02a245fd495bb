"""The attention plugin's ``fuse()`` options (``autofuser_register_options``)."""

from pydantic import BaseModel, ConfigDict, Field


class AttentionOptions(BaseModel):
    """Options the attention strategies read; strict like ``FuseOptions``."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    reassociate_products: bool = Field(
        False,
        strict=True,
        description="Let strategies reorder a chain of matrix products where exact arithmetic gives the same "
        "result ((q @ k^T) @ v as q @ (k^T @ v)): rounding differs and the cost changes, often "
        "from quadratic to linear in the sequence length. Off: products run as written.",
    )
