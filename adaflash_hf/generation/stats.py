"""Per-call statistics of speculative decoding, and the interface verified rounds are emitted to."""

from dataclasses import dataclass, field
from typing import Protocol

import torch


def mean_tokens_per_round(accepted: list[int]) -> float:
    """tau: mean tokens committed per verify round, accepted drafts + the target's own token.

    Example:
        >>> mean_tokens_per_round([0, 3, 1])
        2.3333333333333335
    """
    return (sum(accepted) + len(accepted)) / len(accepted) if accepted else 0.0


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


@dataclass
class GenerationStats:
    """What one speculative `generate` call did, round by round (all rows of a batch together).

    `tau` is the mean number of tokens committed per round (accepted drafts + the target's own
    token), the figure papers report as acceptance length.

    Example:
        >>> out, stats = target.generate(ids, assistant_model=drafter, return_stats=True)  # doctest: +SKIP
        >>> stats.tau, stats.verify_lengths[:4]  # doctest: +SKIP
    """

    block_size: int
    policy: str
    accepted: list[int] = field(default_factory=list)
    verify_lengths: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    fallback_rounds: int = 0
    new_tokens: int = 0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0

    def record(self, row: int, verify_len: int, accepted: int) -> None:
        self.rows.append(row)
        self.verify_lengths.append(verify_len)
        self.accepted.append(accepted)

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Mean tokens per round (accepted + 1); 0.0 before any round."""
        return mean_tokens_per_round(self.accepted)

    @property
    def mean_verify_length(self) -> float:
        return sum(self.verify_lengths) / self.rounds if self.rounds else 0.0

    @property
    def position_acceptance(self) -> list[float]:
        """Acceptance rate of draft slot j (1-based) among rounds that verified slot j."""
        rates = []
        for j in range(1, self.block_size):
            tried = [a for a, v in zip(self.accepted, self.verify_lengths) if v - 1 >= j]
            rates.append(sum(a >= j for a in tried) / len(tried) if tried else float("nan"))
        return rates

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "tau": self.tau,
            "mean_verify_length": self.mean_verify_length,
            "position_acceptance": self.position_acceptance,
            "accepted": list(self.accepted),
            "verify_lengths": list(self.verify_lengths),
            "fallback_rounds": self.fallback_rounds,
            "new_tokens": self.new_tokens,
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
            "policy": self.policy,
            "block_size": self.block_size,
        }
