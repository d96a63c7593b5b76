"""Offline DFlash / AdaFlash drafter training that plugs into ``transformers.Trainer`` (SPEC section 5).

Pieces:

* :class:`DrafterTrainingModel`: an ``nn.Module`` holding the **frozen target** (eval mode,
  ``requires_grad=False``, deliberately *not* a registered submodule: it is never saved, never
  handed to the optimizer, never wrapped by DDP/FSDP; ``.to()`` still moves it) and the
  **trainable drafter** (optionally a PEFT model). ``forward(input_ids, attention_mask,
  loss_mask, target_features=None)`` samples up to ``max_anchors`` anchors per sequence inside the
  response, builds all blocks of a batch as one drafter forward with the block attention mask of
  :mod:`adaflash_hf.training.blocks`, and returns ``{"loss", "ce_loss", "length_loss",
  "accuracy", "accept_len", ...}``:

  - ``ce_loss``: cross-entropy of slot ``k`` against token ``anchor + k``, weighted
    ``exp(-(k - 1) / gamma)`` (``gamma = default_gamma(B)``: 7 for B=16), response tokens only;
  - ``length_loss``: MSE of the length head (fed *detached* block states, so it never changes a
    drafter gradient) against ``(accepted + 1) / B``, where ``accepted`` is the number of leading
    slots whose drafter argmax equals the label (computed without grad; a slot without a label
    ends the run);
  - ``loss = ce_loss + length_head_weight * length_loss``.

  ``objective="opd"`` / ``"forward_kl"`` replace the cross-entropy by distillation against the
  target's own distribution at each label position (SPEC section 4: ``opd_loss``, OSD's
  ``forward_kl_loss``), same anchors, blocks and weights; the target then runs with its LM head
  (``[b, T, V]`` logits, no grad) and a slot counts as accepted when the drafter's argmax equals
  the target's. This is how the online adapter trains on whole served requests
  (:mod:`adaflash_hf.online.adapter`, ``sample_unit="request"``).

  Target features come from the target on the fly (``output_hidden_states``, under ``no_grad``,
  only the decoder is run, no LM head) or, when the batch carries ``target_features``, from a
  feature cache (:func:`build_feature_cache` / :class:`FeatureCacheDataset`). With a cache the
  target's decoder layers never run; its embedding and LM head are still used (they are the
  drafter's, shared).
* :class:`DrafterDataCollator`: chat samples (``{"messages": [...]}``: the tokenizer's chat
  template; ``loss_mask`` = assistant tokens via ``{% generation %}`` tags, or prefix rendering
  when the template has none), plain text (``{"text": ...}``: every token is "response"),
  pre-tokenised samples (``{"input_ids", "loss_mask"}``, e.g. the target's regenerated answers)
  and cached samples (``+ "target_features"``). Right padding.
* :class:`DrafterTrainer`: a ``Trainer`` whose checkpoints hold **only the drafter, in the native
  layout** (``AdaFlashDrafter.from_pretrained`` loads them; LoRA deltas merged in), which logs the
  extra metrics, and which never drops the raw sample columns (``remove_unused_columns=False``).
* :func:`train_length_head`: offline initialisation of the length head on a frozen drafter (the
  released AdaFlash trains its head this way).

Example (single process)::

    from transformers import TrainingArguments
    from adaflash_hf import AdaFlashDrafter
    from adaflash_hf.training.trainer import DrafterTrainingModel, DrafterTrainer, DrafterDataCollator

    drafter = AdaFlashDrafter.from_target(target, num_layers=2, block_size=16, tokenizer=tok)
    model = DrafterTrainingModel(target, drafter)
    args = TrainingArguments("runs/drafter", per_device_train_batch_size=8, learning_rate=6e-4,
                             lr_scheduler_type="cosine", warmup_ratio=0.04, max_grad_norm=1.0,
                             num_train_epochs=6, bf16=True, report_to=[])
    trainer = DrafterTrainer(model=model, args=args, train_dataset=samples,
                             data_collator=DrafterDataCollator(tok, max_length=3072))
    trainer.train()
    model.save_pretrained("my-drafter", dtype=torch.bfloat16)   # native drafter checkpoint

**PEFT / LoRA.** Either pass ``peft_config=LoraConfig(target_modules=["q_proj", "k_proj",
"v_proj", "o_proj"], ...)`` to :class:`DrafterTrainingModel`, or wrap the drafter yourself with
``get_peft_model(drafter, config)`` before building the wrapper. Do **not** call
``get_peft_model`` on the wrapper (the frozen target is outside it, but adapters belong on the
drafter only). LoRA freezes everything else, including ``fc``, ``hidden_norm`` and the length head:
add them to ``modules_to_save`` to train them too (the length-head loss is skipped while the head
has no trainable parameter). Saved checkpoints merge the adapters into a plain drafter.

**Several GPUs** (``accelerate``; not testable on the CPU machines)::

    accelerate launch --num_processes 8 -m adaflash_hf.training.train_drafter --target T --out O ...

or any script that builds a :class:`DrafterTrainer`: the Trainer wraps the drafter in DDP, each
process holds its own frozen target copy (not part of DDP, so no gradient all-reduce for it), the
per-device batch is ``per_device_train_batch_size``, and only the main process writes checkpoints.
Use plain DDP (the default of ``accelerate launch`` without an FSDP/DeepSpeed config): the
drafter is small, and :meth:`DrafterTrainingModel.save_pretrained` reads the drafter's full
(unsharded) state dict, which FSDP / ZeRO-3 would have to gather first (not supported here).
For targets that do not fit one GPU, precompute features once (:func:`build_feature_cache`, which
can run with a ``device_map="auto"`` target) and train from :class:`FeatureCacheDataset`; then
each process only needs the target's embedding and LM head (``move_target=False`` leaves a
``device_map``-dispatched target where it is).
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from torch import nn
from transformers import Trainer, TrainerCallback

from ..losses import block_ce_loss, default_gamma, forward_kl_loss, length_head_loss, opd_loss, position_weights
from .blocks import IGNORE_INDEX, block_attention_mask, build_block_inputs, sample_anchors

__all__ = [
    "DrafterTrainingModel",
    "DrafterTrainer",
    "DrafterDataCollator",
    "encode_sample",
    "build_feature_cache",
    "FeatureCacheDataset",
    "train_length_head",
    "unwrap_drafter",
    "drafter_state_dict",
    "save_drafter",
    "JsonlLogCallback",
    "WallClockCallback",
    "wall_clock_cosine_schedule",
]


# ----------------------------------------------------------------------------- helpers


def unwrap_drafter(drafter: nn.Module) -> nn.Module:
    """The plain ``AdaFlashDrafter`` inside a PEFT model (or the drafter itself)."""
    get_base = getattr(drafter, "get_base_model", None)
    return get_base() if callable(get_base) else drafter


def _is_peft(drafter: nn.Module) -> bool:
    return callable(getattr(drafter, "get_base_model", None))


_MTS = re.compile(r"\.modules_to_save\.[^.]+\.")


def drafter_state_dict(drafter: nn.Module) -> dict[str, torch.Tensor]:
    """Native-layout state dict of a drafter; for a PEFT model the LoRA deltas are merged in.

    Nothing is modified in place (adapters are not merged into the live weights), so this is safe
    to call mid-training.
    """
    base = unwrap_drafter(drafter)
    if not _is_peft(drafter):
        return {k: v.detach() for k, v in base.state_dict().items()}
    sd: dict[str, torch.Tensor] = {}
    for k, v in base.state_dict().items():
        if "lora_" in k or ".original_module." in k:
            continue
        k = _MTS.sub(".", k.replace(".base_layer.", "."))
        sd[k] = v.detach()
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
    from ..modeling import AdaFlashDrafter

    base = unwrap_drafter(drafter)
    sd = drafter_state_dict(drafter)
    if dtype is not None:
        sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
    config = copy.deepcopy(base.config)
    out_dtype = dtype or next(iter(v for v in sd.values() if v.is_floating_point())).dtype
    config.dtype = out_dtype
    # A fresh module built on the meta device takes the tensors by assignment: no copy of the
    # live model, no random init, no dependence on PEFT wrappers.
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
    clean.save_pretrained(save_directory, max_shard_size=max_shard_size, is_main_process=is_main_process, **kwargs)
    return Path(save_directory)


# ----------------------------------------------------------------------------- the model


class DrafterTrainingModel(nn.Module):
    """Frozen target + trainable drafter; ``forward`` returns the DFlash training loss (module doc).

    Args:
        target: the target causal LM (frozen here: eval mode, ``requires_grad_(False)``).
        drafter: an ``AdaFlashDrafter`` (bound to ``target`` here) or a PEFT model around one.
        max_anchors: blocks per sequence (DFlash: 512).
        gamma: position-weight decay; default ``default_gamma(block_size)``.
        length_head_weight: weight of the (detached) length-head MSE; 0 disables it.
        peft_config: optional PEFT config applied to the drafter (``get_peft_model``).
        require_full_block: see :mod:`adaflash_hf.training.blocks`.
        move_target: whether ``.to()`` / ``.cuda()`` on this module also moves the target (turn it
            off for a ``device_map``-dispatched target).
        objective: ``"ce"`` (DFlash, labels = the sequence's tokens), ``"opd"`` or ``"forward_kl"``
            (distillation against the target's distributions; module doc).
        alpha / clip / temperature / clip_mode: the settings of ``opd_loss`` (``temperature`` also
            of ``forward_kl_loss``).
    """

    OBJECTIVES = ("ce", "opd", "forward_kl")

    def __init__(
        self,
        target: nn.Module,
        drafter: nn.Module,
        max_anchors: int = 512,
        gamma: float | None = None,
        length_head_weight: float = 1.0,
        peft_config=None,
        require_full_block: bool = False,
        move_target: bool | None = None,
        objective: str = "ce",
        alpha: float = 0.8,
        clip: float | None = 0.01,
        temperature: float = 1.0,
        clip_mode: str = "entry",
    ):
        super().__init__()
        if objective not in self.OBJECTIVES:
            raise ValueError(f"objective must be one of {self.OBJECTIVES}, got {objective!r}")
        base = unwrap_drafter(drafter)
        impl = str(getattr(base.config, "_attn_implementation", "") or "")
        if impl.startswith("flash") or "paged" in impl:
            raise ValueError(
                f"training needs the block attention mask, which attn_implementation={impl!r} cannot take: "
                "use 'sdpa' (default) or 'eager' for the drafter (drafter.set_attn_implementation('sdpa'))"
            )
        base.bind_target(target)
        target.eval()
        target.requires_grad_(False)
        if peft_config is not None:
            from peft import get_peft_model

            drafter = get_peft_model(drafter, peft_config)
        # Not a submodule: never saved, never optimised, never wrapped by DDP (see _apply for .to()).
        self._frozen = {"target": target}
        self.drafter = drafter
        self.block_size = int(base.config.block_size)
        self.max_anchors = int(max_anchors)
        self.gamma = float(gamma) if gamma is not None else default_gamma(self.block_size)
        self.length_head_weight = float(length_head_weight)
        self.require_full_block = bool(require_full_block)
        self.objective = objective
        self.alpha, self.clip, self.temperature, self.clip_mode = alpha, clip, temperature, clip_mode
        self.move_target = (getattr(target, "hf_device_map", None) is None) if move_target is None else move_target
        self.config = base.config  # Trainer introspection (model.config) finds the drafter's config

    # ---------------------------------------------------------------- plumbing
    @property
    def target(self) -> nn.Module:
        return self._frozen["target"]

    @property
    def base_drafter(self) -> nn.Module:
        return unwrap_drafter(self.drafter)

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        if recurse and self.move_target:
            self.target._apply(fn)
        return self

    def train(self, mode: bool = True):
        super().train(mode)
        self.target.eval()  # the target stays in eval mode whatever Trainer does
        return self

    def save_pretrained(self, save_directory, dtype: torch.dtype | None = None, max_shard_size="5GB", **kwargs):
        """Save **the drafter only**, native layout (LoRA merged), loadable with ``AdaFlashDrafter.from_pretrained``."""
        return save_drafter(self.drafter, save_directory, dtype=dtype, max_shard_size=max_shard_size, **kwargs)

    # ---------------------------------------------------------------- features
    @torch.no_grad()
    def target_features(self, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
        """``select_context`` of the target's hidden states: ``[b, T, K*H]`` (no grad, no LM head)."""
        return compute_target_features(self.target, self.base_drafter.config.target_layer_ids, input_ids, attention_mask, position_ids)

    @torch.no_grad()
    def target_features_and_logits(self, input_ids, attention_mask=None, position_ids=None):
        """Features as :meth:`target_features` plus the target's logits ``[b, T, V]`` (one forward)."""
        out = self.target(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          output_hidden_states=True, use_cache=False)
        hs = out.hidden_states
        return torch.cat([hs[i + 1] for i in self.base_drafter.config.target_layer_ids], dim=-1), out.logits

    # ---------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        target_features: torch.Tensor | None = None,
        anchors: torch.LongTensor | None = None,
        anchor_valid: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        r"""
        input_ids / attention_mask (`[b, T]`, right padded).
        loss_mask (`[b, T]` bool): response tokens (anchors and labels live there); default: every
            real token.
        target_features (`[b, T, K*H]`, optional): cached ``select_context`` features; computed from
            the target when absent.
        anchors / anchor_valid (`[b, n]`, optional): fixed anchors (tests); sampled otherwise.
        """
        base = self.base_drafter
        B = self.block_size
        b, T = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        attention_mask = attention_mask.to(torch.bool)
        loss_mask = attention_mask if loss_mask is None else (loss_mask.to(torch.bool) & attention_mask)
        ctx_pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)

        target_logits = None
        if self.objective != "ce":
            features, target_logits = self.target_features_and_logits(input_ids, attention_mask, ctx_pos)
            target_features = features if target_features is None else target_features
        elif target_features is None:
            target_features = self.target_features(input_ids, attention_mask, ctx_pos)
        fc_in = base.fc.in_features if hasattr(base.fc, "in_features") else base.fc.weight.shape[1]
        if target_features.shape[-1] != fc_in or target_features.shape[:2] != (b, T):
            raise ValueError(
                f"target_features has shape {tuple(target_features.shape)}, expected [{b}, {T}, {fc_in}] "
                f"(K={len(base.config.target_layer_ids)} layers x H={base.config.hidden_size})"
            )

        if anchors is None:
            anchors, anchor_valid = sample_anchors(
                loss_mask, B, self.max_anchors, require_full_block=self.require_full_block
            )
        elif anchor_valid is None:
            anchor_valid = torch.ones_like(anchors, dtype=torch.bool)
        n = anchors.shape[1]
        block_ids, labels, block_pos_rel = build_block_inputs(
            input_ids, anchors, anchor_valid, B, base.config.mask_token_id, loss_mask=loss_mask
        )
        # Absolute block positions follow the context's position ids (anchor position + k).
        anchor_pos = torch.gather(ctx_pos, 1, anchors.clamp(max=T - 1))
        block_pos = (anchor_pos.unsqueeze(-1) + torch.arange(B, device=input_ids.device)).reshape(b, n * B)
        mask = block_attention_mask(T, anchors, anchor_valid, B, key_padding_mask=attention_mask)

        dtype = base.fc.weight.dtype if base.fc.weight.dtype.is_floating_point else torch.float32
        noise = base.embed(block_ids).to(dtype)
        out = self.drafter(
            noise_embeds=noise,
            context_hidden_states=target_features.to(dtype),
            position_ids=torch.cat([ctx_pos, block_pos], dim=1),
            attention_mask=mask,
        )
        hidden = out.last_hidden_state  # [b, n*B, H]

        sel = labels != IGNORE_INDEX  # [b, n*B]
        slot = torch.arange(n * B, device=input_ids.device) % B  # k for every column
        w_slot = torch.zeros(B, device=hidden.device)
        w_slot[1:] = position_weights(B - 1, self.gamma, device=hidden.device)
        h_sel = hidden[sel]
        lm_head = base._target_ref("lm_head")
        lm_dtype = getattr(getattr(lm_head, "weight", None), "dtype", h_sel.dtype)
        logits = base.compute_logits(h_sel.to(lm_dtype))
        lab_sel = labels[sel]
        w_sel = w_slot[slot].unsqueeze(0).expand(b, -1)[sel]
        if target_logits is None:
            ce = block_ce_loss(logits.unsqueeze(0), lab_sel.unsqueeze(0), weights=w_sel.unsqueeze(0))
        else:
            # Slot k's label is token anchor + k; the target predicted it at position anchor + k - 1.
            label_pos = (anchors.unsqueeze(-1) + torch.arange(B, device=anchors.device)).reshape(b, n * B)
            rows = torch.arange(b, device=anchors.device)[:, None].expand(b, n * B)
            t_sel = target_logits[rows[sel], label_pos[sel] - 1].to(logits.device)
            lab_sel = t_sel.argmax(dim=-1)  # acceptance is judged against the target's argmax
            if self.objective == "opd":
                ce = opd_loss(logits.unsqueeze(0), t_sel.unsqueeze(0), alpha=self.alpha, clip=self.clip,
                              temperature=self.temperature, position_weights=w_sel.unsqueeze(0), clip_mode=self.clip_mode)
            else:
                ce = forward_kl_loss(logits.unsqueeze(0), t_sel.unsqueeze(0), temperature=self.temperature,
                                     position_weights=w_sel.unsqueeze(0))

        with torch.no_grad():
            hit = torch.zeros_like(sel)
            hit[sel] = logits.argmax(dim=-1) == lab_sel
            hit = hit.view(b, n, B)[:, :, 1:]
            accepted = hit.long().cumprod(dim=-1).sum(dim=-1)  # [b, n]
            first = sel.view(b, n, B)[:, :, 1]
            acc1 = (hit[:, :, 0] & first).sum().float() / first.sum().clamp(min=1)
            n_valid = anchor_valid.sum()
            accept_len = (accepted.float() * anchor_valid).sum() / n_valid.clamp(min=1) + 1.0

        length_loss = hidden.new_zeros((), dtype=torch.float32)
        head = getattr(base, "length_head", None)
        if (
            self.length_head_weight > 0
            and head is not None
            and any(p.requires_grad for p in head.parameters())
            and bool(anchor_valid.any())
        ):
            pred = base.predict_accept_ratio(hidden.view(b, n, B, -1))  # detached inside
            length_loss = length_head_loss(pred[anchor_valid], accepted[anchor_valid], B)
        loss = ce + self.length_head_weight * length_loss
        return {
            "loss": loss,
            "ce_loss": ce.detach(),
            "length_loss": length_loss.detach(),
            "accuracy": acc1,
            "accept_len": accept_len,
            "num_blocks": n_valid,
            "num_tokens": sel.sum(),
        }


def compute_target_features(target, layer_ids: Sequence[int], input_ids, attention_mask=None, position_ids=None):
    """Concatenated outputs of target layers ``layer_ids`` (HF ``hidden_states[i + 1]``): ``[b, T, K*H]``.

    Runs only the decoder (``target.get_decoder()``; no LM head) under ``no_grad``.
    """
    with torch.no_grad():
        decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
        kw = dict(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
        if position_ids is not None:
            kw["position_ids"] = position_ids
        out = decoder(**kw) if decoder is not None else target(**kw)
        hs = out.hidden_states
        return torch.cat([hs[i + 1] for i in layer_ids], dim=-1)


# ----------------------------------------------------------------------------- data


def _assistant_mask_by_prefix(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids + assistant mask for templates without ``{% generation %}`` tags (prefix rendering)."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(tokenizer.apply_chat_template(messages[:i], tokenize=True, return_dict=True, add_generation_prompt=True)["input_ids"])
        end = len(tokenizer.apply_chat_template(messages[: i + 1], tokenize=True, return_dict=True)["input_ids"])
        for j in range(start, min(end, len(ids))):
            mask[j] = 1
    return ids, mask


def encode_sample(tokenizer, sample: dict, max_length: int | None = None) -> dict[str, list[int]]:
    """One sample -> ``{"input_ids", "loss_mask"}`` (lists), truncated to ``max_length``.

    Accepts ``{"input_ids"[, "loss_mask"]}`` (pre-tokenised; default mask: all ones),
    ``{"messages": [...]}`` (chat template; mask = assistant tokens), ``{"prompt", "response"}``
    strings (mask = response) and ``{"text"}`` (mask = all tokens).
    """
    if "input_ids" in sample:
        ids = [int(x) for x in (sample["input_ids"].tolist() if torch.is_tensor(sample["input_ids"]) else sample["input_ids"])]
        lm = sample.get("loss_mask")
        mask = [1] * len(ids) if lm is None else [int(bool(x)) for x in (lm.tolist() if torch.is_tensor(lm) else lm)]
    elif "messages" in sample:
        if tokenizer is None:
            raise ValueError("chat samples need a tokenizer")
        try:
            enc = tokenizer.apply_chat_template(
                sample["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
            if not any(mask):  # template without {% generation %}
                raise ValueError
        except ValueError:
            ids, mask = _assistant_mask_by_prefix(tokenizer, sample["messages"])
    elif "prompt" in sample and "response" in sample:
        p = tokenizer(sample["prompt"], add_special_tokens=False)["input_ids"]
        r = tokenizer(sample["response"], add_special_tokens=False)["input_ids"]
        ids, mask = p + r, [0] * len(p) + [1] * len(r)
    elif "text" in sample:
        ids = tokenizer(sample["text"], add_special_tokens=False)["input_ids"]
        mask = [1] * len(ids)
    else:
        raise ValueError(f"cannot encode a sample with keys {sorted(sample)}")
    if len(mask) != len(ids):
        raise ValueError(f"loss_mask length {len(mask)} != input_ids length {len(ids)}")
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return {"input_ids": ids, "loss_mask": mask}


class DrafterDataCollator:
    """Pad a list of samples (see :func:`encode_sample`) into ``input_ids``, ``attention_mask``,
    ``loss_mask`` (bool) and, for cached samples, ``target_features`` (zero-padded). Right padding."""

    def __init__(self, tokenizer=None, max_length: int | None = 2048, pad_token_id: int | None = None,
                 pad_to_multiple_of: int | None = None):
        self.tokenizer = tokenizer
        self.max_length = max_length
        if pad_token_id is None and tokenizer is not None:
            pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_token_id = 0 if pad_token_id is None else int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        enc = [encode_sample(self.tokenizer, s, self.max_length) for s in samples]
        T = max(1, max(len(e["input_ids"]) for e in enc))
        if self.pad_to_multiple_of:
            T = -(-T // self.pad_to_multiple_of) * self.pad_to_multiple_of
        b = len(enc)
        ids = torch.full((b, T), self.pad_token_id, dtype=torch.long)
        am = torch.zeros(b, T, dtype=torch.bool)
        lm = torch.zeros(b, T, dtype=torch.bool)
        for i, e in enumerate(enc):
            n = len(e["input_ids"])
            ids[i, :n] = torch.tensor(e["input_ids"], dtype=torch.long)
            am[i, :n] = True
            lm[i, :n] = torch.tensor(e["loss_mask"], dtype=torch.bool)
        batch = {"input_ids": ids, "attention_mask": am, "loss_mask": lm}
        if all("target_features" in s for s in samples):
            feats = [s["target_features"] for s in samples]
            f = feats[0].new_zeros(b, T, feats[0].shape[-1])
            for i, x in enumerate(feats):
                n = min(x.shape[0], len(enc[i]["input_ids"]))
                f[i, :n] = x[:n]
            batch["target_features"] = f
        return batch


# ----------------------------------------------------------------------------- feature cache


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


# ----------------------------------------------------------------------------- Trainer


class DrafterTrainer(Trainer):
    """``transformers.Trainer`` for :class:`DrafterTrainingModel`.

    * ``compute_loss`` returns the model's ``loss`` and logs ``ce_loss``, ``length_loss``,
      ``accuracy`` (slot-1 top-1) and ``accept_len`` (mean ``accepted + 1`` per block, a training
      proxy for tau) averaged over each logging window;
    * checkpoints and ``save_model`` write **the drafter only**, native layout (LoRA merged), plus
      the tokenizer if given; resuming reloads the drafter weights;
    * ``remove_unused_columns`` is forced off (the collator needs the raw sample fields).
    """

    _metric_keys = ("ce_loss", "length_loss", "accuracy", "accept_len")

    def __init__(self, model: DrafterTrainingModel | None = None, args=None, *pargs, **kwargs):
        if args is not None and getattr(args, "remove_unused_columns", False):
            args.remove_unused_columns = False
        super().__init__(model, args, *pargs, **kwargs)
        self._metric_sums: dict[str, float] = {}
        self._metric_count = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        if model.training:  # summed as tensors: no host sync until the next log
            for k in self._metric_keys:
                if k in outputs:
                    v = outputs[k].detach().float()
                    self._metric_sums[k] = self._metric_sums[k] + v if k in self._metric_sums else v
            self._metric_count += 1
        loss = outputs["loss"]
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._metric_count:
            for k, v in self._metric_sums.items():
                logs[k] = round(float(v) / self._metric_count, 6)
            self._metric_sums, self._metric_count = {}, 0
        super().log(logs, start_time)

    def _training_model(self) -> DrafterTrainingModel:
        m = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if not isinstance(m, DrafterTrainingModel):
            raise TypeError(f"DrafterTrainer needs a DrafterTrainingModel, got {type(m).__name__}")
        return m

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        self._training_model().save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        from ..modeling import AdaFlashDrafter

        m = self._training_model()
        loaded = AdaFlashDrafter.from_pretrained(resume_from_checkpoint)
        sd = loaded.state_dict()
        base = m.base_drafter
        if _is_peft(m.drafter):
            raise NotImplementedError("resuming a PEFT drafter run from a merged checkpoint is not supported")
        base.load_state_dict({k: v.to(base.fc.weight.dtype) for k, v in sd.items()})


# ----------------------------------------------------------------------------- callbacks / schedules


class JsonlLogCallback(TrainerCallback):
    """Append every Trainer log record (step, loss, lr, metrics, elapsed seconds) to a jsonl file."""

    def __init__(self, path: str | os.PathLike, verbose: bool = False, budget_s: float | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.verbose = verbose
        self.budget_s = budget_s
        self.t0 = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.t0 = time.time()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not state.is_world_process_zero:
            return
        rec = {"step": state.global_step}
        for k, v in logs.items():
            if k == "learning_rate":
                k = "lr"
            if isinstance(v, (int, float)):
                rec[k] = v
        rec["elapsed_s"] = round(time.time() - (self.t0 or time.time()), 2)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
        if self.verbose and "loss" in rec:
            parts = [f"step {rec['step']}", f"loss {rec['loss']:.4f}"]
            for k, fmt in (("ce_loss", ".4f"), ("length_loss", ".4f"), ("accuracy", ".3f"), ("accept_len", ".3f"), ("lr", ".2e")):
                if k in rec:
                    parts.append(f"{k} {rec[k]:{fmt}}")
            budget = f"/{self.budget_s:.0f}" if self.budget_s else ""
            parts.append(f"{rec['elapsed_s']:.0f}{budget}s")
            print("[train] " + " | ".join(parts), flush=True)


class WallClockCallback(TrainerCallback):
    """Stop training once ``seconds`` of training wall clock have passed; exposes ``fraction()``
    (elapsed share of the budget) for :func:`wall_clock_cosine_schedule`."""

    def __init__(self, seconds: float):
        self.seconds = float(seconds)
        self.t0: float | None = None

    def fraction(self) -> float:
        if self.t0 is None:
            return 0.0
        return min(1.0, (time.time() - self.t0) / max(self.seconds, 1e-9))

    def on_train_begin(self, args, state, control, **kwargs):
        self.t0 = time.time()

    def on_step_end(self, args, state, control, **kwargs):
        if self.fraction() >= 1.0:
            control.should_training_stop = True
            control.should_save = False
        return control


def wall_clock_cosine_schedule(optimizer, clock: WallClockCallback, warmup_ratio: float = 0.04, min_ratio: float = 0.0):
    """A ``LambdaLR`` whose warmup + cosine decay run over *wall-clock time* (``clock.fraction()``)
    instead of steps: the right schedule when the budget is minutes, not a step count."""

    def factor(_step: int) -> float:
        f = clock.fraction()
        if f < warmup_ratio:
            return max(f / warmup_ratio, 1e-3)
        p = (f - warmup_ratio) / max(1e-9, 1.0 - warmup_ratio)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(p, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ----------------------------------------------------------------------------- length head


def train_length_head(
    drafter: nn.Module,
    target: nn.Module,
    dataloader: Iterable[dict],
    steps: int,
    lr: float = 2e-4,
    max_anchors: int = 512,
    autocast_dtype: torch.dtype | None = None,
    progress: bool = False,
) -> list[float]:
    """Offline initialisation of the length head on a **frozen** drafter (the released AdaFlash recipe).

    Only ``drafter.length_head`` is optimised (AdamW, ``lr``) for ``steps`` batches of
    ``dataloader`` (cycled), with the MSE against ``(accepted + 1) / B`` of the module docstring.
    Sets ``config.length_head_trained = True`` and returns the per-step losses.
    """
    from tqdm.auto import tqdm

    base = unwrap_drafter(drafter)
    if base.length_head is None:
        raise ValueError("this drafter has no length head (config.use_length_head is False)")
    flags = {n: p.requires_grad for n, p in base.named_parameters()}
    base.requires_grad_(False)
    base.length_head.requires_grad_(True)
    model = DrafterTrainingModel(target, drafter, max_anchors=max_anchors, length_head_weight=1.0)
    device = base.fc.weight.device
    opt = torch.optim.AdamW(base.length_head.parameters(), lr=lr)
    was_training = base.training
    model.train()
    losses: list[float] = []
    it = iter(dataloader)
    try:
        for _ in tqdm(range(steps), desc="length head", disable=not progress):
            try:
                batch = next(it)
            except StopIteration:
                it = iter(dataloader)
                batch = next(it)
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            ctx = (
                torch.autocast(device.type, dtype=autocast_dtype)
                if autocast_dtype is not None
                else torch.autocast(device.type, enabled=False)
            )
            with ctx:
                out = model(**batch)
            loss = out["loss"]  # = ce (no grad: the drafter is frozen) + length-head MSE
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(out["length_loss"]))
    finally:
        for n, p in base.named_parameters():
            p.requires_grad_(flags.get(n, p.requires_grad))
        base.train(was_training)
    base.config.length_head_trained = True
    return losses
