"""What a verified round is, how it reaches a sink, and tau (the one definition of it).

Both loops (``generate`` and the engine) build a :class:`VerifiedRound` per row per round with
:meth:`VerifiedRound.from_block` and hand it to a :class:`RoundSink`; a finished sequence becomes a
:class:`FinishedRequest`.

tau, for every method (the drafter, prompt lookup, transformers' assisted generation, plain decoding)
and every report, is the papers' "average acceptance length" (DFlash, AdaFlash, EAGLE): tokens
committed by the target's verify forwards divided by the number of verify forwards. Each sequence's
prefill forward is not a verify round, and the one token it produces is not counted; so with ``N``
new tokens over ``S`` sequences and ``F`` target forwards in all,

    tau = (N - S) / (F - S)

Plain decoding is 1.0. Prompt lookup's and the AR assistant's prefill forward also scores the
candidates drafted from the prompt: it is still not a round, but the candidates it accepts stay in
``N - S`` (which makes tau computable from ``N`` and ``F`` alone, and rounds prompt lookup's tau up
by those candidates, never down). Every tau goes through :func:`tokens_per_round`: from per-round
counts (:class:`RoundTally`, :func:`mean_tokens_per_round`) or from totals (:func:`tau_from_totals`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["FinishedRequest", "RoundSink", "RoundTally", "VerifiedRound", "mean_tokens_per_round", "position_counts",
           "tau_from_totals", "tokens_per_round"]


def tokens_per_round(accepted_total: int, rounds: int) -> float:
    """tau (the module's convention): ``(accepted + one target token per round) / rounds`` over the
    verify rounds (prefill forwards left out); ``accepted_total`` is every token committed beyond the
    prefill's own and the rounds' own. 0.0 without rounds.

    Example:
        >>> tokens_per_round(4, 3)
        2.3333333333333335
    """
    return (accepted_total + rounds) / rounds if rounds else 0.0


def mean_tokens_per_round(accepted: list[int]) -> float:
    """tau: mean tokens committed per verify round, accepted drafts + the target's own token.

    Example:
        >>> mean_tokens_per_round([0, 3, 1])
        2.3333333333333335
    """
    return tokens_per_round(sum(accepted), len(accepted))


def tau_from_totals(new_tokens: int, sequences: int, rounds: int) -> float:
    """tau of a method seen only from outside: ``new_tokens`` over ``sequences``, ``rounds`` target
    forwards after each sequence's prefill. Each sequence's first new token is its prefill's.

    Example:
        >>> tau_from_totals(new_tokens=10, sequences=1, rounds=3)  # (10 - 1) / 3
        3.0
    """
    return tokens_per_round(new_tokens - sequences - rounds, rounds)


def position_counts(accepted: list[int], verify_lengths: list[int], positions: int) -> list[list[int]]:
    """Per draft position ``1 .. positions``: ``[verified, accepted]`` over rounds with these ``accepted``
    drafts and ``verify_lengths`` (tokens verified, the target's own included). Acceptance at position j
    is ``accepted / verified`` of row j-1 (the paper's per-position acceptance).

    Example:
        >>> position_counts([2, 0], [4, 2], positions=3)
        [[2, 1], [1, 1], [1, 0]]
    """
    counts = [[0, 0] for _ in range(positions)]
    for a, v in zip(accepted, verify_lengths):
        for j in range(min(int(v) - 1, positions)):
            counts[j][0] += 1
            counts[j][1] += j < a
    return counts


class RoundTally:
    """Round counts of anything that keeps per-forward ``accepted`` candidates and ``verify_lengths``
    lists (``generate``'s stats, an engine request's output, prompt lookup's rounds): rounds, tau,
    mean verify length.

    ``prefill_forwards`` of the entries are prefill forwards that also scored candidates (prompt
    lookup records them; the drafter's prefill scores none and is not recorded): not rounds, but
    what they accepted counts (the module's convention)."""

    accepted: list[int]
    verify_lengths: list[int]
    prefill_forwards: int = 0

    @property
    def rounds(self) -> int:
        """Verify rounds: the recorded forwards less the prefill ones."""
        return len(self.accepted) - self.prefill_forwards

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify round (the module's convention); 0.0 before any round."""
        return tokens_per_round(sum(self.accepted), self.rounds)

    @property
    def mean_verify_length(self) -> float:
        """Mean tokens scored per recorded forward (a prefill forward's candidates + 1 included)."""
        return sum(self.verify_lengths) / len(self.verify_lengths) if self.verify_lengths else 0.0


@dataclass
class VerifiedRound:
    """One verified draft block of one sequence: what the online adapter needs to learn from it.

    `context_ids` are the sequence's tokens before the block's bonus token (prompt padding
    removed); `bonus_token` sits in block slot 0; `draft_tokens[:verify_len - 1]` were verified and
    the first `num_accepted` of them accepted. `target_logits` (`[verify_len, V]`, raw, before
    logits processors) are the target's distributions at the bonus and draft positions.
    """

    row: int
    context_ids: torch.Tensor
    bonus_token: int
    draft_tokens: torch.Tensor
    draft_logits: torch.Tensor
    target_logits: torch.Tensor
    verify_len: int
    num_accepted: int
    predicted_ratio: float | None

    @classmethod
    def from_block(cls, row: int, context_ids: torch.Tensor, bonus_token, draft_tokens: torch.Tensor,
                   draft_logits: torch.Tensor, target_logits: torch.Tensor, draft_len, num_accepted,
                   ratio=None) -> "VerifiedRound":
        """One row's round from the loop's buffers (copied: loops reuse them): ``draft_tokens [>= k]``,
        ``draft_logits [>= k, V]``, ``target_logits [>= k + 1, V]`` for ``k = draft_len`` verified drafts.

        Example:
            >>> r = VerifiedRound.from_block(0, torch.tensor([1, 2]), 3, torch.tensor([4, 5]), torch.zeros(2, 8),
            ...                              torch.zeros(3, 8), draft_len=1, num_accepted=1)
            >>> r.verify_len, r.draft_tokens.tolist(), tuple(r.target_logits.shape)
            (2, [4], (2, 8))
        """
        k = int(draft_len)
        return cls(
            row=int(row),
            context_ids=context_ids,
            bonus_token=int(bonus_token),
            draft_tokens=draft_tokens[:k].clone(),
            draft_logits=draft_logits[:k].to(torch.float32, copy=True),
            target_logits=target_logits[: k + 1].to(torch.float32, copy=True),
            verify_len=k + 1,
            num_accepted=int(num_accepted),
            predicted_ratio=float(ratio) if ratio is not None else None,
        )

    def head_error(self, block_size: int) -> float | None:
        """The length head's absolute error ``|predicted_ratio - (num_accepted + 1) / block_size|``,
        or None where the round has no prediction or its real acceptance is unknown (the verify
        length cut the block and every verified draft was accepted).

        Example:
            >>> r = VerifiedRound.from_block(0, torch.tensor([1]), 2, torch.tensor([3, 4]), torch.zeros(2, 8),
            ...                              torch.zeros(3, 8), draft_len=2, num_accepted=1, ratio=0.25)
            >>> r.head_error(block_size=4)
            0.25
        """
        known = self.num_accepted < self.verify_len - 1 or self.verify_len == block_size
        if self.predicted_ratio is None or not known:
            return None
        return abs(self.predicted_ratio - (self.num_accepted + 1) / block_size)


@dataclass
class FinishedRequest:
    """One sequence whose generation ended: its prompt (padding removed) and the tokens generated.

    `row` is the sequence's row in its `generate` call (the request id in the engine).
    """

    row: int
    prompt_ids: torch.Tensor
    output_ids: torch.Tensor


class RoundSink(Protocol):
    """Receives every verified round (the online adapter implements it; generation never imports it).

    A sink may also define ``on_request(finished: FinishedRequest)``: generation then calls it once
    per sequence when that sequence's generation ends (the online adapter's request-level samples).
    """

    def on_round(self, verified: VerifiedRound) -> None: ...
