"""AdaFlashDrafter: shapes, keys, attention semantics, cache, length head, target binding, native DFlash path."""

import copy

import pytest
import torch
from conftest import (
    FAMILIES,
    TINY,
    block_embeds,
    build_drafter,
    build_tiny_target,
    drafter_inputs,
    spec_dflash_keys,
    spec_head_keys,
    spec_shapes,
    target_context,
)
from safetensors import safe_open
from transformers.cache_utils import DFlashCache

from adaflash_hf import AdaFlashConfig, AdaFlashDrafter

FAMILY = pytest.mark.parametrize("family", FAMILIES)


def _forward(drafter, **inputs):
    with torch.no_grad():
        return drafter(**inputs).last_hidden_state


# ----------------------------------------------------------------------------- shapes and keys
@FAMILY
@pytest.mark.parametrize("num_layers, block_size, batch, ctx_len", [(1, 4, 1, 3), (2, 8, 2, 6), (3, 16, 3, 5)])
def test_forward_shape(family, num_layers, block_size, batch, ctx_len):
    target = build_tiny_target(family)
    drafter = build_drafter(target, num_layers=num_layers, block_size=block_size)
    inputs = drafter_inputs(drafter, target, batch=batch, ctx_len=ctx_len)
    assert inputs["context_hidden_states"].shape == (batch, ctx_len, len(drafter.config.target_layer_ids) * TINY["hidden"])
    out = _forward(drafter, **inputs)
    assert out.shape == (batch, block_size, TINY["hidden"])
    assert torch.isfinite(out).all()
    # The target's LM head turns slots 1..B-1 into B-1 draft distributions over the target vocabulary.
    logits = drafter.compute_logits(out[:, 1:])
    assert logits.shape == (batch, block_size - 1, TINY["vocab"])


@FAMILY
@pytest.mark.parametrize("num_layers, target_layer_ids, use_length_head", [(1, None, True), (3, [0, 3], True), (2, [1, 2, 3], False)])
def test_state_dict_keys_match_spec(family, tmp_path, num_layers, target_layer_ids, use_length_head):
    target = build_tiny_target(family)
    drafter = build_drafter(
        target, num_layers=num_layers, target_layer_ids=target_layer_ids, use_length_head=use_length_head, length_head_dim=24
    )
    K = len(drafter.config.target_layer_ids)
    expected_keys = set(spec_dflash_keys(num_layers)) | (set(spec_head_keys("length_head.")) if use_length_head else set())
    state = drafter.state_dict()
    assert set(state) == expected_keys
    shapes = spec_shapes(
        TINY["hidden"], TINY["intermediate"], num_layers, TINY["heads"], TINY["kv_heads"], TINY["hidden"] // TINY["heads"], K,
        head_dim_len=24, head_prefix="length_head." if use_length_head else None,
    )  # fmt: skip
    assert {k: tuple(v.shape) for k, v in state.items()} == shapes

    # The target's embedding and LM head are used, never owned: not among parameters, not saved.
    target_ptrs = {p.data_ptr() for p in target.parameters()}
    assert not any(p.data_ptr() in target_ptrs for p in drafter.parameters())
    assert not any("embed" in n or "lm_head" in n for n, _ in drafter.named_parameters())
    assert sum(p.numel() for p in drafter.parameters()) == sum(
        torch.Size(s).numel() for s in shapes.values()
    ), "the drafter owns exactly the SPEC tensors"
    drafter.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        saved = set(f.keys())
    assert saved == expected_keys


# ----------------------------------------------------------------------------- SPEC reference forward
def _reference_forward(drafter, noise, ctx_raw, positions):
    """SPEC section 1 written out with plain torch ops and the drafter's weights (no transformers code).

    ctx = hidden_norm(fc(concat)); per layer: queries from the normed block, K/V from
    [ctx (NOT normed) | normed block] with the layer's own k_proj / v_proj, q_norm / k_norm, RoPE at
    absolute positions, no mask at all (full context + bidirectional block), o_proj, residual, SwiGLU.
    """
    c = drafter.config
    eps, hd, nq, nkv = c.rms_norm_eps, c.head_dim, c.num_attention_heads, c.num_key_value_heads

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    theta = c.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    angles = positions[..., None].float() * inv_freq  # [b, T+B, hd/2]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]

    def rope(x, cos, sin):
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    b, B, _ = noise.shape
    ctx = rms(ctx_raw @ drafter.fc.weight.T, drafter.hidden_norm.weight)
    T = ctx.shape[1]
    h = noise
    for layer in drafter.layers:
        a = layer.self_attn
        x = rms(h, layer.input_layernorm.weight)
        kv_in = torch.cat([ctx, x], dim=1)
        q = rms((x @ a.q_proj.weight.T).view(b, B, nq, hd), a.q_norm.weight).transpose(1, 2)
        k = rms((kv_in @ a.k_proj.weight.T).view(b, T + B, nkv, hd), a.k_norm.weight).transpose(1, 2)
        v = (kv_in @ a.v_proj.weight.T).view(b, T + B, nkv, hd).transpose(1, 2)
        q, k = rope(q, cos[..., T:, :], sin[..., T:, :]), rope(k, cos, sin)
        k, v = k.repeat_interleave(nq // nkv, dim=1), v.repeat_interleave(nq // nkv, dim=1)
        attn = torch.softmax(q @ k.transpose(-1, -2) / hd**0.5, dim=-1) @ v
        h = h + attn.transpose(1, 2).reshape(b, B, nq * hd) @ a.o_proj.weight.T
        y = rms(h, layer.post_attention_layernorm.weight)
        m = layer.mlp
        h = h + (torch.nn.functional.silu(y @ m.gate_proj.weight.T) * (y @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    return rms(h, drafter.norm.weight)


@FAMILY
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_forward_matches_spec_reference(family, attn):
    target = build_tiny_target(family)
    drafter = build_drafter(target, num_layers=2, block_size=8, attn_implementation=attn)
    with torch.no_grad():  # norms start at ones; perturb them so a skipped or misplaced norm shows
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.3)
    inputs = drafter_inputs(drafter, target, batch=2, ctx_len=5)
    inputs["position_ids"] = inputs["position_ids"] + 3  # a context that does not start at 0
    with torch.no_grad():
        expected = _reference_forward(drafter, inputs["noise_embeds"], inputs["context_hidden_states"], inputs["position_ids"])
    torch.testing.assert_close(_forward(drafter, **inputs), expected, atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- attention semantics
@FAMILY
@pytest.mark.parametrize("mask_kind", ["none", "2d_padding", "4d_bool"])
def test_eager_and_sdpa_agree(family, mask_kind):
    target = build_tiny_target(family)
    sdpa = build_drafter(target, num_layers=2, block_size=8)
    eager = build_drafter(target, num_layers=2, block_size=8, attn_implementation="eager")
    eager.load_state_dict(sdpa.state_dict())
    assert sdpa.config._attn_implementation == "sdpa" and eager.config._attn_implementation == "eager"
    inputs = drafter_inputs(sdpa, target, batch=2, ctx_len=6)
    kv_len = 6 + 8
    if mask_kind == "2d_padding":
        mask = torch.ones(2, kv_len, dtype=torch.long)
        mask[0, :2] = 0  # sample 0 is left-padded by two context tokens
        inputs["attention_mask"] = mask
    elif mask_kind == "4d_bool":
        mask = torch.ones(2, 1, 8, kv_len, dtype=torch.bool)
        mask[1, :, :, :3] = False
        inputs["attention_mask"] = mask
    a, b = _forward(sdpa, **inputs), _forward(eager, **inputs)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_2d_and_4d_masks_agree():
    """A 2D key padding mask and the equivalent 4D boolean mask give the same result (both kernels)."""
    target = build_tiny_target("qwen3")
    for attn in ("sdpa", "eager"):
        drafter = build_drafter(target, attn_implementation=attn)
        inputs = drafter_inputs(drafter, target, batch=2, ctx_len=6)
        mask2d = torch.ones(2, 14, dtype=torch.long)
        mask2d[1, :4] = 0
        mask4d = mask2d.bool()[:, None, None, :].expand(2, 1, 8, 14)
        torch.testing.assert_close(
            _forward(drafter, **inputs, attention_mask=mask2d), _forward(drafter, **inputs, attention_mask=mask4d)
        )


@FAMILY
def test_block_attends_bidirectionally_and_reads_context(family):
    target = build_tiny_target(family)
    drafter = build_drafter(target, num_layers=2, block_size=8)
    inputs = drafter_inputs(drafter, target, batch=1, ctx_len=5)
    base = _forward(drafter, **inputs)

    # Changing the LAST block slot changes the FIRST slot's output: no causal mask inside the block.
    later = dict(inputs, noise_embeds=inputs["noise_embeds"].clone())
    later["noise_embeds"][:, -1] += 1.0
    changed = _forward(drafter, **later)
    assert not torch.allclose(changed[:, 0], base[:, 0], atol=1e-4)

    # Changing one context position changes every block slot: the context is injected as K/V.
    ctx = dict(inputs, context_hidden_states=inputs["context_hidden_states"].clone())
    ctx["context_hidden_states"][:, 0] += 1.0
    changed = _forward(drafter, **ctx)
    for slot in range(drafter.config.block_size):
        assert not torch.allclose(changed[:, slot], base[:, slot], atol=1e-4), slot

    # No context at all is different again (it is not ignored).
    no_ctx = dict(inputs, context_hidden_states=None, position_ids=inputs["position_ids"][:, 5:])
    assert not torch.allclose(_forward(drafter, **no_ctx), base, atol=1e-4)


def test_padding_mask_hides_context():
    """Masked-out context positions do not influence the block; unmasked ones do."""
    target = build_tiny_target("qwen3")
    drafter = build_drafter(target)
    inputs = drafter_inputs(drafter, target, batch=1, ctx_len=6)
    mask = torch.ones(1, 14, dtype=torch.long)
    mask[0, :2] = 0
    base = _forward(drafter, **inputs, attention_mask=mask)
    edited = inputs["context_hidden_states"].clone()
    edited[:, :2] += 5.0  # only masked positions
    torch.testing.assert_close(_forward(drafter, **dict(inputs, context_hidden_states=edited), attention_mask=mask), base)
    edited[:, 3] += 5.0  # now a visible one too
    assert not torch.allclose(_forward(drafter, **dict(inputs, context_hidden_states=edited), attention_mask=mask), base)


def test_positions_matter():
    """RoPE at absolute positions: shifting every position leaves the result (relative), a gap changes it."""
    target = build_tiny_target("qwen3")
    drafter = build_drafter(target)
    inputs = drafter_inputs(drafter, target, batch=1, ctx_len=5)
    base = _forward(drafter, **inputs)
    shifted = _forward(drafter, **dict(inputs, position_ids=inputs["position_ids"] + 7))
    torch.testing.assert_close(shifted, base, atol=1e-4, rtol=1e-4)
    gap = inputs["position_ids"].clone()
    gap[:, 5:] += 3  # block placed three positions further from the context
    assert not torch.allclose(_forward(drafter, **dict(inputs, position_ids=gap)), base, atol=1e-4)


# ----------------------------------------------------------------------------- incremental cache
# (family, first chunk, second chunk, block size, pass a 2D attention mask like the generator does)
CACHE_CASES = [
    ("qwen3", 5, 4, 8, False),
    ("qwen3", 1, 7, 4, True),
    ("llama", 6, 1, 16, True),
    ("llama", 3, 3, 8, False),
]


@pytest.mark.parametrize("family, first, second, block_size, with_mask", CACHE_CASES)
def test_incremental_cache_matches_full_forward(family, first, second, block_size, with_mask):
    target = build_tiny_target(family)
    drafter = build_drafter(target, num_layers=2, block_size=block_size)
    total = first + second
    ids = torch.randint(0, TINY["vocab"] - 1, (1, total + 1))
    ctx = target_context(drafter, target, ids[:, :total])
    B = block_size

    def mask(n_keys):
        return torch.ones(1, n_keys, dtype=torch.long) if with_mask else None

    # One forward over the whole context (fresh cache, as on the generator's first round).
    full = _forward(
        drafter,
        noise_embeds=block_embeds(drafter, ids[:, total]),
        context_hidden_states=ctx,
        position_ids=torch.arange(total + B)[None],
        attention_mask=mask(total + B),
        past_key_values=DFlashCache(config=drafter.config),
    )

    # The same context in two chunks through a DFlashCache, cropping the block between calls exactly
    # as transformers' DFlashTokenCandidateGenerator does.
    cache = DFlashCache(config=drafter.config)
    _forward(
        drafter,
        noise_embeds=block_embeds(drafter, ids[:, first]),
        context_hidden_states=ctx[:, :first],
        position_ids=torch.arange(first + B)[None],
        attention_mask=mask(first + B),
        past_key_values=cache,
    )
    assert cache.get_seq_length() == first + B
    cache.set_previous_accepted_tokens(second)
    cache.crop(-B)
    assert cache.get_seq_length() == first, "only context K/V survive a round"
    incremental = _forward(
        drafter,
        noise_embeds=block_embeds(drafter, ids[:, total]),
        context_hidden_states=ctx[:, first:],
        position_ids=torch.arange(first, total + B)[None],
        attention_mask=mask(total + B),
        past_key_values=cache,
    )
    torch.testing.assert_close(incremental, full, atol=1e-5, rtol=1e-4)
    # And the cache-free forward agrees too.
    torch.testing.assert_close(
        _forward(drafter, noise_embeds=block_embeds(drafter, ids[:, total]), context_hidden_states=ctx), full, atol=1e-5, rtol=1e-4
    )


# ----------------------------------------------------------------------------- length head
def _spec_length_head(head, block_hidden):
    """SPEC section 2 written out: concat(mean, last) -> Linear+SiLU -> h + SiLU(Linear(h)) -> Linear -> sigmoid."""
    feature = torch.cat([block_hidden.mean(dim=1), block_hidden[:, -1]], dim=-1)
    h = torch.nn.functional.silu(feature @ head.down.weight.T + head.down.bias)
    h = h + torch.nn.functional.silu(h @ head.res[0].weight.T + head.res[0].bias)
    return torch.sigmoid(h @ head.out.weight.T + head.out.bias).squeeze(-1)


@FAMILY
def test_length_head_formula_range_and_detached_gradient(family):
    target = build_tiny_target(family)
    drafter = build_drafter(target, num_layers=2, block_size=8, length_head_dim=16)
    drafter.train()
    inputs = drafter_inputs(drafter, target, batch=3, ctx_len=5)
    hidden = drafter(**inputs).last_hidden_state
    ratio = drafter.predict_accept_ratio(hidden)
    assert ratio.shape == (3,)
    assert ((ratio > 0) & (ratio < 1)).all()
    torch.testing.assert_close(ratio, _spec_length_head(drafter.length_head, hidden.detach()))

    label = torch.tensor([0.125, 0.5, 1.0])  # (accepted + 1) / B
    torch.nn.functional.mse_loss(ratio, label).backward()
    for name, p in drafter.named_parameters():
        if name.startswith("length_head."):
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, f"length-head loss reached drafter parameter {name}"
    assert all(p.grad is None for p in target.parameters())

    # Control: without the detach the same loss does reach the drafter, so the check above can fail.
    drafter.zero_grad(set_to_none=True)
    hidden = drafter(**inputs).last_hidden_state
    torch.nn.functional.mse_loss(drafter.length_head(hidden), label).backward()
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.abs().sum() > 0


def test_length_head_extreme_inputs_stay_in_range():
    target = build_tiny_target("qwen3")
    drafter = build_drafter(target, block_size=8)
    for scale in (0.0, 1e3, -1e3):
        ratio = drafter.predict_accept_ratio(torch.full((2, 8, TINY["hidden"]), scale))
        assert torch.isfinite(ratio).all() and ((ratio >= 0) & (ratio <= 1)).all()


def test_without_length_head():
    target = build_tiny_target("qwen3")
    drafter = build_drafter(target, use_length_head=False)
    assert drafter.length_head is None
    assert not any(k.startswith("length_head") for k in drafter.state_dict())
    with pytest.raises(ValueError, match="no length head"):
        drafter.predict_accept_ratio(torch.zeros(1, 8, TINY["hidden"]))


# ----------------------------------------------------------------------------- mask token via tokenizer
# (family, tokenizer words, existing mask token, target vocab rows, expect resize)
TOKENIZER_CASES = [
    ("qwen3", 100, None, 100, True),  # no mask token, vocab full: add one, grow the target by one row
    ("llama", 60, None, 60, True),
    ("qwen3", 100, None, 128, False),  # padded target vocab: the new id fits without resizing
    ("llama", 100, "[MASK]", 101, False),  # the tokenizer already has a mask token: use it, change nothing
]


@pytest.mark.parametrize("family, words, existing_mask, rows, expect_resize", TOKENIZER_CASES)
def test_from_target_adds_mask_token(family, tiny_tokenizer, words, existing_mask, rows, expect_resize):
    tokenizer = tiny_tokenizer(num_words=words, mask_token=existing_mask)
    before = len(tokenizer)
    target = build_tiny_target(family, vocab=rows)
    old_embed = target.get_input_embeddings().weight.detach().clone()
    drafter = AdaFlashDrafter.from_target(target, num_layers=1, block_size=4, tokenizer=tokenizer)

    assert tokenizer.mask_token is not None
    mask_id = tokenizer.mask_token_id
    assert drafter.config.mask_token_id == mask_id
    if existing_mask is None:
        assert tokenizer.mask_token == "<|mask|>"
        assert len(tokenizer) == before + 1 and mask_id == before
        assert tokenizer.convert_ids_to_tokens(mask_id) == "<|mask|>"
    else:
        assert len(tokenizer) == before and tokenizer.mask_token == existing_mask
    new_rows = rows + 1 if expect_resize else rows
    assert target.get_input_embeddings().weight.shape[0] == new_rows
    assert target.get_output_embeddings().weight.shape[0] == new_rows
    assert target.config.vocab_size == new_rows
    assert drafter.config.vocab_size == new_rows
    assert 0 <= mask_id < new_rows
    torch.testing.assert_close(target.get_input_embeddings().weight[:rows], old_embed)
    drafter.check_target(target)
    # The drafter embeds the mask token with the (resized) target embedding.
    torch.testing.assert_close(drafter.embed(torch.tensor([mask_id])), target.get_input_embeddings()(torch.tensor([mask_id])))


def test_from_target_without_any_mask_source_fails():
    target = build_tiny_target("qwen3")
    with pytest.raises(ValueError, match="no mask token"):
        AdaFlashDrafter.from_target(target, num_layers=1)


@FAMILY
def test_from_target_copies_target_geometry(family):
    target = build_tiny_target(family, layers=6, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    drafter = build_drafter(target, num_layers=3, block_size=16)
    c, tc = drafter.config, target.config
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (32, 4, 2, 8)
    assert c.intermediate_size == tc.intermediate_size and c.vocab_size == tc.vocab_size
    assert c.num_target_layers == 6 and c.target_layer_ids == [1, 2, 3]  # round(1 + i*2/2)
    assert c.rope_parameters["rope_theta"] == 5000.0
    assert c.block_size == 16 and c.mask_token_id == TINY["vocab"] - 1
    assert drafter.has_target


# ----------------------------------------------------------------------------- target compatibility
# (case id, target overrides, drafter built with, fragments the error must name)
MISMATCH_CASES = [
    ("hidden_size", dict(hidden=64, heads=8, intermediate=64), {}, ["hidden size", "target 64", "drafter 32"]),
    ("vocab", dict(vocab=130), {}, ["vocabulary", "target 130", "drafter 128"]),
    ("layer_count", dict(layers=6), {}, ["layer count", "target 6", "built for 4"]),
    ("layer_ids", dict(layers=2), dict(target_layer_ids=[3]), ["layer count", "target_layer_ids [3]", "2-layer"]),
    ("mask_outside_smaller_vocab", dict(vocab=100), dict(mask_token_id=120), ["vocabulary", "mask_token_id 120"]),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("target_kw, drafter_kw, fragments", [c[1:] for c in MISMATCH_CASES], ids=[c[0] for c in MISMATCH_CASES])
def test_check_and_bind_target_name_the_mismatch(family, target_kw, drafter_kw, fragments):
    good = build_tiny_target(family)
    drafter = build_drafter(good, num_layers=1, **drafter_kw)
    unbound = AdaFlashDrafter(copy.deepcopy(drafter.config))
    other = build_tiny_target(family, **target_kw)
    for call in (drafter.check_target, drafter.bind_target, unbound.bind_target):
        with pytest.raises(ValueError) as err:
            call(other)
        for fragment in fragments:
            assert fragment in str(err.value), f"{fragment!r} not in {err.value}"
    # A refused bind leaves the drafter as it was.
    assert not unbound.has_target
    assert drafter.embed(torch.tensor([1])).data_ptr() != other.get_input_embeddings()(torch.tensor([1])).data_ptr()
    torch.testing.assert_close(drafter.embed(torch.tensor([1])), good.get_input_embeddings()(torch.tensor([1])))


def test_unbound_drafter_refuses_to_embed():
    config = AdaFlashConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_target_layers=4, mask_token_id=127, block_size=4,
    )  # fmt: skip
    drafter = AdaFlashDrafter(config)
    with pytest.raises(RuntimeError, match="bind_target"):
        drafter.embed(torch.tensor([[1]]))
    with pytest.raises(RuntimeError, match="bind_target"):
        drafter.compute_logits(torch.zeros(1, 1, 32))
    drafter.bind_target(build_tiny_target("qwen3"))
    assert drafter.has_target


# ----------------------------------------------------------------------------- plain transformers DFlash path
def _count_calls(module):
    calls = []
    module.register_forward_hook(lambda *_: calls.append(1))
    return calls


def _make_pair(family, seed, block_size, variant):
    target = build_tiny_target(family, seed=seed)
    drafter = build_drafter(target, num_layers=2, block_size=block_size, seed=seed + 100)
    if variant == "accept_all":
        # A zero LM head makes every logit 0, so target and drafter both pick token 0: every draft is
        # accepted and the full-block path (bonus token after B-1 accepted drafts) runs.
        with torch.no_grad():
            target.lm_head.weight.zero_()
    return target, drafter


# (family, seed, prompt length, block size, max_new_tokens, variant)
GENERATE_CASES = [
    ("qwen3", 0, 5, 4, 17, "random"),
    ("qwen3", 1, 1, 8, 24, "random"),
    ("qwen3", 2, 12, 16, 32, "random"),
    ("qwen3", 3, 7, 8, 21, "accept_all"),
    ("qwen3", 4, 6, 16, 20, "eos"),
    ("llama", 0, 3, 4, 19, "random"),
    ("llama", 1, 9, 8, 24, "random"),
    ("llama", 2, 2, 16, 25, "random"),
    ("llama", 3, 4, 4, 18, "accept_all"),
    ("llama", 4, 8, 8, 24, "eos"),
]


@pytest.mark.parametrize("family, seed, prompt_len, block_size, max_new, variant", GENERATE_CASES)
def test_native_dflash_generate_equals_target_greedy(monkeypatch, family, seed, prompt_len, block_size, max_new, variant):
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

    # Prove that transformers' own DFlash candidate generator drives the drafter (not a loop of ours).
    native_rounds = []
    original = DFlashTokenCandidateGenerator.get_candidates

    def spy(self, *args, **kwargs):
        native_rounds.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DFlashTokenCandidateGenerator, "get_candidates", spy)
    target, drafter = _make_pair(family, seed, block_size, variant)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY["vocab"] - 1, (1, prompt_len), generator=g)
    kw = dict(do_sample=False, max_new_tokens=max_new, pad_token_id=0)
    with torch.no_grad():
        plain = target.generate(ids, **kw)
        if variant == "eos":
            # Stop on a token the target actually emits mid-way: EOS handling must match too.
            eos = int(plain[0, prompt_len + max_new // 2])
            kw["eos_token_id"] = eos
            plain = target.generate(ids, **kw)
            assert plain.shape[1] < prompt_len + max_new and plain[0, -1] == eos
        else:
            kw["min_new_tokens"] = max_new
            plain = target.generate(ids, **kw)
        calls = _count_calls(drafter)
        speculative = target.generate(ids, assistant_model=drafter, speculation_type="dflash", **kw)
    assert speculative.tolist() == plain.tolist()
    assert calls, "the drafter was never called"
    assert len(native_rounds) >= len(calls)
    if variant == "accept_all":
        # Whole blocks accepted: far fewer drafter rounds than new tokens.
        assert len(calls) <= -(-max_new // block_size) + 1 < max_new
