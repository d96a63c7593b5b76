"""Drafter checkpoints from training: the native layout, LoRA deltas merged, written atomically.

:func:`save_drafter` writes a plain or PEFT drafter as a checkpoint ``AdaFlashDrafter.from_pretrained``
loads, through ``AdaFlashDrafter.save_pretrained``, which is all or nothing: the files are written into a
temporary folder beside the destination and moved into place with ``os.replace``, ``config.json`` last,
so a reader that finds the config finds the weights it describes, and an interrupted save leaves the
previous checkpoint in place.

Example:
    >>> save_drafter(peft_drafter, "out/drafter", dtype=torch.bfloat16)  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path

import torch
from torch import nn

__all__ = ["drafter_state_dict", "is_peft", "save_drafter", "unwrap_drafter"]

_MTS = re.compile(r"\.modules_to_save\.[^.]+\.")


def unwrap_drafter(drafter: nn.Module) -> nn.Module:
    """The plain ``AdaFlashDrafter`` inside a PEFT model (or the drafter itself)."""
    get_base = getattr(drafter, "get_base_model", None)
    return get_base() if callable(get_base) else drafter


def is_peft(drafter: nn.Module) -> bool:
    """Whether ``drafter`` is a PEFT model (it has ``get_base_model``)."""
    return callable(getattr(drafter, "get_base_model", None))


def _merged_lora_weights(base: nn.Module) -> dict[str, torch.Tensor]:
    """``{"<module>.weight": base + sum of active LoRA deltas}`` for every LoRA layer of ``base``."""
    sd: dict[str, torch.Tensor] = {}
    for name, mod in base.named_modules():
        if not (hasattr(mod, "base_layer") and hasattr(mod, "get_delta_weight") and hasattr(mod, "lora_A")):
            continue
        w = mod.base_layer.weight
        if getattr(mod, "merged", False):
            sd[f"{name}.weight"] = w.detach()
            continue
        delta = None
        for a in mod.active_adapters:
            if a in mod.lora_A:
                d = mod.get_delta_weight(a)
                delta = d if delta is None else delta + d
        sd[f"{name}.weight"] = (w if delta is None else w + delta.to(w.dtype)).detach()
    return sd


def drafter_state_dict(drafter: nn.Module) -> dict[str, torch.Tensor]:
    """Native-layout state dict of a drafter; for a PEFT model the LoRA deltas are merged in.

    Nothing is modified in place (adapters are not merged into the live weights), so this is safe
    to call mid-training.
    """
    base = unwrap_drafter(drafter)
    if not is_peft(drafter):
        return {k: v.detach() for k, v in base.state_dict().items()}
    sd: dict[str, torch.Tensor] = {}
    for k, v in base.state_dict().items():
        if "lora_" in k or ".original_module." in k:
            continue
        k = _MTS.sub(".", k.replace(".base_layer.", "."))
        sd[k] = v.detach()
    sd.update(_merged_lora_weights(base))
    return sd


def _clean_drafter(base: nn.Module, sd: dict[str, torch.Tensor], dtype: torch.dtype | None):
    """A fresh ``AdaFlashDrafter`` holding ``sd`` (built on the meta device, tensors assigned: no
    copy of the live model, no random init, no PEFT wrappers)."""
    from ..modeling import AdaFlashDrafter

    config = copy.deepcopy(base.config)
    config.dtype = dtype or next(iter(v for v in sd.values() if v.is_floating_point())).dtype
    with torch.device("meta"):
        clean = AdaFlashDrafter(config)
    missing, unexpected = clean.load_state_dict({k: v.cpu() for k, v in sd.items()}, strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(f"drafter state dict does not match the native layout: missing {missing}, unexpected {unexpected}")
    for name, buf in list(clean.named_buffers()):  # non-persistent buffers (RoPE inv_freq) stay on meta
        if buf.is_meta:
            mod_name, _, attr = name.rpartition(".")
            src = base.get_submodule(mod_name) if mod_name else base
            clean.get_submodule(mod_name).register_buffer(attr, getattr(src, attr).detach().cpu(), persistent=False)
    return clean


def save_drafter(
    drafter: nn.Module,
    save_directory: str | os.PathLike,
    dtype: torch.dtype | None = None,
    max_shard_size: str | int = "5GB",
    is_main_process: bool = True,
    **kwargs,
) -> Path:
    """Write ``drafter`` (plain or PEFT) as a native AdaFlash checkpoint (``from_pretrained`` loads it).

    ``dtype`` casts the saved weights (e.g. ``torch.bfloat16``) without touching the live model.
    """
    base = unwrap_drafter(drafter)
    sd = drafter_state_dict(drafter)
    if dtype is not None:
        sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
    clean = _clean_drafter(base, sd, dtype)
    dest = Path(save_directory)
    if not is_main_process:  # distributed: other ranks write as transformers does, without the config
        clean.save_pretrained(dest, max_shard_size=max_shard_size, is_main_process=False, **kwargs)
        return dest
    clean.save_pretrained(dest, max_shard_size=max_shard_size, is_main_process=True, **kwargs)  # all or nothing
    return dest
