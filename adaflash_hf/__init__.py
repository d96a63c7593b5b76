"""adaflash-hf: AdaFlash speculative decoding for Hugging Face transformers.

Importing the package registers the drafter with `AutoConfig` / `AutoModel` (model_type "adaflash").
"""

from transformers import AutoConfig, AutoModel

from .export import export_dflash
from .generation import GenerationStats, adaflash_decoding, speculative_generate
from .generation.hf_integration import install_generate_hook
from .modeling import AdaFlashConfig, AdaFlashDrafter, default_target_layer_ids
from .reference import load_reference_pair

__version__ = "0.1.0"

AutoConfig.register(AdaFlashConfig.model_type, AdaFlashConfig, exist_ok=True)
AutoModel.register(AdaFlashConfig, AdaFlashDrafter, exist_ok=True)
# save_pretrained copies modeling/ beside the weights and writes auto_map, so a checkpoint also
# loads with trust_remote_code=True where adaflash-hf is not installed.
AdaFlashConfig.register_for_auto_class()
AdaFlashDrafter.register_for_auto_class("AutoModel")
install_generate_hook()

__all__ = [
    "AdaFlashConfig",
    "AdaFlashDrafter",
    "GenerationStats",
    "adaflash_decoding",
    "default_target_layer_ids",
    "export_dflash",
    "load_reference_pair",
    "speculative_generate",
    "__version__",
]
