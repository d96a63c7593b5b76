"""The target's rows as a request's processors leave them: presence / frequency penalties applied at every verified
position, and the log-probabilities of the tokens a round commits.

A round verifies request ``i``'s bonus token and drafts ``d_1 .. d_k`` in one forward: row ``c`` of its verify segment
predicts the token after ``tokens + d_1 .. d_c`` (``tokens``: what it has generated, the bonus last). The penalties at
row ``c`` therefore count ``tokens`` and the first ``c`` drafts, exactly what plain decoding would have generated had
those drafts been its tokens; an accepted row's distribution is plain decoding's, so greedy answers stay plain
decoding's with the penalties on, and speculative sampling stays exact (it needs only the target's processed rows).
A prefill row predicts the first generated token: nothing to penalise yet.

The penalties follow OpenAI's formula, over the generated tokens as vLLM reads it:
``logits[v] -= frequency_penalty * count[v] + presence_penalty * (count[v] > 0)``.

Example:
    >>> logits = torch.zeros(2, 4)
    >>> penalize_rows(logits, [0, 1], counts_by_row([2], torch.tensor([3]), 2, 4), 0.5, 1.0)
    >>> logits.tolist()
    [[0.0, 0.0, -1.5, 0.0], [0.0, 0.0, -1.5, -1.5]]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["LoggedToken", "RoundLogprobs", "counts_by_row", "penalize_round", "penalize_rows", "round_logprobs"]


class LoggedToken(int):
    """A committed token id (an ``int``) with its log-probability under the target's processed row and the
    ``top_logprobs`` most likely ``(token id, logprob)`` pairs there, most likely first: what the engine hands to
    ``on_token`` and keeps in :attr:`EngineOutput.logprobs` for a request with ``SamplingParams(logprobs=...)``.

    Example:
        >>> t = LoggedToken(7, -0.25, ((7, -0.25), (3, -1.5)))
        >>> t == 7, t.logprob, t.top_logprobs[1]
        (True, -0.25, (3, -1.5))
    """

    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]

    def __new__(cls, token: int, logprob: float, top_logprobs=()):
        self = super().__new__(cls, token)
        self.logprob, self.top_logprobs = float(logprob), tuple(top_logprobs)
        return self

    def __reduce__(self):  # pickles (and copies) as itself, not as a bare int
        return LoggedToken, (int(self), self.logprob, self.top_logprobs)


def counts_by_row(generated: list[int], drafts: torch.Tensor, rows: int, vocab: int) -> torch.Tensor:
    """``[rows, vocab]`` float32 counts, row ``c``: ``generated`` plus the first ``c`` of ``drafts`` (on their device)."""
    base = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=vocab)[:vocab].float()
    counts = base.to(drafts.device).expand(rows, vocab).clone()
    if rows > 1:
        steps = torch.zeros(rows - 1, vocab, device=drafts.device).scatter_(1, drafts[: rows - 1, None], 1.0)
        counts[1:] += steps.cumsum(0)
    return counts


def penalize_rows(logits: torch.Tensor, rows, counts: torch.Tensor, presence: float, frequency: float) -> None:
    """Subtract OpenAI's penalties from ``logits[rows]`` in place (``counts [len(rows), V]`` from :func:`counts_by_row`)."""
    idx = torch.as_tensor(rows, dtype=torch.long, device=logits.device)
    penalty = counts * frequency + (counts > 0).float() * presence
    logits.index_copy_(0, idx, (logits.index_select(0, idx).float() - penalty).to(logits.dtype))


def _verify_starts(num_prefill: int, q_lens: list[int]) -> np.ndarray:
    ql = np.asarray(q_lens, dtype=np.int64)
    return num_prefill + np.cumsum(ql) - ql


def penalize_round(logits: torch.Tensor, num_prefill: int, running, q_lens: list[int], drafts: torch.Tensor | None) -> None:
    """Apply each penalised running request's penalties to its verify rows of the packed ``logits`` (in place, before
    acceptance reads them). ``drafts [n, kmax]``: the drafts in the target's input (``verify_inputs``' second)."""
    starts = _verify_starts(num_prefill, q_lens)
    for i, r in enumerate(running):
        p = r.params
        if not p.penalized:
            continue
        q = q_lens[i]
        mine = drafts[i] if drafts is not None and q > 1 else torch.zeros(0, dtype=torch.long, device=logits.device)
        counts = counts_by_row(r.tokens, mine, q, logits.shape[-1])
        penalize_rows(logits, range(starts[i], starts[i] + q), counts, p.presence_penalty, p.frequency_penalty)


@dataclass
class RoundLogprobs:
    """The logprob rows of one round, on the device until :meth:`read`: for each request that asked, its rows'
    chosen token, that token's logprob and the top alternatives (the round's largest ``top`` for all)."""

    owners: list[tuple[int, int, int]]  # (request id, first row, row count) into the stacked rows
    chosen: torch.Tensor
    values: torch.Tensor
    top_ids: torch.Tensor
    top_values: torch.Tensor
    tops: dict[int, int]

    def read(self) -> dict[int, list[LoggedToken]]:
        """One device read: request id -> a :class:`LoggedToken` per row, in row order."""
        chosen, values = self.chosen.tolist(), self.values.tolist()
        ids, tvals = self.top_ids.tolist(), self.top_values.tolist()
        out = {}
        for rid, start, count in self.owners:
            k = self.tops[rid]
            out[rid] = [LoggedToken(chosen[j], values[j], tuple(zip(ids[j][:k], tvals[j][:k])))
                        for j in range(start, start + count)]
        return out


def round_logprobs(logits: torch.Tensor, admitted, running, q_lens: list[int], drafts: torch.Tensor | None,
                   first: torch.Tensor, accepted: torch.Tensor, next_tokens: torch.Tensor) -> RoundLogprobs | None:
    """The logprobs of the rows a round may commit, for the requests with ``params.logprobs`` set (``None``: none
    asked). Row ``c`` of a verify commits draft ``c + 1`` while ``c < accepted``, else the target's next token; a
    prefill row commits its first token. Queued on the device; nothing is read here."""
    starts = _verify_starts(len(admitted), q_lens)
    rows, chosen, owners, tops = [], [], [], {}
    device = logits.device
    for j, r in enumerate(admitted):
        if r.params.logprobs is not None:
            owners.append((r.id, len(rows), 1))
            rows.append(j)
            chosen.append(first[j : j + 1])
            tops[r.id] = r.params.logprobs
    for i, r in enumerate(running):
        if r.params.logprobs is None:
            continue
        q = q_lens[i]
        owners.append((r.id, len(rows), q))
        rows.extend(range(starts[i], starts[i] + q))
        c = torch.arange(q, device=device)
        mine = drafts[i, : q - 1] if drafts is not None and q > 1 else c.new_zeros(0)
        padded = torch.cat([mine, next_tokens[i : i + 1]])
        chosen.append(torch.where(c < accepted[i], padded, next_tokens[i]))
        tops[r.id] = r.params.logprobs
    if not rows:
        return None
    lp = logits.index_select(0, torch.tensor(rows, device=device)).float().log_softmax(dim=-1)
    chosen_t = torch.cat(chosen).long()
    k = max(tops.values())
    top = lp.topk(k, dim=-1) if k else None
    empty = lp.new_zeros(len(rows), 0)
    return RoundLogprobs(owners, chosen_t, lp.gather(1, chosen_t[:, None])[:, 0],
                         top.indices if top is not None else empty.long(), top.values if top is not None else empty, tops)
