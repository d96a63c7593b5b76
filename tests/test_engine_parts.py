"""The engine's parts built alone, each from what it is handed: its config, the request lifecycle, the plain decoder,
the phase timer; and the engine built from a config the one way, keywords or not."""

from __future__ import annotations

import pytest
import torch

from adaflash_hf.engine import Engine, EngineConfig, SamplingParams
from adaflash_hf.engine.decode_steps import PlainDecoder
from adaflash_hf.engine.graphs import DecodeGraphs
from adaflash_hf.engine.lifecycle import Lifecycle
from adaflash_hf.engine.requests import Request
from adaflash_hf.engine.stats import EngineStats, PhaseTimer
from generation_helpers import engine_prompts, make_drafter, make_target, plain_greedy_ids, prefilled_cache


@pytest.mark.parametrize("bad, field", [
    (dict(max_slots=0), "max_slots"), (dict(max_len=-1), "max_len"), (dict(token_budget=2.5), "token_budget"),
    (dict(decode_steps=0), "decode_steps"), (dict(ema_beta=0.0), "ema_beta"), (dict(round_cost="guessed"), "round_cost"),
    (dict(length_policy=3), "length_policy"),
])
def test_a_bad_setting_is_one_error_when_the_config_is_made(bad, field):
    with pytest.raises(ValueError, match=f"EngineConfig: {field}"):
        EngineConfig(**bad)
    with pytest.raises(ValueError, match=f"EngineConfig: {field}"):  # the keyword path checks the same
        EngineConfig.of(None, **bad)
    with pytest.raises(TypeError, match="no setting max_slot"):
        EngineConfig.of(None, max_slot=4)
    EngineConfig()  # the defaults are valid


def test_keywords_build_the_same_config_as_a_config():
    target = make_target(seed=1)
    drafter = make_drafter(target, block_size=4)
    base = EngineConfig(length_policy="fixed", max_slots=2, max_len=64, token_budget=32, cuda_graphs=False)
    by_config = Engine(target, drafter, base)
    by_keywords = Engine(target, drafter, length_policy="fixed", max_slots=2, max_len=64, token_budget=32,
                         cuda_graphs=False)
    on_top = Engine(target, drafter, EngineConfig(max_slots=2, max_len=64), length_policy="fixed", token_budget=32,
                    cuda_graphs=False)
    assert by_config.config == by_keywords.config == on_top.config == base
    prompts = engine_prompts([5, 3], seed=4)
    outs = [[o.token_ids for o in e.generate(prompts, max_new_tokens=6)] for e in (by_config, by_keywords)]
    assert outs[0] == outs[1] == [plain_greedy_ids(target, p, 6) for p in prompts]
    with pytest.raises(ValueError, match="need a drafter"):  # drafter-dependent checks come when the engine is built
        Engine(target, None, base)
    with pytest.raises(TypeError, match="config must be an EngineConfig"):  # a policy name where the config goes
        Engine(target, drafter, "fixed")


class _Cache:
    """A stand-in slotted cache: ``slots`` free ones; records the slots taken and freed."""

    def __init__(self, slots: int = 8):
        self.free_slots, self.taken, self.freed = list(range(slots)), [], []

    @property
    def num_free(self):
        return len(self.free_slots)

    def alloc(self, slot=None):
        slot = self.free_slots.pop(0) if slot is None else self.free_slots.remove(slot) or slot
        self.taken.append(slot)
        return slot

    def free(self, slot):
        self.freed.append(slot)


def _running(life: Lifecycle, rid: int, slot: int, max_new: int = 4, eos=(), on_token=None) -> Request:
    r = Request(rid, [1, 2], max_new, SamplingParams(eos_token_id=tuple(eos) or None), on_token)
    r.state, r.slot = "running", slot
    life.running.append(r)
    return r


def test_lifecycle_alone_commits_finishes_fails_and_cancels():
    cache, dcache, finished = _Cache(), _Cache(), []
    life = Lifecycle(cache, dcache, on_request=finished.append)
    eos = _running(life, 0, slot=0, eos=[9])
    assert life.commit(eos, [5, 9, 7], verify_len=3) == 2  # stops at EOS: 7 is never committed
    assert eos.output.token_ids == [5, 9] and eos.output.finish_reason == "eos" and eos.accepted == [1]
    long = _running(life, 1, slot=1, max_new=2)
    assert life.commit(long, [3]) == 1 and long.output is None  # one token of two: still running
    assert life.commit(long, [4, 4]) == 1 and long.output.finish_reason == "length"
    raising = _running(life, 2, slot=2, on_token=lambda t: 1 / 0)
    assert life.commit(raising, [3]) == 0  # a raising callback fails its own request only
    assert raising.output.finish_reason == "error" and "ZeroDivisionError" in raising.output.error
    assert cache.freed == dcache.freed == [0, 1, 2] and life.running == [] and life.healthy
    assert [f.row for f in finished] == [0, 1]  # eos and length are announced; errors are not

    later = _running(life, 3, slot=3)
    life.in_step = True  # inside a round a cancellation waits for the round's end
    life.cancel(later)
    assert later.output is None and later.cancel_requested
    life.in_step = False
    life.reap()
    assert later.output.finish_reason == "cancelled" and cache.freed[-1] == 3
    queued = Request(4, [1], 2, SamplingParams(), None)
    life.queue.append(queued)
    life.cancel(queued)  # outside a round: at once, out of the queue, no slot to free
    assert queued.output.finish_reason == "cancelled" and not life.queue and cache.freed[-1] == 3

    a, b = _running(life, 5, slot=5), _running(life, 6, slot=6)
    life.fail_round(RuntimeError("kernel"))
    assert not life.healthy and life.last_error == "RuntimeError: kernel" and isinstance(life.failure, RuntimeError)
    assert [r.output.finish_reason for r in (a, b)] == ["error", "error"] and life.running == []
    assert [f.row for f in finished] == [0, 1]


@pytest.mark.parametrize("slots, limit, budget, want", [
    (8, 8, 100, [0, 1, 2, 3]), (2, 8, 100, [0, 1]), (8, 3, 100, [0, 1]), (8, 8, 9, [0, 1]), (8, 8, 3, [])])
def test_lifecycle_admits_in_order_within_slots_limit_and_budget(slots, limit, budget, want):
    """Queued requests start in order while a slot is free, fewer than ``limit`` run and the prompt fits the budget
    left (prompts of 4, 5, 2, 1 tokens; one request already runs); the first that does not fit stops admission."""
    cache, dcache = _Cache(slots), _Cache(slots)
    life = Lifecycle(cache, dcache)
    life.queue.extend(Request(i, [7] * n, 4, SamplingParams(), None) for i, n in enumerate([4, 5, 2, 1]))
    admitted = life.admit(1, limit, budget)
    assert [r.id for r in admitted] == want and life.running == admitted
    assert [r.id for r in life.queue] == [i for i in range(4) if i not in want]
    assert all(r.state == "running" for r in admitted) and cache.taken == dcache.taken == [r.slot for r in admitted]


@pytest.mark.parametrize("steps", [1, 4])
def test_plain_decoder_alone_decodes_as_plain_greedy(steps):
    target = make_target(seed=2)
    prompts = engine_prompts([6, 3, 5], seed=7)
    want = [plain_greedy_ids(target, p, 1 + 2 * steps) for p in prompts]
    cache, slots = prefilled_cache(target, prompts, 4, 64)
    graphs = DecodeGraphs(target, cache, None, max_tokens=8, max_q=1, max_steps=steps)
    life, stats = Lifecycle(cache), EngineStats()
    decoder = PlainDecoder(graphs, cache, life, stats, PhaseTimer(torch.device("cpu")))
    running = []
    for i, (p, s, w) in enumerate(zip(prompts, slots, want)):
        r = Request(i, p, 1 + 2 * steps, SamplingParams(), None)
        r.state, r.slot = "running", s
        r.tokens.append(w[0])  # the prefill's first token: the bonus the first step feeds
        running.append(r)
    life.running.extend(running)
    decoder.run(list(running), steps)
    decoder.run(list(running), steps)
    assert [r.output.token_ids for r in running] == want  # the second stretch ends every request
    assert stats.num_steps == 2 * steps and stats.host_syncs == 2 and stats.forward_tokens == [3] * (2 * steps)
    assert stats.skipped_drafts == 0 and cache.num_free == 4 and life.running == []


def test_phase_timer_marks_only_when_enabled():
    timer = PhaseTimer(torch.device("cpu"))
    timer.mark(None), timer.mark("draft"), timer.end_step(True)
    assert not timer.enabled and not timer.seconds and timer.steps == 0
    timer.enabled = True
    timer.mark(None), timer.mark("draft"), timer.end_step(True)
    assert timer.enabled and set(timer.seconds) == {"draft", "host"} and timer.steps == 1


@pytest.mark.parametrize("offsets, counts", [([0, 3], [3]), ([0, 3], [1]), ([2, 5, 5, 9], [2, 0, 4]), ([0, 1, 4], [1, 1])])
def test_leading_rows_are_each_segments_first_rows(offsets, counts):
    """The drafter's new context in one split equals a slice per segment (the reference), as views of the rows."""
    from adaflash_hf.engine.target import leading_rows

    rows = torch.arange(20).reshape(10, 2)
    got = leading_rows(rows, offsets, counts)
    assert [v.tolist() for v in got] == [rows[o : o + n].tolist() for o, n in zip(offsets, counts)]
    assert all(v.data_ptr() == rows[o].data_ptr() for v, o, n in zip(got, offsets, counts) if n)
