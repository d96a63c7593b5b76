"""Target features for drafter training: which target layers the drafter reads, and a feature cache.

:func:`select_layers` is the one rule (in this package) for turning a target's hidden states into a
drafter's context features: the outputs of decoder layers ``layer_ids`` (HF ``hidden_states[i + 1]``)
concatenated on the feature axis, ``[b, T, K*H]``. (``modeling/`` keeps its own two-line copy,
``AdaFlashDrafter.select_context``, because the Hub remote code cannot import this package.)

:func:`build_feature_cache` runs the frozen target once over a dataset and stores those features;
:class:`FeatureCacheDataset` reads them back, so training never runs the target's decoder layers.

Example:
    >>> feats = compute_target_features(target, drafter.config.target_layer_ids, ids)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from .collator import DrafterDataCollator

__all__ = ["FeatureCacheDataset", "build_feature_cache", "compute_target_features", "select_layers"]


def select_layers(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """Outputs of decoder layers ``layer_ids`` (``hidden_states[i + 1]``), concatenated: ``[b, T, K*H]``."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def compute_target_features(target, layer_ids: Sequence[int], input_ids, attention_mask=None, position_ids=None):
    """:func:`select_layers` of the target's hidden states for ``input_ids``: ``[b, T, K*H]``.

    Runs only the decoder (``target.get_decoder()``; no LM head) under ``no_grad``.
    """
    with torch.no_grad():
        decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
        kw = dict(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
        if position_ids is not None:
            kw["position_ids"] = position_ids
        out = decoder(**kw) if decoder is not None else target(**kw)
        return select_layers(out.hidden_states, layer_ids)


def build_feature_cache(
    target: nn.Module,
    dataset: Iterable[dict],
    path: str | os.PathLike,
    layer_ids: Sequence[int],
    collator: DrafterDataCollator | None = None,
    batch_size: int = 8,
    shard_bytes: int = 1 << 30,
    dtype: torch.dtype = torch.bfloat16,
    progress: bool = True,
) -> Path:
    """Run the frozen target once over ``dataset`` and write its ``select_context`` features.

    Each sample ``i`` becomes ``s{i}.input_ids`` (int32), ``s{i}.loss_mask`` (uint8) and
    ``s{i}.features`` (``[T_i, K*H]`` in ``dtype``, bf16 by default) in safetensors shards of about
    ``shard_bytes``; ``index.json`` lists the shards, ``layer_ids`` and the feature size. Read it
    back with :class:`FeatureCacheDataset`; train with the same drafter ``target_layer_ids``.
    """
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    collator = collator or DrafterDataCollator(None)
    device = next(target.parameters()).device
    was_training = target.training
    target.eval()
    samples = list(dataset)
    shards: list[dict] = []
    buf: dict[str, torch.Tensor] = {}
    buf_ids: list[int] = []
    buf_size = 0
    feat_dim = None

    def flush():
        nonlocal buf, buf_ids, buf_size
        if not buf:
            return
        name = f"features-{len(shards):05d}.safetensors"
        save_file(buf, str(path / name))
        shards.append({"file": name, "samples": buf_ids})
        buf, buf_ids, buf_size = {}, [], 0

    idx = 0
    for start in tqdm(range(0, len(samples), batch_size), desc="feature cache", disable=not progress):
        batch = collator(samples[start : start + batch_size])
        ids = batch["input_ids"].to(device)
        am = batch["attention_mask"].to(device)
        pos = (am.long().cumsum(-1) - 1).clamp(min=0)
        feats = compute_target_features(target, layer_ids, ids, am, pos)
        feat_dim = feats.shape[-1]
        for r in range(ids.shape[0]):
            n = int(am[r].sum())
            buf[f"s{idx}.input_ids"] = batch["input_ids"][r, :n].to(torch.int32).contiguous()
            buf[f"s{idx}.loss_mask"] = batch["loss_mask"][r, :n].to(torch.uint8).contiguous()
            f = feats[r, :n].to(dtype).cpu().contiguous()
            buf[f"s{idx}.features"] = f
            buf_ids.append(idx)
            buf_size += f.numel() * f.element_size()
            idx += 1
            if buf_size >= shard_bytes:
                flush()
    flush()
    target.train(was_training)
    index = {
        "format": "adaflash-feature-cache-v1",
        "num_samples": idx,
        "layer_ids": [int(i) for i in layer_ids],
        "feature_dim": feat_dim,
        "dtype": str(dtype).removeprefix("torch."),
        "shards": shards,
    }
    (path / "index.json").write_text(json.dumps(index))
    return path


class FeatureCacheDataset(torch.utils.data.Dataset):
    """Samples of a cache written by :func:`build_feature_cache`: ``{"input_ids", "loss_mask",
    "target_features"}`` tensors (features in the stored dtype; the model casts them)."""

    def __init__(self, path: str | os.PathLike, layer_ids: Sequence[int] | None = None):
        self.path = Path(path)
        self.index = json.loads((self.path / "index.json").read_text())
        if layer_ids is not None and [int(i) for i in layer_ids] != self.index["layer_ids"]:
            raise ValueError(
                f"feature cache {self.path} holds target layers {self.index['layer_ids']}, the drafter reads "
                f"{list(layer_ids)}: rebuild the cache for this drafter"
            )
        self._where: dict[int, str] = {}
        for shard in self.index["shards"]:
            for i in shard["samples"]:
                self._where[int(i)] = shard["file"]
        self._handles: dict[str, Any] = {}

    @property
    def layer_ids(self) -> list[int]:
        return list(self.index["layer_ids"])

    def __len__(self) -> int:
        return int(self.index["num_samples"])

    def _handle(self, file: str):
        from safetensors import safe_open

        h = self._handles.get(file)
        if h is None:
            h = self._handles[file] = safe_open(str(self.path / file), framework="pt")
        return h

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        h = self._handle(self._where[i])
        return {
            "input_ids": h.get_tensor(f"s{i}.input_ids").long(),
            "loss_mask": h.get_tensor(f"s{i}.loss_mask").bool(),
            "target_features": h.get_tensor(f"s{i}.features"),
        }

    def __getstate__(self):  # dataloader workers reopen the shards
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state
