"""CPU tests of the engine's fused target layers (:mod:`adaflash_hf.engine.kernels.fused`): the elementwise
functions are the HF modules' math bit for bit, fusing the projections re-stores the weights without
changing any value or the model's own forward, the fused layer loop equals the modules' loop, and
what cannot be fused is refused with a reason (the engine then keeps the modules' path).

The compiled kernels themselves run on the GPU (``examples/engine_gpu_check.py``); here dynamo
traces every function whole (``fullgraph``, eager backend), which is what compiling them needs.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from adaflash_hf.engine import DecodeGraphs, Engine, FusedTarget, PackedLayout, layout_args, make_target_cache, target_forward
from adaflash_hf.engine.kernels import fused as F

from generation_helpers import engine_prompts, make_drafter, make_target, plain_greedy_ids

CASES = [  # family, dtype, extra config (biases exercise the fused bias path)
    ("qwen3", torch.float32, {}),
    ("qwen3", torch.bfloat16, {}),
    ("llama", torch.float32, {}),
    ("llama", torch.bfloat16, {"attention_bias": True, "mlp_bias": True}),
]


def _model(family, dtype, extra):
    return make_target(family, **extra).to(dtype)


@pytest.mark.parametrize("family,dtype,extra", CASES)
@pytest.mark.parametrize("T", [1, 5, 37])
def test_elementwise_functions_are_the_hf_modules_bit_for_bit(family, dtype, extra, T):
    model = _model(family, dtype, extra)
    layer = model.model.layers[1]
    attn = layer.self_attn
    rope = importlib.import_module(f"transformers.models.{family}.modeling_{family}").apply_rotary_pos_emb
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, model.config.hidden_size, generator=g).to(dtype)
    d = torch.randn(T, model.config.hidden_size, generator=g).to(dtype)
    norm = layer.input_layernorm
    with torch.no_grad():
        assert torch.equal(F.rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))
        h, normed = F.add_rms_norm(x, d, norm.weight, norm.variance_epsilon)
        assert torch.equal(h, x + d) and torch.equal(normed, norm(x + d))
        q = attn.q_proj(x).view(1, T, -1, attn.head_dim)
        k = attn.k_proj(x).view(1, T, -1, attn.head_dim)
        cos, sin = model.model.rotary_emb(x[None], torch.arange(7, 7 + T)[None])
        q2, k2 = (attn.q_norm(q), attn.k_norm(k)) if hasattr(attn, "q_norm") else (q, k)
        ref_q, ref_k = rope(q2.transpose(1, 2), k2.transpose(1, 2), cos, sin)
        qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        got_q, got_k = F.qk_norm_rope(q[0], k[0], qn.weight if qn else None, kn.weight if kn else None,
                                      qn.variance_epsilon if qn else 0.0, cos[0], sin[0])
        assert torch.equal(got_q, ref_q[0]) and torch.equal(got_k, ref_k[0].transpose(0, 1))
        mlp = layer.mlp
        gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
        assert torch.equal(F._act_mul(mlp.act_fn)(gate_up), mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))


@pytest.mark.parametrize("family,dtype,extra", CASES)
def test_fusing_restores_weights_as_views_and_keeps_the_model_unchanged(family, dtype, extra):
    model = _model(family, dtype, extra)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    fused, why = FusedTarget.build(model)
    assert fused is not None and why == "" and not fused.compiled  # CPU: eager functions
    for layer, w in zip(model.model.layers, fused.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for p in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight):
            assert p.untyped_storage().data_ptr() == w.qkv.untyped_storage().data_ptr()
        for p in (mlp.gate_proj.weight, mlp.up_proj.weight):
            assert p.untyped_storage().data_ptr() == w.gate_up.untyped_storage().data_ptr()
        assert (w.qkv_bias is not None) == bool(extra.get("attention_bias"))
        assert (w.gate_up_bias is not None) == bool(extra.get("mlp_bias"))
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)
    # An in-place update reaches the fused tensor (the engine reads weights by address) ...
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.add_(1.0)
    q_rows = model.model.layers[0].self_attn.q_proj.out_features
    assert torch.equal(fused.layers[0].qkv[q_rows : q_rows + 1], model.model.layers[0].self_attn.k_proj.weight[:1])
    # ... and building again reuses the storage instead of copying the weights a second time.
    again, _ = FusedTarget.build(model)
    assert all(a.qkv.data_ptr() == b.qkv.data_ptr() and a.gate_up.data_ptr() == b.gate_up.data_ptr()
               for a, b in zip(fused.layers, again.layers))


@pytest.mark.parametrize("family,dtype,extra", CASES)
@pytest.mark.parametrize("hidden_layers", [None, [0, 2]])
def test_fused_layer_loop_equals_the_modules(family, dtype, extra, hidden_layers):
    """target_forward with FusedTarget == through the HF modules: logits, hidden states and written K/V.
    Identical in float32; in bf16 the fused GEMM may round a few entries differently."""
    model = _model(family, dtype, extra)
    fused, _ = FusedTarget.build(model)
    outs = []
    for f in (None, fused):
        cache = make_target_cache(model, 3, 32)
        slots = [cache.alloc() for _ in range(2)]
        layout = PackedLayout.from_cache(cache, slots, [5, 3])
        tokens = torch.arange(8) % model.config.vocab_size + 3
        logits, hidden = target_forward(model, cache, tokens, layout.token_slots(), layout.positions(), layout,
                                        hidden_layers, fused=f)
        outs.append((logits, hidden, cache.k.clone(), cache.v.clone()))
    exact = dtype == torch.float32
    for a, b in zip(outs[0], outs[1]):
        if a is None:
            assert b is None
            continue
        assert torch.equal(a, b) if exact else torch.allclose(a.float(), b.float(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_fused_engine_is_lossless_in_every_mode(family):
    target = make_target(family)
    drafter = make_drafter(target, block_size=8)
    prompts = engine_prompts([3, 7, 12, 5], seed=1)
    refs = [plain_greedy_ids(target, p, 12) for p in prompts]
    for mode in ("packed", "fixed", "off"):
        eng = Engine(target, **layout_args(drafter, mode), max_slots=4, max_len=64, cuda_graphs=True)
        assert eng.fused is not None and eng.graphs.fused is eng.fused
        assert [o.token_ids for o in eng.generate(prompts, max_new_tokens=12)] == refs


def test_unsupported_layers_keep_the_modules_path_with_a_reason():
    peft = pytest.importorskip("peft")
    target = make_target("qwen3")
    handle = target.model.layers[1].mlp.register_forward_hook(lambda m, i, o: o)
    fused, why = FusedTarget.build(target)
    assert fused is None and "layer 1" in why and "hooks" in why
    handle.remove()
    lora = peft.get_peft_model(make_target("qwen3"), peft.LoraConfig(r=2, target_modules=["q_proj"])).base_model.model
    fused, why = FusedTarget.build(lora)
    assert fused is None and "not a plain nn.Linear" in why
    eng = Engine(lora, None, max_slots=2, max_len=32)
    assert eng.fused is None and "nn.Linear" in eng.fusion_note
    prompt = engine_prompts([6], seed=2)[0]
    assert eng.generate([prompt], max_new_tokens=6)[0].token_ids == plain_greedy_ids(lora, prompt, 6)
    assert Engine(make_target("qwen3"), None, fused_kernels=False).fusion_note == "fused_kernels=False"


@pytest.mark.parametrize("name", ["rms_norm", "add_rms_norm", "qk_norm_rope"])
def test_elementwise_functions_trace_whole_for_compilation(name):
    """fullgraph tracing (what torch.compile needs for one kernel per function) and the same numbers."""
    torch._dynamo.reset()
    fn = getattr(F, name)
    g = torch.Generator().manual_seed(0)
    x, d, w = (torch.randn(6, 4, 8, generator=g).to(torch.bfloat16) for _ in range(3))
    cos, sin = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    args = {"rms_norm": (x, w[0, 0], 1e-6), "add_rms_norm": (x, d, w[0, 0], 1e-6),
            "qk_norm_rope": (x, d[:, :2], w[0, 0], w[0, 1], 1e-6, cos.bfloat16(), sin.bfloat16())}[name]
    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    for a, b in zip(compiled(*args) if isinstance(fn(*args), tuple) else (compiled(*args),),
                    fn(*args) if isinstance(fn(*args), tuple) else (fn(*args),)):
        assert torch.equal(a, b)


def test_replaced_weights_are_refused_before_any_work():
    """model.to(...) after building the engine re-allocates every parameter: the fused weights would be
    stale, so the next request is refused with a message that says what happened."""
    target = make_target("qwen3")
    eng = Engine(target, None, max_slots=2, max_len=32)
    prompt = engine_prompts([5], seed=3)[0]
    assert eng.generate([prompt], max_new_tokens=4)[0].token_ids == plain_greedy_ids(target, prompt, 4)
    target.to(torch.float64)
    with pytest.raises(RuntimeError, match="replaced after the engine was built"):
        eng.submit(prompt, 4)
    assert eng.num_queued == 0 and eng.num_running == 0


@pytest.mark.parametrize("family,dtype,extra", CASES)
def test_row_kernel_dispatch_equals_cublas_path(family, dtype, extra):
    """With every one-row projection routed to its own function (what ``row_kernels="gemv"`` compiles
    on CUDA; eager here; Triton's kernels: ``tests/test_engine_triton.py``), a one-token static decode forward equals the HF modules' (bit for bit in
    float32), o_proj gathering from the slot layout included; forwards of more tokens never take them."""
    model = _model(family, dtype, extra)
    routed = FusedTarget(model, compile=False, row_kernels={k: "gemv" for k in F.ROW_PROJECTIONS})
    calls = []
    routed._row_fns = {k: (lambda f, k=k: lambda *a: calls.append(k) or f(*a))(f) for k, f in routed._row_fns.items()}
    for q_lens, expect_calls in (([1], True), ([3, 1], False)):
        outs = []
        for f in (None, routed):
            cache = make_target_cache(model, 3, 16, spare_slots=1)
            slots = [cache.alloc() for _ in range(3)][1:]  # slot rows 1, 2: the gather must pick the right row
            for s in slots:
                cache.advance(s, 2)
            graphs = DecodeGraphs(model, cache, None, max_tokens=4, max_q=4, fused=f)
            layout = PackedLayout.from_cache(cache, slots[: len(q_lens)], q_lens)
            outs.append(graphs.run(list(range(5, 5 + sum(q_lens))), layout)[0])
        a, b = outs
        assert torch.equal(a, b) if dtype == torch.float32 else torch.allclose(a, b, atol=0.05, rtol=0.02)
        assert bool(calls) == expect_calls
        if expect_calls:
            n = len(model.model.layers)
            assert sorted(calls) == sorted(["qkv"] * n + ["o"] * n + ["gate_up"] * n + ["down"] * n + ["lm_head"])
            calls.clear()


def test_row_kernels_are_validated_and_tuned_only_on_cuda():
    model = make_target("qwen3")
    with pytest.raises(ValueError, match="row_kernels"):
        FusedTarget(model, compile=False, row_kernels={"attn": "gemv"})
    with pytest.raises(ValueError, match="row_kernels"):
        FusedTarget(model, compile=False, row_kernels={"qkv": "cutlass"})
    with pytest.raises(ValueError, match="block_kernels"):  # Inductor's reduction is a one-row kernel
        FusedTarget(model, compile=False, block_kernels={"qkv": "gemv"})
    odd = make_target("qwen3", intermediate_size=72)  # no power-of-two step of 16 divides 72 features
    with pytest.raises(ValueError, match="no Triton tile"):
        FusedTarget(odd, compile=False, row_kernels={"down": "triton"})
    fused, _ = FusedTarget.build(model)
    assert fused.row_kernels == fused.block_kernels == {k: "cublas" for k in F.ROW_PROJECTIONS} and not fused.row_timings
    with pytest.raises(RuntimeError, match="CUDA"):
        fused.tune_row_kernels()


@pytest.mark.parametrize("family,dtype,extra", CASES)
def test_static_fused_forward_stores_like_the_modules(family, dtype, extra):
    """The static decode path with the fused layers (RoPE, K/V writes and query layout in one function,
    :class:`SlotStore`) == the same path through the HF modules: logits and every cache entry, padding
    and a second bucket included (float32: bit for bit)."""
    model = _model(family, dtype, extra)
    fused, _ = FusedTarget.build(model)
    results = []
    for f in (None, fused):
        cache = make_target_cache(model, 3, 32, spare_slots=1)
        slots = [cache.alloc() for _ in range(2)]
        prompt = PackedLayout.from_cache(cache, slots, [4, 6])
        target_forward(model, cache, torch.arange(10) + 2, prompt.token_slots(), prompt.positions(), prompt)
        for s, n in zip(slots, (4, 6)):
            cache.advance(s, n)
        graphs = DecodeGraphs(model, cache, None, max_tokens=8, max_q=4, fused=f)
        out = [graphs.run([7, 8, 9, 10], PackedLayout.from_cache(cache, slots, [3, 1]))[0]]
        out.append(graphs.run([11, 12], PackedLayout.from_cache(cache, slots, [1, 1]))[0])
        results.append(out + [cache.k.clone(), cache.v.clone()])
    for a, b in zip(*results):
        assert torch.equal(a, b) if dtype == torch.float32 else torch.allclose(a.float(), b.float(), atol=0.05, rtol=0.02)
