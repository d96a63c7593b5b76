"""A round the verify-length planner makes plain runs the ``off`` engine's step: the same function, the same target
forwards per token, no drafter body; the drafter's context is stored when drafting resumes, not per stretch."""

import pytest
import torch

import adaflash_hf.engine.engine as engine_mod
from adaflash_hf.engine import Engine
from adaflash_hf.engine.decode_steps import PlainDecoder
from adaflash_hf.speculation.length import RoundCost

from generation_helpers import engine_prompts, force_length_head, kept_length_head, make_drafter, make_target, plain_greedy_ids

PROBED = RoundCost.flat(draft_fraction=0.5)  # a probe costs half a step: plain holds of 2, 4, 8, ... rounds
NEW = 64


def _spy(monkeypatch, cls, name, calls, key):
    real = getattr(cls, name)

    def spy(self, *a, **k):
        calls.append(key(self, *a, **k))
        return real(self, *a, **k)

    monkeypatch.setattr(cls, name, spy)


def _record_ratios(eng) -> list:
    """The length-head ratios each of ``eng``'s drafting rounds hands its planner (``None``: a whole-block round's), in
    a list that fills as the engine runs."""
    seen, real = [], eng.planner.lengths
    eng.planner.lengths = lambda rows, ratio, draft_logits=None: (
        seen.append(None if ratio is None else ratio.clone()), real(rows, ratio, draft_logits))[1]
    return seen


@pytest.mark.parametrize("ratio_high", [False, True], ids=["drafting cannot pay", "control: drafts pay"])
def test_a_plain_plan_runs_the_off_engines_step(monkeypatch, ratio_high):
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=8, seed=3)
    prompts = engine_prompts([5, 7], seed=17)
    steps, rounds, bodies, greedy = [], [], [], []
    _spy(monkeypatch, engine_mod.Engine, "_plain_steps", steps, lambda self, running, n: (self, n))
    _spy(monkeypatch, engine_mod.Engine, "_draft", rounds, lambda self, running: self)
    _spy(monkeypatch, engine_mod.DraftGraphs, "run_body", bodies, lambda self, slots, ctx, bonus: bonus is not None)
    _spy(monkeypatch, engine_mod.DecodeGraphs, "run_greedy", greedy, lambda self, *a, **k: self)
    off = Engine(target, None, max_slots=2, max_len=96, token_budget=64, cuda_graphs=True, decode_steps=4)
    want = [o.token_ids for o in off.generate(prompts, max_new_tokens=NEW)]
    assert want == [plain_greedy_ids(target, p, NEW) for p in prompts]
    off_rounds = len([r for r in rounds if r is off])
    assert off_rounds == 1 and all(e is off for e, _ in steps)  # the prefill, then off's step only
    with kept_length_head(drafter):
        force_length_head(drafter, ratio_high=ratio_high)
        eng = Engine(target, drafter, length_policy="cost", round_cost=PROBED if not ratio_high else RoundCost.flat(),
                     max_slots=2, max_len=96, token_budget=64, cuda_graphs=True, prompt_ngrams=0, decode_steps=4)
        outs = eng.generate(prompts, max_new_tokens=NEW)
    assert [o.token_ids for o in outs] == want
    plain = [n for e, n in steps if e is eng]
    drafting = len([r for r in rounds if r is eng]) - 1  # less the prefill round
    probes, stores = bodies.count(True), bodies.count(False)
    if ratio_high:  # control: every round drafts (but the last token's), no plain step
        assert plain == [] and drafting - 1 <= probes <= drafting and probes >= NEW // 8 - 1
        return
    # every round but the drafting ones (the first, then the probes) is off's step, the same graphs' greedy replays
    assert plain and len(greedy) == len(steps) and probes == drafting and 2 <= probes < 10
    assert sum(plain) + drafting == NEW - 1 and sum(plain) > 3 * drafting
    # the target's forwards per token are off's: one per plain step of both rows
    assert eng.forward_tokens.count(2) >= sum(plain) and eng.skipped_drafts >= sum(plain)
        # the plain steps' features are stored by the next drafting round's body, not per stretch: a context-only body runs
    # only for the features of a drafting round's own tokens, before the plain steps after it
    assert stores <= drafting and len(plain) >= 2 * drafting


def test_kept_features_equal_stored_ones_step_by_step():
    """The features kept across stretches are the drafter's exact context: a plain engine keeping them (decode steps
    of 8, stored by the next body) and one storing them every step (decode steps of 1) draft the same ratios."""
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=8, seed=5)  # the random head reads the drafter's context
    prompts = engine_prompts([6, 4], seed=19)
    ratios = {}
    for steps in (8, 1):
        eng = Engine(target, drafter, length_policy="cost", round_cost=PROBED, max_slots=2, max_len=96, token_budget=64,
                     cuda_graphs=True, decode_steps=steps, prompt_ngrams=0)
        seen = _record_ratios(eng)
        outs = eng.generate(prompts, max_new_tokens=40)
        assert [o.token_ids for o in outs] == [plain_greedy_ids(target, p, 40) for p in prompts]
        ratios[steps] = (seen, [o.verify_lengths for o in outs])
    (kept, lens), (stored, stored_lens) = ratios[8], ratios[1]
    assert lens == stored_lens and len(kept) == len(stored) > 2
    for a, b in zip(kept, stored):
        assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, atol=1e-5))


def test_kept_features_survive_a_request_ending(monkeypatch):
    """A request that ends inside plain stretches leaves the others' kept features in place (their rows close up on
    the device, no context-only drafter store), and when drafting resumes the survivor's drafter sees exactly the
    context that storing every step gives it: the same ratios as an engine of one-step reads."""
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=8, seed=5)  # the random head reads the drafter's context
    prompts, max_new = engine_prompts([6, 4], seed=19), (12, 40)
    stores, ratios = [], {}
    _spy(monkeypatch, PlainDecoder, "_store_pending_context", stores,
         lambda self, running: (self, sum(r.pending_ctx is not None for r in running)))
    for steps in (8, 1):
        eng = Engine(target, drafter, length_policy="cost", round_cost=RoundCost.flat(spec_overhead=1e9), max_slots=2,
                     max_len=96, token_budget=128, cuda_graphs=True, decode_steps=steps, prompt_ngrams=0)
        handles = [eng.submit(p, n) for p, n in zip(prompts, max_new)]
        while len(handles[1].token_ids) < 25:  # plain only (drafting never pays); the first request ends at 12
            eng.step()
        assert eng.num_running == 1 and len(handles[1].token_ids) == 25
        eng.round_cost = RoundCost.flat()  # now drafting pays: the survivor's kept features are stored, then drafts
        seen = _record_ratios(eng)
        eng.run_until_idle()
        assert [h.result().token_ids for h in handles] == [plain_greedy_ids(target, p, n) for p, n in zip(prompts, max_new)]
        ratios[steps] = [r for r in seen if r is not None]
        if steps == 8:
            # the prefill round's features, stored by the first stretch; nothing when a row ended
            assert [n for decoder, n in stores if decoder is eng.plain and n] == [2]
    assert len(ratios[8]) == len(ratios[1]) >= 1  # the first drafting round reads its ratios (then whole blocks)
    for a, b in zip(ratios[8], ratios[1]):
        assert torch.allclose(a, b, atol=1e-5)
