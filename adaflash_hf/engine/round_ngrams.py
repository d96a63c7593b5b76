"""The prompt n-gram rule in an engine round (:mod:`adaflash_hf.speculation.prompt_ngrams`): each running request's
candidates from its own index, then the substitution, greedy requests all at once and sampled ones all at once
(:func:`.sampled_rows.agree_sampled`); nothing is read back."""

from __future__ import annotations

import torch

from ..speculation.prompt_ngrams import PromptNgrams, agree_with_drafts
from .round_drafts import RoundDrafts
from .sampled_rows import agree_sampled

__all__ = ["apply_prompt_ngrams"]


def apply_prompt_ngrams(rule: PromptNgrams, running, drafts: RoundDrafts, dl_host: list[int]) -> torch.Tensor | None:
    """Rewrite ``drafts`` in place where a request takes a candidate; returns how many did (a device scalar; ``None``:
    no request had a candidate). Each request's index (``Request.ngrams``) is built on first use and fed its new
    tokens.

    Example:
        >>> used = apply_prompt_ngrams(PromptNgrams(), running, drafts, [15] * len(running))  # doctest: +SKIP
    """
    cands = []
    for r, dl in zip(running, dl_host):
        if not rule.applies(r.params.greedy):
            cands.append([])
            continue
        if r.ngrams is None:
            r.ngrams = rule.index(list(r.prompt))
        r.ngrams.tokens.extend(r.tokens[len(r.ngrams.tokens) - len(r.prompt) :])
        cands.append(r.ngrams.candidates(dl) if dl > 0 else [])
    if not any(cands):
        return None
    greedy = [c if r.params.greedy else [] for r, c in zip(running, cands)]
    drafts.tokens, _, used = agree_with_drafts(drafts.tokens, greedy)
    count = used.sum()
    sampled = agree_sampled(drafts, cands)
    return count if sampled is None else count + sampled.sum().to(count.device)
