"""Self-contained model code (torch + transformers only): also uploaded beside checkpoints as remote code."""

from .checkpoint_layouts import config_from_dflash_dict, dflash_dict_from_config, write_dflash_checkpoint
from .configuration_adaflash import AdaFlashConfig, default_target_layer_ids
from .modeling_adaflash import AdaFlashDrafter, AdaFlashDrafterOutput, AdaFlashLengthHead, AdaFlashPaperLengthHead

__all__ = [
    "AdaFlashConfig",
    "AdaFlashDrafter",
    "AdaFlashDrafterOutput",
    "AdaFlashLengthHead",
    "AdaFlashPaperLengthHead",
    "config_from_dflash_dict",
    "default_target_layer_ids",
    "dflash_dict_from_config",
    "write_dflash_checkpoint",
]
