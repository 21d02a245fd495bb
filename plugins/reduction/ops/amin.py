"""``amin``: torch.amin and Tensor.amin (the min values only; torch.min(x, dim),
which also returns indices, is not claimed); ``amax``'s mirror."""

from .amax import extreme_spec

SPECS = [extreme_spec("amin")]
