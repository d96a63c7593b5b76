"""Open-loop Poisson arrivals (adaflash_hf.bench.arrivals): outputs equal plain greedy, no request starts before
its arrival, the concurrency cap holds, and a slower arrival rate stretches the run (the negative control)."""

from __future__ import annotations

import statistics

import pytest

from adaflash_hf.bench.arrivals import poisson_arrivals, run_open_loop
from adaflash_hf.engine import Engine, layout_args

from generation_helpers import engine_prompts, make_drafter, make_target, plain_greedy_ids

MAX_NEW = 8


@pytest.fixture(scope="module")
def pair():
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4)
    prompts = engine_prompts([5, 7, 9, 6, 8], seed=3)
    return target, drafter, prompts, [plain_greedy_ids(target, p, MAX_NEW) for p in prompts]


def test_poisson_gaps_have_the_rate():
    t = poisson_arrivals(4000, rate=50.0, seed=1)
    gaps = [b - a for a, b in zip([0.0] + t, t)]
    assert statistics.mean(gaps) == pytest.approx(1 / 50.0, rel=0.06) and min(gaps) > 0
    assert poisson_arrivals(5, 1.0, seed=2) == poisson_arrivals(5, 1.0, seed=2) != poisson_arrivals(5, 1.0, seed=3)


@pytest.mark.parametrize("layout", ["off", "packed"])
def test_open_loop_is_lossless_and_respects_arrivals_and_the_cap(pair, layout):
    target, drafter, prompts, refs = pair
    eng = Engine(target, **layout_args(drafter, layout), max_slots=4, max_len=48, token_budget=64)
    most = []
    step = eng.step
    eng.step = lambda: (most.append(eng.num_running + eng.num_queued), step())[1]
    fast = run_open_loop(eng, prompts, MAX_NEW, poisson_arrivals(len(prompts), 500.0, seed=0), concurrency=2)
    assert [o.token_ids for o in fast["outputs"]] == refs
    assert max(most) <= 2 and fast["latency_s"] >= fast["ttft_s"] > 0 and fast["tok_per_s"] > 0
    times = [0.1 * (i + 1) for i in range(len(prompts))]
    spread = run_open_loop(eng, prompts, MAX_NEW, times, concurrency=2)
    assert [o.token_ids for o in spread["outputs"]] == refs
    assert all(s >= a for s, a in zip(spread["submitted_s"], times)) and spread["span_s"] >= times[-1] - times[0]
    # the control: all at once through one slot, each request waits for the one before it
    one = run_open_loop(eng, prompts, MAX_NEW, [0.0] * len(prompts), concurrency=1)
    assert [o.token_ids for o in one["outputs"]] == refs
    assert all(s >= d for s, d in zip(one["submitted_s"][1:], one["done_s"])) and one["submitted_s"][-1] > 0


def test_bad_arrivals_are_rejected(pair):
    target, _, prompts, _ = pair
    eng = Engine(target, max_slots=2, max_len=48, token_budget=64)
    with pytest.raises(ValueError, match="one arrival time per prompt"):
        run_open_loop(eng, prompts, MAX_NEW, [0.0], concurrency=1)
    with pytest.raises(ValueError, match="non-decreasing"):
        run_open_loop(eng, prompts[:2], MAX_NEW, [0.2, 0.1], concurrency=1)
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(3, 0.0)
