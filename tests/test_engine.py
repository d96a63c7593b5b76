"""CPU tests of the continuous-batching engine (issue 6): packed attention, slotted caches,
verification, admission, cancellation, losslessness in every verify mode, a soak test."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import DynamicCache

from adaflash_hf.engine import Engine, RequestRejected, layout_args
from adaflash_hf.engine.drafter import draft_blocks, make_drafter_cache
from adaflash_hf.engine.kv_cache import SlotKVCache
from adaflash_hf.engine.target import PackedLayout, make_target_cache, target_forward
from adaflash_hf.speculation import verify as verify_mod
from adaflash_hf.speculation.acceptance import greedy_accept

from generation_helpers import engine_prompts, force_length_head, make_drafter, make_target, plain_greedy_ids

MODES = ("packed", "rectangular", "fixed", "off")


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def pair(request):
    target = make_target(request.param)
    return target, make_drafter(target, block_size=8)


class OracleEngine(Engine):
    """The real drafter runs (caches, shapes), then its drafts are replaced by the known greedy
    continuation with a random number of correct slots, so rounds accept 0..B-1 drafts."""

    def __init__(self, *args, refs: dict, seed: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.refs, self.rng = refs, random.Random(seed)

    def _propose(self, running):
        tokens, finite, logits, offsets, ratio, draft_len = super()._propose(running)
        B = self.block_size
        for i, r in enumerate(running):
            ref = self.refs[tuple(r.prompt)]
            cont = ref[len(r.tokens): len(r.tokens) + B - 1]
            cont = cont + [0] * (B - 1 - len(cont))
            good = self.rng.randint(0, B - 1)
            tokens[i] = torch.tensor([t if j < good else (t + 1) % 126 for j, t in enumerate(cont)])
            if self.layout != "fixed":
                draft_len[i] = min(self.rng.randint(0, B - 1), r.remaining - 1)
        return tokens, finite, logits, offsets, ratio, draft_len


# ---------------------------------------------------------------- the slotted cache
def test_slot_cache_alloc_free_rollback():
    c = SlotKVCache(2, 3, 8, kv_heads=1, head_dim=4)
    slots = [c.alloc() for _ in range(3)]
    assert slots == [0, 1, 2] and c.num_free == 0
    with pytest.raises(RuntimeError, match="no free KV slot"):
        c.alloc()
    c.advance(1, 5)
    c.rollback(1, 3)
    assert c.length(1) == 3
    with pytest.raises(ValueError):
        c.advance(1, 6)
    c.free(1)
    assert c.num_free == 1 and c.length(1) == 0 and c.alloc() == 1


# ---------------------------------------------------------------- packed target forward
def test_packed_forward_matches_hf(pair):
    """Prefill of ragged prompts in one packed forward, then ragged verify chunks on top of the
    cache: logits and selected hidden states equal the HF forward with a DynamicCache, per request."""
    target, drafter = pair
    layers = list(drafter.config.target_layer_ids) + [target.config.num_hidden_layers - 1]
    prompts = engine_prompts([5, 1, 9, 3], seed=1)
    chunks = engine_prompts([3, 1, 6, 2], seed=2)
    cache = make_target_cache(target, 6, 32)
    slots = [cache.alloc() for _ in prompts]
    cache.alloc()  # a slot in use by nobody in this batch: must not be touched or read
    results = []
    for seqs in (prompts, chunks):
        lay = PackedLayout.from_cache(cache, slots, [len(s) for s in seqs])
        toks = torch.tensor([t for s in seqs for t in s])
        logits, hidden = target_forward(target, cache, toks, lay.token_slots(), lay.positions(), lay, layers)
        for s, q in zip(slots, lay.q_lens):
            cache.advance(s, q)
        results.append((lay, logits, hidden))
    H = target.config.hidden_size
    for i, (p, c) in enumerate(zip(prompts, chunks)):
        dc = DynamicCache(config=target.config)
        ref = [target(torch.tensor([p]), past_key_values=dc, use_cache=True, output_hidden_states=True)]
        ref.append(target(torch.tensor([c]), past_key_values=dc, use_cache=True, output_hidden_states=True))
        for (lay, logits, hidden), out in zip(results, ref):
            o = lay.offsets
            torch.testing.assert_close(logits[o[i]: o[i + 1]], out.logits[0].float(), atol=1e-5, rtol=1e-5)
            for j, li in enumerate(layers):
                torch.testing.assert_close(hidden[o[i]: o[i + 1], j * H:(j + 1) * H], out.hidden_states[li + 1][0], atol=1e-5, rtol=1e-5)


def test_packed_verification_equals_per_request(pair):
    """Greedy verification of ragged draft blocks in one packed forward == per-request HF verification."""
    target, _ = pair
    prompts = engine_prompts([4, 8, 2, 6, 3], seed=3)
    refs = [plain_greedy_ids(target, p, 8) for p in prompts]
    rng = random.Random(0)
    cache = make_target_cache(target, 5, 40)
    slots = [cache.alloc() for _ in prompts]
    lay = PackedLayout.from_cache(cache, slots, [len(p) for p in prompts])
    target_forward(target, cache, torch.tensor(sum(prompts, [])), lay.token_slots(), lay.positions(), lay)
    for s, p in zip(slots, prompts):
        cache.advance(s, len(p))
    blocks, kmax = [], 6
    for ref in refs:  # bonus = the first greedy token; drafts right for a random prefix, then wrong
        good, k = rng.randint(0, kmax), rng.randint(0, kmax)
        drafts = [t if j < good else (t + 3) % 126 for j, t in enumerate(ref[1: 1 + k])]
        blocks.append([ref[0]] + drafts)
    lay = PackedLayout.from_cache(cache, slots, [len(b) for b in blocks])
    logits, _ = target_forward(target, cache, torch.tensor(sum(blocks, [])), lay.token_slots(), lay.positions(), lay)
    draft = torch.zeros(len(blocks), kmax, dtype=torch.long)
    vlog = torch.zeros(len(blocks), kmax + 1, logits.shape[-1])
    o = lay.offsets
    for i, b in enumerate(blocks):
        draft[i, : len(b) - 1] = torch.tensor(b[1:], dtype=torch.long)
        vlog[i, : len(b)] = logits[o[i]: o[i + 1]]
    packed = greedy_accept(draft, vlog, torch.tensor([len(b) - 1 for b in blocks]))
    for i, (p, b) in enumerate(zip(prompts, blocks)):
        ref_logits = target(torch.tensor([p + b])).logits[:, len(p):].float()
        single = greedy_accept(torch.tensor([b[1:]], dtype=torch.long), ref_logits)
        assert int(packed.num_accepted[i]) == int(single.num_accepted[0])
        assert int(packed.next_tokens[i]) == int(single.next_tokens[0])
        assert refs[i][1: 1 + int(single.num_accepted[0]) + 1] == b[1: 1 + int(single.num_accepted[0])] + [int(single.next_tokens[0])]


# ---------------------------------------------------------------- drafter slot cache
def test_drafter_slot_cache_matches_full_context_forward(pair):
    """Two rounds through the per-slot drafter cache (ragged contexts, padded batch) == one drafter
    forward over each row's full context without a cache."""
    target, drafter = pair
    KH = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    B = drafter.config.block_size
    g = torch.Generator().manual_seed(0)
    ctx1 = [torch.randn(n, KH, generator=g) for n in (5, 2, 7)]
    ctx2 = [torch.randn(n, KH, generator=g) for n in (1, 3, 2)]
    bonus1, bonus2 = torch.tensor([3, 4, 5]), torch.tensor([6, 7, 8])
    cache = make_drafter_cache(drafter, 4, 32)
    cache.alloc()  # an unrelated slot
    slots = [cache.alloc() for _ in range(3)]
    draft_blocks(drafter, cache, slots, bonus1, ctx1)
    got = draft_blocks(drafter, cache, slots, bonus2, ctx2)
    assert [cache.length(s) for s in slots] == [6, 5, 9]
    mask = drafter.config.mask_token_id
    for i in range(3):
        full = torch.cat([ctx1[i], ctx2[i]])[None]
        T = full.shape[1]
        ids = torch.tensor([[int(bonus2[i])] + [mask] * (B - 1)])
        with torch.no_grad():
            ref = drafter(noise_embeds=drafter.embed(ids), context_hidden_states=full,
                          position_ids=torch.arange(T + B)[None]).last_hidden_state
        torch.testing.assert_close(got[i], ref[0], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- losslessness
RAGGED = [1, 4, 9, 2, 13, 6, 3, 7]
MAX_NEW = [12, 5, 1, 9, 12, 7, 3, 10]


@pytest.mark.parametrize("mode,policy", [(m, "cost") for m in MODES] + [("packed", "adaptive"), ("rectangular", "adaptive")])
def test_modes_greedy_identical_real_drafter(pair, mode, policy):
    """The real (random) drafter and length head: every mode, under either length-head rule, equals plain greedy."""
    target, drafter = pair
    prompts = engine_prompts(RAGGED, seed=4)
    engine = Engine(target, **layout_args(drafter, mode, policy), max_slots=3, max_len=32, token_budget=40)
    handles = [engine.submit(p, n) for p, n in zip(prompts, MAX_NEW)]
    engine.run_until_idle()
    for h, p, n in zip(handles, prompts, MAX_NEW):
        assert h.result().token_ids == plain_greedy_ids(target, p, n)
    assert engine.cache.num_free == 3 and engine.idle


@pytest.mark.parametrize("mode", MODES)
def test_modes_greedy_identical_with_acceptance(pair, mode):
    """Drafts that are often right (oracle) so rounds accept 0..B-1 tokens; outputs still exact."""
    target, drafter = pair
    prompts = engine_prompts(RAGGED, seed=5)
    refs = {tuple(p): plain_greedy_ids(target, p, 16) for p in prompts}
    infos = []
    engine = OracleEngine(target, **layout_args(drafter, mode), max_slots=4, max_len=40, token_budget=48, refs=refs, seed=1,
                          step_hook=infos.append)
    outs = engine.generate(prompts, max_new_tokens=14)
    verify_only = [i for i in infos if i.num_prefill == 0]
    if mode == "off":
        assert all(i.num_tokens == i.num_verify for i in verify_only)
    if mode == "rectangular":  # every request padded to the round's longest verify
        assert all(i.num_tokens % i.num_verify == 0 for i in verify_only)
    if mode == "packed":  # ragged: some round is not a multiple of its request count
        assert any(i.num_tokens % i.num_verify for i in verify_only)
    for o, p in zip(outs, prompts):
        assert o.token_ids == refs[tuple(p)][:14]
        # rounds count emitted tokens (the prefill's first + accepted + 1 each), also when max_new_tokens cuts a block
        assert 1 + sum(a + 1 for a in o.accepted) == len(o.token_ids)
    if mode != "off":
        assert max(o.tau for o in outs) > 1.5  # acceptance actually happened
        assert all(o.rounds == len(o.verify_lengths) for o in outs)


def test_eos_stops_like_plain_generate(pair):
    target, drafter = pair
    prompt = engine_prompts([6], seed=6)[0]
    ref = plain_greedy_ids(target, prompt, 12)
    eos = ref[4]
    expected = ref[: ref.index(eos) + 1]
    engine = OracleEngine(target, drafter, length_policy="adaptive", max_slots=2, max_len=32, token_budget=32,
                          refs={tuple(prompt): ref + [0] * 8})
    out = engine.generate([prompt], max_new_tokens=12, eos_token_id=eos)[0]
    assert out.token_ids == expected and out.finish_reason == "eos"
    assert 1 + sum(a + 1 for a in out.accepted) == len(out.token_ids)  # the round that hit EOS counts what it emitted


# ---------------------------------------------------------------- admission, rejection, cancellation
def test_admission_ema_tracks_fit():
    from adaflash_hf.engine.admission import AdmissionController

    a = AdmissionController(num_slots=16, max_len=64, token_budget=64, tokens_per_request=1.0, beta=0.5)
    assert a.limit == 16  # one token each: the slots bind
    for _ in range(20):
        a.observe(tokens_per_request=8.0, kv_per_request=32)
    assert a.limit == 8  # 8-token verifies: the budget binds, reached smoothly
    a.observe(tokens_per_request=1.0, kv_per_request=32)
    assert 8 < a.n_hat < 16  # EMA, not a jump


@pytest.mark.parametrize("mode", ["fixed", "packed", "rectangular"])
def test_admission_never_exceeds_budget_or_slots(pair, mode):
    target, drafter = pair
    force_length_head(drafter, ratio_high=True)  # long verify blocks: the budget must squeeze them
    try:
        seen = []

        def hook(info):
            assert info.num_tokens <= info.token_budget
            assert info.slots_in_use <= info.num_slots
            seen.append(info)

        prompts = engine_prompts([3, 9, 5, 12, 2, 7, 4, 11, 6, 1], seed=7)
        engine = Engine(target, **layout_args(drafter, mode), max_slots=5, max_len=32, token_budget=20, step_hook=hook)
        outs = engine.generate(prompts, max_new_tokens=8)
        for o, p in zip(outs, prompts):
            assert o.token_ids == plain_greedy_ids(target, p, 8)
        assert max(i.num_tokens for i in seen) <= 20 and any(i.num_prefill and i.num_verify for i in seen)
        assert engine.cache.num_free == 5
    finally:
        torch.nn.init.zeros_(drafter.length_head.out.bias)


def test_too_long_requests_are_rejected_clearly(pair):
    target, drafter = pair
    engine = Engine(target, drafter, max_slots=2, max_len=16, token_budget=8)
    with pytest.raises(RequestRejected, match=r"can never fit.*max_len \(16\)"):
        engine.submit(list(range(10)), max_new_tokens=7)
    with pytest.raises(RequestRejected, match=r"can never fit.*token budget \(8\)"):
        engine.submit(list(range(9)), max_new_tokens=2)
    with pytest.raises(RequestRejected, match="empty prompt"):
        engine.submit([], max_new_tokens=2)
    with pytest.raises(ValueError, match="unknown length_policy 'bogus'"):
        Engine(target, drafter, length_policy="bogus")
    with pytest.raises(ValueError, match="expected_gain"):
        Engine(target, drafter, length_policy="expected_gain")
    with pytest.raises(ValueError, match="need a drafter"):
        Engine(target, None, length_policy="fixed")
    with pytest.raises(ValueError, match="rectangular=True pads"):
        Engine(target, drafter, length_policy="fixed", rectangular=True)
    assert engine.idle


def test_cancellation_frees_slot(pair):
    target, drafter = pair
    engine = Engine(target, drafter, length_policy="adaptive", max_slots=2, max_len=40, token_budget=32)
    prompts = engine_prompts([4, 5, 6], seed=8)
    streamed = []
    a = engine.submit(prompts[0], 30, on_token=streamed.append)
    b = engine.submit(prompts[1], 10)
    c = engine.submit(prompts[2], 10)  # waits: only two slots
    engine.step()
    engine.step()
    assert engine.num_running == 2 and engine.num_queued == 1
    a.cancel()
    assert a.done and a.result().finish_reason == "cancelled" and engine.cache.num_free == 1
    assert a.result().token_ids == streamed and len(streamed) >= 2
    c.cancel()  # cancelling a queued request
    assert engine.num_queued == 0
    assert b.result().token_ids == plain_greedy_ids(target, prompts[1], 10)
    assert engine.idle and engine.cache.num_free == 2 and engine.dcache.num_free == 2
    assert all(length == 0 for length in engine.cache.lengths + engine.dcache.lengths)


def test_cancel_from_callback_mid_round(pair):
    target, drafter = pair
    engine = Engine(target, drafter, length_policy="fixed", max_slots=2, max_len=40, token_budget=32)
    box = {}

    def cb(tok):
        if len(box["h"].token_ids) == 3:
            box["h"].cancel()

    box["h"] = engine.submit(engine_prompts([4], seed=9)[0], 20, on_token=cb)
    out = box["h"].result()
    assert out.finish_reason == "cancelled" and len(out.token_ids) == 3 and engine.cache.num_free == 2


# ---------------------------------------------------------------- sink
def test_round_sink_receives_verified_rounds(pair):
    target, drafter = pair
    rounds = []

    requests = []

    class Sink:
        def on_round(self, v):
            rounds.append(v)

        def on_request(self, finished):
            requests.append(finished)

    prompts = engine_prompts([3, 6, 5], seed=10)
    engine = Engine(target, drafter, length_policy="adaptive", max_slots=2, max_len=32, token_budget=32, round_sink=Sink())
    handles = [engine.submit(p, 6) for p in prompts]
    handles[2].cancel()  # a cancelled request is not a finished one
    outs = [h.result() for h in handles[:2]]
    assert len(rounds) == sum(o.rounds for o in outs)
    assert sorted(r.row for r in requests) == sorted(o.request_id for o in outs)
    for r in requests:
        o = next(o for o in outs if o.request_id == r.row)
        assert r.prompt_ids.tolist() == o.prompt_ids and r.output_ids.tolist() == o.token_ids
    for v in rounds:
        assert v.target_logits.shape[0] == v.verify_len and v.draft_tokens.shape[0] == v.verify_len - 1
        assert 0 <= v.num_accepted < v.verify_len and v.predicted_ratio is not None


# ---------------------------------------------------------------- sampling
def _token2_marginal(target, prompt, top_k):
    """Exact P(second generated token) under temperature 1 + top-k."""
    from adaflash_hf.engine import SamplingParams
    from adaflash_hf.engine.sampling import processed_probs

    params = SamplingParams(temperature=1.0, top_k=top_k)
    p1 = processed_probs(target(torch.tensor([prompt])).logits[0, -1], params)
    out = torch.zeros_like(p1)
    for t in p1.nonzero().flatten().tolist():
        out += p1[t] * processed_probs(target(torch.tensor([prompt + [t]])).logits[0, -1], params)
    return out


def _sample_token2(target, drafter, prompt, n, monkeypatch=None):
    engine = Engine(target, drafter, length_policy="fixed", max_slots=64, max_len=16, token_budget=256)
    # unseeded: speculative (rejection) sampling, each request seeded from the global RNG (seeded per test)
    outs = engine.generate([prompt] * n, max_new_tokens=3, temperature=1.0, top_k=3)
    assert all(o.verify_lengths[0] == 2 for o in outs)  # token 2 went through speculative acceptance
    return torch.bincount(torch.tensor([o.token_ids[1] for o in outs]), minlength=target.config.vocab_size).float() / n


def test_sampling_follows_target_distribution(monkeypatch):
    target = make_target("qwen3", seed=1)
    drafter = make_drafter(target, block_size=4, seed=1)
    prompt = engine_prompts([5], seed=11)[0]
    with torch.no_grad():
        exact = _token2_marginal(target, prompt, 3)
    n = 1500
    emp = _sample_token2(target, drafter, prompt, n)
    tv = 0.5 * (emp - exact).abs().sum().item()
    assert tv < 0.06, tv
    # Negative control: accepting every draft gives the drafter's distribution, which is far off (its
    # support misses the target's here), so a few hundred samples already land far above the bound.
    from adaflash_hf.speculation.acceptance import AcceptResult

    def accept_all(draft_tokens, draft_probs, target_probs, draft_len=None, generator=None):
        b, k = draft_tokens.shape
        keep = torch.full((b,), k) if draft_len is None else draft_len  # the engine's rows are padded to the longest
        nxt = torch.multinomial(target_probs[torch.arange(b), keep], 1, generator=generator).squeeze(1)
        return AcceptResult(num_accepted=keep.clone(), next_tokens=nxt)

    monkeypatch.setattr(verify_mod, "speculative_accept", accept_all)
    bad = _sample_token2(target, drafter, prompt, 200)
    assert 0.5 * (bad - exact).abs().sum().item() > 0.2


# ---------------------------------------------------------------- soak
@pytest.fixture(scope="module")
def soak_pair():
    target = make_target("qwen3", seed=2)
    drafter = make_drafter(target, block_size=6, seed=2)
    pool = engine_prompts([random.Random(7).randint(1, 14) for _ in range(40)], seed=12)
    return target, drafter, pool, {tuple(p): plain_greedy_ids(target, p, 14) for p in pool}


@pytest.mark.parametrize("mode,n_requests,graphs", [("packed", 2000, False), ("rectangular", 300, False), ("fixed", 300, False),
                                                    ("off", 300, False), ("off", 300, True)])
def test_soak_random_arrivals_and_cancellations(soak_pair, mode, n_requests, graphs):
    """Requests of random lengths arrive between steps, some are cancelled at random: every output
    is a prefix (cancelled) or exactly (finished) its plain greedy decoding; no slot or length leaks.
    ``graphs``: the static bucket path, where ``off`` runs several decode steps per replay when it can."""
    target, drafter, pool, refs = soak_pair
    rng = random.Random(MODES.index(mode))
    seen = []
    eng = OracleEngine(target, **layout_args(drafter, mode), max_slots=12, max_len=32, token_budget=48, refs=refs, seed=3,
                       step_hook=seen.append, cuda_graphs=graphs)
    handles, to_submit = [], n_requests
    while to_submit or not eng.idle:
        for _ in range(min(rng.randint(0, 5), to_submit)):
            p = rng.choice(pool)
            handles.append((eng.submit(p, rng.randint(1, 14)), p))
            to_submit -= 1
        live = [h for h, _ in handles if not h.done]
        if live and rng.random() < 0.3:
            rng.choice(live).cancel()  # queued or running
        eng.step()
        assert eng.num_running <= 12
    counts = {"cancelled": 0, "length": 0}
    for h, p in handles:
        out = h.result()
        ref = refs[tuple(p)]
        counts[out.finish_reason] += 1
        assert out.token_ids == ref[: len(out.token_ids)]
        if out.finish_reason == "length":
            assert len(out.token_ids) == h._req.max_new
    assert counts["cancelled"] > n_requests // 20 and counts["length"] > n_requests // 2
    assert all(i.num_tokens <= i.token_budget and i.slots_in_use <= i.num_slots for i in seen)
    assert eng.cache.num_free == 12 and all(length == 0 for length in eng.cache.lengths)
    if eng.dcache is not None:
        assert eng.dcache.num_free == 12 and all(length == 0 for length in eng.dcache.lengths)
    if graphs and mode == "off":
        assert any(len(b) == 4 for b in eng.graphs.replays)  # several decode steps per replay did happen
