"""Per-request sampling parameters and the processed distributions speculative sampling needs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

import torch

__all__ = ["GREEDY_TEMPERATURE", "SamplingParams", "checked_probs", "position_keyed_samples", "processed_probs"]

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by 1e-38 overflows float32 to
# inf and softmax gives NaN, while 1e-5 keeps any finite logit finite (|logit| < 3.4e33) and is already argmax.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """``temperature < GREEDY_TEMPERATURE`` (1e-5; 0 included) means greedy and is stored as 0.0;
    ``top_k`` / ``top_p`` as transformers' warpers (applied after the temperature, top-k before top-p).
    ``seed`` makes the request reproducible: the token at each output position is a function of the seed,
    the position and the text before it only (see :func:`position_keyed_samples`), so the same request
    gives the same text alone or batched with any others. Invalid values (NaN, inf, negative, wrong type) raise
    ``ValueError`` naming the field, before any work."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, Real) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        object.__setattr__(self, "temperature", 0.0 if t < GREEDY_TEMPERATURE else float(t))
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, Integral) or k < 1):
            raise ValueError(f"top_k must be an integer >= 1, got {k!r}")
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, Real) or not 0 < p <= 1):  # NaN fails too
            raise ValueError(f"top_p must be a number in (0, 1], got {p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, Integral)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

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


def checked_probs(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``probs`` with every row that is not a distribution (non-finite, negative or zero mass) replaced by a
    uniform one, so ``multinomial`` never faults (a device assert on CUDA), and a 0-dim device flag: some row
    was replaced (the request is failed after the round's read; no host sync here)."""
    ok = torch.isfinite(probs).all(dim=-1) & (probs >= 0).all(dim=-1) & (probs.sum(dim=-1) > 0)
    safe = torch.where(ok[..., None], probs, torch.full_like(probs, 1.0 / probs.shape[-1]))
    return safe, ~ok.all()


def position_keyed_samples(probs: torch.Tensor, seed: int, start: int) -> torch.Tensor:
    """One-hot rows of the tokens sampled from ``probs [k, V]`` for output positions ``start .. start + k - 1``.

    Gumbel-max with noise keyed by ``(seed, position, token)``: row ``j``'s token is ``argmax(log p_j + g)``
    with ``g`` a counter-based hash of ``(seed, start + j, v)``, an exact sample of ``p_j``. Giving these
    one-hot rows to speculative sampling as both ``q`` and ``p`` makes a draft accepted exactly when it
    equals the target's sample, so the text depends on neither the drafts nor how a round was cut (the
    batch, the token budget). Rows that are not finite pass through unchanged (``checked_probs`` flags them).

        >>> p = torch.tensor([[0.2, 0.8], [0.5, 0.5]])
        >>> torch.equal(position_keyed_samples(p, 7, 3), position_keyed_samples(p, 7, 3))
        True
    """
    k, vocab = probs.shape
    key = hash((int(seed), 0x5EED)) & _MASK31  # int tuples hash the same in every process
    pos = _mix31(torch.arange(start, start + k, device=probs.device) ^ key)
    h = _mix31(pos[:, None] ^ _mix31(torch.arange(vocab, device=probs.device))[None, :])
    u = (h.double() + 0.5) / 2**31  # uniform in (0, 1)
    gumbel = -torch.log(-torch.log(u))
    tokens = (probs.double().log() + gumbel).argmax(dim=-1, keepdim=True)
    one_hot = torch.zeros_like(probs).scatter_(-1, tokens, 1.0)
    return torch.where(torch.isfinite(probs).all(dim=-1, keepdim=True), one_hot, probs)


_MASK31 = 2**31 - 1


def _mix31(x: torch.Tensor) -> torch.Tensor:
    """An integer hash on 31 bits (int64 products never overflow): nearby inputs give unrelated outputs."""
    x = x & _MASK31
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK31
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK31
    return (x >> 16) ^ x
