"""The prompt n-gram rule in an engine round (:mod:`adaflash_hf.speculation.prompt_ngrams`), in two steps around the
drafts: on the host, before the round's layout is fixed, each running request's candidates and how many tokens it may
verify with them (:func:`round_candidates`: under ``max_width`` a greedy request may verify past the block); then on
the device, the substitution (:func:`apply_prompt_ngrams`), greedy requests all at once and sampled ones all at once
(:func:`.sampled_rows.agree_sampled`). Nothing is read back: a widened request whose drafts agree with no candidate
verifies padding past its own drafts, never accepted."""

from __future__ import annotations

import torch

from ..speculation.prompt_ngrams import PromptNgrams, agree_wide, agree_with_drafts
from .graphs import to_device
from .kernels import TILE_ROWS
from .round_drafts import RoundDrafts
from .sampled_rows import agree_sampled

__all__ = ["INDEX_CHUNK", "PROBE_LAG", "apply_prompt_ngrams", "index_while", "round_candidates", "wide_capacity"]

INDEX_CHUNK = 32  # tokens a request's index takes per turn while the device runs: the last turn, past the device's end, is short
PROBE_LAG = 64  # the most tokens a probe round catches up on for a request's candidates (round_candidates)


def wide_capacity(rule: PromptNgrams, target) -> int:
    """The most tokens an engine built with ``rule`` lets a greedy request verify from a candidate (0: ``max_width``
    unset): ``max_width``, within one tile of the decode attention kernel (``TILE_ROWS`` query rows per kv head; a
    wider verify would send every forward to the slower fallback).

    Example:
        >>> wide_capacity(PromptNgrams(max_width=31), target)  # doctest: +SKIP
        31
    """
    if rule.max_width is None or not rule.enabled:
        return 0
    cfg = target.config.get_text_config(decoder=True)
    group = cfg.num_attention_heads // (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    return min(rule.max_width, TILE_ROWS // group - 1)


def round_candidates(rule: PromptNgrams, running, dl_host: list[int], wide: int | None, most_behind: int | None = None):
    """Each running request's candidates (host lists, in order of preference; ``[]``: none) and the draft length it
    may verify with them: its own ``dl_host[i]``, or, under ``wide`` (a greedy request that drafts at all), up to its
    longest candidate, at most ``wide`` tokens and its tokens left - 1. Each request's index (``Request.ngrams``) is
    built on first use and fed its new tokens. ``most_behind``: a request whose index lags its tokens by more than
    that many gets none this round rather than catching up now (a probe of plain decoding: :func:`index_while`
    catches up while the device runs).

    Example:
        >>> cands, lens = round_candidates(PromptNgrams(max_width=31), running, [15], 31)  # doctest: +SKIP
    """
    cands, lens = [], []
    for r, dl in zip(running, dl_host):
        if dl == 0 or not rule.applies(r.params.greedy):
            cands.append([])
            lens.append(dl)
            continue
        index = _fed(rule, r)
        if most_behind is not None and len(index.tokens) - index.length > most_behind:
            cands.append([])
            lens.append(dl)
            continue
        widen = wide is not None and r.params.greedy
        found = r.ngrams.candidates(max(dl, min(wide, r.remaining - 1)) if widen else dl)
        cands.append(found)
        lens.append(max([dl] + [len(c) for c in found]) if widen else dl)
    return cands, lens


def _fed(rule: PromptNgrams, r):
    """``r``'s index (built on first use), its token list holding the prompt and every committed token."""
    if r.ngrams is None:
        r.ngrams = rule.index(list(r.prompt))
    r.ngrams.tokens.extend(r.tokens[len(r.ngrams.tokens) - len(r.prompt) :])
    return r.ngrams


def index_while(rule: PromptNgrams, running, busy) -> int:
    """Index the requests' committed tokens ahead of need, ``INDEX_CHUNK`` tokens of one request at a time, while
    ``busy()`` (the device still runs work queued before this call): a plain stretch's host would otherwise only wait
    for its read. A request that drafts again then finds its index nearly current instead of catching up on every
    token since it last drafted (its whole prompt, the first time) in the middle of that round. Returns the tokens
    indexed. The index is the same whatever the chunks (:meth:`.NgramIndex.extend_to` indexes in order).

    Example:
        >>> index_while(PromptNgrams(), running, lambda: not done_event.query())  # doctest: +SKIP
        128
    """
    rows = [r for r in running if rule.applies(r.params.greedy)]
    done = 0
    while rows and busy():
        r = rows[-1]
        index = _fed(rule, r)
        end = min(len(index.tokens), index.length + INDEX_CHUNK)
        done += end - index.length
        index.extend_to(end)
        if index.length >= len(index.tokens):
            rows.pop()
    return done


def apply_prompt_ngrams(running, drafts: RoundDrafts, cands: list[list[list[int]]], wide: int | None,
                        caps: list[int]) -> torch.Tensor | None:
    """Rewrite ``drafts`` where a request takes a candidate (``cands`` from :func:`round_candidates`); returns how many
    did (a device scalar; ``None``: no request had a candidate). Under ``wide`` the greedy requests' drafts widen to
    the round's longest verify and their draft lengths become device values (``drafts.wide_len``), each at most its
    ``caps[i]``, the draft length planned on the host (within the budget).

    Example:
        >>> used = apply_prompt_ngrams(running, drafts, cands, None, [15] * len(running))  # doctest: +SKIP
    """
    if not any(cands):
        return None
    greedy = [c if r.params.greedy else [] for r, c in zip(running, cands)]
    if wide is None:
        drafts.tokens, _, used = agree_with_drafts(drafts.tokens, greedy)
    else:
        lens = to_device(torch.stack([drafts.draft_len, torch.tensor(caps)]), drafts.tokens.device)  # one copy
        drafts.tokens, drafts.wide_len, used = agree_wide(drafts.tokens, lens[0], greedy, wide, lens[1], width=max(caps))
    count = used.sum()
    sampled = agree_sampled(drafts, cands)
    return count if sampled is None else count + sampled.sum().to(count.device)
