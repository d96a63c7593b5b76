"""CPU tests of the engine's batched drafter step (``DraftGraphs``, ``append_context``), the skipped
drafter forward when nothing can be verified, and the round's device reads / per-request op count.

On CPU ``DraftGraphs`` runs its static, padded forward eagerly with SDPA (what these tests check);
capture / replay and flex are exercised on the GPU by ``examples/engine_gpu_check.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import adaflash_hf.speculation.length.planner as verify_lengths
from adaflash_hf.engine import Engine, SamplingParams, layout_args
from adaflash_hf.engine.drafter import draft_blocks, make_drafter_cache
from adaflash_hf.engine.kernels.attention import BLOCK
from adaflash_hf.engine.drafter import DraftGraphs, append_context
from adaflash_hf.engine.graphs import pick_bucket

from generation_helpers import engine_prompts, force_length_head, make_drafter, make_target, plain_greedy_ids, plain_greedy_once


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def pair(request):
    target = make_target(request.param)
    return target, make_drafter(target, block_size=8)


def _feats(drafter, lens, g):
    KH = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    return [torch.randn(n, KH, generator=g) for n in lens]


# ---------------------------------------------------------------- DraftGraphs == draft_blocks
# (context lengths of round 1, of round 2, slots used, max_rows): ragged, prefill-sized, row / context padding
LAYOUTS = [
    ([5], [1], [0], 4),
    ([5, 2, 7], [1, 3, 2], [1, 2, 3], 4),
    ([30, 1, 12], [8, 8, 1], [3, 0, 2], 8),  # 3 rows padded to a bucket of 4; slots out of order
    ([2] * 5, [4, 1, 6, 2, 3], [0, 1, 2, 3, 4], 8),
]


@pytest.mark.parametrize("lens1,lens2,slots,max_rows", LAYOUTS)
def test_batched_draft_equals_eager_draft(pair, lens1, lens2, slots, max_rows):
    """Two rounds: static padded draft (packed context, [R_b, B] blocks) == the eager padded drafter forward:
    same draft logits / tokens / ratios, same stored context K/V, same slot lengths."""
    target, drafter = pair
    B = drafter.config.block_size
    g = torch.Generator().manual_seed(len(lens1))
    ctx1, ctx2 = _feats(drafter, lens1, g), _feats(drafter, lens2, g)
    bonus1, bonus2 = torch.randint(0, 120, (len(slots),), generator=g), torch.randint(0, 120, (len(slots),), generator=g)
    ref_cache = make_drafter_cache(drafter, 8, 64)
    st_cache = make_drafter_cache(drafter, 8, 64, spare_slots=1, len_multiple=BLOCK)
    for s in sorted(slots):
        ref_cache.alloc(s), st_cache.alloc(s)
    runner = DraftGraphs(drafter, st_cache, max_rows=max_rows, max_ctx=64)
    for ctx, bonus in ((ctx1, bonus1), (ctx2, bonus2)):
        hidden = draft_blocks(drafter, ref_cache, slots, bonus, ctx)
        with torch.no_grad():
            ref_logits = drafter.compute_logits(hidden[:, 1:]).float()
            ref_ratio = drafter.predict_accept_ratio(hidden).float()
        out = runner.run(slots, ctx, bonus.tolist())  # every block's B - 1 draft positions, packed in request order
        assert out.offsets == [i * (B - 1) for i in range(len(slots) + 1)]
        torch.testing.assert_close(out.logits.float().view(ref_logits.shape), ref_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.ratio, ref_ratio, atol=1e-5, rtol=1e-5)
        assert torch.equal(out.tokens.view(len(slots), B - 1), ref_logits.argmax(-1)) and bool(out.finite.all())
        counts = [(3 * i) % B for i in range(len(slots))]  # ragged (a zero among them): the packed head, same rows
        if sum(counts):
            part = runner.run_head(counts)
            want = torch.cat([ref_logits[i, :c] for i, c in enumerate(counts)])
            torch.testing.assert_close(part.logits.float(), want, atol=1e-5, rtol=1e-5)
            assert torch.equal(part.tokens, want.argmax(-1)) and part.offsets[-1] == sum(counts)
    assert [st_cache.length(s) for s in slots] == [ref_cache.length(s) for s in slots] == [a + b for a, b in zip(lens1, lens2)]
    for s in slots:  # the stored context (not the block past it) is the same
        n = st_cache.length(s)
        for layer in range(drafter.config.num_hidden_layers):
            torch.testing.assert_close(st_cache.read(layer, s, n)[0], ref_cache.read(layer, s, n)[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(st_cache.read(layer, s, n)[1], ref_cache.read(layer, s, n)[1], atol=1e-5, rtol=1e-5)
    rows = 1 << (len(slots) - 1).bit_length()  # the request-count bucket (powers of two)
    assert {k[2] for k in runner.replays if k[0] == "body"} == {rows}
    assert ("head", pick_bucket(runner.pos_buckets, len(slots) * (B - 1))) in runner.replays


def test_batched_draft_padding_never_leaks(pair):
    """NaN in the spare row, the static inputs' padding and the outputs: real rows are unaffected."""
    target, drafter = pair
    g = torch.Generator().manual_seed(3)
    ctx, bonus = _feats(drafter, [3, 2, 4], g), [5, 6, 7]
    outs = []
    for poison in (False, True):
        cache = make_drafter_cache(drafter, 4, 32, spare_slots=1, len_multiple=BLOCK)
        slots = [cache.alloc() for _ in range(3)]
        runner = DraftGraphs(drafter, cache, max_rows=4, max_ctx=16)
        if poison:
            cache.k[:, cache.num_slots] = float("nan")
            cache.v[:, cache.num_slots] = float("nan")
            runner.feats.fill_(float("nan"))
            runner.logits.fill_(float("nan"))
        out = runner.run(slots, ctx, bonus)
        outs.append((out.logits.clone(), out.ratio.clone(), out.tokens.clone()))
        assert runner.padded_tokens > 0  # 9 context tokens -> bucket 10, 3 rows -> 4
    for a, b in zip(*outs):
        assert torch.isfinite(a.float()).all() and torch.equal(a, b)


@pytest.mark.parametrize("static", [False, True])
def test_context_only_update_then_draft_equals_drafting_every_round(pair, static):
    """Round 1 stores context only (a skipped draft); round 2 drafts. Same drafts and cache as drafting in both rounds."""
    target, drafter = pair
    g = torch.Generator().manual_seed(7)
    ctx1, ctx2 = _feats(drafter, [4, 1, 6], g), _feats(drafter, [2, 3, 1], g)
    bonus = torch.tensor([9, 10, 11])
    ref_cache = make_drafter_cache(drafter, 4, 32)
    slots = [ref_cache.alloc() for _ in range(3)]
    draft_blocks(drafter, ref_cache, slots, bonus, ctx1)
    ref = drafter.compute_logits(draft_blocks(drafter, ref_cache, slots, bonus, ctx2)[:, 1:]).float()
    if static:
        cache = make_drafter_cache(drafter, 4, 32, spare_slots=1, len_multiple=BLOCK)
        [cache.alloc() for _ in range(3)]
        runner = DraftGraphs(drafter, cache, max_rows=4, max_ctx=16)
        assert runner.run(slots, ctx1, None) is None  # context only: bucket (C_b, 0)
        got = runner.run(slots, ctx2, bonus.tolist()).logits.float().view(ref.shape)  # full blocks, packed
        assert ("body", 12, 0) in runner.replays  # 4 + 1 + 6 = 11 context tokens -> bucket 12, no block rows
    else:
        cache = make_drafter_cache(drafter, 4, 32)
        [cache.alloc() for _ in range(3)]
        append_context(drafter, cache, slots, ctx1)
        assert [cache.length(s) for s in slots] == [4, 1, 6]
        got = drafter.compute_logits(draft_blocks(drafter, cache, slots, bonus, ctx2)[:, 1:]).float()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert [cache.length(s) for s in slots] == [ref_cache.length(s) for s in slots] == [6, 4, 7]


# ---------------------------------------------------------------- skipping the drafter when nothing can be verified
# (length_rate, halving_batch, requests, cuda_graphs, head predicts a high ratio, what the drafter does after prefill)
SKIP_CASES = [
    (0.125, 64, 3, False, True, "context only"),  # B * rate = 1: every k_hat is 1 whatever the head says
    (0.125, 64, 3, True, True, "context only"),
    (0.15, 2, 4, True, True, "context only"),  # load-scaled: rate floor 0.15 -> floor(8 * 0.15) = 1
    (1.0, 64, 3, True, False, "no head"),  # the head predicts ~0: k_hat = 1, the body runs, the LM head does not
    (1.0, 64, 3, False, False, "no head"),
    (1.0, 64, 1, True, True, "drafts"),
    (1.0, 64, 3, False, True, "drafts"),
]


@pytest.mark.parametrize("rate,halving,requests,graphs,high,expect", SKIP_CASES)
def test_packed_drafts_nothing_when_every_k_hat_is_one(rate, halving, requests, graphs, high, expect):
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=8)
    force_length_head(drafter, ratio_high=high)
    prompts = engine_prompts([3, 7, 5, 4][:requests], seed=11)
    engine = Engine(target, drafter, length_policy="adaptive", max_slots=4, max_len=32, token_budget=40,
                    length_rate=rate, length_min=1, halving_batch=halving, cuda_graphs=graphs)
    outs = engine.generate(prompts, max_new_tokens=6)
    assert [o.token_ids for o in outs] == [plain_greedy_ids(target, p, 6) for p in prompts]  # lossless
    rounds = max(o.rounds for o in outs)
    longest = max(v for o in outs for v in o.verify_lengths)
    if expect == "drafts":
        assert longest > 1 and engine.skipped_drafts <= 1  # only the last round (one token left) drafts nothing
    else:
        assert longest == 1 and engine.skipped_drafts == rounds
    if graphs:
        bodies = [k for k in engine.draft_graphs.replays if k[0] == "body"]
        heads = [k for k in engine.draft_graphs.replays if k[0] == "head"]
        if expect == "context only":  # the drafter layers never ran: context K/V only
            assert bodies and all(k[2] == 0 for k in bodies) and not heads
        elif expect == "no head":  # the layers + length head ran, the LM head never did
            assert any(k[2] > 0 for k in bodies) and not heads
        else:
            assert heads
    assert engine.dcache.num_free == 4 and all(engine.dcache.length(s) == 0 for s in range(4))


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("mode", ["packed", "rectangular"])
def test_lm_head_runs_on_the_verified_positions_only(graphs, mode, monkeypatch):
    """k_hat = floor(a * B * rate) = 3: the drafter's LM head runs on each request's own 2 draft positions (fewer
    when a request has fewer tokens left), packed, never the full block (7); the rectangular layout, which
    verifies the longest draft everywhere, runs it on that width for every request."""
    import adaflash_hf.engine.drafter as drafter_mod
    import adaflash_hf.engine.engine as engine_mod

    calls = []

    def recording(counts, block_size, real=drafter_mod.head_index):
        calls.append(list(counts))
        return real(counts, block_size)

    monkeypatch.setattr(drafter_mod, "head_index", recording)
    monkeypatch.setattr(engine_mod, "head_index", recording)
    target = make_target("llama")
    drafter = make_drafter(target, block_size=8)
    force_length_head(drafter, ratio_high=True)
    engine = Engine(target, drafter, length_policy="adaptive", max_slots=2, max_len=32, token_budget=32, length_rate=0.375,
                    cuda_graphs=graphs, rectangular=mode == "rectangular")
    prompts = engine_prompts([5, 6], seed=3)
    outs = [h.result() for h in [engine.submit(p, n) for p, n in zip(prompts, [7, 4])]]
    assert [o.token_ids for o in outs] == [plain_greedy_ids(target, p, n) for p, n in zip(prompts, [7, 4])]
    assert calls and max(max(c) for c in calls) == 2
    if mode == "packed":
        assert any(c[0] != c[-1] for c in calls if len(c) == 2)  # the request near its end drafts fewer
        assert sum(map(sum, calls)) == sum(v - 1 for o in outs for v in o.verify_lengths)
    else:
        assert all(len(set(c)) == 1 for c in calls)


def test_sink_attached_never_skips_the_drafter_layers(pair):
    target, drafter = pair
    rounds = []

    class Sink:
        def on_round(self, v):
            rounds.append(v)

    engine = Engine(target, drafter, length_policy="adaptive", max_slots=2, max_len=32, token_budget=32, length_rate=0.125,
                    round_sink=Sink(), cuda_graphs=True)
    engine.generate(engine_prompts([3, 5], seed=2), max_new_tokens=4)
    assert rounds and all(v.predicted_ratio is not None and v.verify_len == 1 for v in rounds)
    assert all(k[2] > 0 for k in engine.draft_graphs.replays if k[0] == "body")


# ---------------------------------------------------------------- device reads and per-request work
class _Ops(TorchDispatchMode):
    VIEWS = {"view", "_unsafe_view", "transpose", "t", "slice", "select", "unsqueeze", "squeeze", "expand", "as_strided",
             "permute", "alias", "detach", "split", "split_with_sizes", "unbind", "narrow", "lift_fresh", "reshape"}

    def __init__(self):
        super().__init__()
        self.n = 0
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.overloadpacket.__name__ not in self.VIEWS
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


# sampled requests of different parameters, seeded and not (each round processes, draws and accepts them at once)
MIXED = [SamplingParams(0.8, top_k=20, top_p=0.9, seed=5), SamplingParams(1.2)]


@pytest.mark.parametrize("mode,reads,sampled,stretches", [
    ("fixed", 1, False, True), ("packed", 2, False, False), ("packed", 1, False, True), ("off", 1, False, True),
    ("fixed", 1, True, True), ("packed", 2, True, False), ("packed", 1, True, True)])
def test_static_round_work_does_not_grow_with_requests(mode, reads, sampled, stretches, monkeypatch):
    """A verify-only round on the static path dispatches the same number of (non-view) tensor ops for 2 and for
    6 requests (no per-request kernels or reads) and reads the device ``reads`` times: verify lengths (packed, unless
    the last ratios chose whole blocks: ``stretches``, verify_lengths) and the acceptance (with the drafts: they reach
    the target's input on the device). ``sampled``: the requests sample, with :data:`MIXED` parameters. The guess
    before a round is the head's last ratio here (not what the random drafter's rounds accepted)."""
    monkeypatch.setattr(verify_lengths, "GUESS_PRIOR_ROUNDS", 0.0)
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=8)
    force_length_head(drafter, ratio_high=True)
    counts = []
    for n in (2, 6):
        engine = Engine(target, **layout_args(drafter, mode), max_slots=8, max_len=48,
                        token_budget=64, cuda_graphs=True)
        engine.planner.whole_block_stretches = stretches
        handles = [engine.submit(p, 30, MIXED[i % 2] if sampled else None)
                   for i, p in enumerate(engine_prompts([4] * n, seed=n))]
        engine.step()  # prefill
        engine.step()  # first draft consumes the prompts' features
        syncs = engine.host_syncs
        ops = _Ops()
        with ops:
            engine.step()
        assert not any(h.done for h in handles) and engine.skipped_drafts == 0
        assert engine.host_syncs - syncs == reads
        # torch's CPU repeat_interleave enters its thread pool on every call: ~6 ms host stalls per call at 128
        # requests on the H200 (docs/logs/replay_h200_one_read); the round's index arithmetic is numpy's
        assert "repeat_interleave" not in ops.names
        counts.append(ops.n)
    assert counts[0] == counts[1], counts


def test_profile_phases(pair):
    target, drafter = pair
    engine = Engine(target, drafter, length_policy="adaptive", max_slots=2, max_len=32, token_budget=32, cuda_graphs=True,
                    profile=True)
    engine.generate(engine_prompts([3, 5], seed=1), max_new_tokens=5)
    assert set(engine.phase_seconds) == {"draft", "target", "accept", "host"}
    assert engine.profiled_steps == engine.num_steps and all(v >= 0 for v in engine.phase_seconds.values())


# ---------------------------------------------------------------- the drafter's bidirectional slot mask
@pytest.mark.parametrize("q_len", [1, 8, 16])
def test_bidirectional_slot_mask(q_len):
    """causal=False: every query row of slot b sees keys 0 .. start[b]; the capturable block mask equals
    create_block_mask's, and flex_attention with it equals SDPA with the boolean mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from adaflash_hf.engine.kernels.attention import SlotAttention, slot_block_mask, slot_mask_mod
    from adaflash_hf.engine.kernels.attention import INACTIVE

    starts = [12, 130, 127, 0, INACTIVE, 383]
    start = torch.tensor(starts, dtype=torch.int32)
    L = 384
    ours = slot_block_mask(start, q_len, L, causal=False)
    ref = create_block_mask(slot_mask_mod(start, causal=False), len(starts), None, q_len, L, device="cpu")
    assert torch.equal(ours.to_dense(), ref.to_dense())
    att = SlotAttention(len(starts), L, "cpu", "sdpa", causal=False)
    att.start.copy_(start)
    bool_mask = att.mask(q_len)[:, 0]
    assert [int(bool_mask[s, -1].sum()) for s in range(len(starts))] == [max(0, min(L, st + 1)) for st in starts]
    assert torch.equal(bool_mask, bool_mask[:, :1].expand_as(bool_mask))  # the same keys for every row
    g = torch.Generator().manual_seed(0)
    qs, ks, vs = (torch.randn(len(starts), h, n, 16, generator=g) for h, n in ((4, q_len), (2, L), (2, L)))
    active = torch.tensor(starts) != INACTIVE
    out = att(qs, ks, vs, att.mask(q_len), 0.25)
    flex = flex_attention(qs, ks, vs, block_mask=ours, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(flex[active], out[active], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["packed", "fixed"])
def test_round_sink_sees_the_same_rounds_on_both_drafter_paths(pair, mode):
    """The static drafter path hands the sink the same drafts / draft logits as the eager path, and they are
    copies (the static buffers are reused by the next round)."""
    target, drafter = pair
    prompts = engine_prompts([4, 9, 2], seed=6)
    seen = {}
    for graphs in (False, True):
        rounds = []

        class Sink:
            def on_round(self, v):
                rounds.append(v)

        engine = Engine(target, **layout_args(drafter, mode), max_slots=3, max_len=32, token_budget=40, round_sink=Sink(),
                        cuda_graphs=graphs)
        engine.generate(prompts, max_new_tokens=6)
        seen[graphs] = rounds
    assert len(seen[False]) == len(seen[True]) > 0
    for a, b in zip(seen[False], seen[True]):
        assert (a.row, a.verify_len, a.num_accepted) == (b.row, b.verify_len, b.num_accepted)
        assert torch.equal(a.draft_tokens, b.draft_tokens)
        torch.testing.assert_close(b.draft_logits, a.draft_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(b.target_logits, a.target_logits, atol=1e-4, rtol=1e-4)
        assert abs(a.predicted_ratio - b.predicted_ratio) < 1e-5


def test_compiled_flex_drafter_equals_eager_draft():
    """The drafter's flex backend as on CUDA (compiled flex_attention, bidirectional block mask rebuilt from the
    static ``start``), compiled by inductor for CPU: two rounds equal the eager drafter."""
    target = make_target("qwen3", seed=3, hidden=64)  # head_dim 16: the smallest flex compiles for
    drafter = make_drafter(target, block_size=8)
    g = torch.Generator().manual_seed(0)
    ref = make_drafter_cache(drafter, 4, 32)
    cache = make_drafter_cache(drafter, 4, 32, spare_slots=1, len_multiple=BLOCK)
    slots = [ref.alloc() for _ in range(3)]
    [cache.alloc() for _ in range(3)]
    runner = DraftGraphs(drafter, cache, max_rows=4, max_ctx=16, attention="flex")
    for lens in ([4, 1, 6], [2, 3, 1]):
        ctx, bonus = _feats(drafter, lens, g), torch.tensor([3, 4, 5])
        with torch.no_grad():
            expect = drafter.compute_logits(draft_blocks(drafter, ref, slots, bonus, ctx)[:, 1:]).float()
        torch.testing.assert_close(runner.run(slots, ctx, bonus.tolist()).logits.float().view(expect.shape), expect, atol=1e-4, rtol=1e-4)
    assert runner.attention.backend == "flex" and runner.attention_note == ""


@pytest.mark.parametrize("graphs", [False, True])
def test_drafts_reach_the_target_on_the_device_and_non_finite_ones_verify_nothing(graphs):
    """The drafts go into the target's input on the device (never read back before the acceptance): drafts equal to
    the plain greedy continuation are all accepted. A request whose draft logits were not finite verifies its
    bonus token only (accepted 0, verify length 1) while the others accept as usual; outputs equal plain greedy.
    Control: the same engine with every draft finite accepts the full drafts of that request too."""
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=8)
    prompts = engine_prompts([5, 7], seed=4)
    refs = {tuple(p): plain_greedy_ids(target, p, 12) for p in prompts}

    class Continuation(Engine):
        nan_first = True

        def _propose(self, running):
            tokens, finite, logits, offsets, ratio, draft_len = super()._propose(running)
            for i, r in enumerate(running):
                cont = refs[tuple(r.prompt)][len(r.tokens): len(r.tokens) + self.block_size - 1]
                tokens[i] = torch.tensor(cont + [0] * (self.block_size - 1 - len(cont)))
            finite = torch.ones(len(running), dtype=torch.bool)
            finite[0] = not self.nan_first  # the first submitted request runs first in every round
            return tokens, finite, logits, offsets, ratio, draft_len

    for nan_first in (True, False):
        engine = Continuation(target, drafter, max_slots=2, max_len=32, token_budget=32, cuda_graphs=graphs)
        engine.nan_first = nan_first
        outs = engine.generate(prompts, max_new_tokens=12)
        assert [o.token_ids for o in outs] == [refs[tuple(p)] for p in prompts]
        assert all(a == v - 1 for a, v in zip(outs[1].accepted, outs[1].verify_lengths)) and max(outs[1].accepted) > 0
        if nan_first:
            assert set(outs[0].accepted) == {0} and set(outs[0].verify_lengths) == {1}
        else:
            assert all(a == v - 1 for a, v in zip(outs[0].accepted, outs[0].verify_lengths)) and max(outs[0].accepted) > 0


@pytest.mark.parametrize("graphs", [False, True])
def test_sampled_request_with_non_finite_draft_logits_is_served_not_failed(graphs):
    """A sampled request whose draft logits are NaN (the drafter's fault, not the target's) proposes from a uniform
    distribution instead (speculative sampling keeps the target's distribution for any proposal) and finishes
    normally; the other request is untouched. Without that fallback its non-finite proposal fails it."""
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=8)

    class NanFirst(Engine):
        def _propose(self, running):
            tokens, finite, logits, offsets, ratio, draft_len = super()._propose(running)
            if logits is not None:
                logits[offsets[0] : offsets[1]] = float("nan")
                finite = finite.clone()
                finite[0] = False
            return tokens, finite, logits, offsets, ratio, draft_len

    engine = NanFirst(target, drafter, max_slots=2, max_len=32, token_budget=32, cuda_graphs=graphs)
    outs = engine.generate(engine_prompts([5, 7], seed=5), max_new_tokens=10, temperature=1.0, seed=3)
    assert [o.finish_reason for o in outs] == ["length", "length"] and all(len(o.token_ids) == 10 for o in outs)
    assert engine.healthy


# ---------------------------------------------------------------- the chained body (queued before the round's read)
@pytest.mark.parametrize("accepted,slots,q_lens", [([0], [1], None), ([3, 7], [2, 0], None), ([5, 0, 7], [0, 3, 1], None),
                                                    ([2, 0, 4], [0, 3, 1], [3, 1, 8]), ([1], [2], [2]), ([0, 6], [1, 0], [1, 7])])
def test_chained_body_drafts_what_the_next_body_drafts(pair, accepted, slots, q_lens):
    """``run_chain`` (the next round's body from the verify's features, accepted counts and next tokens, computed on
    the device) and then ``run_body`` for the same slots with the accepted rows as context: the body is taken, not run
    again, and the drafts, ratios, slot lengths and stored context equal a plain ``run_body``'s. Whole blocks
    (``q_lens`` None) or packed verify segments of ``q_lens`` tokens. Control: a chain queued with other accepted
    counts, taken the same way, drafts something else."""
    target, drafter = pair
    B, n = drafter.config.block_size, len(slots)
    offs = [i * B for i in range(n)] if q_lens is None else [sum(q_lens[:i]) for i in range(n)]
    g = torch.Generator().manual_seed(n)
    first = _feats(drafter, [4 + i for i in range(n)], g)  # the context before the round
    source = _feats(drafter, [8 * B], g)[0]  # a verify's features: request i's segment starts at row offs[i]
    nxt = torch.randint(0, 120, (n,), generator=g)

    def run(chain_acc):
        cache = make_drafter_cache(drafter, 4, 64, spare_slots=1, len_multiple=BLOCK)
        for s in sorted(slots):
            cache.alloc(s)
        runner = DraftGraphs(drafter, cache, max_rows=4, max_ctx=64)
        runner.chain_source = source
        runner.run(slots, first, torch.randint(0, 120, (n,), generator=torch.Generator().manual_seed(0)).tolist())
        if chain_acc is not None:
            assert runner.run_chain(slots, torch.tensor(chain_acc), nxt, q_lens)
        ctx = [source[offs[i] : offs[i] + a + 1] for i, a in enumerate(accepted)]
        out = runner.run(slots, ctx, nxt.tolist())
        bodies = sum(v for k, v in runner.replays.items() if k[0] == "body")
        return out, cache, runner, bodies

    ref, ref_cache, _, ref_bodies = run(None)
    out, cache, runner, bodies = run(accepted)
    assert bodies == ref_bodies - 1 and sum(v for k, v in runner.replays.items() if k[0] == "chain") == 1
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.ratio, ref.ratio, atol=1e-5, rtol=1e-5)
    assert torch.equal(out.tokens, ref.tokens)
    assert [cache.length(s) for s in slots] == [ref_cache.length(s) for s in slots]
    for s in slots:
        m = ref_cache.length(s)
        for layer in range(drafter.config.num_hidden_layers):
            torch.testing.assert_close(cache.read(layer, s, m)[0], ref_cache.read(layer, s, m)[0], atol=1e-5, rtol=1e-5)
    other, *_ = run([(a + 3) % B for a in accepted])
    assert not torch.allclose(other.logits, ref.logits, atol=1e-3)


def test_chained_body_is_not_taken_for_other_context(pair):
    """Context that is not the chain source's rows (a copy), other slots, or a context-only update: the body runs."""
    target, drafter = pair
    B = drafter.config.block_size
    g = torch.Generator().manual_seed(3)
    source = _feats(drafter, [4 * B], g)[0]
    cache = make_drafter_cache(drafter, 4, 64, spare_slots=1, len_multiple=BLOCK)
    cache.alloc(0), cache.alloc(1)
    runner = DraftGraphs(drafter, cache, max_rows=4, max_ctx=64)
    runner.chain_source = source
    runner.run([0, 1], _feats(drafter, [3, 3], g), [5, 6])
    for args in (([0, 1], [source[:2].clone(), source[B : B + 1]]), ([1, 0], [source[:2], source[B : B + 1]])):
        assert runner.run_chain([0, 1], torch.tensor([1, 0]), torch.tensor([7, 8]))
        before = runner.replays.copy()
        runner.run_body(*args, [7, 8])
        assert sum(runner.replays.values()) == sum(before.values()) + 1 and runner._chained is None


@pytest.fixture(scope="module")
def reference_pair():
    """The reference pair, loaded once for the engines of this module's tests (an engine leaves it as it found it)."""
    from adaflash_hf import load_reference_pair

    return load_reference_pair()


@pytest.mark.parametrize("mode,policy", [("fixed", "cost"), ("packed", "cost"), ("packed", "adaptive"), ("rectangular", "cost")])
def test_engine_chains_the_next_body_and_equals_plain_greedy(reference_pair, mode, policy):
    """On the static path, an engine queues each round's next body before the read and takes it (every layout that
    drafts: the packed verify segments are the next body's context as the fixed blocks are): the rounds accept
    exactly what they accept without chaining (same drafts), outputs equal plain greedy decoding."""
    target, drafter, tok = reference_pair
    prompts = [tok(p)["input_ids"] for p in ("Question: Tom has 3 apples and buys 5 more. How many", "def add(a, b):")]
    runs = []
    for chain in (True, False):
        engine = Engine(target, **layout_args(drafter, mode, policy), max_slots=2, max_len=160, cuda_graphs=True)
        if not chain:
            engine.draft_graphs.chain_source = None
        outs = engine.generate(prompts, max_new_tokens=40)
        runs.append((engine.forward_tokens, [o.token_ids for o in outs], engine.draft_graphs.replays))
    (tokens_c, outs_c, replays_c), (tokens_p, outs_p, _) = runs
    # the engine stops at max_new_tokens only; computed once for the module's target
    plain = [plain_greedy_once(target, p, 40, eos_token_id=None) for p in prompts]
    assert outs_c == outs_p == plain
    assert tokens_c == tokens_p and len(tokens_c) < 2 * 40  # same rounds: the drafts were the same
    taken = sum(v for k, v in replays_c.items() if k[0] == "chain")
    assert taken > 0, replays_c
