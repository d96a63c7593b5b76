"""What a drafter is trained to do on its blocks: the loss, the length head's loss and the metrics.

One objective serves offline training and the online adapter:

* ``kind="ce"`` (DFlash): cross-entropy of slot ``k`` against token ``anchor + k``;
* ``kind="opd"`` (AdaFlash on-policy distillation) and ``kind="forward_kl"`` (OSD's
  baseline): distillation against the target's own distribution at each label position.

Slot ``k`` is weighted ``exp(-(k - 1) / gamma)``. The length head is trained by MSE on *detached*
block states against ``(accepted + 1) / B``, where ``accepted`` is the number of leading slots whose
drafter argmax equals the label (the target's argmax when distilling): the greedy acceptance rule
of verification, applied without grad.

Example:
    >>> obj = DrafterObjective("opd", block_size=16, alpha=0.8, clip=0.01)  # doctest: +SKIP
    >>> loss = obj.distill_loss(draft_logits, target_logits, weights)  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..speculation.acceptance import accepted_prefix_len
from .blocks import IGNORE_INDEX
from .losses import block_ce_loss, default_gamma, forward_kl_loss, length_head_loss, opd_loss, position_weights

__all__ = ["OBJECTIVES", "DrafterObjective", "greedy_accepted"]

OBJECTIVES = ("ce", "opd", "forward_kl")


def greedy_accepted(hit: torch.Tensor) -> torch.Tensor:
    """Accepted draft tokens per block from per-slot matches ``hit [..., k]`` (bool): the length of
    the leading run of matches, as greedy verification counts it."""
    flat = hit.reshape(-1, hit.shape[-1])
    full = torch.full((flat.shape[0],), flat.shape[1], dtype=torch.long, device=flat.device)
    return accepted_prefix_len(flat, full).view(hit.shape[:-1])


@dataclass
class DrafterObjective:
    """The training objective of a drafter's blocks (module doc).

    ``gamma``: position-weight decay (default ``default_gamma(block_size)``; ``inf``: equal weights).
    ``alpha`` / ``clip`` / ``temperature`` / ``clip_mode``: the settings of ``opd_loss``
    (``temperature`` also of ``forward_kl_loss``). ``length_head_weight``: weight of the length
    head's MSE in the total (0 disables it).
    """

    kind: str = "ce"
    block_size: int = 16
    gamma: float | None = None
    alpha: float = 0.8
    clip: float | None = 0.01
    temperature: float = 1.0
    clip_mode: str = "entry"
    length_head_weight: float = 1.0

    def __post_init__(self):
        if self.kind not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.kind!r}")
        self.block_size = int(self.block_size)
        self.gamma = float(self.gamma) if self.gamma is not None else default_gamma(self.block_size)
        self.length_head_weight = float(self.length_head_weight)

    @property
    def distills(self) -> bool:
        """Whether the labels are the target's distributions (the target must run its LM head)."""
        return self.kind != "ce"

    def slot_weights(self, device=None) -> torch.Tensor:
        """``[B]`` weights of the block slots: 0 for slot 0 (the anchor), ``exp(-(k-1)/gamma)`` after."""
        w = torch.zeros(self.block_size, device=device)
        w[1:] = position_weights(self.block_size - 1, self.gamma, device=device)
        return w

    def distill_loss(self, draft_logits, target_logits, weights=None) -> torch.Tensor:
        """OPD or forward KL of ``draft_logits`` against ``target_logits`` (``[b, k, V]``; weights ``[b, k]`` or ``[k]``)."""
        if self.kind == "opd":
            return opd_loss(draft_logits, target_logits, alpha=self.alpha, clip=self.clip, temperature=self.temperature,
                            position_weights=weights, clip_mode=self.clip_mode)  # fmt: skip
        if self.kind == "forward_kl":
            return forward_kl_loss(draft_logits, target_logits, temperature=self.temperature, position_weights=weights)
        raise ValueError("distill_loss needs objective 'opd' or 'forward_kl'")

    def head_loss(self, pred, accepted, verify_len=None) -> torch.Tensor:
        """MSE of the predicted acceptance ratio against ``(accepted + 1) / B``."""
        return length_head_loss(pred, accepted, self.block_size, verify_len=verify_len)

    def block_loss(self, logits, labels, weights, target_logits=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, argmax labels)`` of the labelled slots: ``logits [N, V]``, ``labels [N]``, ``weights
        [N]``; with ``target_logits [N, V]`` the loss distils and the labels become the target's argmax."""
        if target_logits is None:
            return block_ce_loss(logits[None], labels[None], weights=weights[None]), labels
        return self.distill_loss(logits[None], target_logits[None], weights[None]), target_logits.argmax(dim=-1)

    @torch.no_grad()
    def metrics(self, logits, labels, sel, anchor_valid) -> dict[str, torch.Tensor]:
        """Greedy acceptance of the blocks ``[b, n]``: ``accepted`` per block, slot-1 ``accuracy``,
        ``accept_len`` (mean ``accepted + 1`` over valid blocks), ``num_blocks``."""
        b, n = anchor_valid.shape
        B = self.block_size
        hit = torch.zeros_like(sel)
        hit[sel] = logits.argmax(dim=-1) == labels
        hit = hit.view(b, n, B)[:, :, 1:]
        accepted = greedy_accepted(hit)  # [b, n]
        first = sel.view(b, n, B)[:, :, 1]
        n_valid = anchor_valid.sum()
        return {
            "accepted": accepted,
            "accuracy": (hit[:, :, 0] & first).sum().float() / first.sum().clamp(min=1),
            "accept_len": (accepted.float() * anchor_valid).sum() / n_valid.clamp(min=1) + 1.0,
            "num_blocks": n_valid,
        }


def labelled(labels: torch.Tensor) -> torch.Tensor:
    """The block slots that carry a label."""
    return labels != IGNORE_INDEX
