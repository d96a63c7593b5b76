"""Prompt-lookup decoding's rounds, computed from the output alone.

transformers' prompt-lookup decoding (``generate(..., prompt_lookup_num_tokens=N)``) proposes up to N
candidate tokens per round by n-gram matching against the tokens so far, runs one target forward
over them, and keeps the longest candidate prefix equal to the target's own choices there (its argmax,
or under sampling its sample: `_assisted_decoding` has no candidate logits for prompt lookup) plus the
target's next token. Each of those steps depends only on the prompt and the output, so every round
(candidates, accepted count) follows from the output, with no model: :func:`prompt_lookup_rounds`. It is
exact wherever the output is the one batch-1 prompt lookup produced (under greedy decoding, plain's), and
not a timing: it says nothing of speed.

Under sampling transformers also drops candidates its logits processors forbid on all-ones logits
(candidate_generator.py:1107-1124); top-p does forbid some: on uniform logits it removes the tail of its
sort order, about ``1 - top_p`` of the vocabulary. That set, fixed for the run, is ``forbidden`` here
(`..methods.hf.forbidden_candidates` computes it with transformers' own warpers, on the target's device).

It mirrors transformers 5.23 (line numbers of that release): ``generation/candidate_generator.py``,
``PromptLookupCandidateGenerator.get_candidates`` (lines 1057-1150: the candidates), and
``generation/utils.py``, ``GenerationMixin._assisted_decoding`` (lines 3919-4226: verification, the
bonus token, the max-length and EOS crops, the stopping criteria); the knobs come from
``_get_candidate_generator`` (utils.py:1318-1325). A change there fails ``tests/test_prompt_lookup_tau.py``,
which compares with the real run.

Logits processors that forbid candidate tokens depending on the sequence (``no_repeat_ngram_size``,
``bad_words_ids``, ...) are not modelled: the bench skips the computation when the target's generation config
sets one.

Every target forward is recorded, the first included (it verifies the candidates found in the prompt
together with the prefill), but tau leaves that prefill forward out as for every method
(`adaflash_hf.speculation.rounds`): ``(new tokens - 1) / (target forwards - 1)``.

Example:
    >>> r = prompt_lookup_rounds([5, 6, 7, 5, 6], [7, 5, 9, 9], max_new_tokens=4)
    >>> r.accepted, r.verify_lengths, r.rounds, r.tau  # (4 - 1) / (2 - 1)
    ([2, 0], [4, 1], 1, 3.0)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..speculation.prompt_ngrams import NgramIndex
from ..speculation.rounds import RoundTally

__all__ = ["PromptLookupRounds", "PromptLookupSettings", "as_generation_stats", "prompt_lookup_rounds"]


@dataclass(frozen=True)
class PromptLookupSettings:
    """transformers' prompt-lookup knobs: ``num_tokens`` is ``prompt_lookup_num_tokens``,
    ``max_ngram`` is ``generation_config.max_matching_ngram_size`` (``None`` there means 2)."""

    num_tokens: int = 10
    max_ngram: int = 2

    def __post_init__(self):
        if self.num_tokens <= 0 or self.max_ngram <= 0:  # transformers raises on these too
            raise ValueError(f"prompt lookup needs num_tokens > 0 and max_ngram > 0, got {self.num_tokens} and {self.max_ngram}")


@dataclass
class PromptLookupRounds(RoundTally):
    """One sequence's target forwards, its prefill's first: ``accepted`` candidates per forward (the
    target's own token not counted) and ``verify_lengths`` (candidates + 1: the positions it scored)."""

    accepted: list[int] = field(default_factory=list)
    verify_lengths: list[int] = field(default_factory=list)
    prefill_forwards: int = 1


def _candidates(seq: list[int], cur: int, max_length: int, index: NgramIndex, settings, eos_ids) -> list[int]:
    """``get_candidates`` on ``seq[:cur]`` (candidate_generator.py, PromptLookupCandidateGenerator)."""
    if max_length == cur + 1:  # candidate_generator.py:1071 "if self.max_length == input_length + 1"
        return []
    # Largest n-gram first, down to 1 (candidate_generator.py:1076); matches are tried left to right (:1092); one
    # wins when its window is not empty after the forbidden crop (:1107-1124), that is when it is not the suffix
    # itself and its first token is allowed: `NgramIndex.match`.
    start = index.match(cur)
    if start is None:
        return []
    chosen = seq[start : min(start + settings.num_tokens, cur, max_length)]  # candidate_generator.py:1095
    chosen = chosen[: next((j for j, t in enumerate(chosen) if t in index.forbidden), len(chosen))]
    # candidate_generator.py:1132-1138: cut before the first EOS, and stop searching even when
    # that leaves nothing (match_found is already True; :1143 then returns no candidates).
    return chosen[: next((j for j, t in enumerate(chosen) if t in eos_ids), len(chosen))]


def prompt_lookup_rounds(
    prompt: list[int],
    continuation: list[int],
    max_new_tokens: int,
    eos_ids=(),
    settings: PromptLookupSettings = PromptLookupSettings(),
    forbidden=frozenset(),
) -> PromptLookupRounds:
    """The rounds batch-1 prompt-lookup decoding runs on ``prompt`` when it outputs ``continuation`` (the
    new tokens, up to and including the first EOS, with the same ``max_new_tokens`` and EOS ids; under greedy
    decoding plain's). ``forbidden``: token ids transformers' sampling processors forbid as candidates.

    Example:
        >>> prompt_lookup_rounds([1, 2, 3, 1, 2], [3, 1, 2], max_new_tokens=3).accepted
        [2]
    """
    eos_ids = set(eos_ids)
    _check(prompt, continuation, max_new_tokens, eos_ids)
    seq = list(prompt) + list(continuation)
    p, total = len(prompt), len(continuation)
    max_length = p + max_new_tokens  # generation_config.max_length under max_new_tokens
    index = NgramIndex(seq, settings.max_ngram, frozenset(forbidden))
    rounds = PromptLookupRounds()
    k = 0  # new tokens so far
    while k < total:  # the loop runs until the max-length or EOS stopping criterion fires
        index.extend_to(p + k)
        cand = _candidates(seq, p + k, max_length, index, settings, eos_ids)
        # utils.py:4132-4134: n_matches is the run of candidates equal to the target's chosen tokens and
        # valid_tokens = selected_tokens[:, : n_matches + 1] (+1: the target's own token); :4139-4148 crop
        # them to the max-length budget and to the first EOS. Both crops fall exactly at the end of
        # `continuation`, so tokens past it never matter.
        matched = 0
        while matched < min(len(cand), total - k) and cand[matched] == continuation[k + matched]:
            matched += 1
        committed = min(matched + 1, total - k)
        rounds.accepted.append(committed - 1)  # utils.py:4151 "n_matches = valid_tokens.shape[1] - 1"
        rounds.verify_lengths.append(len(cand) + 1)
        k += committed
    return rounds


def _check(prompt, continuation, max_new_tokens, eos_ids) -> None:
    """A continuation that decoding cannot have produced makes the rounds meaningless: refuse it."""
    if not prompt:
        raise ValueError("prompt lookup needs a non-empty prompt")
    if max_new_tokens < 1 or not continuation or len(continuation) > max_new_tokens:
        raise ValueError(
            f"the continuation must hold 1..max_new_tokens ({max_new_tokens}) tokens, got {len(continuation)}"
        )
    early = next((j for j, t in enumerate(continuation[:-1]) if t in eos_ids), None)
    if early is not None:
        raise ValueError(f"the continuation goes on past an EOS (at new token {early}); cut it after the first EOS")
    if len(continuation) < max_new_tokens and continuation[-1] not in eos_ids:
        raise ValueError(
            f"the continuation stops after {len(continuation)} of {max_new_tokens} tokens without an EOS: "
            "it is truncated, so prompt lookup's rounds cannot be computed from it"
        )


def as_generation_stats(rounds: list[PromptLookupRounds], settings: PromptLookupSettings):
    """Several sequences' rounds as one `GenerationStats` (what a bench cell's figures are filled from).

    Example:
        >>> s = as_generation_stats([prompt_lookup_rounds([5, 6, 7, 5, 6], [7, 5, 9, 9], max_new_tokens=4)],
        ...                         PromptLookupSettings())
        >>> s.tau, s.rounds, s.block_size
        (3.0, 1, 11)
    """
    from ..generation.stats import GenerationStats

    stats = GenerationStats(block_size=settings.num_tokens + 1, policy="prompt_lookup")
    for row, r in enumerate(rounds):
        for verify_len, accepted in zip(r.verify_lengths, r.accepted):
            stats.record(row, verify_len, accepted)
        stats.new_tokens += sum(r.accepted) + len(r.accepted)
        stats.prefill_forwards += r.prefill_forwards
    return stats
