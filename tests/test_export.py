"""`export_dflash` writes exactly what vLLM's and SGLang's own DFlash loaders read.

The engines' loaders are restated here as small tables (tensor names after their renaming, the
shapes of the parameters they fill, the config fields they parse), from their source:
- vLLM `vllm/model_executor/models/qwen3_dflash.py` (vllm-project/vllm 036a00d):
  `DFlashQwen3ForCausalLM.load_weights` prefixes every name without `lm_head` with `model.`;
  `DFlashQwen3Model.hf_to_vllm_mapper` stacks `q/k/v_proj` into `qkv_proj` and `gate/up_proj` into
  `gate_up_proj`; `AutoWeightsLoader` raises `ValueError("There is no module or parameter named ...")`
  for any other name; every top-level `*.safetensors` of the folder is read. `fc` input size is
  `hidden_size * len(dflash_config.target_layer_ids)` (`eagle3_utils.get_eagle3_aux_layers_from_config`).
- SGLang `python/sglang/srt/models/dflash.py` (sgl-project/sglang 003b23d): `DFlashDraftModel.load_weights`
  with the same stacking; unknown names are skipped silently, so every parameter must be covered;
  `speculative/dflash_utils.py::parse_dflash_draft_config` for the config.
`examples/engine_compat/check_vllm_sglang.py` runs the real loaders on an export (docs/export.md).
"""

import json
import os
import shlex
import stat

import pytest
import torch
from conftest import TINY, build_drafter, distinct_pair, build_tiny_target, drafter_inputs, spec_dflash_keys, spec_head_keys
from safetensors import safe_open
from safetensors.torch import load_file

from adaflash_hf import AdaFlashDrafter, export_dflash
from adaflash_hf.export import launch_commands

H, I = TINY["hidden"], TINY["intermediate"]
NQ, NKV = TINY["heads"], TINY["kv_heads"]
HD = H // NQ
STACKED = {".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"), ".v_proj": (".qkv_proj", "v"),
           ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)}  # fmt: skip


def engine_params(n_layers, K, engine):
    """Parameter name -> shape of the engine's DFlash drafter module (unsharded, tp=1)."""
    pre = "model." if engine == "vllm" else ""
    params = {pre + "fc.weight": (H, K * H), pre + "hidden_norm.weight": (H,), pre + "norm.weight": (H,)}
    for i in range(n_layers):
        p = f"{pre}layers.{i}."
        params.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.qkv_proj.weight": ((NQ + 2 * NKV) * HD, H), p + "self_attn.o_proj.weight": (H, NQ * HD),
            p + "self_attn.q_norm.weight": (HD,), p + "self_attn.k_norm.weight": (HD,),
            p + "mlp.gate_up_proj.weight": (2 * I, H), p + "mlp.down_proj.weight": (H, I),
        })  # fmt: skip
    return params


def engine_name(name, engine):
    """A checkpoint tensor name as the engine's loader routes it: (parameter, shard or None)."""
    if engine == "vllm" and "lm_head" not in name:
        name = "model." + name
    for old, (new, shard) in STACKED.items():
        if old + "." in name:
            return name.replace(old, new), shard
    return name, None


def exported(path):
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("use_length_head", [True, False])
def test_export_is_what_the_engines_load(tmp_path, family, use_length_head):
    target, drafter = distinct_pair(family, use_length_head)
    out = tmp_path / "export"
    assert export_dflash(drafter, str(out)) == str(out)
    top = sorted(os.listdir(out))
    assert top == (["config.json", "length_head", "model.safetensors"] if use_length_head else ["config.json", "model.safetensors"])
    assert [f for f in top if f.endswith(".safetensors")] == ["model.safetensors"]  # vLLM reads every one of them

    K = len(drafter.config.target_layer_ids)
    tensors = exported(out)
    assert set(tensors) == set(spec_dflash_keys(2))  # SPEC's DFlash list and nothing else (no head, no prefix)
    assert {dtype for _, dtype in tensors.values()} == {"BF16"}  # the targets' dtype, not the drafter's fp32
    for engine in ("vllm", "sglang"):
        params = engine_params(2, K, engine)
        filled = {}
        for name, (shape, _) in tensors.items():
            param, shard = engine_name(name, engine)
            assert param in params, f"{engine} has no parameter for {name} (vLLM raises, SGLang drops it)"
            filled.setdefault(param, []).append((shard, shape))
        assert set(filled) == set(params), f"{engine} parameters left unfilled: {set(params) - set(filled)}"
        for param, parts in filled.items():  # stacked shards concatenate on dim 0 into the engine's shape
            rows = sum(shape[0] for _, shape in parts)
            assert (rows, *parts[0][1][1:]) == params[param], param

    # config.json as the engines parse it: transformers' Qwen3Config (both load it so), then their reads.
    from transformers import AutoConfig, Qwen3Config

    raw = json.loads((out / "config.json").read_text())
    view = AutoConfig.from_pretrained(out)
    assert type(view) is Qwen3Config and view.architectures == ["DFlashDraftModel"]  # vLLM registry -> qwen3_dflash
    assert str(view.dtype).removeprefix("torch.") == "bfloat16" and raw["torch_dtype"] == "bfloat16"
    d = view.dflash_config
    assert d["target_layer_ids"] == drafter.config.target_layer_ids and d["mask_token_id"] == drafter.config.mask_token_id
    assert d["block_size"] == raw["block_size"] == 8  # SGLang reads dflash_config.block_size first
    assert d["num_target_layers"] == raw["num_target_layers"] == 4
    assert view.layer_types == ["full_attention"] * 2 and view.sliding_window is None  # non-causal full attention
    assert view.hidden_act == "silu" and view.num_hidden_layers == 2 and view.head_dim == HD
    assert view.rope_parameters["rope_theta"] == drafter.config.rope_parameters["rope_theta"]
    assert not {"use_thresh_head_two_model", "thresh_head_bottleneck_dim"} & set(d)  # the head is not at the top level
    assert "auto_map" not in raw

    # Readable by an engine running as another user.
    for root, dirs, files in os.walk(out):
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o755, root
        for f in files:
            assert stat.S_IMODE(os.stat(os.path.join(root, f)).st_mode) == 0o644, f

    if use_length_head:
        head = load_file(str(out / "length_head" / "model.safetensors"))
        assert set(head) == set(spec_head_keys("thresh_head_two_model."))
        head_cfg = json.loads((out / "length_head" / "config.json").read_text())
        assert head_cfg["length_head_dim"] == 24 and head_cfg["dflash_config"]["use_thresh_head_two_model"] is True

    # Round trip through our reader: the same weights (bf16-rounded), the head included.
    loaded = AdaFlashDrafter.from_pretrained(out)
    assert loaded.config.use_length_head is use_length_head
    state = drafter.state_dict()
    assert set(loaded.state_dict()) == set(state)
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, state[k].to(torch.bfloat16).float(), rtol=0, atol=0, msg=k)
    if use_length_head:
        assert loaded.config.length_head_dim == 24
        assert loaded.config.length_head_trained == drafter.config.length_head_trained


def test_round_trip_keeps_the_head_exactly(tmp_path):
    target, drafter = distinct_pair()
    drafter.config.length_head_trained = True
    export_dflash(drafter, str(tmp_path / "out"), dtype=None)
    assert {dt for _, dt in exported(tmp_path / "out").values()} == {"F32"}
    loaded = AdaFlashDrafter.from_pretrained(tmp_path / "out").bind_target(target)
    assert loaded.config.length_head_trained is True
    for k, v in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    inputs = drafter_inputs(drafter, target)
    with torch.no_grad():
        a, b = drafter(**inputs).last_hidden_state, loaded(**inputs).last_hidden_state
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        # the weights are equal bit for bit (above); the outputs only to float32 rounding: safetensors loads each
        # tensor as a view at its offset in the file, and a CPU's BLAS may sum an unaligned matrix in another order
        torch.testing.assert_close(drafter.predict_accept_ratio(a), loaded.predict_accept_ratio(b), rtol=0, atol=1e-6)


def test_export_dtype_argument(tmp_path):
    _, drafter = distinct_pair()
    export_dflash(drafter, str(tmp_path / "fp16"), dtype="float16")
    assert {dt for _, dt in exported(tmp_path / "fp16").values()} == {"F16"}
    assert json.loads((tmp_path / "fp16" / "config.json").read_text())["torch_dtype"] == "float16"
    assert {t.dtype for t in load_file(str(tmp_path / "fp16" / "length_head" / "model.safetensors")).values()} == {torch.float16}


def test_remote_code_export_loads_with_automodel(remote_code_loads):
    """`remote_code=True`: the z-lab README's `AutoModel.from_pretrained(..., trust_remote_code=True)` path
    builds our drafter (not a plain Qwen3Model), the head included; the engines' files are unchanged."""
    drafter, out = remote_code_loads["drafter"], remote_code_loads["folders"]["exported"]  # export_dflash(dtype=None, remote_code=True)
    raw = json.loads((out / "config.json").read_text())
    assert raw["auto_map"] == {"AutoModel": "modeling_adaflash.AdaFlashDrafter"}  # AutoConfig stays Qwen3Config
    assert {"modeling_adaflash.py", "configuration_adaflash.py", "checkpoint_layouts.py"} <= set(os.listdir(out))
    assert set(exported(out)) == set(spec_dflash_keys(2))
    stdout, remote = remote_code_loads["loads"]["exported"]
    assert "AdaFlashDrafter True" in stdout
    torch.manual_seed(0)
    ctx = torch.randn(1, 5, len(drafter.config.target_layer_ids) * H)
    noise = torch.randn(1, 8, H)
    with torch.no_grad():
        torch.testing.assert_close(drafter(noise_embeds=noise, context_hidden_states=ctx).last_hidden_state, remote["__hidden__"])


def test_launch_commands(tmp_path):
    _, drafter = distinct_pair()
    out = tmp_path / "exp"
    export_dflash(drafter, str(out))
    cmds = launch_commands(str(out), "Qwen/Qwen3-8B", {"tp": 4, "port": 8001})
    vllm = shlex.split(cmds["vllm"])
    assert vllm[:3] == ["vllm", "serve", "Qwen/Qwen3-8B"] and vllm[vllm.index("--tensor-parallel-size") + 1] == "4"
    spec = json.loads(vllm[vllm.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": str(out), "num_speculative_tokens": 7}  # vLLM requires it for dflash
    sgl = shlex.split(cmds["sglang"])
    assert sgl[:3] == ["python", "-m", "sglang.launch_server"]
    for flag, value in (("--model-path", "Qwen/Qwen3-8B"), ("--speculative-algorithm", "DFLASH"),
                        ("--speculative-draft-model-path", str(out)), ("--speculative-num-draft-tokens", "8"),
                        ("--tp-size", "4"), ("--port", "8001")):  # fmt: skip
        assert sgl[sgl.index(flag) + 1] == value, flag
    assert "<target-model>" in launch_commands(str(out))["vllm"]
    assert '"num_speculative_tokens": 3' in launch_commands(str(out), settings={"num_draft_tokens": 4})["vllm"]
    with pytest.raises(ValueError, match="num_draft_tokens"):
        launch_commands(str(out), settings={"num_draft_tokens": 9})



DOCS_EXPORT_DIR = "/models/my-drafter-dflash"  # the export path docs/export.md shows


@pytest.mark.parametrize("doc", ["docs/export.md"])
def test_docs_show_launch_commands_output(tmp_path, doc):
    """The launch lines docs/export.md shows are `launch_commands`' output, byte for byte.

    The docs call `launch_commands("/models/my-drafter-dflash", "Qwen/Qwen3-8B", {"tp": 2})` for a block-16
    drafter; here the export lives in tmp_path and its (absolute) path is put back to the docs' one.
    `examples/engine_compat/check_vllm_sglang.py` parses the same lines with vLLM's and SGLang's own code.
    """
    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), doc), encoding="utf-8").read()
    assert f'launch_commands("{DOCS_EXPORT_DIR}", "Qwen/Qwen3-8B", {{"tp": 2}})' in text
    target = build_tiny_target("qwen3")
    drafter = build_drafter(target, num_layers=1, block_size=16, use_length_head=False)
    out = tmp_path / "exp"
    export_dflash(drafter, str(out))
    cmds = launch_commands(str(out), "Qwen/Qwen3-8B", {"tp": 2})
    want = {k: v.replace(os.path.abspath(str(out)), DOCS_EXPORT_DIR) for k, v in cmds.items()}
    lines = text.splitlines()
    shown = {"vllm": [line for line in lines if line.startswith("vllm serve ")],
             "sglang": [line for line in lines if line.startswith("python -m sglang.launch_server ")]}  # fmt: skip
    assert shown == {"vllm": [want["vllm"]], "sglang": [want["sglang"]]}
    assert json.loads(shlex.split(want["vllm"])[4])["num_speculative_tokens"] == 15


# ----------------------------------------------------------------------------- folder handling
def test_export_into_existing_empty_dir(tmp_path):
    _, drafter = distinct_pair(use_length_head=False)
    (tmp_path / "empty").mkdir()
    export_dflash(drafter, str(tmp_path / "empty"))
    assert sorted(os.listdir(tmp_path / "empty")) == ["config.json", "model.safetensors"]
    assert stat.S_IMODE(os.stat(tmp_path / "empty").st_mode) == 0o755


def test_export_rejects_non_drafter(tmp_path):
    with pytest.raises(TypeError, match="AdaFlashDrafter"):
        export_dflash(build_tiny_target("qwen3"), str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()


def test_export_into_non_empty_dir_refused(tmp_path):
    _, drafter = distinct_pair()
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="not empty"):
        export_dflash(drafter, str(out))
    assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "user data"
    assert sorted(os.listdir(tmp_path)) == ["busy"], "no temp dir left behind"


@pytest.mark.parametrize("fail_at", ["safetensors", "json"])
def test_crash_during_export_leaves_nothing(tmp_path, monkeypatch, fail_at):
    import safetensors.torch

    _, drafter = distinct_pair()
    parent = tmp_path / "exports"
    parent.mkdir()
    out = parent / "drafter"

    def boom(*args, **kwargs):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(*((safetensors.torch, "save_file", boom) if fail_at == "safetensors" else (json, "dump", boom)))
    with pytest.raises(RuntimeError, match="simulated crash"):
        export_dflash(drafter, str(out))
    assert not out.exists()
    assert os.listdir(parent) == [], f"left behind: {os.listdir(parent)}"
    monkeypatch.undo()
    export_dflash(drafter, str(out))  # and the same path then works
    assert sorted(os.listdir(out)) == ["config.json", "length_head", "model.safetensors"]
