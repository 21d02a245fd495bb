"""Dropout outside training is the identity: ``F.dropout`` (and its 1d/2d/3d,
alpha and feature-alpha variants) with ``training=False``, ``torch.dropout``
with ``train=False``, and the ``nn.Dropout*`` modules in eval mode. p == 0 is
the identity in training too (though the planner keeps every training-mode
dropout function eager before asking). Random masks stay eager, as does
inplace=True.
"""

import torch
import torch.nn.functional as F

from autofuser import LoweringSpec

from ._common import lowering, number, refuse_inplace, unary_samples

#: Each function's default for ``training`` (the alpha variants default to False).
_TRAINING_DEFAULT = {
    F.dropout: True,
    F.dropout1d: True,
    F.dropout2d: True,
    F.dropout3d: True,
    F.alpha_dropout: False,
    F.feature_alpha_dropout: False,
}
_MODULES = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)


@lowering
def lower_dropout(ctx, *args, **kwargs):
    if ctx.module is not None:
        return _identity_unless_random(
            ctx, *args, p=ctx.module.p, training=ctx.module.training, inplace=ctx.module.inplace
        )
    if ctx.node.target is torch.dropout:
        return _torch_dropout(ctx, *args, **kwargs)
    return _functional_dropout(ctx, *args, **kwargs)


@lowering
def _torch_dropout(ctx, input, p, train):
    return _identity_unless_random(ctx, input, p=p, training=train, inplace=False)


@lowering
def _functional_dropout(ctx, input, p=0.5, training=None, inplace=False):
    if training is None:
        training = _TRAINING_DEFAULT[ctx.node.target]
    return _identity_unless_random(ctx, input, p=p, training=training, inplace=inplace)


def _identity_unless_random(ctx, input, *, p, training, inplace):
    refuse_inplace(ctx, inplace)
    if not isinstance(training, bool):
        ctx.refuse("unsupported_argument", f"dropout with training={training!r}")
    if training and number(ctx, p, "p") != 0:
        ctx.refuse("random", "dropout in training draws a random mask; left to eager")
    return ctx.tensor(input)


SPECS = [
    LoweringSpec(
        name="elementwise.dropout",
        description="dropout outside training: the identity",
        targets=(torch.dropout, *_TRAINING_DEFAULT, *_MODULES),
        kind="pointwise",
        lower=lower_dropout,
        # 4-d, the one rank every variant here accepts (dropout1d wants 2-d/3-d: not referenced).
        samples=lambda dtype: unary_samples(dtype, shapes=((2, 3, 5, 7), (3, 4, 1, 9))),
        references=(
            lambda x: F.dropout(x, p=0.3, training=False),
            lambda x: F.dropout2d(x, 0.5, False),
            lambda x: F.dropout3d(x, training=False),
            lambda x: F.alpha_dropout(x, 0.2),
            lambda x: F.feature_alpha_dropout(x, 0.2, training=False),
            lambda x: torch.dropout(x, 0.4, False),
            torch.nn.Dropout(0.3).eval(),
            torch.nn.Dropout(0.0),
            torch.nn.Dropout2d(0.25).eval(),
            torch.nn.AlphaDropout(0.25).eval(),
        ),
    ),
]
