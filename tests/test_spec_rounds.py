"""Draft-verify rounds queued behind one read (``EngineConfig.spec_rounds``, engine/spec_rounds.py): lossless, the same
rounds as one read a round, fewer reads. The reference pair's drafter accepts several drafts a round, so the queued
rounds really carry accepted drafts, bonus tokens and chained bodies from one to the next on the device."""

from __future__ import annotations

import pytest
import torch

from adaflash_hf.engine import Engine
from generation_helpers import plain_greedy_once


@pytest.fixture(scope="module")
def ref():
    from adaflash_hf import load_reference_pair

    target, drafter, tok = load_reference_pair()
    prompts = [tok(p)["input_ids"] for p in ("Question: Tom has 3 apples and buys 5 more. How many",
                                             "def add(a, b):", "The capital of France is")]
    return target, drafter, prompts


def plain(target, prompt, n):
    """Plain greedy decoding without a stop (the module's reference target: no test changes it)."""
    return plain_greedy_once(target, prompt, n, eos_token_id=None)


def run(target, drafter, prompts, news, spec_rounds):
    engine = Engine(target, drafter, length_policy="fixed", max_slots=3, max_len=200, cuda_graphs=True, prompt_ngrams=0,
                    spec_rounds=spec_rounds)
    handles = [engine.submit(p, n) for p, n in zip(prompts, news)]
    engine.run_until_idle()
    assert engine.healthy, engine.last_error
    return engine, [h.result() for h in handles]


@pytest.mark.parametrize("news", [(64, 64, 64), (33, 12, 47)])
def test_queued_rounds_equal_plain_greedy_and_the_rounds_of_one_read_each(ref, news):
    """Outputs == plain greedy, and each request's rounds accept exactly what they accept at one read a round (the
    same drafts: the queued bodies are the chained ones); requests that end inside a queue (12 and 33 new tokens) drop
    their later rounds while the others go on."""
    target, drafter, prompts = ref
    one, outs_one = run(target, drafter, prompts, news, 1)
    queued, outs_q = run(target, drafter, prompts, news, 4)
    expected = [plain(target, p, n) for p, n in zip(prompts, news)]
    assert [o.token_ids for o in outs_q] == [o.token_ids for o in outs_one] == expected
    assert [o.accepted for o in outs_q] == [o.accepted for o in outs_one]
    assert max(a for o in outs_q for a in o.accepted) >= 3  # drafts were accepted inside the queues
    assert queued.num_steps == one.num_steps  # the same forwards ...
    assert queued.host_syncs < 0.7 * one.host_syncs  # ... behind fewer reads


def test_without_spec_rounds_nothing_is_queued(ref):
    """The control: ``spec_rounds=1`` (the default) builds no queue and reads once a round."""
    target, drafter, prompts = ref
    engine, _ = run(target, drafter, prompts, (20, 20, 20), 1)
    assert engine.spec is None
    assert engine.host_syncs >= engine.num_steps - 1  # the prefill and each verify round: a read each


def test_a_round_that_cannot_fit_its_queue_runs_alone(ref):
    """Near ``max_len`` the queue shrinks to what every request's caches hold, down to a normal round."""
    target, drafter, prompts = ref
    engine = Engine(target, drafter, length_policy="fixed", max_slots=1, max_len=96, cuda_graphs=True, prompt_ngrams=0,
                    spec_rounds=8)
    out = engine.generate(prompts[:1], max_new_tokens=96 - len(prompts[0]) - 16)[0]
    assert engine.healthy, engine.last_error
    assert out.token_ids == plain(target, prompts[0], len(out.token_ids))
    assert engine.spec.rounds_for([]) == 0


def test_nothing_is_queued_while_a_request_waits_or_samples(ref, monkeypatch):
    """Rounds are queued only when no request waits for a slot and every running one is greedy: the queue would hold
    a waiting request back for its rounds, and sampled rows accept outside the replay. Outputs stay plain greedy."""
    from adaflash_hf.engine.spec_rounds import SpecRounds

    target, drafter, prompts = ref
    engine = Engine(target, drafter, length_policy="fixed", max_slots=2, max_len=200, cuda_graphs=True, prompt_ngrams=0,
                    spec_rounds=4)
    seen = []
    run_queue = SpecRounds.run

    def spy(self, running, rounds):
        seen.append((len(engine.lifecycle.queue), [r.params.greedy for r in running]))
        return run_queue(self, running, rounds)

    monkeypatch.setattr(SpecRounds, "run", spy)
    sampled = engine.submit(prompts[0], 8, temperature=1.0, seed=0)
    handles = [engine.submit(p, 64) for p in prompts]  # the last two wait for a slot
    engine.run_until_idle()
    assert engine.healthy, engine.last_error
    assert [h.result().token_ids for h in handles] == [plain(target, p, 64) for p in prompts]
    assert len(sampled.result().token_ids) == 8
    assert seen and all(waiting == 0 and all(greedy) for waiting, greedy in seen)  # queued only once nothing waited


def test_generate_queues_fixed_rounds_on_the_engine(ref, monkeypatch):
    """``generate(assistant_model=drafter, spec_rounds=K)``: the engine's fast path queues the rounds (a spy on
    SpecRounds.run), the output equals plain greedy ``generate``."""
    from adaflash_hf.engine.spec_rounds import SpecRounds

    target, drafter, prompts = ref
    calls = []
    run_queue = SpecRounds.run
    monkeypatch.setattr(SpecRounds, "run", lambda self, running, rounds: (calls.append(rounds),
                                                                          run_queue(self, running, rounds))[1])
    ids = torch.tensor([prompts[0]])
    out = target.generate(ids, assistant_model=drafter, length_policy="fixed", prompt_ngrams=0, spec_rounds=4,
                          fast_path=True, do_sample=False, max_new_tokens=48)
    assert out.tolist() == target.generate(ids, do_sample=False, max_new_tokens=48).tolist()
    assert calls and max(calls) > 1


@pytest.mark.parametrize("kwargs,message", [
    ({"spec_rounds": 0, "length_policy": "fixed"}, "integer >= 1"),
    ({"spec_rounds": 4, "length_policy": "cost"}, "length_policy='fixed'"),
    ({"spec_rounds": 4, "length_policy": "fixed", "fast_path": False}, "eager loop"),
    ({"spec_rounds": 4, "length_policy": "fixed"}, "eager loop"),  # fast_path "auto" off CUDA: the eager loop
])
def test_generate_refuses_spec_rounds_that_cannot_apply(ref, kwargs, message):
    target, drafter, prompts = ref
    with pytest.raises(ValueError, match=message):
        target.generate(torch.tensor([prompts[0]]), assistant_model=drafter, do_sample=False, max_new_tokens=8, **kwargs)


@pytest.mark.parametrize("policy", ["cost", "adaptive"])
def test_an_engine_refuses_spec_rounds_for_rounds_that_are_not_fixed(ref, policy):
    target, drafter, _ = ref
    with pytest.raises(ValueError, match="length_policy='fixed'"):
        Engine(target, drafter, length_policy=policy, max_slots=1, max_len=64, cuda_graphs=True, spec_rounds=4)
