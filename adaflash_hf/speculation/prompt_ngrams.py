"""The sequence's own n-grams beside the drafter: prompt lookup's candidate, verified when the drafter agrees.

Where the answer repeats its prompt (summarization, RAG, QA, code edits) the continuation after the earlier
occurrence of the text's last n-gram is often right for many tokens, more than a small drafter guesses. The
rule, ``agree``: each round, for each row, gather up to ``matches`` candidates, the continuations of the earlier
occurrences of the text's suffix n-grams (longest n-gram first, leftmost occurrence first, up to ``max_ngram``;
:class:`NgramIndex`). Among those whose first token equals the drafter's first draft, verify the one that agrees
with the drafter's drafts the longest (ties: the earlier in that order) in the drafter's place, over the slots the
verify length already gives the row. The drafter is the judge: where a candidate disagrees with it on the very next
token it is usually a false match, and among several matches the drafter's later drafts, weak on their own, pick
the right occurrence. With ``matches=1`` the candidate is exactly transformers' prompt lookup's. Picked among
several rules by a CPU projection on validation prompts (`examples/reference_pair/hybrid_lookup_projection.py`;
"the candidate whenever there is one" loses on summarization and RAG), then checked against the drafter alone on
the validation slices on a GPU.

Lossless: greedy acceptance keeps only what the target itself would choose, whatever is verified. Under
sampling, position 1 keeps the drafter's token and distribution, and the candidate is chosen by that sampled token
alone (the first in order that agrees with it: the later drafts are random, and a choice that read them would make
the later positions' proposal a mixture); so the candidate's later positions are deterministic given it, a one-hot
proposal (:func:`agree_with_drafts` rewrites ``q`` there): speculative sampling keeps the target's distribution for any proposal that is a
function of the prefix and of independent randomness.

Example:
    >>> index = NgramIndex([7, 1, 2, 3, 9, 1, 2], max_ngram=2)
    >>> index.candidates(3)  # "1 2" occurred at 1: what followed it
    [[3, 9, 1]]
    >>> NgramIndex([5, 1, 4, 1, 2, 1], max_ngram=1, matches=3).candidates(2)  # each "1": what followed it
    [[4, 1], [2, 1]]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["NgramIndex", "PromptNgrams", "agree_wide", "agree_with_drafts"]


@dataclass(frozen=True)
class PromptNgrams:
    """The ``agree`` rule's setting: the longest n-gram matched (``max_ngram``; 0 turns the rule off), how many
    candidates a row weighs each round (``matches``, the earliest occurrences, longest n-gram first) and whether
    sampled rows use it too (``sampled``; greedy rows always do). Candidates are as long as the row's verify length
    allows (at most the drafter's block - 1), unless ``max_width`` is set.

    ``max_width`` (``None``: the row's verify length, as above): a greedy row that takes a candidate verifies it in
    full, up to that many tokens, wider than the block if need be (:func:`agree_wide`: a wider candidate can
    only add accepted tokens, at the cost of a wider verify). The engine plans
    the widths on the host before the drafts exist: a greedy request with a candidate longer than its verify sends
    that many slots, padding when the drafter disagrees with every candidate (cheap where a verify's cost is flat in
    its width, at small batches). Sampled rows never widen.

    Off for sampled rows by default: there a candidate is a one-hot proposal, kept with the target's probability
    of its token, where the drafter's own sample is kept with ``1 - TV(p, q)``; with a good drafter that is more
    (reference pair, T 0.7, 16 math-reasoning prompts, dev CPU: tau 2.76 with the rule against 3.02 without).

    Example:
        >>> PromptNgrams().enabled, PromptNgrams(0).enabled, PromptNgrams().applies(greedy=False)
        (True, False, False)
        >>> PromptNgrams(matches=1).index([7, 1, 2, 9, 1, 2]).candidates(2)  # transformers' candidate only
        [[9, 1]]
    """

    max_ngram: int = 4
    matches: int = 8
    sampled: bool = False
    max_width: int | None = None

    def __post_init__(self):
        if isinstance(self.max_ngram, bool) or not isinstance(self.max_ngram, int) or self.max_ngram < 0:
            raise ValueError(f"prompt_ngrams must be an int >= 0 (the longest n-gram matched; 0: off), got {self.max_ngram!r}")
        if isinstance(self.matches, bool) or not isinstance(self.matches, int) or self.matches < 1:
            raise ValueError(f"prompt_ngrams matches must be an int >= 1 (candidates weighed per round), got {self.matches!r}")
        if self.max_width is not None and (isinstance(self.max_width, bool) or not isinstance(self.max_width, int) or self.max_width < 1):
            raise ValueError(f"prompt_ngrams max_width must be None or an int >= 1 (tokens of a candidate verified), got {self.max_width!r}")

    def index(self, tokens: list[int]) -> "NgramIndex":
        """A row's index over ``tokens`` (read, never copied: append the row's new tokens to it)."""
        return NgramIndex(tokens, self.max_ngram, matches=self.matches)

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
    """The leftmost starts (up to ``matches``) of every n-gram (sizes 1..``max_ngram``) of a growing token list
    whose next token is already in the list and outside ``forbidden`` (transformers' prompt lookup keeps only such
    windows).

    ``tokens`` is read, never copied: append to it and :meth:`candidates` (or :meth:`extend_to`) indexes what is new.
    One dict holds every size, keyed by an int that spells the n-gram backwards from its last token behind a leading 1
    bit (32 bits a token id), so the sizes never collide; a single occurrence is stored as its int start. The engine
    indexes every request's tokens on the host: ints, unlike a tuple key and a list per new n-gram, allocate nothing
    the garbage collector tracks, so a long run of indexing neither slows each step nor triggers full collections.
    """

    def __init__(self, tokens: list[int], max_ngram: int, forbidden=frozenset(), matches: int = 1):
        self.tokens, self.max_ngram, self.forbidden, self.matches = tokens, max_ngram, forbidden, matches
        self.starts: dict[int, int | list[int]] = {}
        self.length = 0

    def extend_to(self, length: int) -> None:
        """Index every n-gram whose next token lies before ``length``."""
        toks, starts, forbidden, top, most = self.tokens, self.starts, self.forbidden, self.max_ngram, self.matches
        for nxt in range(self.length, length):
            if forbidden and toks[nxt] in forbidden:
                continue
            key = 1
            for n in range(1, min(top, nxt) + 1):
                key = (key << 32) | toks[nxt - n]
                seen = starts.get(key)
                if seen is None:
                    starts[key] = nxt - n
                elif type(seen) is int:
                    if most > 1:
                        starts[key] = [seen, nxt - n]
                elif len(seen) < most:
                    seen.append(nxt - n)
        self.length = max(self.length, length)

    def _suffix_keys(self, cur: int) -> list[int]:
        """The keys of ``tokens[:cur]``'s suffix n-grams, shortest first (sizes 1 .. ``min(max_ngram, cur - 1)``)."""
        toks, keys, key = self.tokens, [], 1
        for n in range(1, min(self.max_ngram, cur - 1) + 1):
            key = (key << 32) | toks[cur - n]
            keys.append(key)
        return keys

    def match(self, cur: int) -> int | None:
        """Where the continuation of ``tokens[:cur]``'s longest indexed suffix n-gram starts (``None``: no match);
        n-grams are tried longest first, as transformers does."""
        self.extend_to(cur)
        keys = self._suffix_keys(cur)
        for n in range(len(keys), 0, -1):
            idx = self.starts.get(keys[n - 1])
            if idx is not None:
                return (idx if type(idx) is int else idx[0]) + n
        return None

    def candidates(self, num_tokens: int) -> list[list[int]]:
        """Up to ``matches`` continuations (each up to ``num_tokens`` tokens) of the whole list's suffix n-grams'
        earlier occurrences: longest n-gram first, leftmost first, each continuation once (an occurrence of a
        4-gram is one of its last 3 tokens too)."""
        cur = len(self.tokens)
        self.extend_to(cur)
        toks, out, taken = self.tokens, [], set()
        keys = self._suffix_keys(cur)
        for n in range(len(keys), 0, -1):
            found = self.starts.get(keys[n - 1])
            for start in () if found is None else (found,) if type(found) is int else found:
                if start + n not in taken:
                    taken.add(start + n)
                    out.append(toks[start + n : min(start + n + num_tokens, cur)])
                    if len(out) == self.matches:
                        return out
        return out


def _pick(drafts: torch.Tensor, candidates: list[list[list[int]]], width: int, by_first: bool):
    """Each row's preferred candidate (cut to ``width >= w`` tokens, ``-1`` after it), its length and whether it agrees:
    agreement is read over the drafts' ``w`` only (``by_first``: the first draft only). ``None``: no candidate at all."""
    b, w = drafts.shape
    if len(candidates) != b:
        raise ValueError(f"prompt n-grams: {len(candidates)} rows of candidates for {b} rows of drafts")
    k = max((len(c) for c in candidates), default=0)
    if w == 0 or k == 0:
        return None
    host = np.full((b, k, width + 1), -1, dtype=np.int64)  # the candidates, then their lengths: one copy to the device
    host[:, :, width] = 0
    for i, row in enumerate(candidates):
        for j, c in enumerate(row):
            c = c[:width]
            host[i, j, : len(c)] = c
            host[i, j, width] = len(c)
    host = torch.from_numpy(host).to(drafts.device, non_blocking=True)
    cand, lengths = host[..., :width].to(drafts.dtype), host[..., width]
    agree = (cand[..., :w] == drafts[:, None, :]).long().cumprod(dim=-1).sum(dim=-1).minimum(lengths)  # [b, k]
    if by_first:
        agree = agree.clamp(max=1)
    best = (agree * k + torch.arange(k - 1, -1, -1, device=agree.device)).argmax(dim=-1)  # longest, then earliest
    used = agree.gather(1, best[:, None])[:, 0] > 0
    rows = torch.arange(b, device=drafts.device)
    return cand[rows, best], lengths[rows, best], used


def agree_with_drafts(drafts: torch.Tensor, candidates: list[list[list[int]]], q: torch.Tensor | None = None):
    """The ``agree`` rule on one round's drafts: each row verifies, in the drafter's place (over at most the drafts'
    width), the candidate whose first token equals its first draft and that agrees with its drafts the longest
    (ties: the earlier candidate); rows where none agrees keep the drafter's block.

    Args:
        drafts: ``[b, w]`` the drafter's drafts (sampled ones for sampled rows), on any device.
        candidates: each row's candidates, in order of preference (host lists; none: ``[]``).
        q: ``[b, w, V]`` the draft distributions of sampled rows (``None`` under greedy). Then the candidate is
            chosen by the first draft alone (the first that agrees with it), and its positions after the first
            become one-hot on its tokens.

    Returns ``(drafts, q, used)``: new tensors (the inputs are not modified) and ``used [b]``, the rows that took
    a candidate. Everything is decided on the device: nothing is read back.

    Example:
        >>> d, _, used = agree_with_drafts(torch.tensor([[4, 5, 6], [1, 2, 3]]), [[[4, 8], [4, 5, 9]], [[7, 7, 7]]])
        >>> d.tolist(), used.tolist()
        ([[4, 5, 9], [1, 2, 3]], [True, False])
    """
    b, w = drafts.shape
    picked = _pick(drafts, candidates, w, by_first=q is not None)
    if picked is None:
        return drafts, q, torch.zeros(b, dtype=torch.bool, device=drafts.device)
    cand, lengths, used = picked
    place = used[:, None] & (torch.arange(w, device=drafts.device)[None, :] < lengths[:, None])
    drafts = torch.where(place, cand, drafts)
    if q is not None:
        place = place.clone()
        place[:, 0] = False  # the first draft is the drafter's own sample: its distribution stays
        one_hot = torch.nn.functional.one_hot(drafts.clamp(min=0), q.shape[-1]).to(q.dtype)
        q = torch.where(place[..., None], one_hot, q)
    return drafts, q, used


def agree_wide(drafts: torch.Tensor, draft_len: torch.Tensor, candidates: list[list[list[int]]], max_width: int,
               budget: torch.Tensor, width: int | None = None):
    """The ``agree`` rule for greedy rows, where a row that takes a candidate verifies it in full, up to ``max_width``
    tokens (and its ``budget``, the tokens it may still add), past the drafts' width ``w`` if need be: the round's
    drafts widen to the longest such verify. Candidates are chosen as :func:`agree_with_drafts` does (agreement with
    the ``w`` drafts); a row that takes one verifies ``max(draft_len, candidate length)``, other rows keep their
    ``draft_len``, and positions past a row's length are padding, never accepted. ``width``: the drafts' new width when
    the caller knows a bound (the engine: ``budget`` then holds each row's verify length planned on the host, and
    nothing is read back); ``None``: the longest verify, read back (generate's eager loop).

    Returns ``(drafts [b, k], draft_len [b], used [b])``, ``k >= w``.

    Example:
        >>> d, n, used = agree_wide(torch.tensor([[4, 5], [1, 2]]), torch.tensor([2, 2]), [[[4, 5, 6, 7]], [[3]]], 8,
        ...                         torch.tensor([9, 9]))
        >>> d.tolist(), n.tolist(), used.tolist()
        ([[4, 5, 6, 7], [1, 2, 0, 0]], [4, 2], [True, False])
    """
    b, w = drafts.shape
    picked = _pick(drafts, candidates, max(w, max_width), by_first=False)
    if picked is None:
        return drafts, draft_len, torch.zeros(b, dtype=torch.bool, device=drafts.device)
    cand, lengths, used = picked
    # A row verifying no draft (no tokens left, non-finite draft logits: a plain step) stays one.
    wide = used & (draft_len > 0)
    draft_len = torch.where(wide, draft_len.maximum(lengths.clamp(max=max_width).minimum(budget)), draft_len)
    k = max(w, int(draft_len.max()) if width is None else width)
    padded = torch.cat([drafts, drafts.new_zeros(b, k - w)], dim=1)
    place = used[:, None] & (torch.arange(k, device=drafts.device)[None, :] < lengths[:, None])
    return torch.where(place, cand[:, :k], padded), draft_len, used
