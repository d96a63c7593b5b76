"""adaflash-hf: AdaFlash speculative decoding for Hugging Face transformers.

Importing the package registers the drafter with `AutoConfig` / `AutoModel` (model_type "adaflash")
and routes `generate(assistant_model=<AdaFlash drafter>)` to our loop. The `adaflash` command (console
script or ``python -m adaflash_hf.cli``) defers that, and with it torch and transformers, until a
command actually runs, so that ``adaflash --help`` answers at once; the public names below are then
loaded on first use.
"""

import importlib
import os
import sys

__version__ = "0.1.0"

_PUBLIC = {
    "AdaFlashConfig": ".modeling",
    "AdaFlashDrafter": ".modeling",
    "default_target_layer_ids": ".modeling",
    "GenerationStats": ".generation",
    "adaflash_decoding": ".generation",
    "speculative_generate": ".generation",
    "install_generate_hook": ".generation.hf_integration",
    "export_dflash": ".export",
    "load_reference_pair": ".reference",
}
_bootstrapped = False


def _bootstrap() -> None:
    """Import the public names and register with transformers (idempotent)."""
    global _bootstrapped
    if _bootstrapped:
        return
    from transformers import AutoConfig, AutoModel

    for name, module in _PUBLIC.items():
        globals()[name] = getattr(importlib.import_module(module, __name__), name)
    config_cls, model_cls = globals()["AdaFlashConfig"], globals()["AdaFlashDrafter"]
    AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
    AutoModel.register(config_cls, model_cls, exist_ok=True)
    # save_pretrained copies modeling/ beside the weights and writes auto_map, so a checkpoint also
    # loads with trust_remote_code=True where adaflash-hf is not installed.
    config_cls.register_for_auto_class()
    model_cls.register_for_auto_class("AutoModel")
    globals()["install_generate_hook"]()
    _bootstrapped = True


def __getattr__(name: str):
    if name in _PUBLIC:
        _bootstrap()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _started_as_cli() -> bool:
    """Whether this process is the `adaflash` command, which bootstraps only when a command runs."""
    if os.path.basename(sys.argv[0] if sys.argv else "") in ("adaflash", "adaflash.exe"):
        return True
    argv = getattr(sys, "orig_argv", [])
    return any(flag == "-m" and module in ("adaflash_hf.cli", "adaflash_hf.bench") for flag, module in zip(argv, argv[1:]))


if not _started_as_cli():
    _bootstrap()

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
