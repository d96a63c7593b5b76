"""Prompt lookup's rounds computed from an output (`adaflash_hf.bench.prompt_lookup_tau`) against
transformers' real prompt-lookup decoding on the embedded reference pair, with negative controls."""

import pytest
import torch

from adaflash_hf import load_reference_pair
from adaflash_hf.bench.methods.hf import recorded_prompt_lookup
from adaflash_hf.bench.prompt_lookup_tau import PromptLookupSettings, prompt_lookup_rounds
from adaflash_hf.generation.prompts import encode_prompt

# Repetitive prompts (prompt lookup finds long matches) and chat prompts (the template's end-of-turn
# token is an EOS id, so candidates get cut at it); "add" ends with an EOS before max_new_tokens.
PROMPTS = [
    ("cat", "Repeat this exactly three times: the cat sat on the mat. the cat sat on the mat.", 40),
    ("add", [{"role": "user", "content": "Write a python function def add(a, b): return a + b and call add(1, 2) "
                                         "and add(3, 4)."}], 40),
    ("king", "Once upon a time there was a king. Once upon a time there was a queen. Once upon a time", 40),
    ("sum", [{"role": "user", "content": "What is 12 + 12 + 12 + 12?"}], 24),
]  # fmt: skip


@pytest.fixture(scope="module")
def runs():
    """Per prompt: (prompt ids, plain greedy continuation up to the first EOS, real prompt lookup's
    output and recorded rounds, max_new_tokens, EOS ids)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target, _, tok = load_reference_pair()
        eos = target.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos])
        out = {}
        for name, prompt, max_new in PROMPTS:
            ids = encode_prompt(tok, prompt)
            x = torch.tensor([ids])
            with torch.inference_mode():
                plain = target.generate(x, max_new_tokens=max_new, do_sample=False)[0, len(ids) :].tolist()
                real_out, real = recorded_prompt_lookup(target, x, None, 10, max_new_tokens=max_new, do_sample=False)
            cut = next((j + 1 for j, t in enumerate(plain) if t in eos_ids), len(plain))
            out[name] = (ids, plain[:cut], real_out[0, len(ids) :].tolist(), real, max_new, eos_ids)
        return out
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", [p[0] for p in PROMPTS])
def test_computed_rounds_equal_the_real_run(runs, name):
    ids, plain, real_out, real, max_new, eos_ids = runs[name]
    assert real_out == plain  # lossless: the premise of computing from plain's output
    computed = prompt_lookup_rounds(ids, plain, max_new, eos_ids)
    assert computed.accepted == real.accepted
    assert computed.verify_lengths == real.verify_lengths  # same candidates, same target forwards
    assert sum(a + 1 for a in computed.accepted) == len(plain)
    assert computed.rounds == len(real.accepted) - 1  # the prefill forward is not a round (speculation.rounds)
    assert computed.tau == pytest.approx((len(plain) - 1) / computed.rounds)


def test_the_table_exercises_long_matches_and_eos(runs):
    """Guards the table above: without long accepted runs or an EOS stop the comparison proves little."""
    assert max(max(real.accepted) for *_, real, _, _ in runs.values()) >= 5
    assert any(len(plain) < max_new and plain[-1] in eos for _, plain, _, _, max_new, eos in runs.values())
    assert any(v == 1 for *_, real, _, _ in runs.values() for v in real.verify_lengths)  # rounds without candidates


# Hand-made cases of the rules in transformers' `get_candidates` (why each expectation holds is in its name).
RULES = [
    # (n-gram (1, 2) occurs at 0 and 4: the leftmost wins, proposing 3 9 1 2 4 8 1 2 (wrong at once); next
    #  round (2, 4) first occurs at 5 and proposes 8 1 2 4: one accepted, then the length budget ends it)
    ("leftmost_match_wins", [1, 2, 3, 9, 1, 2, 4, 8, 1, 2], [4, 8, 7], 3, set(), [0, 1], [9, 5]),
    # (the match of 7 proposes 0 5 7, cut before the EOS 0: nothing left, and no shorter n-gram is tried;
    #  the last round, one token short of max_length, proposes nothing either)
    ("eos_cut_leaves_no_candidates", [7, 0, 5, 7], [3, 4], 2, {0}, [0, 0], [1, 1]),
    # (1 proposes 2 1: one accepted; then the sequence is one token short of max_length, where the
    #  lookup would propose 1 2 1 2 4 after the 4 but transformers proposes nothing)
    ("one_short_of_max_length_proposes_nothing", [4, 1, 2, 1], [2, 4, 9], 3, set(), [1, 0], [3, 1]),
    # (2-gram (5, 6) has no earlier match; the 1-gram 6 does, proposing 7 5 6 up to the current end)
    ("falls_back_to_a_shorter_ngram", [6, 7, 5, 6], [7, 5, 6, 1], 4, set(), [3], [4]),
    # (all ten candidates accepted, the bonus token too: 11 tokens in one round)
    ("full_window_plus_bonus", list(range(10, 21)) + [10], list(range(11, 21)) + [10], 11, set(), [10], [11]),
]  # fmt: skip


@pytest.mark.parametrize("name,prompt,cont,max_new,eos,accepted,verify", RULES, ids=[r[0] for r in RULES])
def test_rules_of_get_candidates(name, prompt, cont, max_new, eos, accepted, verify):
    r = prompt_lookup_rounds(prompt, cont, max_new, eos)
    assert (r.accepted, r.verify_lengths) == (accepted, verify)


BAD = [
    (dict(prompt=[], continuation=[1], max_new_tokens=1), "non-empty prompt"),
    (dict(prompt=[1], continuation=[1, 2, 3], max_new_tokens=2), "1..max_new_tokens"),
    (dict(prompt=[1], continuation=[], max_new_tokens=2), "1..max_new_tokens"),
    (dict(prompt=[1], continuation=[5, 0, 5], max_new_tokens=3, eos_ids={0}), "past an EOS"),
    (dict(prompt=[1], continuation=[5, 6], max_new_tokens=3, eos_ids={0}), "truncated"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_is_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        prompt_lookup_rounds(**kwargs)
    with pytest.raises(ValueError, match="num_tokens > 0"):
        PromptLookupSettings(num_tokens=0)


@pytest.mark.parametrize(
    "wrong",
    [PromptLookupSettings(num_tokens=3), PromptLookupSettings(max_ngram=3), PromptLookupSettings(num_tokens=10, max_ngram=1)],
    ids=["num_tokens=3", "max_ngram=3", "max_ngram=1"],
)
def test_negative_control_a_wrong_variant_disagrees(runs, wrong):
    """A variant of the knobs that is not transformers' default differs from the real run somewhere in the table."""
    differs = []
    for name, (ids, plain, _, real, max_new, eos_ids) in runs.items():
        computed = prompt_lookup_rounds(ids, plain, max_new, eos_ids, wrong)
        differs.append((computed.accepted, computed.verify_lengths) != (real.accepted, real.verify_lengths))
    assert any(differs)


@pytest.mark.parametrize("real_tau,real_identical,failed", [(1.5, True, False), (1.6, True, True), (1.6, False, False)])
def test_bench_cross_check_flags_a_computed_cell_that_disagrees(real_tau, real_identical, failed):
    """Beside a real prompt_lookup cell that decoded plain's outputs, prompt_lookup_exact must agree."""
    from adaflash_hf.bench import BenchCell, BenchResult
    from adaflash_hf.bench.runner import cross_check

    def cell(method, tau, identical):
        return BenchCell(method=method, dataset="d", concurrency=1, tau=tau, rounds=4, mean_verify_length=3.0,
                         tau_histogram={"1": 2, "2": 2}, identical=identical)  # fmt: skip

    computed, real = cell("prompt_lookup_exact", 1.5, None), cell("prompt_lookup", real_tau, real_identical)
    result = BenchResult(config={}, environment={}, hardware={})
    cross_check([computed, real], result)
    assert bool(result.failures) is failed
    if failed:
        assert "tau" in result.failures[0]["message"] and result.failures[0]["method"] == "prompt_lookup_exact"
    else:
        assert any("cross-checked" in n for n in computed.notes) is real_identical


# Non-default grid points (`bench.prompt_lookup_grid`): the real run gets the n-gram size through
# `generate(max_matching_ngram_size=...)`, the computation through `PromptLookupSettings`.
OTHER_SETTINGS = [PromptLookupSettings(15, 3), PromptLookupSettings(20, 4)]


@pytest.mark.parametrize("settings", OTHER_SETTINGS, ids=lambda s: f"{s.num_tokens}x{s.max_ngram}")
def test_computed_rounds_equal_the_real_run_off_default(runs, settings):
    target, _, _ = load_reference_pair()
    differs_from_default = False
    for name in ("cat", "king", "add"):
        ids, plain, _, default_real, max_new, eos_ids = runs[name]
        with torch.inference_mode():
            out, real = recorded_prompt_lookup(target, torch.tensor([ids]), None, settings.num_tokens, max_new_tokens=max_new,
                                               do_sample=False, max_matching_ngram_size=settings.max_ngram)  # fmt: skip
        assert out[0, len(ids) :].tolist() == plain
        computed = prompt_lookup_rounds(ids, plain, max_new, eos_ids, settings)
        assert (computed.accepted, computed.verify_lengths) == (real.accepted, real.verify_lengths)
        differs_from_default |= real.verify_lengths != default_real.verify_lengths
    assert differs_from_default  # negative control: the setting reaches transformers (else this test proves nothing)


@pytest.mark.parametrize("seed,sampling", [(0, dict(temperature=0.7, top_p=0.95, top_k=0)),
                                           (1, dict(temperature=1.0, top_p=0.95)),  # transformers' default top-k 50
                                           (2, dict(temperature=1.0, top_p=0.5, top_k=0))])  # fmt: skip
def test_computed_rounds_equal_a_sampled_run(runs, seed, sampling):
    """Under sampling too the rounds are a function of the output: transformers keeps a prompt-lookup candidate iff
    it equals the token it samples there, and drops candidates its top-p warper forbids on all-ones logits, so the
    rounds computed from the run's own sampled output equal its recorded rounds. Negative control: the same output
    with nothing forbidden disagrees somewhere (else the forbidden set is not exercised)."""
    from adaflash_hf.bench.methods.hf import forbidden_candidates

    target, _, _ = load_reference_pair()
    kwargs = dict(do_sample=True, **sampling)
    forbidden = forbidden_candidates(target, kwargs)
    assert 0 < len(forbidden) < target.config.vocab_size
    ignoring_differs = False
    for name in ("cat", "king", "add"):
        ids, _, _, _, max_new, eos_ids = runs[name]
        torch.manual_seed(seed)
        with torch.inference_mode():
            out, real = recorded_prompt_lookup(target, torch.tensor([ids]), None, 10, max_new_tokens=max_new, **kwargs)
        sampled = out[0, len(ids) :].tolist()
        sampled = sampled[: next((j + 1 for j, t in enumerate(sampled) if t in eos_ids), len(sampled))]
        computed = prompt_lookup_rounds(ids, sampled, max_new, eos_ids, forbidden=forbidden)
        assert (computed.accepted, computed.verify_lengths) == (real.accepted, real.verify_lengths), name
        ignoring = prompt_lookup_rounds(ids, sampled, max_new, eos_ids)
        ignoring_differs |= ignoring.verify_lengths != real.verify_lengths
    assert ignoring_differs


@pytest.mark.parametrize(
    "seq,cur,forbidden,expected",
    [
        ([1, 2, 3, 4, 9, 1, 2], 7, set(), [3, 4, 9, 1, 2]),  # leftmost match of (1, 2)
        ([1, 2, 3, 4, 9, 1, 2], 7, {4}, [3]),  # cropped before the first forbidden token
        ([1, 2, 3, 4, 1, 2, 5, 6, 1, 2], 10, {3}, [5, 6, 1, 2]),  # first token forbidden: the next match wins
        ([1, 2, 3, 7, 2, 5, 1, 2], 8, {3}, [5, 1, 2]),  # no allowed match of (1, 2): the 1-gram (2,) then
        ([1, 2, 3, 1, 2], 5, {3}, []),  # nothing allowed anywhere
    ],
)
def test_forbidden_candidates_follow_get_candidates(seq, cur, forbidden, expected):
    """transformers' crop (candidate_generator.py:1107-1124): cut at the first forbidden token, and a match whose
    window is then empty gives way to the next match, then to a shorter n-gram."""
    from adaflash_hf.bench.prompt_lookup_tau import _candidates
    from adaflash_hf.speculation.prompt_ngrams import NgramIndex

    index = NgramIndex(seq, 2, frozenset(forbidden))
    index.extend_to(cur)
    assert _candidates(seq, cur, 100, index, PromptLookupSettings(), eos_ids=set()) == expected
