"""Where the online trainer's models live: a model rebuilt around given tensors, and a frozen copy on another device.

The trainer of :mod:`~adaflash_hf.online.worker` may run on a device of its own (``OnlineConfig(trainer_device=...)``):
it then holds a frozen copy of the target there (:func:`frozen_copy`), so that an update's forwards never run on the
serving device; the child process of :mod:`~adaflash_hf.online.trainer_process` rebuilds the models it is sent with
:func:`rebuild`.

Example:
    >>> copy = frozen_copy(target, "cuda:1")  # the trainer's target: same weights, its own memory  # doctest: +SKIP
"""

from __future__ import annotations

from itertools import chain

import torch
from torch import nn

__all__ = ["frozen_copy", "model_tensors", "rebuild"]


def model_tensors(model: nn.Module):
    """``(name, tensor)`` of every parameter and buffer, tied ones under each of their names."""
    return chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))


def rebuild(cls, config, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """A ``cls(config)`` built on the meta device and given ``tensors`` (no copy), in eval mode and frozen."""
    with torch.device("meta"):
        model = cls(config)
    for name, t in tensors.items():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        if leaf in module._parameters:
            module._parameters[leaf] = nn.Parameter(t, requires_grad=False)
        else:
            module._buffers[leaf] = t
    missing = [n for n, t in chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if missing:
        raise RuntimeError(f"{cls.__name__} rebuilt without tensors for {missing[:5]}")
    return model.eval().requires_grad_(False)


def frozen_copy(model: nn.Module, device: torch.device | str) -> nn.Module:
    """``model`` (a transformers model) copied to ``device``, frozen and in eval mode: each tensor copied once, straight
    to ``device`` (tied weights stay one tensor), and nothing of the model's runtime state (hooks, compiled parts)."""
    copies: dict[int, torch.Tensor] = {}
    tensors = {}
    for name, t in model_tensors(model):
        if id(t) not in copies:
            copies[id(t)] = t.detach().to(device, copy=True)
        tensors[name] = copies[id(t)]
    return rebuild(type(model), model.config, tensors)
