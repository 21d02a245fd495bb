"""``batch_norm_act`` (the call ``batch_norm_pass.py`` writes for a batch norm by the
batch's statistics and its activation): no fused group holds it - it updates the
running statistics, and its own kernels already read the activation once per pass -
so its lowering only names it in the report."""

from autofuser import LoweringSpec

from ..batch_norm_train import batch_norm_act


def lower_batch_norm_act(ctx, *args, **kwargs):
    ctx.refuse(
        "own_kernels",
        "batch norm by the batch's statistics with its activation runs as the conv plugin's own kernels "
        "(statistics, then normalisation and activation in one pass; backward in two)",
    )


SPECS = [
    LoweringSpec(
        name="conv.batch_norm_act",
        description="batch norm in training mode with its activation: the plugin's own kernels, never a group",
        targets=(batch_norm_act,),
        kind="opaque",
        lower=lower_batch_norm_act,
        dtypes=("float32", "float16", "bfloat16", "int64"),  # num_batches_tracked: int64
    )
]
