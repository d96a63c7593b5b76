"""Per-call statistics of speculative ``generate`` (all rows of a batch together)."""

from dataclasses import dataclass, field

from ..speculation.rounds import RoundTally

__all__ = ["GenerationStats"]


@dataclass
class GenerationStats(RoundTally):
    """What one speculative `generate` call did, round by round (all rows of a batch together).

    `tau` is the mean number of tokens committed per verify round (accepted drafts + the target's own
    token), the figure papers report as acceptance length (convention: `adaflash_hf.speculation.rounds`).
    ``prefill_forwards``: recorded entries that are prefill forwards (prompt lookup's; 0 for the drafter).

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
    ngram_rounds: int = 0  # row-rounds that verified a prompt n-gram candidate (`speculation.prompt_ngrams`)
    wide_rounds: int = 0  # rounds whose verify was wider than the block (`PromptNgrams.max_width`)
    new_tokens: int = 0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    prefill_forwards: int = 0

    def record(self, row: int, verify_len: int, accepted: int) -> None:
        self.rows.append(row)
        self.verify_lengths.append(verify_len)
        self.accepted.append(accepted)

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
            "ngram_rounds": self.ngram_rounds,
            "wide_rounds": self.wide_rounds,
            "prefill_forwards": self.prefill_forwards,
            "new_tokens": self.new_tokens,
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
            "policy": self.policy,
            "block_size": self.block_size,
        }
