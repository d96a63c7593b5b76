"""CPU tests of the engine's Triton kernels, run in Triton's interpreter (``TRITON_INTERPRET=1``, set in
``conftest.py``): split-KV slot attention (:mod:`adaflash_hf.engine.kernels.decode_attention`) against SDPA with
the boolean slot mask, the few-row projections (:mod:`adaflash_hf.engine.kernels.skinny_linear`) against
``F.linear``, and both inside the static decode forward, the drafter forward and the engine.

The interpreter runs the kernels' own code (indexing, masking, the online softmax, the chunk merge);
speed and bfloat16 are checked on the GPU (``examples/engine_gpu_check.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from adaflash_hf.engine import Engine, layout_args
from adaflash_hf.engine.graphs import DecodeGraphs
from adaflash_hf.engine.kernels.fused import FusedTarget
from adaflash_hf.engine.target import PackedLayout, target_forward
from adaflash_hf.engine import drafter as drafter_module
from adaflash_hf.engine import graphs as graphs_module
from adaflash_hf.engine.kernels import skinny_linear as SL
from adaflash_hf.engine.kernels.attention import INACTIVE, SlotAttention
from adaflash_hf.engine.kernels.decode_attention import decode_attention, merge_partials, splits_for

from generation_helpers import engine_prompts, make_drafter, make_target, plain_greedy_ids, prefilled_cache


# ---------------------------------------------------------------- split-KV slot attention
# slots' starts, heads, kv heads, query rows, head dim, keys, causal, chunks, dtype
ATTENTION_CASES = [
    ([30, INACTIVE, 5], 8, 2, 1, 16, 40, True, 1, torch.float32),  # decode, one chunk, a padding row
    ([90, INACTIVE, 0], 8, 2, 4, 16, 100, True, 4, torch.float32),  # chunks, a slot with one key
    ([113, 2], 4, 4, 16, 32, 130, True, 2, torch.float32),  # MHA, a verify block, keys past one chunk
    ([60, INACTIVE, 7], 8, 2, 5, 16, 70, False, 3, torch.float32),  # the drafter's bidirectional block
    ([90, INACTIVE, 11], 8, 2, 4, 16, 100, True, 8, torch.float16),  # more chunks than a short slot fills
    ([127, 64], 16, 2, 8, 16, 128, True, 16, torch.float32),  # 8 heads per kv head x 8 rows = a 64-row tile
]


def _slot_inputs(starts, heads, kv_heads, q_len, d, kv_len, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(len(starts), h, n, d, generator=g).to(dtype)
               for h, n in ((heads, q_len), (kv_heads, kv_len), (kv_heads, kv_len)))
    return q, k, v


@pytest.mark.parametrize("starts,heads,kv_heads,q_len,d,kv_len,causal,splits,dtype", ATTENTION_CASES)
def test_decode_attention_equals_masked_sdpa(starts, heads, kv_heads, q_len, d, kv_len, causal, splits, dtype):
    q, k, v = _slot_inputs(starts, heads, kv_heads, q_len, d, kv_len, dtype)
    ref_att = SlotAttention(len(starts), kv_len, "cpu", "sdpa", causal=causal)
    ref_att.start.copy_(torch.tensor(starts, dtype=torch.int32))
    ref = torch.nan_to_num(ref_att(q.float(), k.float(), v.float(), ref_att.mask(q_len), d ** -0.5))
    out = decode_attention(q, k, v, ref_att.start, d ** -0.5, causal=causal, splits=splits)
    assert out.shape == q.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    inactive = torch.tensor(starts) == INACTIVE
    assert out[inactive].abs().max() == 0 if inactive.any() else True
    if causal and q_len > 1:  # negative control: the same kernel without the causal rule sees later keys
        wrong = decode_attention(q, k, v, ref_att.start, d ** -0.5, causal=False, splits=splits)
        assert not torch.allclose(wrong.float()[~inactive], ref[~inactive], atol=1e-2)


def test_slot_attention_triton_backend_reads_start_from_the_device_buffer():
    """``SlotAttention(backend="triton")``: ``mask()`` hands the kernel the live ``start`` buffer, so a
    forward after ``start`` changes (as in a CUDA-graph replay) uses the new starts."""
    q, k, v = _slot_inputs([0, 0], 4, 2, 2, 16, 64, torch.float32, seed=1)
    att, ref = SlotAttention(2, 64, "cpu", "triton"), SlotAttention(2, 64, "cpu", "sdpa")
    mask = att.mask(2)
    for starts in ([10, 40], [62, INACTIVE]):
        att.start.copy_(torch.tensor(starts, dtype=torch.int32))
        ref.start.copy_(att.start)
        expect = torch.nan_to_num(ref(q, k, v, ref.mask(2), 0.25))
        torch.testing.assert_close(att(q, k, v, mask, 0.25), expect, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="unknown attention backend"):
        SlotAttention(2, 64, "cpu", "cutlass")


def test_decode_attention_refuses_shapes_it_cannot_tile():
    q, k, v = _slot_inputs([3], 4, 2, 1, 8, 16, torch.float32)  # head_dim 8: below one tensor-core tile
    with pytest.raises(ValueError, match="head_dim 8"):
        decode_attention(q, k, v, torch.tensor([3], dtype=torch.int32), 0.3)
    q, k, v = _slot_inputs([3], 6, 4, 1, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="not a multiple"):
        decode_attention(q, k, v, torch.tensor([3], dtype=torch.int32), 0.3)


@pytest.mark.parametrize("chunks", [[5, 7, 4], [16], [1, 1, 30]])
def test_merge_partials_equals_one_softmax(chunks):
    """Attention computed chunk by chunk (each chunk's own max, base-2 scores) and merged == one softmax
    over all keys; an empty chunk (no visible key) contributes nothing; a row with no key at all is 0.
    Negative control: averaging the chunks' normalised outputs (a wrong merge) does not match."""
    g = torch.Generator().manual_seed(len(chunks))
    rows, d = 3, 8
    scores = torch.randn(rows, sum(chunks), generator=g) * 3
    values = torch.randn(sum(chunks), d, generator=g)
    expect = torch.softmax(scores * torch.log(torch.tensor(2.0)), dim=-1) @ values  # base-2 scores
    accs, ms, ls, outs = [], [], [], []
    for part_s, part_v in zip(scores.split(chunks, dim=1), values.split(chunks)):
        m = part_s.amax(dim=1)
        p = torch.exp2(part_s - m[:, None])
        accs.append(p @ part_v), ms.append(m), ls.append(p.sum(1)), outs.append(p @ part_v / p.sum(1)[:, None])
    empty = (torch.zeros(rows, d), torch.full((rows,), float("-inf")), torch.zeros(rows))
    acc, m, l = (torch.stack(list(x) + [e]) for x, e in zip((accs, ms, ls), empty))
    torch.testing.assert_close(merge_partials(acc, m, l), expect, atol=1e-5, rtol=1e-5)
    assert merge_partials(empty[0][None], empty[1][None], empty[2][None]).abs().max() == 0
    if len(chunks) > 1:
        assert not torch.allclose(torch.stack(outs).mean(0), expect, atol=1e-3)


@pytest.mark.parametrize("slots,rows,kv_len,expect", [
    (2, 4, 1152, 8), (2, 64, 1152, 4), (2, 4, 256, 4), (33, 4, 1152, 1), (129, 64, 1152, 1), (1, 4, 32, 1)])
def test_chunks_per_slot(slots, rows, kv_len, expect):
    """About one program per multiprocessor (132: the H200), half for 64-row tiles, never a chunk
    shorter than one key block: the choices the H200 probe measured fastest."""
    assert splits_for(slots, 8, kv_len, rows, sms=132) == expect


# ---------------------------------------------------------------- few-row projections
# rows, bias, gathered from the slot layout, dtype
LINEAR_CASES = [(1, False, False, torch.float32), (1, True, True, torch.float32), (3, True, False, torch.float32),
                (16, False, True, torch.float32), (5, True, True, torch.float16), (1, False, False, torch.float16)]


@pytest.mark.parametrize("rows,bias,gathered,dtype", LINEAR_CASES)
def test_skinny_linear_equals_f_linear(rows, bias, gathered, dtype):
    g = torch.Generator().manual_seed(rows)
    N, K, heads = 64, 128, 4
    w = (torch.randn(N, K, generator=g) / 8).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    if gathered:  # attention output [slot rows, heads, q, d]; row m at (slots[m], :, rows[m])
        x = torch.randn(4, heads, 3, K // heads, generator=g).to(dtype)
        where = (torch.randint(0, 4, (rows,), generator=g), torch.randint(0, 3, (rows,), generator=g))
        flat = x[where[0], :, where[1]].flatten(1)
    else:
        x = flat = torch.randn(rows, K, generator=g).to(dtype)
        where = None
    tile = SL.fitting(SL.ROW_CONFIGS if rows == 1 else SL.BLOCK_CONFIGS, w.shape, rows)[0]
    out = SL.skinny_linear(x, w, b, tile, gather=where)
    ref = F.linear(flat.float(), w.float(), None if b is None else b.float())
    assert out.shape == (rows, N) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_skinny_linear_tiles_and_bad_input():
    assert SL.fitting(SL.ROW_CONFIGS, (6144, 4096), 1) == list(SL.ROW_CONFIGS)  # Qwen3-8B qkv: every probe tile
    assert SL.fitting(SL.BLOCK_CONFIGS, (96, 48), 16) == [SL.SkinnyConfig(32, 16, 4)]  # small: the largest that divides
    assert SL.fitting(SL.ROW_CONFIGS, (96, 40), 1) == []  # 40 columns: no power-of-two step of 16
    w = torch.randn(64, 128)
    with pytest.raises(ValueError, match="17 rows"):
        SL.skinny_linear(torch.randn(17, 128), w, None, SL.SkinnyConfig(16, 64, 4))
    with pytest.raises(ValueError, match="tile"):
        SL.skinny_linear(torch.randn(1, 128), w, None, SL.SkinnyConfig(48, 64, 4))


# ---------------------------------------------------------------- inside the forwards and the engine
def _hd16_target(family="qwen3", **kw):
    return make_target(family, seed=3, hidden=64, **kw)  # head_dim 16: the smallest tile the attention kernel takes


@pytest.mark.parametrize("family,extra", [("qwen3", {}), ("llama", {"attention_bias": True, "mlp_bias": True})])
@pytest.mark.parametrize("q_lens", [[1], [3, 1, 4]])
def test_static_forward_with_triton_kernels_equals_eager(family, extra, q_lens, monkeypatch):
    """The static decode forward with every Triton kernel (attention; every projection: one row the
    matrix-vector kernel, 2-16 rows the tile kernel, ``o`` gathered from the slot layout; norm + RoPE +
    stores) == the eager packed forward through the HF modules; each projection really ran on Triton."""
    target = _hd16_target(family, **extra)
    prompts = engine_prompts([5, 9, 3][: len(q_lens)], seed=31)
    ref_cache, slots = prefilled_cache(target, prompts, 4, 32)
    cache, _ = prefilled_cache(target, prompts, 4, 32)
    every = {k: "triton" for k in FusedTarget(target, compile=False).row_kernels}
    fused = FusedTarget(target, compile=False, row_kernels=every, block_kernels=every, elementwise="triton")
    calls = []
    real = SL.skinny_linear
    monkeypatch.setattr(SL, "skinny_linear", lambda x, w, *a, **kw: calls.append(w.shape) or real(x, w, *a, **kw))
    graphs = DecodeGraphs(target, cache, [1], max_tokens=8, max_q=4, attention="triton", fused=fused)
    lay = PackedLayout.from_cache(cache, slots, q_lens)
    toks = torch.tensor(sum(engine_prompts(q_lens, seed=40), []))
    ref_logits, ref_hidden = target_forward(target, ref_cache, toks, lay.token_slots(), lay.positions(), lay, [1])
    logits, hidden = graphs.run(toks.tolist(), lay)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(hidden, ref_hidden, atol=1e-4, rtol=1e-4)
    n = cache.num_slots
    torch.testing.assert_close(cache.k[:, :n], ref_cache.k[:, :n], atol=1e-5, rtol=1e-5)
    assert len(calls) == 4 * len(target.model.layers) + 1  # qkv, o, gate_up, down per layer + the LM head
    assert graphs.attention.backend == "triton" and graphs.attention_note == ""
    assert FusedTarget(target, compile=False).elementwise == "torch"  # CPU default: the torch functions
    with pytest.raises(ValueError, match="elementwise"):
        FusedTarget(target, compile=False, elementwise="cuda")
    with pytest.raises(ValueError, match="head_dim 12"):
        FusedTarget(make_target(family, hidden=48), compile=False, elementwise="triton")


@pytest.mark.parametrize("mode", ["packed", "off"])
def test_engine_with_triton_kernels_is_lossless(mode, monkeypatch):
    """The engine's static path with every Triton kernel (attention in the target and drafter forwards,
    every projection, norm + RoPE + store), as on CUDA: every request's greedy output equals its plain
    greedy decoding (``off``: several greedy steps per device read), and no slot leaks."""
    for module in (graphs_module, drafter_module):
        monkeypatch.setattr(module, "default_backend", lambda device: "triton")
    every = dict.fromkeys(("qkv", "o", "gate_up", "down", "lm_head"), "triton")
    monkeypatch.setattr(FusedTarget, "build", classmethod(lambda cls, model, compile=None: (
        cls(model, False, row_kernels=every, block_kernels=every, elementwise="triton"), "")))
    target = _hd16_target(layers=2)  # two layers: every kernel still runs; each interpreted launch is costly
    drafter = make_drafter(target, block_size=4)
    prompts = engine_prompts([3, 9, 5], seed=7)
    eng = Engine(target, **layout_args(drafter, mode), max_slots=2, max_len=32, cuda_graphs=True)
    # 4 new tokens (3 rounds per request; 6 took 5): the same target buckets and drafter graph kinds replay, a third
    # request still waits for a freed slot, and each round re-reads the keys stored before it
    outs = eng.generate(prompts, max_new_tokens=4)
    assert [o.token_ids for o in outs] == [plain_greedy_ids(target, p, 4) for p in prompts]
    assert eng.graphs.attention.backend == "triton" and eng.cache.num_free == 2
    assert eng.fused.elementwise == "triton" and set(eng.fused.row_kernels.values()) == {"triton"}
    if mode == "packed":
        assert eng.draft_graphs.attention.backend == "triton" and eng.draft_graphs.attention.causal is False
        assert eng.draft_graphs.fused is eng.fused  # the drafter's layers on the same Triton kernels


@pytest.mark.parametrize("family,dtype", [("qwen3", torch.float32), ("llama", torch.float32), ("qwen3", torch.float16)])
def test_rope_store_kernel_equals_the_torch_function(family, dtype):
    """One kernel for q/k norm + RoPE + the K/V and query stores == :func:`fused.qk_norm_rope_store`
    (values and every written place; nothing else of the cache or the query layout is touched)."""
    from adaflash_hf.engine.kernels.elementwise import SlotStore, qk_norm_rope_store
    from adaflash_hf.engine.kernels.rope_store import qk_norm_rope_store_triton

    model = _hd16_target(family).to(dtype)
    attn = model.model.layers[0].self_attn
    T, hq, hkv, d = 5, 4, 2, attn.head_dim
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q, k, v = (t.view(T, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))  # strided views, as in the forward
    positions = torch.tensor([3, 4, 9, 0, 7])
    cos, sin = model.model.rotary_emb(q[None], positions[None])
    qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    norms = (qn.weight, kn.weight, qn.variance_epsilon) if qn is not None else (None, None, 0.0)
    outs = []
    for fn in (qk_norm_rope_store, qk_norm_rope_store_triton):
        kc = torch.full((2, 4, hkv, 16, d), 7.0, dtype=dtype)
        vc = kc.clone()
        q_out = torch.full((4, hq, 3, d), -5.0, dtype=dtype)
        store = SlotStore(kc, vc, torch.tensor([1]), torch.tensor([0, 0, 2, 3, 1]), positions, q_out,
                          torch.tensor([0, 0, 2, 3, 1]), torch.tensor([0, 1, 0, 2, 1]))
        assert fn(q, k, v, *norms, cos[0], sin[0], *store) is q_out
        outs.append((kc, vc, q_out))
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    for ref, got in zip(*outs):
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    assert (outs[1][0][0] == 7.0).all() and (outs[1][2][:, :, 0] != -5.0).any()  # layer 0 untouched, queries written


# family, dtype, hidden (a width that is not a power of two: the norm kernel's masked columns)
ELEMENTWISE_CASES = [("qwen3", torch.float32, 64), ("llama", torch.float32, 64), ("qwen3", torch.float16, 64),
                     ("qwen3", torch.float32, 96)]


@pytest.mark.parametrize("family,dtype,hidden", ELEMENTWISE_CASES)
def test_elementwise_kernels_equal_the_torch_functions(family, dtype, hidden):
    """Each Triton elementwise kernel (:mod:`adaflash_hf.engine.kernels.norms`, and the store kernel) == its torch
    function on the model's shapes: the norms with and without the residual add, q/k norm + RoPE (the q layout
    transposed), the keys' norm + RoPE, SiLU(gate) * up, and what the store writes to the caches."""
    from adaflash_hf.engine.kernels.norms import elementwise_cases, written

    model = make_target(family, seed=3, hidden=hidden, head_dim=16).to(dtype)
    with torch.no_grad():  # norm weights start at one: make the weighting count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    torch_fns = FusedTarget(model, compile=False)
    kernels = FusedTarget(model, compile=False, elementwise="triton")
    assert kernels.rms_norm is not torch_fns.rms_norm and kernels.act_mul is not torch_fns.act_mul
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    cases = elementwise_cases(torch_fns)
    assert set(cases) == {"rms_norm", "add_rms_norm", "qk_norm_rope", "qk_norm_rope_store", "act_mul", "norm_rope"}
    for name, make in cases.items():
        ref, got = written(name, getattr(torch_fns, name), make()), written(name, getattr(kernels, name), make())
        assert len(ref) == len(got), name
        for a, b in zip(ref, got):
            assert a.shape == b.shape and a.dtype == b.dtype, name
            torch.testing.assert_close(b, a, atol=tol, rtol=tol, msg=name)
    # Negative control: the torch norm without its weight is told apart at this tolerance.
    h, weight, eps = cases["rms_norm"]()
    assert not torch.allclose(kernels.rms_norm(h, weight, eps), torch_fns.rms_norm(h, torch.ones_like(weight), eps), atol=tol)


def test_elementwise_kernels_are_checked_before_use():
    """``check_elementwise`` keeps the Triton kernels when each agrees with its torch function and falls back to
    the torch functions (with a note naming the function) when one does not; the negative control is a store
    without the q/k norm."""
    from adaflash_hf.engine.kernels import elementwise

    target = _hd16_target()
    fused = FusedTarget(target, compile=False, elementwise="triton")
    assert fused.check_elementwise() == "triton" and fused.elementwise_note == ""

    def no_norm(q, k, v, qw, kw, eps, cos, sin, *store):
        return elementwise.qk_norm_rope_store(q, k, v, None, None, eps, cos, sin, *store)

    wrong = FusedTarget(target, compile=False, elementwise="triton")
    wrong.qk_norm_rope_store = no_norm
    assert wrong.check_elementwise() == "torch" and "qk_norm_rope_store differ" in wrong.elementwise_note
    assert wrong.qk_norm_rope_store is elementwise.qk_norm_rope_store and wrong.rms_norm is elementwise.rms_norm


@pytest.mark.parametrize("change,why", [({"hidden_act": "gelu"}, "not SiLU"), ({"head_dim": 12}, "head_dim 12")])
def test_elementwise_kernels_refuse_what_they_do_not_compute(change, why):
    """A model whose activation is not SiLU, or whose head size the RoPE kernels do not take, keeps the torch
    functions; asking for the kernels says why."""
    model = make_target("qwen3", seed=3, hidden=64, **change)
    with pytest.raises(ValueError, match=why):
        FusedTarget(model, compile=False, elementwise="triton")
    assert FusedTarget(model, compile=False).elementwise == "torch"
