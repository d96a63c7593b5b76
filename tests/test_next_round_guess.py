"""The cost rule's guess of a request's next round before its drafter runs (issue 35's tau at concurrency 1): what a
round says of the request's acceptance, the guess shrunk toward the traffic's mean, and the engine deciding on it."""

import pytest
import torch

import adaflash_hf.speculation.length.planner as vl
from adaflash_hf.engine import Engine
from adaflash_hf.engine.requests import Request
from adaflash_hf.engine.sampling import SamplingParams

from generation_helpers import (engine_prompts, force_length_head, kept_length_head, make_drafter, make_target,
                                plain_greedy_ids)


@pytest.fixture(scope="module")
def pair():
    target = make_target("qwen3")
    return target, make_drafter(target, block_size=8)


def _engines_by_prior(monkeypatch, pair, cost, **engine_kwargs):
    """``(prior, engine)``: a ``cost`` engine built under ``GUESS_PRIOR_ROUNDS`` 8 (the default), then 0 (the
    control: the rule before the guess)."""
    for prior in (8.0, 0.0):
        monkeypatch.setattr(vl, "GUESS_PRIOR_ROUNDS", prior)
        yield prior, Engine(*pair, length_policy="cost", round_cost=cost, max_len=64, token_budget=64, prompt_ngrams=0,
                            **engine_kwargs)


def _request(head_ratio=None) -> Request:
    r = Request(0, [1, 2], 30, SamplingParams(), None)
    r.head_ratio = head_ratio
    return r


# (name, accepted, verify length, the round's head ratio, what the round says of acceptance, block 8; None: nothing)
OBSERVED = [
    ("a rejection inside the verify: what it accepted", 2, 8, 0.9, 3 / 8),
    ("a draft rejected short of the block: what it accepted", 1, 4, 0.9, 2 / 8),
    # (as the rounds before it calibrate the head: none here)
    ("every verified draft accepted short of the block: at least the head's ratio", 3, 4, 0.75, 0.75),
    ("censored, the head lower: what it accepted", 3, 4, 0.25, 4 / 8),
    ("the whole block accepted", 7, 8, 0.1, 1.0),
    ("control: a plain round says nothing", 0, 1, 0.5, None),
]


@pytest.mark.parametrize("name,accepted,verify,ratio,seen", OBSERVED, ids=[c[0] for c in OBSERVED])
def test_what_a_round_says_of_acceptance(pair, name, accepted, verify, ratio, seen):
    eng = Engine(*pair, length_policy="cost", max_slots=1, max_len=32, token_budget=32)
    r = _request(ratio)
    eng.planner.observe(r, accepted, verify)
    if seen is None:
        assert r.seen == (0.0, 0) and eng.planner.traffic_seen == (0.0, 0.0)
    else:
        assert r.seen == (pytest.approx(seen), 1) and eng.planner.traffic_seen == (pytest.approx(seen), 1.0)


@pytest.mark.parametrize("prior", [8.0, 0.0])
def test_the_guess_is_the_requests_level_shrunk_toward_the_traffic(pair, monkeypatch, prior):
    """A request that accepted 1 of 8 on its rounds while the traffic accepted 5 of 8: its guess lies between, nearer
    the traffic's after one round than after eight; nothing seen yet: the head's last ratio. With no prior rounds (the
    control, the rule before) the guess is the last ratio whatever was seen."""
    monkeypatch.setattr(vl, "GUESS_PRIOR_ROUNDS", prior)
    eng = Engine(*pair, length_policy="cost", max_slots=1, max_len=32, token_budget=32)
    mine, other = _request(0.9), _request(0.6)
    assert eng.planner.guess(mine) == 0.9
    for _ in range(24):
        eng.planner.observe(other, 4, 8)  # 5 of 8
    guesses, traffic = [], []
    for _ in range(8):
        eng.planner.observe(mine, 0, 8)  # 1 of 8, a rejection at the first draft
        guesses.append(eng.planner.guess(mine))
        traffic.append(eng.planner.traffic_seen[0] / eng.planner.traffic_seen[1])  # its own rounds count in the traffic too
    if prior == 0.0:
        assert guesses == [0.9] * 8
        return
    assert all(1 / 8 < g < t < 5 / 8 for g, t in zip(guesses, traffic))
    assert guesses[0] == pytest.approx((prior * traffic[0] + 1 / 8) / (prior + 1))
    assert guesses == sorted(guesses, reverse=True) and guesses[-1] < (guesses[0] + 1 / 8) / 2 + 0.05


@pytest.mark.parametrize("graphs", [False, True])
def test_the_engine_trusts_what_rounds_accepted_over_the_heads_last_ratio(pair, monkeypatch, graphs):
    """The head says every draft will be accepted (ratio ~1) and the random drafter's drafts are rejected: decided on
    the last ratio (the control, ``GUESS_PRIOR_ROUNDS`` 0) every round after the first verifies whole blocks without
    reading its ratios; decided on what the rounds accepted, the engine reads them instead (a flat cost with a read
    to spare makes whole blocks pay only when drafts are likely accepted). Plain greedy output either way."""
    from adaflash_hf.speculation.length.cost import RoundCost

    target, drafter = pair
    cost = RoundCost(rows=(1,), tokens_per_row=(1, 8), verify=((1.0, 2.0),), draft_fraction=0.0, spec_overhead=1.0,
                     read_overhead=0.5)
    prompts = engine_prompts([5, 7], seed=11)
    whole = {}
    with kept_length_head(drafter):
        force_length_head(drafter, ratio_high=True)
        for prior, eng in _engines_by_prior(monkeypatch, pair, cost, max_slots=2, cuda_graphs=graphs):
            outs = eng.generate(prompts, max_new_tokens=30)
            assert [o.token_ids for o in outs] == [plain_greedy_ids(target, p, 30) for p in prompts]
            accepted = [a for o in outs for a in o.accepted]
            whole[prior] = (eng.whole_rounds, eng.num_steps - eng.skipped_drafts - 1)
    assert sum(accepted) < len(accepted)  # the premise: the drafts are mostly rejected
    # the control: every drafting round but the first (no ratio yet) and at most one near the end, whose ratios said
    # plain and which verified what its spent body had left
    assert whole[0.0][1] - 2 <= whole[0.0][0] <= whole[0.0][1] - 1
    assert whole[8.0][0] < whole[0.0][0] // 2


# (GUESS_PRIOR_ROUNDS, the traffic's rounds seen, the guess of a request yet to draft)
UNDRAFTED = [
    ("no traffic yet: it accepts everything, its first round drafts", 8.0, False, 1.0),
    ("traffic seen: the traffic's mean", 8.0, True, 5 / 8),
    ("control, no prior rounds (the rule before): it accepts everything", 0.0, True, 1.0),
]


@pytest.mark.parametrize("name,prior,traffic,want", UNDRAFTED, ids=[c[0] for c in UNDRAFTED])
def test_a_request_yet_to_draft_is_guessed_at_the_traffics_mean(pair, monkeypatch, name, prior, traffic, want):
    monkeypatch.setattr(vl, "GUESS_PRIOR_ROUNDS", prior)
    eng = Engine(*pair, length_policy="cost", max_slots=1, max_len=32, token_budget=32)
    for _ in range(24 if traffic else 0):
        eng.planner.observe(_request(0.6), 4, 8)  # 5 of 8
    assert eng.planner.guess(_request()) == pytest.approx(want)


def test_new_requests_skip_the_body_the_traffic_says_cannot_pay(pair, monkeypatch):
    """A drafter costing twice a whole-block verify, traffic that accepted 1 of 8 and the head saying ~0: requests
    arriving after a plain decision skip their first round's body on the traffic's mean; guessed as accepting
    everything (the control, ``GUESS_PRIOR_ROUNDS`` 0) each runs it. Plain greedy output either way."""
    import adaflash_hf.engine.engine as engine_module
    from adaflash_hf.speculation.length.cost import RoundCost

    target, drafter = pair
    cost = RoundCost(rows=(1,), tokens_per_row=(1, 8), verify=((1.0, 2.0),), draft_fraction=2.0, spec_overhead=1.0)
    bodies = [0]
    real = engine_module.draft_blocks

    def counted(*a, **k):
        bodies[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(engine_module, "draft_blocks", counted)
    first, later = engine_prompts([6], seed=3), engine_prompts([5, 7, 9], seed=4)
    runs = {}
    with kept_length_head(drafter):
        force_length_head(drafter, ratio_high=False)
        for prior, eng in _engines_by_prior(monkeypatch, pair, cost, max_slots=1, cuda_graphs=False):
            eng.generate(first, max_new_tokens=12)  # its first round drafts, its ratios say plain
            for _ in range(24):
                eng.planner.observe(_request(0.1), 0, 8)  # the traffic accepted 1 of 8
            bodies[0] = 0
            outs = eng.generate(later, max_new_tokens=12)
            assert [o.token_ids for o in outs] == [plain_greedy_ids(target, p, 12) for p in later]
            runs[prior] = bodies[0]
    assert runs[0.0] >= len(later)  # the control: every request's first round runs the body
    assert runs[8.0] < runs[0.0]
