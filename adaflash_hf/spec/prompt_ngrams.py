"""The sequence's own n-grams beside the drafter: prompt lookup's candidate, verified when the drafter agrees.

Where the answer repeats its prompt (summarization, RAG, QA, code edits) the continuation after the earlier
occurrence of the text's last n-gram is often right for many tokens, more than a small drafter guesses. The
rule, ``agree``: each round, for each row, take prompt lookup's candidate (transformers' rule: the leftmost
earlier occurrence of the longest suffix n-gram, up to ``max_ngram``; :class:`NgramIndex`) and, when its first
token equals the drafter's first draft, verify the candidate in the drafter's place over the slots the verify
length already gives the row. The drafter's first draft is the tie-breaker: where the two disagree on the very
next token, the candidate is usually a false match. Picked among several rules by a CPU projection
(`examples/reference_pair/hybrid_lookup_projection.py`; "the candidate whenever there is one" loses on
summarization and RAG), then checked against the drafter alone on the H200 validation slices (BENCHMARKS section 1).

Lossless: greedy acceptance keeps only what the target itself would choose, whatever is verified. Under
sampling, position 1 keeps the drafter's token and distribution (agreement is decided *by* that sampled token),
and the candidate's later positions are deterministic given it, a one-hot proposal (:func:`agree_with_drafts`
rewrites ``q`` there): speculative sampling keeps the target's distribution for any proposal that is a
function of the prefix and of independent randomness.

Example:
    >>> index = NgramIndex([7, 1, 2, 3, 9, 1, 2], max_ngram=2)
    >>> index.candidate(3)  # "1 2" occurred at 1: what followed it
    [3, 9, 1]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["NgramIndex", "PromptNgrams", "agree_with_drafts"]


@dataclass(frozen=True)
class PromptNgrams:
    """The ``agree`` rule's setting: the longest n-gram matched (``max_ngram``; 0 turns the rule off) and whether
    sampled rows use it too (``sampled``; greedy rows always do). Candidates are as long as the row's verify length
    allows (at most the drafter's block - 1).

    Off for sampled rows by default: there a candidate is a one-hot proposal, kept with the target's probability
    of its token, where the drafter's own sample is kept with ``1 - TV(p, q)``; with a good drafter that is more
    (reference pair, T 0.7, 16 math-reasoning prompts, dev CPU: tau 2.76 with the rule against 3.02 without).

    Example:
        >>> PromptNgrams().enabled, PromptNgrams(0).enabled, PromptNgrams().applies(greedy=False)
        (True, False, False)
    """

    max_ngram: int = 4
    sampled: bool = False

    def __post_init__(self):
        if isinstance(self.max_ngram, bool) or not isinstance(self.max_ngram, int) or self.max_ngram < 0:
            raise ValueError(f"prompt_ngrams must be an int >= 0 (the longest n-gram matched; 0: off), got {self.max_ngram!r}")

    @property
    def enabled(self) -> bool:
        return self.max_ngram > 0

    def applies(self, greedy: bool) -> bool:
        """Whether a greedy (else sampled) row uses the rule."""
        return self.enabled and (greedy or self.sampled)

    @classmethod
    def of(cls, value) -> "PromptNgrams":
        """``None`` -> the default, an int -> that ``max_ngram``, a :class:`PromptNgrams` as is."""
        if value is None:
            return cls()
        return value if isinstance(value, PromptNgrams) else cls(value)


class NgramIndex:
    """The leftmost start of every n-gram (sizes 1..``max_ngram``) of a growing token list whose next token is
    already in the list and outside ``forbidden`` (transformers' prompt lookup keeps only such windows).

    ``tokens`` is read, never copied: append to it and :meth:`candidate` (or :meth:`extend_to`) indexes what is new.
    One dict holds every size (an n-gram's tuple length is its size): the engine calls this for every request
    every round, on the host.
    """

    def __init__(self, tokens: list[int], max_ngram: int, forbidden=frozenset()):
        self.tokens, self.max_ngram, self.forbidden = tokens, max_ngram, forbidden
        self.first: dict[tuple, int] = {}
        self.length = 0

    def extend_to(self, length: int) -> None:
        """Index every n-gram whose next token lies before ``length``."""
        toks, first, forbidden, top = self.tokens, self.first, self.forbidden, self.max_ngram
        for nxt in range(self.length, length):
            if forbidden and toks[nxt] in forbidden:
                continue
            for n in range(1, min(top, nxt) + 1):
                first.setdefault(tuple(toks[nxt - n : nxt]), nxt - n)
        self.length = max(self.length, length)

    def match(self, cur: int) -> int | None:
        """Where the continuation of ``tokens[:cur]``'s longest indexed suffix n-gram starts (``None``: no match);
        n-grams are tried longest first, as transformers does."""
        self.extend_to(cur)
        toks, first = self.tokens, self.first
        for n in range(min(self.max_ngram, cur - 1), 0, -1):
            idx = first.get(tuple(toks[cur - n : cur]))
            if idx is not None:
                return idx + n
        return None

    def candidate(self, num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` tokens that followed the whole list's suffix n-gram where it first occurred."""
        cur = len(self.tokens)
        start = self.match(cur)
        return [] if start is None else self.tokens[start : min(start + num_tokens, cur)]


def agree_with_drafts(drafts: torch.Tensor, candidates: list[list[int]], q: torch.Tensor | None = None):
    """The ``agree`` rule on one round's drafts: rows whose candidate's first token equals their first draft verify
    the candidate (over at most the drafts' width) in the drafter's place.

    Args:
        drafts: ``[b, w]`` the drafter's drafts (sampled ones for sampled rows), on any device.
        candidates: each row's candidate (host lists; empty: none).
        q: ``[b, w, V]`` the draft distributions of sampled rows (``None`` under greedy): at the candidate's
            positions after the first they become one-hot on its tokens.

    Returns ``(drafts, q, used)``: new tensors (the inputs are not modified) and ``used [b]``, the rows that took
    their candidate.

    Example:
        >>> d, _, used = agree_with_drafts(torch.tensor([[4, 5, 6], [1, 2, 3]]), [[4, 8], [7, 7, 7]])
        >>> d.tolist(), used.tolist()
        ([[4, 8, 6], [1, 2, 3]], [True, False])
    """
    b, w = drafts.shape
    if w == 0 or not any(candidates):
        return drafts, q, torch.zeros(b, dtype=torch.bool, device=drafts.device)
    host = np.full((b, w + 1), -1, dtype=np.int64)  # the candidates, then their lengths: one copy to the device
    for i, c in enumerate(candidates):
        if c:
            c = c[:w]
            host[i, : len(c)] = c
            host[i, w] = len(c)
    host = torch.from_numpy(host).to(drafts.device, non_blocking=True)
    cand, lengths = host[:, :w].to(drafts.dtype), host[:, w]
    used = (lengths > 0) & (cand[:, 0] == drafts[:, 0])
    place = used[:, None] & (torch.arange(w, device=drafts.device)[None, :] < lengths[:, None])
    drafts = torch.where(place, cand, drafts)
    if q is not None:
        place = place.clone()
        place[:, 0] = False  # the first draft is the drafter's own sample: its distribution stays
        one_hot = torch.nn.functional.one_hot(drafts.clamp(min=0), q.shape[-1]).to(q.dtype)
        q = torch.where(place[..., None], one_hot, q)
    return drafts, q, used
