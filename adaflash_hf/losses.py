"""The training losses, re-exported from :mod:`adaflash_hf.training.losses` (where they live)."""

from .training.losses import (  # noqa: F401
    block_ce_loss,
    default_gamma,
    forward_kl_loss,
    length_head_loss,
    length_mask,
    opd_loss,
    position_weights,
)
from .training.losses import __all__  # noqa: F401
