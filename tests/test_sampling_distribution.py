"""The two-sample distribution check of speculative sampling (`adaflash_hf.bench.distribution`): it passes for
the real samplers (generate, the engine) against plain sampling and fails for a deliberately biased one.

The exact-distribution checks of the acceptance rule itself live in test_speculation_acceptance.py (Markov chains),
test_generation_paths.py (generate vs the exact joint) and test_engine.py (the engine's second token); this
file checks the permutation test the scale run (examples/sampling_distribution_check.py) relies on."""

from __future__ import annotations

import functools

import pytest
import torch
from generation_helpers import make_drafter, make_target

from adaflash_hf.bench.distribution import (
    CheckSettings, SamplingSettings, accepting_every_draft, engine_rows, generate_rows, two_sample_check,
)  # fmt: skip
from adaflash_hf.speculation import verify

SAMPLING = SamplingSettings(temperature=1.0, top_p=0.95, max_new_tokens=5)
PROMPT, N = [3, 7, 1, 5], 300
CHECK = CheckSettings(permutations=999)


@functools.lru_cache(maxsize=None)
def pair_and_reference():
    """A tiny target over 16 tokens (far from degenerate), a random drafter (often rejected), plain rows."""
    target = make_target("qwen3", seed=5, vocab=16, layers=2, initializer_range=0.3)
    drafter = make_drafter(target, block_size=4, seed=1)
    return target, drafter, [generate_rows(target, PROMPT, N, SAMPLING, seed=10)]


def test_generate_speculative_sampling_passes():
    target, drafter, reference = pair_and_reference()
    rows = [generate_rows(target, PROMPT, N, SAMPLING, seed=11, drafter=drafter)]
    result = two_sample_check(reference, rows, CHECK, "generate")
    assert result.passed, result.to_dict()
    assert result.rows == (N, N) and len(result.tests) == 6


@pytest.mark.parametrize("seeded, ngrams", [(False, False), (True, False), (False, True)],
                         ids=["rejection", "position_keyed", "prompt_ngrams"])
def test_engine_speculative_sampling_passes(seeded, ngrams):
    from adaflash_hf.engine import Engine
    from adaflash_hf.speculation.prompt_ngrams import PromptNgrams

    target, drafter, reference = pair_and_reference()
    engine = Engine(target, drafter, length_policy="fixed", max_slots=64, max_len=32, token_budget=512,
                    prompt_ngrams=PromptNgrams(4, sampled=True) if ngrams else None)
    rows = [engine_rows(engine, PROMPT, N, SAMPLING, seed=3, seeded=seeded)]
    assert all(len(r) == SAMPLING.max_new_tokens for r in rows[0])
    # the prompt n-gram rule's sampled path ran under the check when asked, and never by default under sampling
    assert (int(engine.ngram_used) > 0) if ngrams else int(engine.ngram_used) == 0
    assert two_sample_check(reference, rows, CHECK, "engine").passed


def test_biased_sampler_fails_the_same_check():
    target, drafter, reference = pair_and_reference()
    real = verify.speculative_accept
    with accepting_every_draft():
        rows = [generate_rows(target, PROMPT, N, SAMPLING, seed=11, drafter=drafter)]
    assert verify.speculative_accept is real  # the control is undone on leaving
    result = two_sample_check(reference, rows, CHECK, "accept every draft")
    assert not result.passed
    # the first token comes from the prefill (no draft in it): only the drafted n-grams can show the bias
    by_order = {t.order: t.passed for t in result.tests}
    assert by_order[1] and not by_order[2] and not by_order[3]


def _categorical_rows(probs: torch.Tensor, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.multinomial(probs, n * 4, replacement=True, generator=g).view(n, 4).tolist()


def test_permutation_test_on_known_distributions():
    """Same distribution on both sides (two prompts): passes; a reversed one (TV 0.4) on one prompt: fails."""
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    q = torch.tensor([0.25, 0.25, 0.3, 0.2])
    same = two_sample_check([_categorical_rows(p, 400, 0), _categorical_rows(q, 300, 1)],
                            [_categorical_rows(p, 400, 2), _categorical_rows(q, 300, 3)], CHECK)  # fmt: skip
    assert same.passed and all(0 < t.p_value <= 1 for t in same.tests)
    shifted = two_sample_check([_categorical_rows(p, 400, 0), _categorical_rows(q, 300, 1)],
                               [_categorical_rows(p.flip(0), 400, 2), _categorical_rows(q, 300, 3)], CHECK)  # fmt: skip
    assert not any(t.passed for t in shifted.tests) and shifted.tests[0].observed > shifted.tests[0].threshold


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: CheckSettings(permutations=99), "permutations cannot reach"),
        (lambda: CheckSettings(alpha=1.5), "alpha"),
        (lambda: CheckSettings(orders=(0,)), "orders"),
        (lambda: SamplingSettings(temperature=0.0), "temperature"),
        (lambda: SamplingSettings(top_p=0.0), "top_p"),
        (lambda: two_sample_check([[[1]]], [], CHECK), "same prompts"),
        (lambda: two_sample_check([[[1]]], [[[]]], CHECK), "prompt 0"),
    ],
)
def test_bad_input_is_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()
