"""Drafting one block per row: the drafter side of a speculative round, batched.

The drafter keeps K/V of verified context only (a transformers `DFlashCache`); each round it
appends the fused features of the newly verified tokens, drafts one block in one forward, asks
the length policy how many slots to verify, and discards the block's K/V.
"""

from dataclasses import dataclass

import torch
from transformers.cache_utils import DFlashCache

from ..modeling import AdaFlashDrafter
from .length_policy import adaptive_verify_length, expected_gain_verify_length

POLICIES = ("adaptive", "fixed", "expected_gain")


@dataclass
class DraftBlock:
    """A drafted block for every active row.

    `tokens[i, :draft_len[i]]` are proposed; `logits` are the raw draft logits of slots 1..B-1;
    `ratio` is the length head's estimate (None without a head); `finite` is False for rows whose
    draft logits were NaN/inf (they verify no draft: a plain decoding step).
    """

    tokens: torch.Tensor
    logits: torch.Tensor
    draft_len: torch.Tensor
    ratio: torch.Tensor | None
    finite: torch.Tensor


class AdaFlashCandidateGenerator:
    """Proposes up to `block_size - 1` draft tokens per row from one drafter forward.

    Args:
        drafter: a drafter bound to the target.
        policy: `adaptive` (length head), `fixed` (full block, classic DFlash) or `expected_gain`
            (per-position: the draft's own top-1 probability stands in for each slot's conditional
            acceptance, and the prefix with most expected tokens per verify cost wins).
        length_rate, length_min: the adaptive policy's `k_hat = clamp(round(a*B*rate), min, B)`.
        verify_token_cost: cost of one more verified token relative to a whole round
            (expected-gain policy); SPEC's H200 table gives ~0.01-0.05 at batch 1.
    """

    def __init__(self, drafter: AdaFlashDrafter, policy: str, length_rate: float, length_min: int, verify_token_cost: float = 0.05):
        if policy not in POLICIES:
            raise ValueError(f"unknown length_policy {policy!r}: choose one of {', '.join(POLICIES)}")
        if policy == "adaptive" and drafter.length_head is None:
            raise ValueError("length_policy='adaptive' needs a drafter with a length head (config.use_length_head)")
        self.drafter = drafter
        self.policy = policy
        self.block_size = drafter.config.block_size
        self.length_rate = length_rate
        self.length_min = length_min
        self.verify_token_cost = verify_token_cost
        self.cache = DFlashCache(config=drafter.config)
        self.cache_valid: torch.Tensor | None = None

    def select_rows(self, keep: torch.Tensor) -> None:
        """Drop finished rows (`keep`: indices of the rows that stay)."""
        if self.cache.get_seq_length() > 0:
            self.cache.batch_select_indices(keep)
        if self.cache_valid is not None:
            self.cache_valid = self.cache_valid[keep]

    @torch.no_grad()
    def propose(self, bonus: torch.Tensor, bonus_pos: torch.Tensor, ctx: torch.Tensor, ctx_valid: torch.Tensor, ctx_pos: torch.Tensor, budget: torch.Tensor) -> DraftBlock:
        """Draft a block after `bonus` (`[b]`, at positions `bonus_pos`) given new context features.

        `ctx` (`[b, m, K*H]`) are the target features of the tokens verified since the last call,
        at positions `ctx_pos`; `ctx_valid` marks real columns (rows verified different counts).
        `budget` caps each row's draft length (e.g. tokens left before `max_length`).
        """
        b, B = bonus.shape[0], self.block_size
        d = self.drafter
        noise_ids = torch.full((b, B), d.config.mask_token_id, dtype=torch.long, device=bonus.device)
        noise_ids[:, 0] = bonus
        block_pos = bonus_pos[:, None] + torch.arange(B, device=bonus.device)
        past_valid = self.cache_valid if self.cache_valid is not None else ctx_valid[:, :0]
        key_mask = torch.cat([past_valid, ctx_valid, torch.ones_like(ctx_valid[:, :1]).expand(b, B)], dim=1)
        out = d(
            noise_embeds=d.embed(noise_ids),
            context_hidden_states=ctx.to(d.dtype),
            position_ids=torch.cat([ctx_pos, block_pos], dim=1),
            attention_mask=key_mask.long(),
            past_key_values=self.cache,
        )
        # Keep context K/V only; the block is drafted afresh next round.
        self.cache.crop(-B)
        self.cache_valid = torch.cat([past_valid, ctx_valid], dim=1)

        hidden = out.last_hidden_state
        logits = d.compute_logits(hidden[:, 1:]).float()
        finite = torch.isfinite(logits).all(dim=-1).all(dim=-1)
        ratio = d.predict_accept_ratio(hidden) if d.length_head is not None else None
        k_hat = self._verify_length(logits, ratio, b)
        draft_len = torch.minimum(k_hat - 1, budget.clamp(min=0))
        draft_len = torch.where(finite, draft_len, torch.zeros_like(draft_len))
        tokens = torch.nan_to_num(logits).argmax(dim=-1)
        return DraftBlock(tokens=tokens, logits=logits, draft_len=draft_len, ratio=ratio, finite=finite)

    def _verify_length(self, logits: torch.Tensor, ratio: torch.Tensor | None, b: int) -> torch.Tensor:
        B = self.block_size
        if self.policy == "adaptive":
            return adaptive_verify_length(ratio, B, rate=self.length_rate, min_len=self.length_min)
        if self.policy == "expected_gain":
            top1 = torch.nan_to_num(logits).softmax(dim=-1).amax(dim=-1)
            k_hat = expected_gain_verify_length(top1, cost_per_token=self.verify_token_cost, min_len=self.length_min)
            return k_hat.to(logits.device)
        return torch.full((b,), B, dtype=torch.long, device=logits.device)
