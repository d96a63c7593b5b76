"""Per-request sampling parameters and the processed distributions speculative sampling needs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SamplingParams", "processed_probs"]


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` means greedy; ``top_k`` / ``top_p`` as transformers' warpers (applied
    after the temperature, top-k before top-p). ``seed`` seeds the request's own generator."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def eos_ids(self) -> frozenset[int]:
        e = self.eos_token_id
        return frozenset() if e is None else frozenset([e] if isinstance(e, int) else e)


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``softmax`` of temperature / top-k / top-p processed logits, row-wise over ``[..., V]``."""
    scores = logits.float() / params.temperature
    if params.top_k is not None and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        # transformers' TopPLogitsWarper: drop the low tail whose mass is <= 1 - top_p, keep >= 1 token.
        sorted_scores, idx = torch.sort(scores, descending=False, dim=-1)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove = cum <= (1 - params.top_p)
        remove[..., -1] = False
        scores = scores.masked_fill(remove.scatter(-1, idx, remove), float("-inf"))
    return scores.softmax(dim=-1)
