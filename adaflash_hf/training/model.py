"""The training wrapper: a frozen target and a trainable drafter whose ``forward`` returns the loss.

:class:`DrafterTrainingModel` holds the **frozen target** (eval mode, ``requires_grad=False``,
deliberately *not* a registered submodule: it is never saved, never handed to the optimizer, never
wrapped by DDP/FSDP; ``.to()`` still moves it) and the **trainable drafter** (optionally a PEFT
model). ``forward(input_ids, attention_mask, loss_mask, target_features=None)`` samples up to
``max_anchors`` anchors per sequence inside the response, builds all blocks of a batch as one
drafter forward with the block attention mask of :mod:`adaflash_hf.training.blocks`, and scores
them with a :class:`~adaflash_hf.training.objective.DrafterObjective`; it returns ``{"loss",
"ce_loss", "length_loss", "accuracy", "accept_len", "num_blocks", "num_tokens"}`` with
``loss = ce_loss + length_head_weight * length_loss`` (``ce_loss`` is the objective's main term,
cross-entropy or distillation).

Target features come from the target on the fly (only the decoder runs, under ``no_grad``; with a
distilling objective the LM head runs too) or, when the batch carries ``target_features``, from a
feature cache (:mod:`adaflash_hf.training.features`). The online adapter trains whole served
requests through this same wrapper.

Example:
    >>> model = DrafterTrainingModel(target, drafter)  # doctest: +SKIP
    >>> out = model(**DrafterDataCollator(tok)(samples)); out["loss"].backward()  # doctest: +SKIP
"""

from __future__ import annotations

import torch
from torch import nn

from .block_attention import FlexBlockAttention
from .blocks import block_attention_mask, build_block_inputs, sample_anchors
from .checkpoint import save_drafter, unwrap_drafter
from .features import compute_target_features, select_layers
from .objective import DrafterObjective, labelled

__all__ = ["DrafterTrainingModel"]


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
            (distillation against the target's distributions), or a ready ``DrafterObjective``.
        alpha / clip / temperature / clip_mode: the settings of ``opd_loss`` (``temperature`` also
            of ``forward_kl_loss``).
        block_attention: ``"dense"`` (the block rule as a dense mask, any SDPA / eager kernel) or
            ``"flex"`` (the same rule as a sparse flex-attention mask, compiled on CUDA:
            :mod:`~adaflash_hf.training.block_attention`).
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
        objective: str | DrafterObjective = "ce",
        alpha: float = 0.8,
        clip: float | None = 0.01,
        temperature: float = 1.0,
        clip_mode: str = "entry",
        block_attention: str = "dense",
    ):
        super().__init__()
        base = unwrap_drafter(drafter)
        if block_attention not in ("dense", "flex"):
            raise ValueError(f"block_attention must be 'dense' or 'flex', got {block_attention!r}")
        if block_attention == "flex" and "sliding_attention" in base.config.layer_types:
            raise ValueError("block_attention='flex' does not cover sliding_attention drafter layers: use 'dense'")
        if not isinstance(objective, DrafterObjective):
            objective = DrafterObjective(objective, int(base.config.block_size), gamma, alpha, clip, temperature,
                                         clip_mode, length_head_weight)  # fmt: skip
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
        self.loss_fn = objective
        self.block_size = objective.block_size
        self.max_anchors = int(max_anchors)
        self.block_attention = block_attention
        self.require_full_block = bool(require_full_block)
        self.move_target = (getattr(target, "hf_device_map", None) is None) if move_target is None else move_target
        self.config = base.config  # Trainer introspection (model.config) finds the drafter's config

    # ---------------------------------------------------------------- plumbing
    @property
    def objective(self) -> str:
        return self.loss_fn.kind

    @property
    def gamma(self) -> float:
        return self.loss_fn.gamma

    @property
    def length_head_weight(self) -> float:
        return self.loss_fn.length_head_weight

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
        """The drafter's context features of the target's hidden states: ``[b, T, K*H]`` (no grad, no LM head)."""
        return compute_target_features(self.target, self.base_drafter.config.target_layer_ids, input_ids, attention_mask, position_ids)

    @torch.no_grad()
    def target_features_and_logits(self, input_ids, attention_mask=None, position_ids=None):
        """Features as :meth:`target_features` plus the target's logits ``[b, T, V]`` (one forward)."""
        out = self.target(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          output_hidden_states=True, use_cache=False)
        return select_layers(out.hidden_states, self.base_drafter.config.target_layer_ids), out.logits

    def _features(self, input_ids, attention_mask, ctx_pos, target_features):
        """``(features [b, T, K*H], target logits or None)``, checked against the drafter's ``fc``."""
        base = self.base_drafter
        target_logits = None
        if self.loss_fn.distills:
            features, target_logits = self.target_features_and_logits(input_ids, attention_mask, ctx_pos)
            target_features = features if target_features is None else target_features
        elif target_features is None:
            target_features = self.target_features(input_ids, attention_mask, ctx_pos)
        b, T = input_ids.shape
        fc_in = base.fc.in_features if hasattr(base.fc, "in_features") else base.fc.weight.shape[1]
        if target_features.shape[-1] != fc_in or target_features.shape[:2] != (b, T):
            raise ValueError(
                f"target_features has shape {tuple(target_features.shape)}, expected [{b}, {T}, {fc_in}] "
                f"(K={len(base.config.target_layer_ids)} layers x H={base.config.hidden_size})"
            )
        return target_features, target_logits

    # ---------------------------------------------------------------- forward
    def _draft_blocks(self, input_ids, attention_mask, loss_mask, ctx_pos, features, anchors, anchor_valid):
        """One drafter forward over every block: ``(hidden [b, n*B, H], labels [b, n*B])``."""
        base = self.base_drafter
        B = self.block_size
        b, T = input_ids.shape
        n = anchors.shape[1]
        block_ids, labels, _ = build_block_inputs(
            input_ids, anchors, anchor_valid, B, base.config.mask_token_id, loss_mask=loss_mask
        )
        # Absolute block positions follow the context's position ids (anchor position + k).
        anchor_pos = torch.gather(ctx_pos, 1, anchors.clamp(max=T - 1))
        block_pos = (anchor_pos.unsqueeze(-1) + torch.arange(B, device=input_ids.device)).reshape(b, n * B)
        if self.block_attention == "flex":
            attn = {"attention_mask": None, "attention_fn": FlexBlockAttention.build(
                T, anchors, anchor_valid, B, attention_mask, compiled=input_ids.is_cuda)}
        else:
            attn = {"attention_mask": block_attention_mask(T, anchors, anchor_valid, B, key_padding_mask=attention_mask)}
        dtype = base.fc.weight.dtype if base.fc.weight.dtype.is_floating_point else torch.float32
        out = self.drafter(
            noise_embeds=base.embed(block_ids).to(dtype),
            context_hidden_states=features.to(dtype),
            position_ids=torch.cat([ctx_pos, block_pos], dim=1),
            **attn,
        )
        return out.last_hidden_state, labels

    def _length_loss(self, hidden, accepted, anchor_valid, verify_len=None) -> torch.Tensor:
        """The length head's MSE on the detached block states (0 when it is off or frozen); ``verify_len``
        marks censored labels (:func:`~.losses.length_head_loss`)."""
        base = self.base_drafter
        head = getattr(base, "length_head", None)
        if not (self.length_head_weight > 0 and head is not None and any(p.requires_grad for p in head.parameters())
                and bool(anchor_valid.any())):  # fmt: skip
            return hidden.new_zeros((), dtype=torch.float32)
        b, n = anchor_valid.shape
        pred = base.predict_accept_ratio(hidden.view(b, n, self.block_size, -1))  # detached inside
        vl = verify_len[anchor_valid] if verify_len is not None else None
        return self.loss_fn.head_loss(pred[anchor_valid], accepted[anchor_valid], verify_len=vl)

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        target_features: torch.Tensor | None = None,
        anchors: torch.LongTensor | None = None,
        anchor_valid: torch.Tensor | None = None,
        served_accepted: torch.LongTensor | None = None,
        served_verify_len: torch.LongTensor | None = None,
    ) -> dict[str, torch.Tensor]:
        r"""
        input_ids / attention_mask (`[b, T]`, right padded).
        loss_mask (`[b, T]` bool): response tokens (anchors and labels live there); default: every
            real token.
        target_features (`[b, T, K*H]`, optional): cached context features; computed from the target
            when absent.
        anchors / anchor_valid (`[b, n]`, optional): fixed anchors (tests, served rounds); sampled otherwise.
        served_accepted / served_verify_len (`[b, n]`, optional, with `anchors`): the drafts the target
            really accepted in the served round anchored there, and that round's verify length (online
            training): the length head's labels, censored where the verify length cut the block. Without
            them the head learns the greedy match of this drafter's own drafts (teacher-forced, offline).
        """
        B = self.block_size
        b, T = input_ids.shape
        if served_accepted is not None and (anchors is None or served_accepted.shape != anchors.shape):
            raise ValueError("served_accepted needs anchors of the same shape (the served rounds' positions)")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        attention_mask = attention_mask.to(torch.bool)
        loss_mask = attention_mask if loss_mask is None else (loss_mask.to(torch.bool) & attention_mask)
        ctx_pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        features, target_logits = self._features(input_ids, attention_mask, ctx_pos, target_features)
        if anchors is None:
            anchors, anchor_valid = sample_anchors(loss_mask, B, self.max_anchors, require_full_block=self.require_full_block)
        elif anchor_valid is None:
            anchor_valid = torch.ones_like(anchors, dtype=torch.bool)
        n = anchors.shape[1]
        hidden, labels = self._draft_blocks(input_ids, attention_mask, loss_mask, ctx_pos, features, anchors, anchor_valid)

        sel = labelled(labels)  # [b, n*B]
        slot = torch.arange(n * B, device=input_ids.device) % B  # k for every column
        w_sel = self.loss_fn.slot_weights(hidden.device)[slot].unsqueeze(0).expand(b, -1)[sel]
        base = self.base_drafter
        h_sel = hidden[sel]
        lm_dtype = getattr(getattr(base._target_ref("lm_head"), "weight", None), "dtype", h_sel.dtype)
        logits = base.compute_logits(h_sel.to(lm_dtype))
        t_sel = None
        if target_logits is not None:
            # Slot k's label is token anchor + k; the target predicted it at position anchor + k - 1.
            label_pos = (anchors.unsqueeze(-1) + torch.arange(B, device=anchors.device)).reshape(b, n * B)
            rows = torch.arange(b, device=anchors.device)[:, None].expand(b, n * B)
            t_sel = target_logits[rows[sel], label_pos[sel] - 1].to(logits.device)
        ce, lab_sel = self.loss_fn.block_loss(logits, labels[sel], w_sel, t_sel)
        m = self.loss_fn.metrics(logits, lab_sel, sel, anchor_valid)
        if served_accepted is not None:
            length_loss = self._length_loss(hidden, served_accepted, anchor_valid, served_verify_len)
        else:
            length_loss = self._length_loss(hidden, m["accepted"], anchor_valid)
        return {
            "loss": ce + self.length_head_weight * length_loss,
            "ce_loss": ce.detach(),
            "length_loss": length_loss.detach(),
            "accuracy": m["accuracy"],
            "accept_len": m["accept_len"],
            "num_blocks": m["num_blocks"],
            "num_tokens": sel.sum(),
        }
