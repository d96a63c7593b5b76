"""The reader of z-lab DFlash configs honours every field the three implementations read.

Sources (read with git at the commits below; facts restated in docs/export.md):
- z-lab `dflash/model.py` (github z-lab/dflash 44947fb): `DFlashDraftModel.__init__` takes
  `dflash_config.get("target_layer_ids", build_target_layer_ids(num_target_layers, n))`; a layer is
  windowed iff `layer_types[i] == "sliding_attention"` (window `config.sliding_window`).
- SGLang `python/sglang/srt/speculative/dflash_utils.py::parse_dflash_draft_config` (sgl-project/sglang
  00731f0): `dflash_config.block_size` before the top-level `block_size`, `dflash_config.num_target_layers`
  before the top-level one, `target_layer_ids` / `mask_token_id` from `dflash_config` then the top level;
  `srt/models/dflash.py::_get_dflash_layer_attention_params`: sliding layers are causal
  (`AttentionType.DECODER`) with `window_left = sliding_window - 1`, full layers non-causal.
- vLLM `vllm/model_executor/models/qwen3_dflash.py` (vllm-project/vllm 036a00d):
  `_resolve_layer_attention` (window `dflash_config.swa_window_size`, then `sliding_window`; causal exactly
  on sliding layers), `load_weights` accepts `embed_tokens.weight`.
"""

import json
import math
import os

import pytest
import torch
from conftest import TINY, build_tiny_target
from test_formats import HEAD_DIM, write_spec_checkpoint
from transformers import DynamicCache

from adaflash_hf import AdaFlashDrafter, export_dflash

H = TINY["hidden"]


def zlab_checkpoint(path, config=None, dflash=None, drop_config=(), drop_dflash=(), **writer):
    """A z-lab layout written from SPEC alone (tests/test_formats.py), then its config.json edited."""
    tensors = write_spec_checkpoint(path, **writer)
    file = os.path.join(path, "config.json")
    cfg = json.loads(open(file).read())
    cfg.update(config or {})
    cfg["dflash_config"].update(dflash or {})
    for k in drop_config:
        cfg.pop(k, None)
    for k in drop_dflash:
        cfg["dflash_config"].pop(k, None)
    open(file, "w").write(json.dumps(cfg))
    return tensors


def zlab_build_target_layer_ids(num_target_layers, num_draft_layers):
    """z-lab's `build_target_layer_ids`, restated."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


# ----------------------------------------------------------------------------- defaults and precedence
@pytest.mark.parametrize("num_layers, num_target_layers", [(2, 36), (5, 36), (1, 28), (3, 8)])
def test_target_layer_ids_default_as_zlab_computes_them(tmp_path, num_layers, num_target_layers):
    K = len(zlab_build_target_layer_ids(num_target_layers, num_layers))
    zlab_checkpoint(tmp_path, num_layers=num_layers, K=K, num_target_layers=num_target_layers, drop_dflash=["target_layer_ids"])
    drafter = AdaFlashDrafter.from_pretrained(tmp_path)
    assert drafter.config.target_layer_ids == zlab_build_target_layer_ids(num_target_layers, num_layers)
    assert drafter.config.num_target_layers == num_target_layers


def test_num_target_layers_absent_falls_back(tmp_path):
    """vLLM never reads num_target_layers: ids alone suffice; our check then accepts any deep-enough target."""
    zlab_checkpoint(tmp_path, target_layer_ids=[0, 2], drop_config=["num_target_layers"])
    drafter = AdaFlashDrafter.from_pretrained(tmp_path)
    assert drafter.config.target_layer_ids == [0, 2] and not drafter.config.num_target_layers_known
    drafter.bind_target(build_tiny_target("qwen3"))  # 4 layers: fine
    drafter.bind_target(build_tiny_target("qwen3", layers=6))  # deeper: fine too
    with pytest.raises(ValueError, match=r"target_layer_ids \[2\] do not exist"):
        drafter.bind_target(build_tiny_target("qwen3", layers=2))


def test_neither_ids_nor_target_depth_is_a_named_error(tmp_path):
    zlab_checkpoint(tmp_path, drop_config=["num_target_layers"], drop_dflash=["target_layer_ids"])
    with pytest.raises(ValueError) as err:
        AdaFlashDrafter.from_pretrained(tmp_path)
    assert "config.json" in str(err.value) and "target_layer_ids" in str(err.value) and "num_target_layers" in str(err.value)


def test_dflash_config_fields_come_first(tmp_path):
    """SGLang: dflash_config.block_size / num_target_layers before the top level."""
    zlab_checkpoint(tmp_path, block_size=8, num_target_layers=4, dflash={"block_size": 10, "num_target_layers": 6})
    c = AdaFlashDrafter.from_pretrained(tmp_path).config
    assert c.block_size == 10 and c.num_target_layers == 6


def test_top_level_fallbacks(tmp_path):
    """mask_token_id / target_layer_ids at the top level, block_size absent (SGLang default 16)."""
    zlab_checkpoint(
        tmp_path, config={"mask_token_id": 100, "target_layer_ids": [1, 3]}, drop_config=["block_size"],
        drop_dflash=["mask_token_id", "target_layer_ids"],
    )  # fmt: skip
    c = AdaFlashDrafter.from_pretrained(tmp_path).config
    assert (c.mask_token_id, c.target_layer_ids, c.block_size) == (100, [1, 3], 16)


@pytest.mark.parametrize(
    "dflash, fragment",
    [
        ({"attention_sink_bias": True}, "dflash_config.attention_sink_bias"),
        ({"projector_type": "domino"}, "dflash_config.projector_type"),
        ({"output_multiplier": 2.0}, "dflash_config.output_multiplier"),
        ({"causal": True}, "dflash_config.causal"),
        ({"use_swa": True, "swa_window_size": 4}, "dflash_config.use_swa"),
    ],
)
def test_unsupported_fields_are_named(tmp_path, dflash, fragment):
    zlab_checkpoint(tmp_path, dflash=dflash)
    with pytest.raises(ValueError) as err:
        AdaFlashDrafter.from_pretrained(tmp_path)
    assert fragment in str(err.value) and str(tmp_path) in str(err.value)


def test_missing_decoder_field_is_named(tmp_path):
    zlab_checkpoint(tmp_path, drop_config=["hidden_size"])
    with pytest.raises(ValueError, match=r"config.json: required field hidden_size"):
        AdaFlashDrafter.from_pretrained(tmp_path)


# ----------------------------------------------------------------------------- embed_tokens.weight
def _with_embedding(path, weight):
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["embed_tokens.weight"] = weight
    save_file(tensors, file, metadata={"format": "pt"})


def test_embed_tokens_equal_to_the_targets_is_accepted(tmp_path):
    target = build_tiny_target("qwen3")
    zlab_checkpoint(tmp_path)
    _with_embedding(tmp_path, target.get_input_embeddings().weight.detach().to(torch.bfloat16))  # engines ship bf16
    drafter = AdaFlashDrafter.from_pretrained(tmp_path)
    assert "embed_tokens.weight" not in drafter.state_dict()  # the target's embedding is used, not a copy
    assert drafter.config.embed_tokens_fingerprint["shape"] == [TINY["vocab"], H]
    drafter.bind_target(target)


def test_embed_tokens_of_another_model_is_refused_at_bind(tmp_path):
    zlab_checkpoint(tmp_path)
    _with_embedding(tmp_path, build_tiny_target("qwen3", seed=5).get_input_embeddings().weight.detach())
    drafter = AdaFlashDrafter.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="embed_tokens.weight that differs from the target's"):
        drafter.bind_target(build_tiny_target("qwen3"))


def test_embed_tokens_of_wrong_shape_is_refused_at_load(tmp_path):
    zlab_checkpoint(tmp_path)
    _with_embedding(tmp_path, torch.zeros(TINY["vocab"] - 1, H))
    with pytest.raises(ValueError, match=r"embed_tokens.weight has shape \[127, 32\]"):
        AdaFlashDrafter.from_pretrained(tmp_path)


# ----------------------------------------------------------------------------- sliding-window layers
SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": True, "sliding_window": 3, "max_window_layers": 0}


def test_sliding_config_is_read(tmp_path):
    zlab_checkpoint(tmp_path, config=SLIDING)
    c = AdaFlashDrafter.from_pretrained(tmp_path).config
    assert c.layer_types == ["sliding_attention", "full_attention"] and c.sliding_window == 3


def test_sliding_layers_derived_like_qwen3config(tmp_path):
    """No layer_types: transformers' Qwen3Config (what both engines load) derives them from max_window_layers."""
    zlab_checkpoint(tmp_path, config={"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}, drop_config=["layer_types"])
    c = AdaFlashDrafter.from_pretrained(tmp_path).config
    assert c.layer_types == ["full_attention", "sliding_attention"] and c.sliding_window == 5


def test_swa_window_size_counts_like_vllm(tmp_path):
    zlab_checkpoint(tmp_path, config={**SLIDING, "use_sliding_window": False, "sliding_window": None}, dflash={"swa_window_size": 4})
    assert AdaFlashDrafter.from_pretrained(tmp_path).config.sliding_window == 4


@pytest.mark.parametrize(
    "config, dflash, fragment",
    [
        ({**SLIDING, "use_sliding_window": False}, {}, "no window"),  # transformers drops the window: engines fail too
        (SLIDING, {"swa_window_size": 7}, "differs from sliding_window=3"),
        ({"layer_types": ["chunked_attention", "full_attention"]}, {}, "chunked_attention"),
    ],
)
def test_bad_sliding_configs_are_named(tmp_path, config, dflash, fragment):
    zlab_checkpoint(tmp_path, config=config, dflash=dflash)
    with pytest.raises(ValueError) as err:
        AdaFlashDrafter.from_pretrained(tmp_path)
    assert fragment in str(err.value) and "config.json" in str(err.value)


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    f = pos.double()[:, None] * inv[None]
    emb = torch.cat([f, f], dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * cos + rot * sin


def reference_draft(sd, layer_types, window, ctx_feats, noise, positions, theta=1e6):
    """DFlash drafter forward written from the engines' semantics, in float64, one sequence.

    `ctx_feats` `[T, K*H]`, `noise` `[B, H]`, `positions` `[T + B]`. Full layers: every block query sees all
    context and the whole block. Sliding layers (vLLM / SGLang): causal, keys at positions (p - window, p].
    """
    sd = {k: v.double() for k, v in sd.items()}
    nq, nkv, hd = TINY["heads"], TINY["kv_heads"], HEAD_DIM
    T, B = ctx_feats.shape[0], noise.shape[0]
    ctx = _rms(ctx_feats.double() @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    h = noise.double()
    q_pos, k_pos = positions[T:], positions
    for i, kind in enumerate(layer_types):
        p = f"layers.{i}."
        x = _rms(h, sd[p + "input_layernorm.weight"])
        kv_in = torch.cat([ctx, x])
        q = _rms((x @ sd[p + "self_attn.q_proj.weight"].T).view(B, nq, hd), sd[p + "self_attn.q_norm.weight"])
        k = _rms((kv_in @ sd[p + "self_attn.k_proj.weight"].T).view(T + B, nkv, hd), sd[p + "self_attn.k_norm.weight"])
        v = (kv_in @ sd[p + "self_attn.v_proj.weight"].T).view(T + B, nkv, hd)
        q, k = _rope(q, q_pos, theta), _rope(k, k_pos, theta)
        k, v = k.repeat_interleave(nq // nkv, dim=1), v.repeat_interleave(nq // nkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        if kind == "sliding_attention":
            allowed = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
            scores = scores.masked_fill(~allowed[None], float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(B, nq * hd)
        h = h + attn @ sd[p + "self_attn.o_proj.weight"].T
        y = _rms(h, sd[p + "post_attention_layernorm.weight"])
        gate, up = y @ sd[p + "mlp.gate_proj.weight"].T, y @ sd[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return _rms(h, sd["norm.weight"])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_sliding_drafter_drafts_like_the_reference(tmp_path, attn):
    """A z-lab checkpoint with a sliding-window layer: one call and two cached rounds equal the reference."""
    tensors = zlab_checkpoint(tmp_path, config=SLIDING, seed=3)
    target = build_tiny_target("qwen3")
    drafter = AdaFlashDrafter.from_pretrained(tmp_path, attn_implementation=attn).bind_target(target)
    B, T1, T2 = drafter.config.block_size, 5, 3
    g = torch.Generator().manual_seed(0)
    ctx = torch.randn(1, T1 + T2, 2 * H, generator=g)
    ids = torch.randint(0, TINY["vocab"] - 1, (1, T1 + T2 + 1), generator=g)

    def block(bonus):
        return drafter.embed(torch.cat([bonus.view(1, 1), torch.full((1, B - 1), drafter.config.mask_token_id)], dim=1))

    def reference(T):
        pos = torch.arange(T + B)
        out = reference_draft(tensors, SLIDING["layer_types"], 3, ctx[0, :T], block(ids[:, T])[0], pos)
        return out.float()

    with torch.no_grad():
        # One call: context T1, block at T1..T1+B-1.
        one = drafter(block(ids[:, T1]), ctx[:, :T1], position_ids=torch.arange(T1 + B)[None]).last_hidden_state[0]
        torch.testing.assert_close(one, reference(T1), rtol=1e-4, atol=1e-5)
        # Two rounds through the drafter cache (context kept, block cropped), as generation runs it.
        cache = DynamicCache()
        drafter(block(ids[:, T1 - T2]), ctx[:, : T1 - T2], position_ids=torch.arange(T1 - T2 + B)[None], past_key_values=cache)
        cache.crop(-B)
        pos = torch.arange(T1 - T2, T1 + T2 + B)[None]
        two = drafter(block(ids[:, T1 + T2]), ctx[:, T1 - T2 : T1 + T2], position_ids=pos, past_key_values=cache).last_hidden_state[0]
        ref = reference(T1 + T2)
        torch.testing.assert_close(two, ref, rtol=1e-4, atol=1e-5)
        # The drafts (argmax of the target's LM head on slots 1..B-1) are identical.
        assert torch.equal(drafter.compute_logits(two[1:]).argmax(-1), drafter.compute_logits(ref[1:]).argmax(-1))
        # And the window matters: as full attention the same weights draft something else.
        drafter.config.layer_types = ["full_attention", "full_attention"]
        full = drafter(block(ids[:, T1]), ctx[:, :T1], position_ids=torch.arange(T1 + B)[None]).last_hidden_state[0]
        assert not torch.allclose(full, one, atol=1e-3)


def test_sliding_drafter_batched_with_padding_matches_rows_alone(tmp_path):
    """Left padding and ragged context (invalid cache columns) keep each row equal to the row alone."""
    zlab_checkpoint(tmp_path, config=SLIDING, seed=4)
    target = build_tiny_target("qwen3")
    drafter = AdaFlashDrafter.from_pretrained(tmp_path).bind_target(target)
    B = drafter.config.block_size
    g = torch.Generator().manual_seed(1)
    ctx = torch.randn(2, 6, 2 * H, generator=g)
    noise = torch.randn(2, B, H, generator=g)
    noise2 = torch.randn(2, B, H, generator=g)
    # Row 0: 6 context tokens at 0..5. Row 1: 2 pads, then 4 tokens at 0..3.
    valid = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    pos0 = torch.stack([torch.arange(6), torch.arange(-2, 4).clamp(min=0)])
    # Round 2 adds 2 new context columns; row 1 verified only 1 (the second column is invalid).
    ctx2 = torch.randn(2, 2, 2 * H, generator=g)
    valid2 = torch.tensor([[1, 1], [1, 0]])
    pos2 = torch.tensor([[6, 7], [4, 5]])
    with torch.no_grad():
        cache = DynamicCache()
        mask1 = torch.cat([valid, torch.ones(2, B, dtype=torch.long)], 1)
        drafter(noise, ctx, position_ids=torch.cat([pos0, pos0[:, -1:] + 1 + torch.arange(B)], 1), attention_mask=mask1, past_key_values=cache)
        cache.crop(-B)
        bpos = torch.tensor([[8], [5]]) + torch.arange(B)
        mask2 = torch.cat([valid, valid2, torch.ones(2, B, dtype=torch.long)], 1)
        batched = drafter(noise2, ctx2, position_ids=torch.cat([pos2, bpos], 1), attention_mask=mask2, past_key_values=cache).last_hidden_state
        for r, n_ctx in ((0, 8), (1, 5)):
            cols = [c for c in range(8) if torch.cat([valid, valid2], 1)[r, c]]
            alone_ctx = torch.cat([ctx, ctx2], 1)[r : r + 1, cols]
            assert alone_ctx.shape[1] == n_ctx
            alone = drafter(noise2[r : r + 1], alone_ctx, position_ids=torch.arange(n_ctx + B)[None]).last_hidden_state
            torch.testing.assert_close(batched[r : r + 1], alone, rtol=1e-4, atol=1e-5)


def test_sliding_drafter_export_round_trip(tmp_path):
    zlab_checkpoint(tmp_path / "zlab", config=SLIDING)
    drafter = AdaFlashDrafter.from_pretrained(tmp_path / "zlab")
    export_dflash(drafter, str(tmp_path / "out"), dtype=None)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["layer_types"] == SLIDING["layer_types"] and cfg["sliding_window"] == 3 and cfg["use_sliding_window"] is True
    assert cfg["dflash_config"]["swa_window_size"] == 3
    from transformers import AutoConfig

    view = AutoConfig.from_pretrained(tmp_path / "out")  # what vLLM / SGLang see
    assert view.layer_types == SLIDING["layer_types"] and view.sliding_window == 3
    again = AdaFlashDrafter.from_pretrained(tmp_path / "out")
    assert again.config.layer_types == SLIDING["layer_types"] and again.config.sliding_window == 3
    for k, v in drafter.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def test_engine_refuses_sliding_drafters(tmp_path):
    from adaflash_hf.engine.drafter import make_drafter_cache

    zlab_checkpoint(tmp_path, config=SLIDING)
    drafter = AdaFlashDrafter.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="sliding_attention"):
        make_drafter_cache(drafter, 2, 64)
