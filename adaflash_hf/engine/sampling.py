"""Per-request sampling parameters and the processed distributions speculative sampling needs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any

import numpy as np
import torch

from .graphs import arrays_to_device

__all__ = [
    "GREEDY_TEMPERATURE", "RowSampling", "SamplingParams", "checked_probs", "keyed_samples", "position_keyed_samples",
    "processed_probs", "seed_key",
]

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by 1e-38 overflows float32 to
# inf and softmax gives NaN, while 1e-5 keeps any finite logit finite (|logit| < 3.4e33) and is already argmax.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """``temperature < GREEDY_TEMPERATURE`` (1e-5; 0 included) means greedy and is stored as 0.0;
    ``top_k`` / ``top_p`` as transformers' warpers (applied after the temperature, top-k before top-p).
    ``seed`` makes the request reproducible: the token at each output position is a function of the seed,
    the position and the text before it only (see :func:`position_keyed_samples`), so the same request
    gives the same text alone or batched with any others. ``presence_penalty`` / ``frequency_penalty`` are OpenAI's
    (vLLM's reading: over the tokens generated so far, not the prompt), subtracted from the target's logits at every
    verified position before anything reads them (:mod:`.processed_rows`); ``logprobs`` (``None``: off) asks for each
    committed token's log-probability under those processed logits and that many most likely alternatives (0: the
    token's own only); ``grammar`` (a :class:`~.grammar.Grammar`) masks the rows to what it allows. Invalid values (NaN, inf, negative, wrong type) raise ``ValueError`` naming the field, before
    any work."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    grammar: Any = field(default=None, compare=False, repr=False)

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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, Real) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
            object.__setattr__(self, name, float(v))
        n = self.logprobs
        if n is not None and (isinstance(n, bool) or not isinstance(n, Integral) or n < 0):
            raise ValueError(f"logprobs must be an integer >= 0 or None, got {n!r}")

    @property
    def penalized(self) -> bool:
        """Whether the target's logits are changed for this request before acceptance (a penalty is set)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def raw_rows(self) -> bool:
        """Whether the request reads the target's rows as they come (no penalty, grammar or logprobs): the greedy
        steps that commit without building any row (``decode_steps``) may take it."""
        return not self.penalized and self.logprobs is None and self.grammar is None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def eos_ids(self) -> frozenset[int]:
        e = self.eos_token_id
        return frozenset() if e is None else frozenset([e] if isinstance(e, int) else e)


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``softmax`` of temperature / top-k / top-p processed logits, row-wise over ``[..., V]``, one request's
    ``params`` for every row (:meth:`RowSampling.probs` with the same values: one implementation of the warpers).

    Example:
        >>> processed_probs(torch.tensor([[2.0, 1.0, 0.0]]), SamplingParams(temperature=1.0, top_k=2)).tolist()
        [[0.7310585975646973, 0.2689414322376251, 0.0]]
    """
    shape, vocab = logits.shape[:-1], logits.shape[-1]
    rows = RowSampling.build([params], [shape.numel()], [0], vocab, logits.device, keyed=False)
    return rows.probs(logits.reshape(-1, vocab)).reshape(logits.shape)


@dataclass(frozen=True)
class RowSampling:
    """Per-row sampling parameters on the device, for packed rows of several requests: each row's temperature,
    top-k and top-p (transformers' warpers, in that order), and for the rows of seeded requests their seed's
    key and output position (:func:`keyed_samples`). One :meth:`probs` / :meth:`sampling_rows` call processes
    every row, whatever mix of parameters the requests have (no loop over requests).

    ``top_k [R, 1]`` (0: none; ``None``: no row has one, ``max_k`` the largest); ``top_p_rows`` the rows with a
    top-p (``None``: every row) and ``top_p_drop [r, 1]`` their ``1 - top_p`` (``None``: no row has one); the same
    for ``keyed_rows`` / ``keys`` / ``positions`` (``keys`` ``None``: no seeded row). Build it with :meth:`build`.

    Example:
        >>> rows = RowSampling.build([SamplingParams(0.5), SamplingParams(1.0, top_p=0.5)], [1, 1], [0, 0], 3, "cpu")
        >>> rows.probs(torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]]))[1].tolist()
        [1.0, 0.0, 0.0]
    """

    temperature: torch.Tensor
    top_k: torch.Tensor | None = None
    max_k: int = 0
    top_p_rows: torch.Tensor | None = None
    top_p_drop: torch.Tensor | None = None
    keyed_rows: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    positions: torch.Tensor | None = None

    @classmethod
    def build(cls, params: list[SamplingParams], counts: list[int], starts: list[int], vocab: int, device,
              keyed: bool = True) -> "RowSampling":
        """Request ``i`` (``params[i]``) owns ``counts[i]`` consecutive rows, for output positions ``starts[i]``
        onwards; rows of seeded requests are position-keyed unless ``keyed=False``. Host arrays, then one
        host-to-device copy per dtype (no device read)."""
        counts = np.asarray(counts, dtype=np.int64)

        def per_row(values, dtype) -> np.ndarray:
            return np.repeat(np.asarray(values, dtype=dtype), counts)

        top_k = per_row([p.top_k if p.top_k is not None and p.top_k < vocab else 0 for p in params], np.int64)
        has_p = per_row([p.top_p is not None and p.top_p < 1.0 for p in params], bool)
        seeded = per_row([keyed and p.seed is not None for p in params], bool)
        ints, floats = {}, {"temperature": per_row([p.temperature for p in params], np.float32)}
        if top_k.any():
            ints["top_k"] = top_k
        if has_p.any():  # 1 - top_p in double, then float32: as comparing float32 sums with the Python scalar does
            floats["top_p_drop"] = per_row([1.0 - (p.top_p or 1.0) for p in params], np.float64)[has_p].astype(np.float32)
            if not has_p.all():
                ints["top_p_rows"] = np.flatnonzero(has_p)
        if seeded.any():
            row_in_request = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
            ints["keys"] = per_row([seed_key(p.seed) if p.seed is not None else 0 for p in params], np.int64)[seeded]
            ints["positions"] = (per_row(starts, np.int64) + row_in_request)[seeded]
            if not seeded.all():
                ints["keyed_rows"] = np.flatnonzero(seeded)
        dev = {**arrays_to_device(ints, np.int64, device), **arrays_to_device(floats, np.float32, device)}
        for column in ("temperature", "top_k", "top_p_drop"):  # [R, 1]: broadcast over the vocabulary
            if column in dev:
                dev[column] = dev[column][:, None]
        return cls(max_k=int(top_k.max(initial=0)), **dev)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``softmax`` of the processed ``logits [R, V]`` (float32)."""
        scores = logits.float() / self.temperature
        if self.top_k is not None:  # transformers' TopKLogitsWarper: drop what is below the k-th largest
            kth = torch.topk(scores, self.max_k, dim=-1).values.gather(-1, (self.top_k - 1).clamp(min=0))
            scores = scores.masked_fill((scores < kth) & (self.top_k > 0), float("-inf"))
        if self.top_p_drop is not None:
            scores = _on_rows(scores, self.top_p_rows, lambda s: _top_p(s, self.top_p_drop))
        return scores.softmax(dim=-1)

    def sampling_rows(self, probs: torch.Tensor) -> torch.Tensor:
        """The distributions to sample the rows from: ``probs [R, V]`` as they are, the rows of seeded requests
        replaced by their position-keyed samples (:func:`keyed_samples`; reproducible under load)."""
        if self.keys is None:
            return probs
        return _on_rows(probs, self.keyed_rows, lambda p: keyed_samples(p, self.keys, self.positions))


def _on_rows(x: torch.Tensor, rows: torch.Tensor | None, fn) -> torch.Tensor:
    """``fn`` applied to the ``rows`` of ``x`` (``None``: all of them), the other rows as they are."""
    return fn(x) if rows is None else x.index_copy(0, rows, fn(x.index_select(0, rows)))


def _top_p(scores: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """transformers' TopPLogitsWarper: drop the low tail whose mass is <= ``drop`` (``1 - top_p``, per row),
    keep >= 1 token. In row chunks of at most ``_KEYED_ELEMENTS`` scores: the sort's values and int64 indices, the
    cumulative sums and the masks are several times the scores (500 rows x 16 slots x a 152k vocabulary would
    otherwise need tens of GB at once)."""
    step = max(1, _KEYED_ELEMENTS // scores.shape[-1])
    if scores.shape[0] > step:  # each row's mask is its own, whatever the chunk
        return torch.cat([_top_p(scores[i : i + step], drop[i : i + step]) for i in range(0, scores.shape[0], step)])
    sorted_scores, idx = torch.sort(scores, descending=False, dim=-1)
    cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove = cum <= drop
    remove[..., -1] = False
    return scores.masked_fill(remove.scatter(-1, idx, remove), float("-inf"))


def checked_probs(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``probs`` with every row that is not a distribution (non-finite, negative or zero mass) replaced by a
    uniform one, so ``multinomial`` never faults (a device assert on CUDA), and device flags ``[...]``: which rows
    were replaced (their request is failed after the round's read; no host sync here).

    Example:
        >>> safe, bad = checked_probs(torch.tensor([[0.5, 0.5], [float("nan"), 1.0]]))
        >>> safe.tolist(), bad.tolist()
        ([[0.5, 0.5], [0.5, 0.5]], [False, True])
    """
    ok = torch.isfinite(probs).all(dim=-1) & (probs >= 0).all(dim=-1) & (probs.sum(dim=-1) > 0)
    safe = torch.where(ok[..., None], probs, torch.full_like(probs, 1.0 / probs.shape[-1]))
    return safe, ~ok


def seed_key(seed: int) -> int:
    """The 31-bit key a request's ``seed`` (any integer) gives its position-keyed noise (:func:`keyed_samples`).

    Example:
        >>> seed_key(7) == seed_key(7) != seed_key(8)
        True
    """
    return hash((int(seed), 0x5EED)) & _MASK31  # int tuples hash the same in every process


def keyed_samples(probs: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One-hot rows of the tokens sampled from ``probs [R, V]``, row ``j`` keyed by ``keys[j]`` (:func:`seed_key` of
    its request's seed) and its output position ``positions[j]``: the batched form of
    :func:`position_keyed_samples` (rows of several seeded requests at once).

    Gumbel-max with noise keyed by ``(seed, position, token)``: row ``j``'s token is ``argmax(log p_j + g)``
    with ``g`` a counter-based hash of ``(key_j, position_j, v)``, an exact sample of ``p_j``. Rows that are not
    finite pass through unchanged (``checked_probs`` flags them).

        >>> p = torch.tensor([[0.2, 0.8], [0.5, 0.5]])
        >>> keys = torch.tensor([seed_key(7), seed_key(7)])
        >>> torch.equal(keyed_samples(p, keys, torch.tensor([3, 4])), position_keyed_samples(p, 7, 3))
        True
    """
    vocab = probs.shape[-1]
    step = max(1, _KEYED_ELEMENTS // vocab)
    if probs.shape[0] > step:  # row chunks: each row's sample is its own, whatever the chunk
        return torch.cat([keyed_samples(probs[i : i + step], keys[i : i + step], positions[i : i + step])
                          for i in range(0, probs.shape[0], step)])
    pos = _mix31(positions ^ keys)
    h = _mix31(pos[:, None] ^ _mix31(torch.arange(vocab, device=probs.device))[None, :])
    u = (h.double() + 0.5) / 2**31  # uniform in (0, 1)
    gumbel = -torch.log(-torch.log(u))
    tokens = (probs.double().log() + gumbel).argmax(dim=-1, keepdim=True)
    one_hot = torch.zeros_like(probs).scatter_(-1, tokens, 1.0)
    return torch.where(torch.isfinite(probs).all(dim=-1, keepdim=True), one_hot, probs)


def position_keyed_samples(probs: torch.Tensor, seed: int, start: int) -> torch.Tensor:
    """One-hot rows of the tokens sampled from ``probs [k, V]`` for output positions ``start .. start + k - 1``
    of a request seeded with ``seed`` (:func:`keyed_samples` for one request).

    Giving these one-hot rows to speculative sampling as both ``q`` and ``p`` makes a draft accepted exactly
    when it equals the target's sample, so the text depends on neither the drafts nor how a round was cut (the
    batch, the token budget).

        >>> p = torch.tensor([[0.2, 0.8], [0.5, 0.5]])
        >>> torch.equal(position_keyed_samples(p, 7, 3), position_keyed_samples(p, 7, 3))
        True
    """
    k = probs.shape[0]
    keys = torch.full((k,), seed_key(seed), dtype=torch.long, device=probs.device)
    return keyed_samples(probs, keys, torch.arange(start, start + k, device=probs.device))


_MASK31 = 2**31 - 1
# Rows x vocabulary per keyed_samples / top-p pass: their int64 / float64 temporaries stay near 0.5 GB each (a round of 64
# requests x 16 rows of a 152k vocabulary would need ~1.2 GB each at once, several at a time).
_KEYED_ELEMENTS = 2**26


def _mix31(x: torch.Tensor) -> torch.Tensor:
    """An integer hash on 31 bits (int64 products never overflow): nearby inputs give unrelated outputs."""
    x = x & _MASK31
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK31
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK31
    return (x >> 16) ^ x
