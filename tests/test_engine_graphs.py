"""CPU tests of the engine's CUDA-graph decode path (issue 6): buckets, the slot-layout block mask,
the static padded forward against the eager packed forward, padding isolation, losslessness.

On CPU the static forward runs eagerly with SDPA (no capture); the graph capture / replay and the
compiled flex kernel themselves are exercised by ``examples/engine_gpu_check.py`` on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from adaflash_hf.engine import Engine, layout_args
from adaflash_hf.engine.graphs import DecodeGraphs, pick_bucket, q_buckets, token_buckets
from adaflash_hf.engine.kernels.attention import SlotAttention, slot_block_mask, slot_mask_mod
from adaflash_hf.engine.target import PackedLayout, make_target_cache, target_forward
from adaflash_hf.engine.kernels.attention import INACTIVE as INACTIVE_START

from generation_helpers import engine_prompts, make_drafter, make_target, plain_greedy_ids, prefilled_cache

MODES = ("packed", "rectangular", "fixed", "off")


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def pair(request):
    target = make_target(request.param)
    return target, make_drafter(target, block_size=8)


# ---------------------------------------------------------------- buckets
@pytest.mark.parametrize("max_tokens,expected", [
    (1, [1]),
    (6, [1, 2, 4, 6]),
    (8, [1, 2, 4, 8]),
    (40, [1, 2, 4, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40]),
    (70, [1, 2, 4, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 70]),
])
def test_token_buckets(max_tokens, expected):
    assert token_buckets(max_tokens) == expected


def test_token_buckets_bound_padding():
    ladder = token_buckets(2048)
    assert ladder[-1] == 2048 and all(2 ** k in ladder for k in range(12))
    assert all(pick_bucket(ladder, n) <= max(8, 1.25 * n) for n in range(1, 2049))


@pytest.mark.parametrize("max_q,expected", [(1, [1]), (8, [1, 2, 4, 8]), (16, [1, 2, 4, 8, 16]), (6, [1, 2, 4, 6])])
def test_q_buckets(max_q, expected):
    assert q_buckets(max_q) == expected


@pytest.mark.parametrize("n,bucket", [(1, 1), (3, 4), (9, 10), (17, 20), (33, 40), (40, 40)])
def test_pick_bucket(n, bucket):
    assert pick_bucket(token_buckets(40), n) == bucket


def test_pick_bucket_too_large():
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        pick_bucket([1, 2, 4], 5)


# ---------------------------------------------------------------- the slot-layout mask
STARTS = [5, 130, 127, 0, INACTIVE_START, 300, 383]


@pytest.mark.parametrize("q_len", [1, 4, 16, 130])
def test_block_mask_equals_create_block_mask(q_len):
    """The block mask built with tensor ops (capturable) lists exactly the KV blocks
    ``create_block_mask`` finds by evaluating the mask_mod everywhere."""
    start = torch.tensor(STARTS, dtype=torch.int32)
    ours = slot_block_mask(start, q_len, 384)
    ref = create_block_mask(slot_mask_mod(start), len(STARTS), None, q_len, 384, device="cpu")
    assert torch.equal(ours.to_dense(), ref.to_dense())
    assert ours.kv_num_blocks[4].sum() == 0  # an inactive slot computes nothing


@pytest.mark.parametrize("q_len", [1, 3, 16])
def test_mask_mod_and_flex_equal_boolean_mask(q_len):
    """The mask_mod, the SDPA backend's boolean mask and the eager causal rule agree, and
    flex_attention (eager on CPU) with our block mask equals SDPA with the boolean mask."""
    start = torch.tensor(STARTS, dtype=torch.int32)
    L = 384
    att = SlotAttention(len(STARTS), L, "cpu", "sdpa")
    att.start.copy_(start)
    bool_mask = att.mask(q_len)[:, 0]  # [slots, q, K]
    mm = slot_mask_mod(start)
    b, q, k = torch.meshgrid(torch.arange(len(STARTS)), torch.arange(q_len), torch.arange(L), indexing="ij")
    assert torch.equal(mm(b, 0, q, k), bool_mask)
    for s, st in enumerate(STARTS):  # query row i of a slot starting at p sees positions 0 .. p + i
        for i in range(q_len):
            assert int(bool_mask[s, i].sum()) == max(0, min(L, st + i + 1))
    g = torch.Generator().manual_seed(0)
    qs, ks, vs = (torch.randn(len(STARTS), h, n, 16, generator=g) for h, n in ((4, q_len), (2, L), (2, L)))
    active = torch.tensor(STARTS) != INACTIVE_START
    out = att(qs, ks, vs, att.mask(q_len), 0.25)
    flex = flex_attention(qs, ks, vs, block_mask=slot_block_mask(start, q_len, L), scale=0.25, enable_gqa=True)
    torch.testing.assert_close(flex[active], out[active], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all() and flex[~active].abs().max() == 0


# ---------------------------------------------------------------- the static padded forward
# (prompt lengths, decode tokens per request, largest token / q bucket): ragged, uniform, one request,
# rectangular-like, a padded token bucket (T=7 -> 8) and a padded q bucket (max 3 -> 4)
LAYOUTS = [
    ([5, 1, 9, 3], [3, 1, 6, 2], 48, 8),
    ([4, 4, 4], [1, 1, 1], 48, 8),
    ([7], [8], 48, 8),
    ([2, 11, 6], [4, 4, 4], 48, 8),
    ([3, 8, 2], [3, 1, 3], 8, 4),
    ([1, 12], [2, 8], 16, 8),
]


@pytest.mark.parametrize("prompt_lens,q_lens,max_tokens,max_q", LAYOUTS)
def test_static_forward_equals_eager(pair, prompt_lens, q_lens, max_tokens, max_q):
    """Logits and drafter features of the bucketed static forward == the eager packed forward, and
    it writes the same K/V to the same places, touching no other slot (padding goes to the spare row)."""
    target, drafter = pair
    layers = list(drafter.config.target_layer_ids) + [target.config.num_hidden_layers - 1]
    prompts = engine_prompts(prompt_lens, seed=sum(prompt_lens))
    chunks = engine_prompts(q_lens, seed=len(q_lens))
    ref_cache, slots = prefilled_cache(target, prompts, 6, 32)
    cache, _ = prefilled_cache(target, prompts, 6, 32)
    lay = PackedLayout.from_cache(cache, slots, q_lens)
    toks = torch.tensor(sum(chunks, []))
    ref_logits, ref_hidden = target_forward(target, ref_cache, toks, lay.token_slots(), lay.positions(), lay, layers)
    graphs = DecodeGraphs(target, cache, layers, max_tokens=max_tokens, max_q=max_q)
    assert not graphs.use_graphs and graphs.attention.backend == "sdpa"  # CPU: the static forward runs eagerly
    logits, hidden = graphs.run(toks.tolist(), lay)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden, ref_hidden, atol=1e-5, rtol=1e-5)
    assert logits.dtype == torch.float32 and logits.shape[0] == lay.num_tokens
    n = cache.num_slots
    torch.testing.assert_close(cache.k[:, :n], ref_cache.k[:, :n], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cache.v[:, :n], ref_cache.v[:, :n], atol=1e-6, rtol=1e-6)
    (bucket,) = graphs.replays
    assert bucket[:2] == graphs.bucket(lay.num_tokens, max(q_lens)) and bucket[0] <= max_tokens
    assert bucket[2] == pick_bucket(graphs.row_buckets, max(slots) + 1)  # slot rows attended: 0 .. R_b
    assert graphs.padded_tokens == bucket[0] - lay.num_tokens


def test_padding_never_leaks(pair):
    """Poisoned padding (NaN in the spare row, stale rows and the static buffers) and a different
    bucket for the same requests leave every real token's logits unchanged."""
    target, _ = pair
    prompts = engine_prompts([4, 7, 2], seed=21)
    chunks = engine_prompts([2, 3, 1], seed=22)
    results = []
    # buckets: exact (6, 3), padded tokens (8, 3), padded rows (6, 4), both (8, 4)
    for max_tokens, max_q, poison in ((6, 3, False), (48, 3, True), (6, 8, True), (48, 8, True)):
        cache, slots = prefilled_cache(target, prompts, 4, 32)
        lay = PackedLayout.from_cache(cache, slots, [len(c) for c in chunks])
        graphs = DecodeGraphs(target, cache, None, max_tokens=max_tokens, max_q=max_q)
        if poison:
            cache.k[:, cache.num_slots:] = float("nan")
            cache.v[:, cache.num_slots:] = float("nan")
            for s, c in zip(slots, chunks):  # positions past each request's block: stale garbage
                cache.k[:, s, :, cache.length(s) + len(c):] = 1e4
            graphs.logits.fill_(float("nan"))
        logits, hidden = graphs.run(sum(chunks, []), lay)
        assert hidden is None and torch.isfinite(logits).all()
        results.append((next(iter(graphs.replays)), logits))
    assert [b for b, _ in results] == [(6, 3, 4), (8, 3, 4), (6, 4, 4), (8, 4, 4)]
    for _, logits in results[1:]:
        torch.testing.assert_close(logits, results[0][1], atol=1e-5, rtol=1e-5)


def test_compiled_flex_backend_equals_eager():
    """The flex backend as it runs on CUDA (torch.compile'd flex_attention, block mask rebuilt from
    the static ``start`` every forward), compiled here by inductor for CPU: two rounds with different
    slots and prefixes reuse one compiled kernel and both equal the eager packed forward."""
    target = make_target("qwen3", seed=3, hidden=64)  # head_dim 16: the smallest flex compiles for
    prompts = engine_prompts([5, 9, 3], seed=31)
    ref_cache, slots = prefilled_cache(target, prompts, 4, 32)
    cache, _ = prefilled_cache(target, prompts, 4, 32)
    graphs = DecodeGraphs(target, cache, [1], max_tokens=8, max_q=4, attention="flex")
    assert graphs.attention.backend == "flex"
    for round_, q_lens in enumerate(([2, 4, 1], [3, 3, 2])):
        lay = PackedLayout.from_cache(cache, slots[round_:], q_lens[round_:])
        toks = torch.tensor(sum(engine_prompts(q_lens[round_:], seed=40 + round_), []))
        ref_logits, ref_hidden = target_forward(target, ref_cache, toks, lay.token_slots(), lay.positions(), lay, [1])
        logits, hidden = graphs.run(toks.tolist(), lay)
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(hidden, ref_hidden, atol=1e-4, rtol=1e-4)
        for s, q in zip(lay.slots, lay.q_lens):
            cache.advance(s, q)
            ref_cache.advance(s, q)
    assert set(graphs.replays) == {(8, 4, 4)} and graphs.attention_note == ""


@pytest.mark.parametrize("used,rows", [([0, 1, 2], 4), ([0, 9], 16), ([5], 8), ([15], 16)])
def test_idle_slot_rows_are_not_attended(pair, used, rows):
    """Attention runs over slot rows 0 .. R_b only (R_b: bucket of the highest slot in use + 1, row R_b takes the
    padding queries): NaN in every other row, the spare row included, changes no real token's logits."""
    target, _ = pair
    chunks = engine_prompts([2, 3, 1][: len(used)], seed=23)
    out = []
    for poison in (False, True):
        cache = make_target_cache(target, 16, 32, spare_slots=1)
        for s in used:
            cache.alloc(s)
        prompts = engine_prompts([4, 7, 2][: len(used)], seed=24)
        lay = PackedLayout.from_cache(cache, used, [len(p) for p in prompts])
        target_forward(target, cache, torch.tensor(sum(prompts, [])), lay.token_slots(), lay.positions(), lay)
        for s, p in zip(used, prompts):
            cache.advance(s, len(p))
        graphs = DecodeGraphs(target, cache, None, max_tokens=16, max_q=4)
        if poison:
            idle = [r for r in range(cache.k.shape[1]) if r not in used]
            cache.k[:, idle] = float("nan")
            cache.v[:, idle] = float("nan")
        logits, _ = graphs.run(sum(chunks, []), PackedLayout.from_cache(cache, used, [len(c) for c in chunks]))
        assert torch.isfinite(logits).all()
        out.append(logits)
        assert [k[2] for k in graphs.replays] == [rows]
    torch.testing.assert_close(out[1], out[0], atol=0, rtol=0)


def test_decode_graphs_needs_a_spare_row(pair):
    target, _ = pair
    with pytest.raises(ValueError, match="spare slot"):
        DecodeGraphs(target, make_target_cache(target, 2, 16), None, max_tokens=4, max_q=1)
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(target, make_target_cache(target, 2, 16, spare_slots=1), None, max_tokens=4, max_q=1, use_graphs=True)


# ---------------------------------------------------------------- the engine on the static path
RAGGED = [1, 4, 9, 2, 13, 6, 3, 7]
MAX_NEW = [12, 5, 1, 9, 12, 7, 3, 10]


@pytest.mark.parametrize("mode", MODES)
def test_engine_static_path_lossless(pair, mode):
    """``cuda_graphs=True`` on CPU (static padded buckets, SDPA): every request's greedy output is its
    own plain greedy decoding, rounds mixing prefill and decode included, and no slot leaks."""
    target, drafter = pair
    prompts = engine_prompts(RAGGED, seed=4)
    infos = []
    engine = Engine(target, **layout_args(drafter, mode), max_slots=3, max_len=32, token_budget=40, cuda_graphs=True,
                    step_hook=infos.append)
    assert engine.graphs is not None and engine.cache.spare_slots == 1 and engine.cache.max_len % 128 == 0
    handles = [engine.submit(p, n) for p, n in zip(prompts, MAX_NEW)]
    engine.run_until_idle()
    for h, p, n in zip(handles, prompts, MAX_NEW):
        assert h.result().token_ids == plain_greedy_ids(target, p, n)
    assert engine.cache.num_free == 3 and engine.idle
    assert any(i.num_prefill and i.num_verify for i in infos)  # split rounds: eager prefill + static decode
    decode_forwards = engine.num_steps - sum(1 for i in infos if not i.num_verify)  # greedy steps count one each
    assert sum(engine.graphs.replays.values()) == decode_forwards
    if mode == "off":
        assert {k[1] for k in engine.graphs.replays} == {1}
    else:
        assert len(engine.graphs.replays) > 1


def test_engine_default_is_eager_on_cpu(pair):
    target, drafter = pair
    engine = Engine(target, drafter, max_slots=2, max_len=16, token_budget=16)
    assert engine.graphs is None and not engine.cuda_graphs and engine.cache.spare_slots == 0




# ---------------------------------------------------------------- greedy decode steps in one replay
@pytest.mark.parametrize("steps", [1, 2, 5])
def test_run_greedy_equals_single_steps(pair, steps):
    """``run_greedy(steps)`` == ``steps`` calls of ``run`` with the argmax fed back: the same tokens and
    K/V, and the inputs left as ``prepare`` wrote them (a second replay repeats the first exactly)."""
    target, _ = pair
    prompts = engine_prompts([5, 1, 9], seed=3)
    ref_cache, slots = prefilled_cache(target, prompts, 4, 32)
    cache, _ = prefilled_cache(target, prompts, 4, 32)
    single = DecodeGraphs(target, ref_cache, None, max_tokens=4, max_q=1)
    multi = DecodeGraphs(target, cache, None, max_tokens=4, max_q=1, max_steps=8)
    current, expected = [3, 7, 11], []
    for _ in range(steps):
        logits, _ = single.run(current, PackedLayout.from_cache(ref_cache, slots, [1, 1, 1]))
        current = logits.argmax(dim=-1).tolist()
        expected.append(current)
        for s in slots:
            ref_cache.advance(s, 1)
    layout = PackedLayout.from_cache(cache, slots, [1, 1, 1])
    out = multi.run_greedy([3, 7, 11], layout, steps)
    assert out.is_contiguous() and out[:, :3].tolist() == expected  # one read of contiguous memory (bucket 4)
    n = cache.num_slots
    torch.testing.assert_close(cache.k[:, :n], ref_cache.k[:, :n], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cache.v[:, :n], ref_cache.v[:, :n], atol=1e-6, rtol=1e-6)
    (bucket,) = multi.replays
    assert bucket[3:] == (("greedy",) if steps > 1 else ()) and multi.replays[bucket] == steps  # one graph per step
    assert multi.run_greedy([3, 7, 11], layout, steps)[:, :3].tolist() == expected  # prepare() resets what the steps advanced


@pytest.mark.parametrize("prompt_lens,kept_steps", [([5], 16), ([5, 1, 9], 4)], ids=["1 request", "3 requests"])
def test_run_greedy_keeps_features_across_calls(pair, prompt_lens, kept_steps):
    """Each step's features land in the flat kept buffer at ``offset + s``, equal to a single step's, and earlier
    calls' steps stay: few requests keep more steps (16 rows: 16 steps of one request, 4 of three, bucket 4)."""
    target, _ = pair
    prompts = engine_prompts(prompt_lens, seed=5)
    n, layers = len(prompts), [0, 1]
    ref_cache, slots = prefilled_cache(target, prompts, 4, 32)
    cache, _ = prefilled_cache(target, prompts, 4, 32)
    single = DecodeGraphs(target, ref_cache, layers, max_tokens=4, max_q=1)
    multi = DecodeGraphs(target, cache, layers, max_tokens=4, max_q=1, max_steps=2, kept_tokens=16)
    assert multi.kept_steps(n) == kept_steps and multi.kept_steps(2) == 8
    current, want = list(range(3, 3 + n)), []
    for _ in range(4):
        logits, hidden = single.run(current, PackedLayout.from_cache(ref_cache, slots, [1] * n))
        want.append(hidden[:n].clone())
        current = logits.argmax(dim=-1).tolist()
        for s in slots:
            ref_cache.advance(s, 1)
    tokens = list(range(3, 3 + n))
    for offset in (0, 2):
        new = multi.run_greedy(tokens, PackedLayout.from_cache(cache, slots, [1] * n), 2, offset)
        tokens = new[-1, :n].tolist()
        for s in slots:
            cache.advance(s, 2)
    torch.testing.assert_close(multi.kept_features(n, 4), torch.stack(want), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="offset \\+ steps at most"):
        multi.run_greedy(tokens, PackedLayout.from_cache(cache, slots, [1] * n), 2, kept_steps - 1)


def test_run_greedy_refuses_what_it_cannot_do(pair):
    target, drafter = pair
    cache, slots = prefilled_cache(target, engine_prompts([4, 30], seed=1), 3, 32)
    graphs = DecodeGraphs(target, cache, None, max_tokens=8, max_q=4, max_steps=4)
    with pytest.raises(ValueError, match="steps must be in"):
        graphs.run_greedy([1, 2], PackedLayout.from_cache(cache, slots, [1, 1]), 5)
    with pytest.raises(ValueError, match="one token per request"):
        graphs.run_greedy([1, 2, 3], PackedLayout.from_cache(cache, slots, [2, 1]), 2)
    with pytest.raises(ValueError, match="past max_len"):  # slot 1 holds 30 of 32 positions
        graphs.run_greedy([1, 2], PackedLayout.from_cache(cache, slots, [1, 1]), 4)


def _first_new(ids):
    """An index >= 2 whose token does not occur earlier (a usable mid-output EOS)."""
    return next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])


@pytest.mark.parametrize("decode_steps", [2, 8])
def test_engine_decode_steps_are_lossless(pair, decode_steps):
    """``off`` mode with several greedy steps per replay: every output, finish reason, per-round stat and
    streamed token equals ``decode_steps=1``; an EOS inside a replay ends the request exactly there; a
    request submitted mid-run is admitted; every slot comes back; the device is read fewer times."""
    target, _ = pair
    prompts = engine_prompts([3, 8, 5], seed=11)
    ref0 = plain_greedy_ids(target, prompts[0], 12)
    eos = ref0[_first_new(ref0)]
    runs = []
    for k in (1, decode_steps):
        engine = Engine(target, None, max_slots=3, max_len=32, token_budget=32, cuda_graphs=True,
                        decode_steps=k)
        streamed = [[] for _ in prompts]
        handles = [engine.submit(prompts[0], 12, eos_token_id=eos, on_token=streamed[0].append),
                   engine.submit(prompts[1], 13, on_token=streamed[1].append)]
        for _ in range(3):
            engine.step()
        handles.append(engine.submit(prompts[2], 7, on_token=streamed[2].append))
        engine.run_until_idle()
        outs = [h.result() for h in handles]
        assert [s for s in streamed] == [o.token_ids for o in outs]
        assert engine.cache.num_free == 3 and engine.idle
        runs.append((outs, engine))
    (ref, eng1), (outs, engk) = runs
    for o, r in zip(outs, ref):
        assert (o.token_ids, o.finish_reason, o.accepted, o.verify_lengths) == (
            r.token_ids, r.finish_reason, r.accepted, r.verify_lengths)
    assert outs[0].finish_reason == "eos" and outs[0].token_ids == ref0[: ref0.index(eos) + 1]
    assert outs[1].token_ids == plain_greedy_ids(target, prompts[1], 13)
    assert outs[2].token_ids == plain_greedy_ids(target, prompts[2], 7)
    assert any(b[3:] == ("greedy",) for b in engk.graphs.replays)  # steps queued back to back happened
    assert engk.host_syncs < eng1.host_syncs


def test_engine_decode_steps_wait_for_admission_and_sampling(pair):
    """Several steps per replay only when nothing waits for a slot and every running request is greedy:
    admission latency and sampled requests are those of single steps."""
    target, _ = pair
    engine = Engine(target, None, max_slots=1, max_len=32, token_budget=32, cuda_graphs=True,
                    decode_steps=8)
    a = engine.submit([1, 2, 3], 10)
    engine.step()
    b = engine.submit([4, 5], 6)
    assert engine._greedy_steps(engine._running) == 0  # b is queued: a normal round
    engine.run_until_idle()
    assert b.result().token_ids == plain_greedy_ids(target, [4, 5], 6) and a.result().token_ids == plain_greedy_ids(target, [1, 2, 3], 10)
    c = engine.submit([1, 2, 3], 10, temperature=1.0, seed=0)
    engine.step()
    assert engine._greedy_steps(engine._running) == 0
    engine.run_until_idle()
    assert len(c.result().token_ids) == 10
    with pytest.raises(ValueError, match="decode_steps"):
        Engine(target, None, decode_steps=0)


@pytest.mark.parametrize("first_len,second_new,stretch", [
    (3, 13, 8),  # the first request ends inside the stretch: it runs on for the second (not cut to 2 steps)
    (3, 4, 3),   # neither has more than 3 left after the prefill's token: the stretch stops there
    (-3, 13, 3),  # the first request's slot holds 3 more positions (its prompt fills the rest): they cap it
])
def test_engine_stretch_runs_to_the_longest_request_within_every_slot(pair, first_len, second_new, stretch):
    """A plain stretch lasts until the request with the most left is done or a slot is full, not until the first
    request ends: the one that ends inside drops its later steps (outputs equal plain greedy, every slot freed)."""
    target, _ = pair
    engine = Engine(target, None, max_slots=2, max_len=128, token_budget=256, cuda_graphs=True, decode_steps=8)
    assert engine.cache.max_len == 128  # a whole number of attention blocks: the slots hold what requests may use
    n = first_len if first_len > 0 else engine.cache.max_len + first_len
    prompts = [engine_prompts([n], seed=3)[0], engine_prompts([4], seed=4)[0]]
    handles = [engine.submit(prompts[0], 3), engine.submit(prompts[1], second_new)]
    engine.step()  # both prefilled: one token each
    assert engine._greedy_steps(engine._running) == stretch
    engine.run_until_idle()
    assert [h.result().token_ids for h in handles] == [plain_greedy_ids(target, p, m) for p, m in zip(prompts, (3, second_new))]
    assert engine.cache.num_free == 2


@pytest.mark.parametrize("graphs,policy,plain_steps", [(True, "cost", 8), (False, "cost", 1), (True, "adaptive", 1)])
def test_the_planner_prices_plain_rounds_as_the_engine_runs_them(pair, graphs, policy, plain_steps):
    """The cost planner's plain rounds run in stretches of ``decode_steps`` behind one read on the static path (one
    read each without it, or under another policy), and it prices them so."""
    target, drafter = pair
    engine = Engine(target, drafter, length_policy=policy, max_slots=2, max_len=64, token_budget=64, cuda_graphs=graphs,
                    decode_steps=8)
    assert engine.planner.plain_steps == engine.decode_steps == plain_steps
