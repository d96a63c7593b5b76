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

from adaflash_hf.engine import Engine, layout_args
from adaflash_hf.engine.graphs import DecodeGraphs
from adaflash_hf.engine.kernels.fused import FusedTarget
from adaflash_hf.engine.target import PackedLayout, make_target_cache, target_forward
from adaflash_hf.engine.kernels import elementwise as E
from adaflash_hf.engine.kernels import fused as F
from adaflash_hf.engine.kernels import stock_layers

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
        assert torch.equal(E.rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))
        h, normed = E.add_rms_norm(x, d, norm.weight, norm.variance_epsilon)
        assert torch.equal(h, x + d) and torch.equal(normed, norm(x + d))
        q = attn.q_proj(x).view(1, T, -1, attn.head_dim)
        k = attn.k_proj(x).view(1, T, -1, attn.head_dim)
        cos, sin = model.model.rotary_emb(x[None], torch.arange(7, 7 + T)[None])
        q2, k2 = (attn.q_norm(q), attn.k_norm(k)) if hasattr(attn, "q_norm") else (q, k)
        ref_q, ref_k = rope(q2.transpose(1, 2), k2.transpose(1, 2), cos, sin)
        qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        got_q, got_k = E.qk_norm_rope(q[0], k[0], qn.weight if qn else None, kn.weight if kn else None,
                                      qn.variance_epsilon if qn else 0.0, cos[0], sin[0])
        assert torch.equal(got_q, ref_q[0]) and torch.equal(got_k, ref_k[0].transpose(0, 1))
        mlp = layer.mlp
        gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
        assert torch.equal(E._act_mul(mlp.act_fn)(gate_up), mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))


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
    with pytest.warns(RuntimeWarning, match="fused kernels off.*nn.Linear"):
        eng = Engine(lora, None, max_slots=2, max_len=32)
    assert eng.fused is None and "nn.Linear" in eng.fusion_note
    prompt = engine_prompts([6], seed=2)[0]
    assert eng.generate([prompt], max_new_tokens=6)[0].token_ids == plain_greedy_ids(lora, prompt, 6)
    assert Engine(make_target("qwen3"), None, fused_kernels=False).fusion_note == "fused_kernels=False"


@pytest.mark.parametrize("name", ["rms_norm", "add_rms_norm", "qk_norm_rope"])
def test_elementwise_functions_trace_whole_for_compilation(name):
    """fullgraph tracing (what torch.compile needs for one kernel per function) and the same numbers."""
    torch._dynamo.reset()
    fn = getattr(E, name)
    g = torch.Generator().manual_seed(0)
    x, d, w = (torch.randn(6, 4, 8, generator=g).to(torch.bfloat16) for _ in range(3))
    cos, sin = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    args = {"rms_norm": (x, w[0, 0], 1e-6), "add_rms_norm": (x, d, w[0, 0], 1e-6),
            "qk_norm_rope": (x, d[:, :2], w[0, 0], w[0, 1], 1e-6, cos.bfloat16(), sin.bfloat16())}[name]
    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    for a, b in zip(compiled(*args) if isinstance(fn(*args), tuple) else (compiled(*args),),
                    fn(*args) if isinstance(fn(*args), tuple) else (fn(*args),)):
        assert torch.equal(a, b)


def test_compiled_functions_may_recompile_for_every_bucket():
    """A compiled fused function sees a new shape per token / slot-row / query bucket (an engine reaches a few
    dozen): past Dynamo's default limit of 8 a ``fullgraph`` function fails (the control); a compiled
    FusedTarget raises the limit so it compiles on."""

    def run_shapes(n):
        torch._dynamo.reset()
        fn = torch.compile(F._linear, backend="eager", fullgraph=True, dynamic=False)
        for rows in range(1, n + 1):
            fn(torch.ones(rows, 4), torch.ones(3, 4), None)

    # config.patch, not monkeypatch: undoing a monkeypatch on Dynamo's config module can hide the key for good
    with torch._dynamo.config.patch(recompile_limit=8):
        with pytest.raises(Exception, match="fullgraph"):  # FailOnRecompileLimitHit
            run_shapes(12)
        F.FusedTarget(make_target("qwen3"), compile=True)
        run_shapes(12)
        assert torch._dynamo.config.recompile_limit >= 128


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


def test_transformers_output_capturing_hooks_are_recognised_and_only_they():
    """Tripwire for the one transformers internal :func:`stock_layers.foreign_hooks` reads: the code of the hook
    ``transformers.utils.output_capturing`` installs the first time hidden states are requested."""
    assert stock_layers._RECORDING_HOOK is not None, (
        "transformers' output-capturing hook moved: update stock_layers._output_capturing_code")
    target = make_target("qwen3")
    target.generate(torch.tensor([[3, 4, 5]]), do_sample=False, max_new_tokens=2, output_hidden_states=True,
                    return_dict_in_generate=True)
    hooked = [m for m in target.modules() if m._forward_hooks]
    assert hooked, "transformers no longer leaves forward hooks after output_hidden_states=True"
    assert all(stock_layers.foreign_hooks(m) == [] for m in hooked)
    layer = target.model.layers[0]
    handle = layer.register_forward_hook(lambda m, i, o: o)
    assert stock_layers.foreign_hooks(layer) == ["test_transformers_output_capturing_hooks_are_recognised_and_only_they.<locals>.<lambda>"]
    handle.remove()


def _plain_hidden(target, drafter, ids):
    target.generate(ids, do_sample=False, max_new_tokens=3, output_hidden_states=True, return_dict_in_generate=True)


def _ours(target, drafter, ids):
    target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=5)


def _native_dflash(target, drafter, ids):
    target.generate(ids, assistant_model=drafter, speculation_type="dflash", do_sample=False, max_new_tokens=5)


@pytest.mark.parametrize("before", [_plain_hidden, _ours, _native_dflash])
def test_engine_built_after_any_generate_call_fuses_and_is_lossless(before, recwarn):
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4)
    prompts = engine_prompts([5, 9], seed=4)
    refs = [plain_greedy_ids(target, p, 8) for p in prompts]
    before(target, drafter, torch.tensor([prompts[0]]))
    assert any(m._forward_hooks for m in target.modules())  # transformers' hooks are there
    eng = Engine(target, drafter, length_policy="fixed", max_slots=2, max_len=48, cuda_graphs=True)
    assert eng.fused is not None and eng.fusion_note == ""
    assert not [w for w in recwarn if "fused kernels off" in str(w.message)]
    assert [o.token_ids for o in eng.generate(prompts, max_new_tokens=8)] == refs


def test_a_hook_that_may_change_a_forward_turns_fusion_off_with_a_warning():
    target = make_target("qwen3")
    target.model.layers[2].self_attn.register_forward_pre_hook(lambda m, a: None)
    with pytest.warns(RuntimeWarning, match="fused kernels off.*layer 2: Qwen3Attention has forward hooks"):
        eng = Engine(target, None, max_slots=1, max_len=32)
    assert eng.fused is None


def _footprint(model) -> tuple:
    """What a library could leave on a model: module attributes, hooks, parameters and buffers."""
    modules = {name: (sorted(vars(m)), [h.__code__ for h in m._forward_hooks.values()],
                      list(m._forward_pre_hooks.values())) for name, m in model.named_modules()}
    tensors = {k: v.clone() for k, v in model.state_dict().items()}
    return modules, tensors, model.generation_config.to_dict()


def test_our_generate_and_engine_leave_nothing_of_their_own_on_the_target():
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    ids = torch.tensor([[7, 8, 9, 10]])
    _plain_hidden(target, drafter, ids)  # transformers' own hooks and flag: theirs, present before and after
    modules, tensors, config = _footprint(target)
    _ours(target, drafter, ids)
    Engine(target, drafter, length_policy="adaptive", max_slots=2, max_len=32, cuda_graphs=True).generate([[1, 2, 3]], 4)
    after_modules, after_tensors, after_config = _footprint(target)
    assert after_modules == modules and after_config == config
    assert after_tensors.keys() == tensors.keys() and all(torch.equal(tensors[k], after_tensors[k]) for k in tensors)


def _fake_tuner(fused, calls: list) -> None:
    """Stand-ins for the CUDA-only measurements: they record the call and choose Inductor's one-row kernel."""

    def tune():
        calls.append("tune")
        fused.row_kernels = {**fused.row_kernels, "qkv": "gemv", "lm_head": "gemv"}
        fused.row_timings = {"qkv x1": {"cublas": 2.0, "gemv": 1.0}}
        return dict(fused.row_kernels)

    def check():
        calls.append("check")
        return fused.elementwise

    fused.tune_row_kernels, fused.check_elementwise = tune, check


def _fresh(dtype=torch.float32, calls=None):
    """A FusedTarget of a new model object (what a new process sees: nothing tuned in memory)."""
    fused = FusedTarget(make_target("qwen3", seed=len(calls)).to(dtype), compile=False)
    _fake_tuner(fused, calls)
    return fused


def test_kernel_choices_are_saved_once_and_read_back_by_the_next_process(tmp_path, monkeypatch):
    monkeypatch.delenv("ADAFLASH_HF_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = tmp_path / "adaflash_hf" / "kernels"
    calls = []
    first = _fresh(calls=calls)
    assert first.load_or_tune() == "tuned" and calls == ["tune", "check"]
    assert len(list(folder.glob("*.json"))) == 1 and not list(folder.glob("*.tmp"))
    second = _fresh(calls=calls)
    assert second.load_or_tune() == "disk" and calls == ["tune", "check"]  # nothing measured again
    assert second.tuning_choices() == first.tuning_choices() and second.row_kernels["qkv"] == "gemv"
    assert second.load_or_tune() == "memory"
    other = _fresh(torch.bfloat16, calls)  # another dtype is another key
    assert other.load_or_tune() == "tuned" and len(list(folder.glob("*.json"))) == 2


@pytest.mark.parametrize("damage,warning", [
    (lambda text: text[: len(text) // 2], "ignoring the kernel tuning cache file"),
    (lambda text: text.replace('"gemv"', '"cutlass"'), "do not fit this model"),
])
def test_a_damaged_tuning_file_is_ignored_with_a_warning_and_rewritten(tmp_path, monkeypatch, damage, warning):
    monkeypatch.setenv("ADAFLASH_HF_CACHE", str(tmp_path))
    calls = []
    _fresh(calls=calls).load_or_tune()
    (path,) = (tmp_path / "kernels").glob("*.json")
    path.write_text(damage(path.read_text()))
    again = _fresh(calls=calls)
    with pytest.warns(RuntimeWarning, match=warning):
        assert again.load_or_tune() == "tuned"
    assert calls == ["tune", "check"] * 2 and _fresh(calls=calls).load_or_tune() == "disk"


def test_fusing_under_inference_mode_leaves_normal_updatable_weights():
    target = make_target("qwen3")
    with torch.inference_mode():
        Engine(target, None, max_slots=1, max_len=32)
    assert not any(p.is_inference() for p in target.parameters())
    target.load_state_dict(target.state_dict())  # in place: fails on inference tensors
