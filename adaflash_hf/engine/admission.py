"""Admission control: an EMA estimate of how many requests fit, plus hard limits."""

from __future__ import annotations

import math

import torch

__all__ = ["AdmissionController", "fit_token_budget"]


class AdmissionController:
    """``N_hat <- (1 - beta) * N_hat + beta * N`` where ``N`` is this round's instantaneous fit:
    ``min(num_slots, kv_tokens // mean tokens a request holds, token_budget // mean tokens a
    request sends per forward)``. New requests are admitted while the running count is below
    ``floor(N_hat)`` (at least 1) *and* the hard limits hold (a free slot, the prompt within what
    is left of this forward's token budget). The hard limits alone guarantee the engine never
    overflows; the EMA smooths admission so a burst does not fill the batch with requests whose
    verify blocks the budget then has to squeeze every round.
    """

    def __init__(self, num_slots: int, max_len: int, token_budget: int, tokens_per_request: float, beta: float = 0.2):
        if not 0 < beta <= 1:
            raise ValueError(f"beta must be in (0, 1], got {beta}")
        self.num_slots, self.kv_tokens, self.token_budget, self.beta = num_slots, num_slots * max_len, token_budget, beta
        self.n_hat = float(self.instant_fit(tokens_per_request, max_len / 2))

    def instant_fit(self, tokens_per_request: float, kv_per_request: float) -> int:
        by_budget = self.token_budget / max(tokens_per_request, 1.0)
        by_memory = self.kv_tokens / max(kv_per_request, 1.0)
        return max(1, min(self.num_slots, math.floor(by_budget), math.floor(by_memory)))

    def observe(self, tokens_per_request: float, kv_per_request: float) -> float:
        n = self.instant_fit(tokens_per_request, kv_per_request)
        self.n_hat = (1 - self.beta) * self.n_hat + self.beta * n
        return self.n_hat

    @property
    def limit(self) -> int:
        return max(1, math.floor(self.n_hat + 1e-9))


def fit_token_budget(draft_len: torch.Tensor, token_budget: int, rectangular: bool = False) -> torch.Tensor:
    """Trim the longest draft lengths until one round's verify fits ``token_budget`` (a shorter verify is
    lossless). A round costs ``sum(draft_len + 1)`` tokens, or ``n * (max + 1)`` when ``rectangular``.

    Example:
        >>> fit_token_budget(torch.tensor([7, 3, 0]), 10).tolist()
        [4, 3, 0]
    """
    n = draft_len.shape[0]
    if n == 0:
        return draft_len

    def cost(dl):
        return n * (int(dl.max()) + 1) if rectangular else int((dl + 1).sum())

    if cost(draft_len) <= token_budget:  # the common round: nothing to trim (a few host ops fewer)
        return draft_len
    cap = int(draft_len.max())
    while cap > 0 and cost(draft_len.clamp(max=cap)) > token_budget:
        cap -= 1
    out = draft_len.clamp(max=cap)
    if cost(out) > token_budget:  # admission keeps running <= budget, so this cannot happen
        raise RuntimeError(f"{n} running requests exceed the token budget {token_budget}")
    return out
