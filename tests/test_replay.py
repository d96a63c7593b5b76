"""Acceptance replay (adaflash_hf.bench.replay): the engine's real forwards under a trace's acceptance.

Identity with plain greedy decoding holds, every round accepts what the trace planned (cut by the
verify length), and the head's replayed ratio sets the verify length."""

from __future__ import annotations

import random

import pytest

from adaflash_hf.bench.replay import (DraftReplay, PerPositionTrace, RecordedTrace, ReplayPolicy, TraceRound,
                                     paper_dflash_trace)
from adaflash_hf.engine import Engine, layout_args

from generation_helpers import engine_prompts, make_drafter, make_target, plain_greedy_ids

B = 8
MAX_NEW = 20
RATE1 = ReplayPolicy("adaptive", 1.0, 1, B)


@pytest.fixture(scope="module")
def replay_pair():
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=B)
    prompts = engine_prompts([5, 9, 12], seed=4)
    refs = {tuple(p): plain_greedy_ids(target, p, MAX_NEW) for p in prompts}
    return target, drafter, prompts, refs


def _run(pair, mode, trace, graphs=True):
    target, drafter, prompts, refs = pair
    replay = DraftReplay(refs, trace, seed=2)
    # packed at the trace's own rule: the oracle traces' is the paper's floor rule (k_hat = L + 1)
    eng = Engine(target, **layout_args(drafter, mode, trace.policy.length_policy), max_slots=3, max_len=48, token_budget=64, cuda_graphs=graphs,
                 draft_replay=replay)
    trace.policy.apply(eng)
    return eng.generate(prompts, max_new_tokens=MAX_NEW), replay


@pytest.mark.parametrize("mode,graphs", [("fixed", True), ("packed", True), ("packed", False)])
def test_replay_is_lossless_and_follows_the_trace(replay_pair, mode, graphs):
    trace = PerPositionTrace([0.95, 0.9, 0.8, 0.6, 0.4, 0.3, 0.1])  # oracle head: k_hat = L + 1
    outs, replay = _run(replay_pair, mode, trace, graphs)
    _, _, prompts, refs = replay_pair
    assert [o.token_ids for o in outs] == [refs[tuple(p)] for p in prompts]
    ok, total = replay.followed(outs)
    assert total >= 2 * len(prompts) and ok == total
    accepted = [a for o in outs for a in o.accepted]
    assert max(accepted) >= 3  # the trace, not the random drafter (which accepts ~nothing), drives acceptance
    if mode == "packed":  # the oracle ratio (L + 1) / B verifies exactly the planned drafts + the bonus
        for o in outs:
            for t, v in enumerate(o.verify_lengths):
                plan = replay.planned.get((o.request_id, t))
                if plan is not None and v > 1:
                    assert v == plan.accepted + 1


def test_every_run_of_the_same_prompts_replays_the_same_rounds(replay_pair):
    # An engine reused for a second run numbers its requests on, and a second engine starts from 0: both must walk the
    # same recorded rounds per prompt, or two modes compared at one concurrency replay different requests.
    target, drafter, prompts, refs = replay_pair
    trace = RecordedTrace([TraceRound(a, 0.5) for a in (0, 7, 3, 1, 6, 2, 5, 4)], RATE1, sequences=[1, 2, 3, 2])
    replay = DraftReplay(refs, trace, seed=2)
    eng = Engine(target, **layout_args(drafter, "fixed"), max_slots=3, max_len=48, token_budget=64, draft_replay=replay)
    runs = [eng.generate(prompts, max_new_tokens=MAX_NEW) for _ in range(2)]
    runs.append(Engine(target, **layout_args(drafter, "fixed"), max_slots=3, max_len=48, token_budget=64,
                       draft_replay=DraftReplay(refs, trace, seed=2)).generate(prompts[::-1], max_new_tokens=MAX_NEW)[::-1])
    assert runs[0][0].request_id != runs[1][0].request_id  # the ids moved on
    for run in runs[1:]:
        assert [o.accepted for o in run] == [o.accepted for o in runs[0]]
    assert len({tuple(o.accepted) for o in runs[0]}) > 1  # the control: different prompts walk different rounds


@pytest.mark.parametrize("accepted", [0, 2, B - 1])
def test_recorded_trace_sets_tau_exactly(replay_pair, accepted):
    outs, _ = _run(replay_pair, "fixed", RecordedTrace([TraceRound(accepted, 1.0)], RATE1))
    for o in outs:  # every round but a last one cut by max_new_tokens accepts the trace's count
        assert o.accepted[:-1] == [accepted] * (len(o.accepted) - 1)
        assert o.accepted[-1] <= accepted


@pytest.mark.parametrize("rate", [1.0, 2.0])
def test_replayed_ratio_sets_the_verify_length_at_the_traces_rate(replay_pair, rate):
    trace = RecordedTrace([TraceRound(B - 1, 3 / B)], ReplayPolicy("adaptive", rate, 1, B))
    outs, _ = _run(replay_pair, "packed", trace)
    # k_hat = floor(3 * rate) from the ratio and the trace's rate whatever the live head and the drafter's own rate
    # say; the trace would accept more: cut at k_hat - 1 drafts
    k = int(3 * rate)
    assert {v for o in outs for v in o.verify_lengths[:-1]} == {k}
    assert {a for o in outs for a in o.accepted[:-1]} == {k - 1}
    _, _, prompts, refs = replay_pair
    assert [o.token_ids for o in outs] == [refs[tuple(p)] for p in prompts]


def test_policy_refuses_another_block_size(replay_pair):
    target, drafter, _, refs = replay_pair
    eng = Engine(target, **layout_args(drafter, "packed"), max_slots=1, max_len=48, token_budget=64)
    with pytest.raises(ValueError, match="block size 16"):
        ReplayPolicy("adaptive", 2.0, 1, 16).apply(eng)
    with pytest.raises(ValueError, match="block size"):
        paper_dflash_trace(16, ratio_from=RecordedTrace([TraceRound(1, 0.2)], RATE1))


def test_per_position_draws_match_the_slot_probabilities():
    probs = [0.9, 0.7, 0.4, 0.1]
    trace, rng, n = PerPositionTrace(probs), random.Random(0), 20000
    draws = [trace.draw(rng, block_size=5).accepted for _ in range(n)]
    for j, p in enumerate(probs, start=1):
        assert abs(sum(d >= j for d in draws) / n - p) < 0.015
    assert abs(1 + sum(draws) / n - trace.tau) < 0.03


def test_paper_trace_ends_and_mean_acceptance():
    t = paper_dflash_trace(16)
    assert len(t.probs) == 15 and t.probs[0] == pytest.approx(0.89) and t.probs[-1] == pytest.approx(0.13)
    assert all(b < a for a, b in zip(t.probs, t.probs[1:]))
    assert abs(t.tau - 7.09) < 0.1  # the paper's mean acceptance length for DFlash on Qwen3-8B


def test_ratio_from_a_recorded_head():
    rec = RecordedTrace([TraceRound(1, 0.2), TraceRound(5, 0.7)], ReplayPolicy("adaptive", 2.0, 1, B))
    t = PerPositionTrace([1.0] * 5 + [0.0] * 2, ratio_from=rec)  # always 5 accepted
    assert t.policy == rec.policy and PerPositionTrace([0.5]).policy == ReplayPolicy.oracle(2)
    assert t.draw(random.Random(0), 8) == TraceRound(5, 0.7)
    assert rec.ratio_for(2, random.Random(0)) == 0.2  # nearest recorded count


def _streamed(trace, seed: int, n: int) -> list:
    stream = trace.stream(random.Random(seed), 8)
    return [next(stream) for _ in range(n)]


def test_a_stream_replays_one_recorded_request_in_order_then_another():
    """Two recorded requests, one drafting well (ratios 0.9, 0.8, 0.7) and one not (0.1, 0.2): a stream walks one of
    them from its first round, in order, then another; the same rounds drawn at random (no ``sequences``, the
    control) break that order."""
    rounds = [TraceRound(6, 0.9), TraceRound(5, 0.8), TraceRound(4, 0.7), TraceRound(0, 0.1), TraceRound(1, 0.2)]
    runs = (rounds[:3], rounds[3:])
    nexts = {a: b for run in runs for a, b in zip(run, run[1:])}  # a round's successor within its request
    lasts, firsts = {run[-1] for run in runs}, {run[0] for run in runs}

    def in_order(got):
        return got[0] in firsts and all(nexts.get(a) == b or (a in lasts and b in firsts) for a, b in zip(got, got[1:]))

    assert all(in_order(_streamed(RecordedTrace(rounds, RATE1, sequences=[3, 2]), seed, 12)) for seed in range(20))
    assert not any(in_order(_streamed(RecordedTrace(rounds, RATE1), seed, 12)) for seed in range(20))


@pytest.mark.parametrize("sequences", [[2, 2], [5, 0], [6]])
def test_sequences_must_cover_the_rounds(sequences):
    with pytest.raises(ValueError, match="sequences"):
        RecordedTrace([TraceRound(1, 0.2)] * 5, RATE1, sequences=sequences)


@pytest.mark.parametrize("probs", [[0.5, 0.9], [1.2], []])
def test_bad_per_position_trace_is_rejected(probs):
    with pytest.raises(ValueError, match="per-slot acceptance"):
        PerPositionTrace(probs)


def test_record_keeps_whole_blocks_and_the_drafters_policy_and_round_trips(replay_pair):
    target, drafter, prompts, _ = replay_pair
    cfg = drafter.config
    saved = cfg.length_rate, cfg.length_min, getattr(cfg, "length_head_trained", False)
    cfg.length_rate, cfg.length_min, cfg.length_head_trained = 1.75, 2, True
    try:
        rec = RecordedTrace.record(target, drafter, prompts, MAX_NEW, name="tiny", max_slots=3, token_budget=64)
    finally:
        cfg.length_rate, cfg.length_min, cfg.length_head_trained = saved
    assert rec.rounds and all(0 <= r.accepted < B and 0.0 < r.ratio < 1.0 for r in rec.rounds)
    assert rec.policy == ReplayPolicy("cost", 1.75, 2, B)  # a trained head: the default rule, cost
    back = RecordedTrace.from_json(rec.to_json())
    assert back.rounds == rec.rounds and back.name == "tiny" and back.policy == rec.policy
    # one run per request, in order: the rounds of each request, as the engine verified them
    assert len(rec.sequences) == len(prompts) and sum(rec.sequences) == len(rec.rounds) and back.sequences == rec.sequences
    old = {k: v for k, v in rec.to_json().items() if k != "policy"}  # saved before traces carried their policy
    with pytest.raises(ValueError, match="no 'policy'"):
        RecordedTrace.from_json(old)


@pytest.mark.parametrize("bad", [dict(length_policy="sometimes"), dict(length_rate=0.0), dict(length_min=9)])
def test_bad_policy_is_rejected(bad):
    with pytest.raises(ValueError):
        ReplayPolicy(**{**dict(length_policy="adaptive", length_rate=1.0, length_min=1, block_size=B), **bad})


def test_replay_rejects_sampled_requests(replay_pair):
    target, drafter, prompts, refs = replay_pair
    eng = Engine(target, drafter, length_policy="fixed", max_slots=1, max_len=48, token_budget=64,
                 draft_replay=DraftReplay(refs, paper_dflash_trace(B)))
    out = eng.generate(prompts[:1], max_new_tokens=4, temperature=1.0, seed=0)[0]
    assert out.finish_reason == "error" and "greedy" in out.error


@pytest.mark.parametrize("fails", ["round", "request", None])
def test_the_replay_bench_fails_a_row_whose_requests_fail_instead_of_waiting(monkeypatch, fails):
    """A round that fails (the device out of memory at 128 requests on an 80 GB card, 2026-12-05) fails the requests in
    flight and leaves the rest queued on an unhealthy engine; the bench's prefill then names the failure at once.
    Before, it stepped the engine for ever, waiting for their first tokens. A request failing alone fails the row
    too. The control: healthy requests get their first tokens and go on."""
    import importlib.util
    import sys
    from pathlib import Path

    examples = Path(__file__).resolve().parents[1] / "examples"
    monkeypatch.syspath_prepend(str(examples))
    spec = importlib.util.spec_from_file_location("replay_bench_under_test", examples / "replay_bench.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)
    spec.loader.exec_module(bench)
    target = make_target(layers=2, seed=3)
    eng = Engine(target, max_slots=2, max_len=64, token_budget=64)
    if fails == "round":
        monkeypatch.setattr(eng, "_step", lambda: (_ for _ in ()).throw(RuntimeError("CUDA out of memory (simulated)")))
    elif fails == "request":
        submit = eng.submit
        def failing(*args, **kwargs):
            handle = submit(*args, **kwargs)
            eng.lifecycle.fail(handle._req, "bad row (simulated)")
            return handle

        monkeypatch.setattr(eng, "submit", failing)
    prompts = engine_prompts([5, 7], seed=11)
    if fails:
        why = "engine failed before .*out of memory" if fails == "round" else "2 of 2 requests failed: bad row"
        with pytest.raises(RuntimeError, match=why):
            bench.submit_and_prefill(eng, prompts, 4)
    else:
        handles = bench.submit_and_prefill(eng, prompts, 4)
        assert all(h.token_ids for h in handles)
        assert [h.result().token_ids for h in handles] == [plain_greedy_ids(target, p, 4) for p in prompts]
