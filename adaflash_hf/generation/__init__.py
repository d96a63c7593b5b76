"""Lossless speculative generation with AdaFlash drafters."""

from .decoding import adaflash_decoding
from .drafting import AdaFlashCandidateGenerator, DraftBlock
from ..speculation.rounds import FinishedRequest, RoundSink, VerifiedRound
from .stats import GenerationStats


def speculative_generate(target, drafter, input_ids, attention_mask=None, **generate_kwargs):
    """Speculative decoding of a (padded) batch; each row equals that row generated alone.

    A thin spelling of `target.generate(input_ids, attention_mask=..., assistant_model=drafter,
    **generate_kwargs)` that works for any batch size. Options: `length_policy` (`cost`, `adaptive`,
    `fixed`, `expected_gain`), `length_rate`, `length_min`, `return_stats`, `round_sink`, `fast_path`
    (`"auto"`: on CUDA the rounds run on the engine's fused layers and CUDA graphs; see `fast_path.py`).

    Example:
        >>> batch = tok(prompts, return_tensors="pt", padding=True, padding_side="left")  # doctest: +SKIP
        >>> out = speculative_generate(target, drafter, **batch, max_new_tokens=64)  # doctest: +SKIP
    """
    return target.generate(input_ids, attention_mask=attention_mask, assistant_model=drafter, **generate_kwargs)


__all__ = [
    "AdaFlashCandidateGenerator",
    "DraftBlock",
    "FinishedRequest",
    "GenerationStats",
    "RoundSink",
    "VerifiedRound",
    "adaflash_decoding",
    "speculative_generate",
]
