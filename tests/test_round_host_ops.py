"""The host's share of a drafting round: greedy acceptance inside the target's decode replay, and what a steady-state
round still dispatches eagerly (CPU-checkable: on CUDA every eager op outside a graph replay is at least one launch).

On CPU the static path runs the graphs' forwards eagerly; a TorchDispatchMode counts the ops dispatched outside
``GraphRunner.replay`` (what a CUDA round launches one by one)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from adaflash_hf.engine import Engine
from adaflash_hf.engine.graphs import DecodeGraphs, GraphRunner
from adaflash_hf.engine.target import PackedLayout
from adaflash_hf.speculation.acceptance import greedy_accept_ids

from generation_helpers import engine_prompts, make_drafter, make_target, plain_greedy_ids, prefilled_cache

ACCEPT_OPS = {"argmax", "cumprod", "gather"}  # the eager acceptance's (speculation.acceptance, Engine._accept)


class EagerOps(TorchDispatchMode):
    """Counts aten ops by name, except those dispatched inside a graph replay (``paused``)."""

    def __init__(self):
        super().__init__()
        self.ops, self.paused = Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def pair():
    target = make_target("qwen3")
    return target, make_drafter(target, block_size=8)


def _round_ops(monkeypatch, engine: Engine, rounds: int) -> tuple[Counter, int]:
    """Eager ops and device reads (``host_syncs``) of ``rounds`` engine rounds, the graph replays left out."""
    mode, replay = EagerOps(), GraphRunner.replay

    def paused(self, bucket):
        mode.paused += 1
        try:
            return replay(self, bucket)
        finally:
            mode.paused -= 1

    monkeypatch.setattr(GraphRunner, "replay", paused)
    syncs = engine.host_syncs
    with mode:
        for _ in range(rounds):
            assert engine.step()
    monkeypatch.setattr(GraphRunner, "replay", replay)
    assert engine.healthy, engine.last_error
    return mode.ops, engine.host_syncs - syncs


def _steady(pair, **params) -> Engine:
    target, drafter = pair
    engine = Engine(target, drafter, length_policy="fixed", max_slots=4, max_len=128, token_budget=64, cuda_graphs=True,
                    prompt_ngrams=0)
    for p in engine_prompts([9, 13], seed=3):
        engine.submit(p, 40, **params)
    for _ in range(3):  # prefill, then verify-only rounds
        engine.step()
    return engine


def test_a_greedy_round_accepts_inside_the_replay_with_one_read(pair, monkeypatch):
    """A steady fixed round of greedy requests dispatches no acceptance op outside the target's replay, reads the
    device once, and stays within a budget of eager ops that the eager acceptance exceeds (it dispatches ~90 a round
    here). The control, a penalised request (its rows change before acceptance), takes the eager path: its
    acceptance ops show and the count rises."""
    rounds = 4
    ops, reads = _round_ops(monkeypatch, _steady(pair), rounds)
    assert reads == rounds
    assert not ACCEPT_OPS & set(ops), ops
    control, control_reads = _round_ops(monkeypatch, _steady(pair, presence_penalty=1e-6), rounds)
    assert control_reads == rounds and ACCEPT_OPS <= set(control), control
    eager = sum(ops.values()) / rounds
    assert eager <= 70 and sum(control.values()) / rounds > eager + 15, (eager, sum(control.values()) / rounds)


@pytest.mark.parametrize("q_lens,dl,cut", [([4, 1, 6], [3, 0, 5], [9, 0, 2]), ([8, 8], [7, 4], [1, 9])])
def test_the_replay_accepts_as_the_eager_acceptance(pair, q_lens, dl, cut):
    """:meth:`DecodeGraphs.run` with ``accept``: accepted counts, next tokens, flags and the drafts read back equal
    the eager greedy acceptance on the same logits, with drafts that agree with the target up to ``cut[i]``."""
    target, _ = pair
    prompts = engine_prompts([5, 7, 6][: len(q_lens)], seed=1)
    cache, slots = prefilled_cache(target, prompts, 4, 32)
    graphs = DecodeGraphs(target, cache, None, max_tokens=24, max_q=8)
    lay = PackedLayout.from_cache(cache, slots, q_lens)
    starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    toks = sum(engine_prompts(q_lens, seed=2), [])
    for j in range(max(q_lens) - 1):  # draft j + 1 := the target's argmax after draft j, while under the cut
        top = graphs.run(toks, lay)[0].argmax(dim=-1).tolist()
        for i, s in enumerate(starts):
            if j + 1 < q_lens[i]:
                toks[s + j + 1] = top[s + j] if j < cut[i] else (top[s + j] + 1) % 100
    dl_dev = torch.tensor(dl)
    logits, _ = graphs.run(toks, lay, accept=dl_dev)
    host = graphs.verdict_rows(lay.num_tokens).tolist()
    acc, nxt, bad, dls, drafts = graphs.read_verdict(host, q_lens)
    kmax = max(q_lens) - 1
    vidx = torch.tensor([[s + min(c, q - 1) for c in range(kmax + 1)] for s, q in zip(starts, q_lens)])
    draft_t = torch.tensor([toks[s + 1 : s + q] + [0] * (kmax + 1 - q) for s, q in zip(starts, q_lens)])
    ref = greedy_accept_ids(draft_t, logits.argmax(dim=-1)[vidx], dl_dev)
    assert acc == ref.num_accepted.tolist() and nxt == ref.next_tokens.tolist()
    assert acc == [min(c, d) for c, d in zip(cut, dl)]  # the drafts really agreed where they were made to
    assert bad == [0] * len(q_lens) and dls == dl and drafts == [toks[s + 1 : s + q] for s, q in zip(starts, q_lens)]


@pytest.mark.parametrize("mode", ["fixed", "packed", "rectangular"])
def test_greedy_rounds_accepted_in_the_replay_equal_plain_greedy(pair, mode):
    """Lossless: the engine's static path, acceptance in the replay, == plain greedy token for token, with drafts
    often right (an acceptance replay of the greedy references drives them: the random drafter accepts ~nothing)."""
    from adaflash_hf.bench.replay import DraftReplay, PerPositionTrace
    from adaflash_hf.engine import layout_args

    target, drafter = pair
    prompts = engine_prompts([6, 11, 8], seed=5)
    refs = {tuple(p): plain_greedy_ids(target, p, 20) for p in prompts}
    trace = PerPositionTrace([0.95, 0.9, 0.8, 0.6, 0.4, 0.3, 0.1])
    engine = Engine(target, **layout_args(drafter, mode, trace.policy.length_policy), max_slots=3, max_len=48,
                    token_budget=64, cuda_graphs=True, draft_replay=DraftReplay(refs, trace, seed=2))
    trace.policy.apply(engine)
    outs = engine.generate(prompts, max_new_tokens=20)
    assert [o.token_ids for o in outs] == [refs[tuple(p)] for p in prompts]
    assert max(a for o in outs for a in o.accepted) >= 3
    assert any(b[-1] == "accept" for b in engine.graphs.replays)  # the rounds took the in-replay acceptance
