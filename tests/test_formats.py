"""Checkpoint formats: native (+ Auto classes, remote code), z-lab DFlash and AdaFlash layouts, errors.

Exports: tests/test_export.py; every DFlash config field the engines read: tests/test_dflash_reader.py.
"""

import json
import os

import pytest
import torch
from conftest import TINY, build_drafter, distinct_pair, build_tiny_target, drafter_inputs, spec_dflash_keys, spec_head_keys, spec_shapes
from safetensors.torch import load_file, save_file

import adaflash_hf
from adaflash_hf import AdaFlashConfig, AdaFlashDrafter

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAD_DIM = TINY["hidden"] // TINY["heads"]


def _assert_same_weights(a: AdaFlashDrafter, b: AdaFlashDrafter):
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, msg=k)


def _assert_same_outputs(a, b, target):
    inputs = drafter_inputs(a, target, batch=2, ctx_len=5)
    with torch.no_grad():
        torch.testing.assert_close(a(**inputs).last_hidden_state, b(**inputs).last_hidden_state, rtol=0, atol=0)


# ----------------------------------------------------------------------------- native layout
@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("use_length_head", [True, False])
def test_native_round_trip(tmp_path, family, use_length_head):
    target, drafter = distinct_pair(family, use_length_head)
    drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "adaflash"
    assert config["auto_map"] == {
        "AutoConfig": "configuration_adaflash.AdaFlashConfig",
        "AutoModel": "modeling_adaflash.AdaFlashDrafter",
    }
    # The model code travels with the checkpoint (remote code); no pickle anywhere.
    files = set(os.listdir(tmp_path))
    assert {"configuration_adaflash.py", "modeling_adaflash.py", "checkpoint_layouts.py", "model.safetensors"} <= files
    assert not any(f.endswith((".bin", ".pt", ".pth", ".ckpt")) for f in files)

    loaded = AdaFlashDrafter.from_pretrained(tmp_path)
    assert loaded.config.use_length_head is use_length_head
    for field in ("block_size", "target_layer_ids", "mask_token_id", "num_target_layers", "length_head_dim", "hidden_size"):
        assert getattr(loaded.config, field) == getattr(drafter.config, field), field
    _assert_same_weights(drafter, loaded)
    assert not loaded.has_target
    loaded.bind_target(target)
    _assert_same_outputs(drafter, loaded, target)


def test_auto_classes_after_import(tmp_path):
    from transformers import AutoConfig, AutoModel

    target, drafter = distinct_pair()
    drafter.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    assert type(config) is AdaFlashConfig and config.target_layer_ids == drafter.config.target_layer_ids
    model = AutoModel.from_pretrained(tmp_path)
    assert type(model) is AdaFlashDrafter  # the installed class, not a remote-code copy
    _assert_same_weights(drafter, model)
    model = AutoModel.from_pretrained(tmp_path, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"


def test_trust_remote_code_without_library(remote_code_loads):
    """A `save_pretrained` folder loads with `trust_remote_code=True` where adaflash_hf is not installed."""
    drafter = remote_code_loads["drafter"]
    remote = dict(remote_code_loads["loads"]["saved"][1])
    hidden = remote.pop("__hidden__")
    local = drafter.state_dict()
    assert set(remote) == set(local)
    for k in local:
        torch.testing.assert_close(remote[k], local[k], rtol=0, atol=0, msg=k)
    torch.manual_seed(0)
    ctx = torch.randn(1, 5, len(drafter.config.target_layer_ids) * TINY["hidden"])
    noise = torch.randn(1, 8, TINY["hidden"])
    with torch.no_grad():
        torch.testing.assert_close(drafter(noise_embeds=noise, context_hidden_states=ctx).last_hidden_state, hidden)


# ----------------------------------------------------------------------------- z-lab / AdaFlash layouts
def write_spec_checkpoint(
    path, *, num_layers=2, K=2, block_size=8, num_target_layers=4, mask_token_id=127, head_dim_len=None,
    dtype=torch.float32, seed=0, drop=(), extra=(), reshape=None, rope_theta=1000000, target_layer_ids=None,
):  # fmt: skip
    """A DFlash (z-lab) / AdaFlash checkpoint written from SPEC.md alone: key list, shapes, config keys.

    Knows nothing of our save code. `head_dim_len` adds the AdaFlash length head; `drop` / `extra` /
    `reshape` damage the tensor set for the error tests. Returns the tensors written.
    """
    H, inter = TINY["hidden"], TINY["intermediate"]
    target_layer_ids = list(range(K)) if target_layer_ids is None else target_layer_ids
    shapes = spec_shapes(
        H, inter, num_layers, TINY["heads"], TINY["kv_heads"], HEAD_DIM, K,
        head_dim_len=head_dim_len, head_prefix="thresh_head_two_model." if head_dim_len else None,
    )  # fmt: skip
    expected_keys = set(spec_dflash_keys(num_layers)) | (set(spec_head_keys("thresh_head_two_model.")) if head_dim_len else set())
    assert set(shapes) == expected_keys
    g = torch.Generator().manual_seed(seed)
    tensors = {k: torch.randn(s, generator=g).to(dtype) for k, s in shapes.items() if k not in drop}
    for name in extra:
        tensors[name] = torch.zeros(3, dtype=dtype)
    for name, shape in (reshape or {}).items():
        tensors[name] = torch.zeros(shape, dtype=dtype)
    dflash_config = {"target_layer_ids": target_layer_ids, "mask_token_id": mask_token_id}
    if head_dim_len:
        dflash_config.update(thresh_head_bottleneck_dim=head_dim_len, use_thresh_head_two_model=True, thresh_head_direct_len=True)
    config = {
        # A Qwen3 config, as the released DFlash drafters ship it ...
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": inter,
        "layer_types": ["full_attention"] * num_layers,
        "max_position_embeddings": 4096,
        "max_window_layers": num_layers,
        "num_attention_heads": TINY["heads"],
        "num_hidden_layers": num_layers,
        "num_key_value_heads": TINY["kv_heads"],
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": rope_theta,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": TINY["vocab"],
        # ... plus the DFlash keys.
        "block_size": block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": dflash_config,
    }
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return tensors


# (case id, writer kwargs, load kwargs, expected dtype)
LAYOUT_CASES = [
    ("dflash_fp32", dict(), {}, torch.float32),
    ("dflash_bf16_default_dtype", dict(dtype=torch.bfloat16), {}, torch.float32),
    ("dflash_bf16_auto", dict(dtype=torch.bfloat16), dict(dtype="auto"), torch.bfloat16),
    ("dflash_1_layer_3_ids", dict(num_layers=1, K=3, block_size=16), {}, torch.float32),
    ("adaflash_head", dict(head_dim_len=24), {}, torch.float32),
    ("adaflash_head_bf16_auto", dict(head_dim_len=16, dtype=torch.bfloat16, num_layers=3), dict(dtype="auto"), torch.bfloat16),
]


@pytest.mark.parametrize("writer, load_kw, dtype", [c[1:] for c in LAYOUT_CASES], ids=[c[0] for c in LAYOUT_CASES])
def test_spec_layout_loads_exactly(tmp_path, writer, load_kw, dtype):
    written = write_spec_checkpoint(tmp_path, **writer)
    drafter = AdaFlashDrafter.from_pretrained(tmp_path, **load_kw)
    c = drafter.config
    num_layers, K = writer.get("num_layers", 2), writer.get("K", 2)
    head = writer.get("head_dim_len")
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (TINY["hidden"], TINY["intermediate"], num_layers)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (4, 2, HEAD_DIM, TINY["vocab"])
    assert c.block_size == writer.get("block_size", 8)
    assert c.num_target_layers == 4
    assert c.target_layer_ids == list(range(K))
    assert c.mask_token_id == 127
    assert c.rope_parameters["rope_theta"] == 1000000
    assert c.use_length_head is bool(head)
    if head:
        assert c.length_head_dim == head and c.length_head_trained
    state = drafter.state_dict()
    rename = {k: "length_head." + k.removeprefix("thresh_head_two_model.") for k in written if k.startswith("thresh_head")}
    assert set(state) == {rename.get(k, k) for k in written}
    for k, v in written.items():
        got = state[rename.get(k, k)]
        assert got.dtype == dtype, k
        torch.testing.assert_close(got.float(), v.float(), rtol=0, atol=0, msg=k)
    # It runs: bind to a matching target and draft a block.
    target = build_tiny_target("qwen3").to(dtype)
    drafter.bind_target(target)
    assert not drafter.training
    inputs = drafter_inputs(drafter, target, batch=1, ctx_len=4)
    with torch.no_grad():
        hidden = drafter(**inputs).last_hidden_state
    assert hidden.shape == (1, c.block_size, TINY["hidden"]) and torch.isfinite(hidden.float()).all()
    if head:
        assert drafter.predict_accept_ratio(hidden).shape == (1,)


def test_spec_layout_loads_with_attn_implementation(tmp_path):
    write_spec_checkpoint(tmp_path)
    eager = AdaFlashDrafter.from_pretrained(tmp_path, attn_implementation="eager")
    sdpa = AdaFlashDrafter.from_pretrained(tmp_path, attn_implementation="sdpa")
    assert eager.config._attn_implementation == "eager" and sdpa.config._attn_implementation == "sdpa"
    target = build_tiny_target("qwen3")
    eager.bind_target(target), sdpa.bind_target(target)
    inputs = drafter_inputs(eager, target)
    with torch.no_grad():
        torch.testing.assert_close(eager(**inputs).last_hidden_state, sdpa(**inputs).last_hidden_state, atol=1e-5, rtol=1e-4)




# ----------------------------------------------------------------------------- errors
def _native_dir(path, **mutate):
    _, drafter = distinct_pair()
    drafter.save_pretrained(path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for name in mutate.get("drop", ()):
        del tensors[name]
    for name in mutate.get("extra", ()):
        tensors[name] = torch.zeros(3)
    for name, shape in mutate.get("reshape", {}).items():
        tensors[name] = torch.zeros(shape)
    save_file(tensors, file, metadata={"format": "pt"})


def _pickle_dir(path):
    _, drafter = distinct_pair()
    drafter.save_pretrained(path)
    state = load_file(os.path.join(path, "model.safetensors"))
    os.remove(os.path.join(path, "model.safetensors"))
    torch.save(state, os.path.join(path, "pytorch_model.bin"))


def _qwen3_dir(path, with_weights):
    target = build_tiny_target("qwen3")
    if with_weights:
        target.save_pretrained(path)
    else:
        target.config.save_pretrained(path)


def _no_mask_dir(path):
    write_spec_checkpoint(path)
    config = json.loads(open(os.path.join(path, "config.json")).read())
    del config["dflash_config"]["mask_token_id"]
    open(os.path.join(path, "config.json"), "w").write(json.dumps(config))


# (case id, make the directory, expected exception, fragments the message must name)
ERROR_CASES = [
    ("dflash_missing", lambda p: write_spec_checkpoint(p, drop=["layers.1.self_attn.k_norm.weight"]), ValueError,
     ["missing tensors", "layers.1.self_attn.k_norm.weight"]),
    ("dflash_unexpected", lambda p: write_spec_checkpoint(p, extra=["layers.0.self_attn.rotary.weight"]), ValueError,
     ["unexpected tensors", "layers.0.self_attn.rotary.weight"]),
    ("dflash_wrong_shape", lambda p: write_spec_checkpoint(p, reshape={"fc.weight": (32, 96)}), ValueError,
     ["wrong shapes", "fc.weight", "[32, 96]", "[32, 64]"]),
    ("adaflash_head_missing", lambda p: write_spec_checkpoint(p, head_dim_len=16, drop=["thresh_head_two_model.out.bias"]),
     ValueError, ["missing tensors", "length_head.out.bias"]),
    ("adaflash_head_wrong_shape", lambda p: write_spec_checkpoint(p, head_dim_len=16, reshape={"thresh_head_two_model.down.weight": (16, 32)}),
     ValueError, ["wrong shapes", "length_head.down.weight", "[16, 32]", "[16, 64]"]),
    ("dflash_layer_id_out_of_range", lambda p: write_spec_checkpoint(p, target_layer_ids=[0, 5]), ValueError,
     ["target_layer_ids [5]", "num_target_layers=4"]),
    ("dflash_no_mask_token", _no_mask_dir, ValueError, ["mask_token_id"]),
    ("native_missing", lambda p: _native_dir(p, drop=["norm.weight"]), ValueError, ["missing tensors", "norm.weight"]),
    ("native_unexpected", lambda p: _native_dir(p, extra=["lm_head.weight"]), ValueError, ["unexpected tensors", "lm_head.weight"]),
    ("native_wrong_shape", lambda p: _native_dir(p, reshape={"layers.0.mlp.up_proj.weight": (65, 32)}), ValueError,
     ["wrong shapes", "layers.0.mlp.up_proj.weight", "[65, 32]"]),
    ("pickle_only", _pickle_dir, ValueError, ["pickle", "pytorch_model.bin", "safetensors"]),
    ("plain_qwen3_model", lambda p: _qwen3_dir(p, with_weights=True), ValueError, ["not a drafter config", "qwen3"]),
    ("plain_qwen3_config_only", lambda p: _qwen3_dir(p, with_weights=False), ValueError, ["not a drafter config", "qwen3"]),
    ("no_config", lambda p: os.makedirs(p), FileNotFoundError, ["config.json"]),
    ("no_weights", lambda p: distinct_pair()[1].config.save_pretrained(p), FileNotFoundError, ["model.safetensors"]),
]  # fmt: skip


@pytest.mark.parametrize("make, exc, fragments", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_bad_checkpoint_is_refused_with_a_named_reason(tmp_path, make, exc, fragments):
    path = str(tmp_path / "ckpt")
    make(path)
    with pytest.raises(exc) as err:
        AdaFlashDrafter.from_pretrained(path)
    for fragment in fragments:
        assert fragment in str(err.value), f"{fragment!r} not in {err.value}"


def test_pickle_is_never_unpickled(tmp_path, monkeypatch):
    """Refusal happens before any unpickling: torch.load must not even be called."""
    _pickle_dir(str(tmp_path))
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called on a pickle checkpoint"))
    with pytest.raises(ValueError, match="pickle"):
        AdaFlashDrafter.from_pretrained(tmp_path)


def test_library_exports():
    assert adaflash_hf.AdaFlashDrafter is AdaFlashDrafter
    assert callable(adaflash_hf.export_dflash)
