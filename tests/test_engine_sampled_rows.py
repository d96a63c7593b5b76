"""The engine's sampled round, batched across requests (`adaflash_hf.engine.sampled_rows`): one processing pass,
one draw and one acceptance call for every sampled row, whatever the mix of sampling parameters.

- the per-row warpers equal transformers' (temperature, then top-k, then top-p) request by request, and the
  position-keyed rows of a batch equal each seeded request's own;
- a mixed batch (greedy + sampled requests of different temperature / top-k / top-p, seeded and not) keeps each
  request's exact target distribution (the joint of its first two tokens, the second through speculative
  sampling), and fails the same check under two wrong samplers (negative controls);
- a distribution that is not finite, at a prefill, verify or draft row of one request, fails that request only.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
)  # fmt: skip

from adaflash_hf.engine import Engine, layout_args
from adaflash_hf.engine import sampling
from adaflash_hf.engine.lifecycle import NON_FINITE
from adaflash_hf.engine.sampling import RowSampling, SamplingParams, position_keyed_samples
from adaflash_hf.speculation import verify as verify_mod
from adaflash_hf.speculation.acceptance import AcceptResult

from generation_helpers import FlatDrafter, engine_prompts, make_drafter, make_target, plain_greedy_ids, wrap_round_forward


def _warped(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """transformers' warpers, in generate's order, then softmax: the reference for one request's rows."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.top_k is not None:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p is not None:
        warpers.append(TopPLogitsWarper(params.top_p))
    return warpers(None, logits.float()).softmax(dim=-1)


# ---------------------------------------------------------------- the per-row warpers
ROW_CASES = [  # name, each request's (params, rows)
    ("temperatures", [(SamplingParams(0.3), 2), (SamplingParams(1.7), 3), (SamplingParams(1.0), 1)]),
    ("top_k_some_rows", [(SamplingParams(0.8, top_k=3), 2), (SamplingParams(1.2), 2), (SamplingParams(0.5, top_k=17), 1)]),
    ("top_p_some_rows", [(SamplingParams(1.0, top_p=0.5), 3), (SamplingParams(0.9), 1), (SamplingParams(1.3, top_p=0.95), 2)]),
    ("everything", [(SamplingParams(0.7, top_k=5, top_p=0.8, seed=3), 2), (SamplingParams(1.1, top_k=64, seed=-9), 3),
                    (SamplingParams(0.6, top_p=0.7), 2), (SamplingParams(1.0, top_k=1), 1), (SamplingParams(0.9, seed=2**80), 4)]),
    ("top_k_above_vocab", [(SamplingParams(1.0, top_k=500, top_p=1.0), 2), (SamplingParams(0.4, top_k=2), 1)]),
]  # fmt: skip


@pytest.mark.parametrize("name,requests", ROW_CASES, ids=[c[0] for c in ROW_CASES])
def test_row_sampling_equals_each_request_alone(name, requests, monkeypatch):
    params, counts = [p for p, _ in requests], [c for _, c in requests]
    starts = [7 * i for i in range(len(requests))]
    logits = 3 * torch.randn(sum(counts), 64, generator=torch.Generator().manual_seed(len(name)))
    rows = RowSampling.build(params, counts, starts, 64, "cpu")
    probs = rows.probs(logits)
    sampled = rows.sampling_rows(probs)
    monkeypatch.setattr(sampling, "_KEYED_ELEMENTS", 2 * 64)  # keyed samples and top-p two rows at a time: the same
    assert torch.equal(rows.sampling_rows(probs), sampled)
    assert torch.equal(rows.probs(logits), probs)
    at = 0
    for p, c, start in zip(params, counts, starts):
        assert torch.allclose(probs[at : at + c], _warped(logits[at : at + c], p), rtol=0, atol=1e-6), p
        alone = position_keyed_samples(probs[at : at + c], p.seed, start) if p.seed is not None else probs[at : at + c]
        assert torch.equal(sampled[at : at + c], alone), p
        at += c


# ---------------------------------------------------------------- a mixed batch keeps each request's distribution
GROUPS = [SamplingParams(1.0, top_k=3), SamplingParams(0.7, top_k=4, top_p=0.8), SamplingParams(1.5, top_k=5, top_p=0.95),
          SamplingParams()]  # fmt: skip
PER_GROUP = 700
SV, PROMPT = 12, [3, 7, 1, 5]  # a tiny vocabulary: each group's joint has at most 25 cells


def _exact_joint(target, prompt: list[int], params: SamplingParams) -> dict[tuple[int, int], float]:
    """P(first two generated tokens) under ``params``, by plain forward passes."""
    with torch.no_grad():
        p1 = _warped(target(torch.tensor([prompt])).logits[0, -1:], params)[0].double()
        joint = {}
        for t in p1.nonzero().flatten().tolist():
            p2 = _warped(target(torch.tensor([prompt + [t]])).logits[0, -1:], params)[0].double()
            joint.update({(t, u): (p1[t] * p2[u]).item() for u in p2.nonzero().flatten().tolist()})
    return joint


def _tv_and_bound(samples: list[tuple[int, int]], exact: dict, delta: float = 1e-3) -> tuple[float, float]:
    """Total variation of the empirical joint from the exact one, and the bound it stays under with probability
    1 - delta (E[TV] <= 1/2 sum sqrt(p(1-p)/N); McDiarmid for the deviation), as in test_generation_paths."""
    n = len(samples)
    emp: dict = {}
    for s in samples:
        emp[s] = emp.get(s, 0) + 1 / n
    tv = 0.5 * sum(abs(emp.get(c, 0.0) - exact.get(c, 0.0)) for c in set(emp) | set(exact))
    bound = 0.5 * sum(math.sqrt(p * (1 - p) / n) for p in exact.values()) + math.sqrt(math.log(1 / delta) / (2 * n))
    return tv, bound


def _accept_every_draft(draft_tokens, draft_probs, target_probs, draft_len=None, generator=None):
    keep = draft_len if draft_len is not None else torch.full((draft_tokens.shape[0],), draft_tokens.shape[1])
    nxt = torch.multinomial(target_probs[torch.arange(draft_tokens.shape[0]), keep], 1, generator=generator).squeeze(1)
    return AcceptResult(num_accepted=keep.clone(), next_tokens=nxt)


@pytest.fixture(scope="module")
def mixed_setup():
    """A target over 12 tokens (far from degenerate), the exact joints, and a drafter proposing a flattened average of
    the groups' second-token marginals (accepted often, not always)."""
    target = make_target("qwen3", seed=5, vocab=SV, layers=2, initializer_range=0.3)
    exact = [_exact_joint(target, PROMPT, p) for p in GROUPS[:-1]]
    second = torch.zeros(SV, dtype=torch.float64)
    for joint in exact:
        for (_, u), p in joint.items():
            second[u] += p / len(exact)
    torch.manual_seed(1)
    drafter = FlatDrafter.from_target(target, num_layers=1, block_size=4, mask_token_id=SV - 1).eval()
    drafter.q_logits = 0.5 * torch.log(second.float() + 1e-2)
    return target, drafter, exact, plain_greedy_ids(target, PROMPT, 3)


@pytest.mark.parametrize("sampler", ["batched", "accept_every_draft", "first_request_params_for_all"])
def test_mixed_batch_keeps_each_request_distribution(mixed_setup, sampler, monkeypatch):
    target, drafter, exact, greedy = mixed_setup
    if sampler == "accept_every_draft":
        monkeypatch.setattr(verify_mod, "speculative_accept", _accept_every_draft)
    elif sampler == "first_request_params_for_all":  # a batching bug: every row processed with one request's params
        real = RowSampling.build.__func__
        monkeypatch.setattr(RowSampling, "build", classmethod(lambda cls, params, *a, **k: real(cls, params[:1] * len(params), *a, **k)))
    torch.manual_seed(5)
    engine = Engine(target, drafter, length_policy="fixed", max_slots=64, max_len=16, token_budget=256)
    handles = []
    for i in range(PER_GROUP * len(GROUPS)):  # interleaved: every round mixes every group, seeded and not
        g = GROUPS[i % len(GROUPS)]
        params = SamplingParams(g.temperature, g.top_k, g.top_p, seed=1000 + i if i % 8 < 4 and not g.greedy else None)
        handles.append((i % len(GROUPS), engine.submit(PROMPT, 3, params)))
    engine.run_until_idle()
    outs = [(g, h.result()) for g, h in handles]
    assert all(o.finish_reason == "length" and o.verify_lengths[0] == 2 for _, o in outs)  # token 2 was verified
    assert all(o.token_ids == greedy for g, o in outs if GROUPS[g].greedy)
    checks = [_tv_and_bound([tuple(o.token_ids[:2]) for g, o in outs if g == k], exact[k]) for k in range(len(exact))]
    ok = [tv <= bound for tv, bound in checks]
    if sampler == "batched":
        assert all(ok), checks
        first_round = [o.accepted[0] for g, o in outs if not GROUPS[g].greedy]
        assert 0.1 * len(first_round) < sum(a > 0 for a in first_round) < 0.9 * len(first_round)  # both branches ran
    else:
        assert not all(ok), checks


# ---------------------------------------------------------------- a non-finite row fails its request only
HUGE = 3e38  # finite logits whose division by a temperature < 1 overflows: the processed distribution is NaN


class PoisonedEngine(Engine):
    """One phase's rows (``prefill``, ``verify`` or ``draft``) of request ``victim`` get finite logits that overflow
    once processed, the first time that phase comes for it."""

    victim: int | None = None
    phase: str | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        wrap_round_forward(self, self._poisoned_forward)

    def _poisoned_forward(self, forward, segs, layout, num_prefill, verify_inputs, **kw):
        logits, hidden = forward(segs, layout, num_prefill, verify_inputs, **kw)
        slot = next((r.slot for r in self._running if r.id == self.victim), None)
        start = 0
        for j, (s, toks) in enumerate(segs):
            n = 1 if j < num_prefill else len(toks)  # one logits row per prefill, one per verified token
            if s == slot and self.phase == ("prefill" if j < num_prefill else "verify"):
                logits, self.phase = logits.clone(), None
                logits[start : start + n] = HUGE
            start += n
        return logits, hidden

    def _propose(self, running):
        tokens, finite, logits, offsets, ratio, draft_len = super()._propose(running)
        i = next((i for i, r in enumerate(running) if r.id == self.victim), None)
        if self.phase == "draft" and logits is not None and i is not None and offsets[i + 1] > offsets[i]:
            logits[offsets[i] : offsets[i + 1]] = HUGE
            self.phase = None
        return tokens, finite, logits, offsets, ratio, draft_len


OTHERS = [SamplingParams(), SamplingParams(0.9, top_k=20, seed=11), SamplingParams(1.3, top_p=0.9, seed=12),
          SamplingParams(0.8), SamplingParams()]  # fmt: skip


@pytest.mark.parametrize("phase,seeded,mode", [
    ("prefill", False, "packed"), ("prefill", True, "fixed"), ("verify", True, "packed"), ("verify", False, "rectangular"),
    ("draft", False, "packed"), ("draft", True, "fixed"),
])  # fmt: skip
def test_non_finite_row_fails_only_its_request(phase, seeded, mode):
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=6)
    prompts = engine_prompts([5, 7, 4, 6, 3, 5], seed=19)

    def engine():
        return PoisonedEngine(target, **layout_args(drafter, mode), max_slots=6, max_len=40, token_budget=64)

    alone = {}
    for i, p in enumerate(OTHERS):
        if p.seed is not None:
            e = engine()
            alone[i] = e.submit(prompts[i + 1], 10, p).result().token_ids
    e = engine()
    bad = e.submit(prompts[0], 10, SamplingParams(0.5, top_k=30, seed=7 if seeded else None))
    e.victim, e.phase = bad.request_id, phase
    others = [e.submit(prompts[i + 1], 10, p) for i, p in enumerate(OTHERS)]
    e.run_until_idle()
    assert e.phase is None  # the poison was given
    assert bad.result().finish_reason == "error" and bad.result().error == NON_FINITE
    for i, (p, h) in enumerate(zip(OTHERS, others)):
        out = h.result()
        assert out.finish_reason == "length" and len(out.token_ids) == 10
        if p.greedy:
            assert out.token_ids == plain_greedy_ids(target, prompts[i + 1], 10)
        elif p.seed is not None:
            assert out.token_ids == alone[i]  # seeded: the same text as alone
    assert e.healthy and e.idle and e.cache.num_free == 6
