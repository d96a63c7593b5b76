"""Readers and writers of the drafter checkpoint layouts (SPEC section 1).

- native: `config.json` with `model_type: "adaflash"`, weights named as our modules.
- DFlash (z-lab): a Qwen3 `config.json` plus `block_size`, `num_target_layers`, `dflash_config`;
  weights without prefix, without embeddings / LM head. Read by SGLang and vLLM.
- AdaFlash: the DFlash layout plus the length head as `thresh_head_two_model.*`.

Self-contained (torch + transformers + safetensors) so it travels with the modeling files.
"""

import json
import os

import torch
from safetensors import safe_open
from transformers.utils import cached_file

from .configuration_adaflash import AdaFlashConfig

DFLASH_ARCHITECTURE = "DFlashDraftModel"
RELEASED_HEAD_PREFIX = "thresh_head_two_model."
NATIVE_HEAD_PREFIX = "length_head."
_PICKLE_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.ckpt")
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")
# Qwen3 decoder fields shared by both config layouts.
_DECODER_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "attention_bias", "attention_dropout", "initializer_range", "tie_word_embeddings",
    "bos_token_id", "eos_token_id", "pad_token_id",
)  # fmt: skip


def is_dflash_layout(config_dict: dict) -> bool:
    """True for a z-lab DFlash or released AdaFlash `config.json` (they carry `dflash_config`)."""
    return "dflash_config" in config_dict and config_dict.get("model_type") != AdaFlashConfig.model_type


def config_from_dflash_dict(config_dict: dict) -> AdaFlashConfig:
    """Translate a DFlash / AdaFlash `config.json` dict into an [`AdaFlashConfig`]."""
    dflash = config_dict["dflash_config"]
    fields = {k: config_dict[k] for k in _DECODER_FIELDS if k in config_dict}
    rope = config_dict.get("rope_parameters") or config_dict.get("rope_scaling") or {}
    rope = dict(rope)
    if "rope_theta" in config_dict:
        rope.setdefault("rope_theta", config_dict["rope_theta"])
    if rope:
        rope.setdefault("rope_type", rope.pop("type", "default"))
        fields["rope_parameters"] = rope
    has_head = bool(dflash.get("use_thresh_head_two_model", False))
    if "mask_token_id" not in dflash:
        raise ValueError("dflash_config has no mask_token_id: the checkpoint cannot be used as a drafter")
    fields.update(
        block_size=config_dict.get("block_size", 16),
        num_target_layers=config_dict["num_target_layers"],
        target_layer_ids=dflash["target_layer_ids"],
        mask_token_id=dflash["mask_token_id"],
        use_length_head=has_head,
        length_head_dim=dflash.get("thresh_head_bottleneck_dim", 256),
        # Released AdaFlash heads ship trained; a DFlash checkpoint has none.
        length_head_trained=has_head,
    )
    return AdaFlashConfig(**fields)


def dflash_dict_from_config(config: AdaFlashConfig) -> dict:
    """The z-lab `config.json` for `config` (AdaFlash head keys included when it has a head)."""
    out = {k: getattr(config, k) for k in _DECODER_FIELDS}
    rope = dict(config.rope_parameters or {})
    out.update(
        model_type="qwen3",
        architectures=[DFLASH_ARCHITECTURE],
        rope_theta=rope.get("rope_theta", config.default_theta),
        rope_scaling=None if rope.get("rope_type", "default") == "default" else rope,
        block_size=config.block_size,
        num_target_layers=config.num_target_layers,
        dflash_config={"target_layer_ids": list(config.target_layer_ids), "mask_token_id": config.mask_token_id},
        torch_dtype=str(config.dtype).removeprefix("torch.") if config.dtype is not None else "bfloat16",
    )
    if config.use_length_head:
        out["dflash_config"].update(
            thresh_head_bottleneck_dim=config.length_head_dim,
            use_thresh_head_two_model=True,
            thresh_head_direct_len=True,
        )
    return out


def to_native_keys(names):
    """Released AdaFlash head names -> ours (`thresh_head_two_model.*` -> `length_head.*`)."""
    return {n: NATIVE_HEAD_PREFIX + n[len(RELEASED_HEAD_PREFIX) :] if n.startswith(RELEASED_HEAD_PREFIX) else n for n in names}


def to_dflash_keys(names):
    """Our names -> the z-lab / AdaFlash layout."""
    return {n: RELEASED_HEAD_PREFIX + n[len(NATIVE_HEAD_PREFIX) :] if n.startswith(NATIVE_HEAD_PREFIX) else n for n in names}


def _resolve(path, filename, hub_kwargs, required=True):
    return cached_file(
        path,
        filename,
        _raise_exceptions_for_missing_entries=required,
        _raise_exceptions_for_connection_errors=required,
        **hub_kwargs,
    )


def weight_files(path, hub_kwargs) -> list[str]:
    single = _resolve(path, "model.safetensors", hub_kwargs, required=False)
    if single is not None:
        return [single]
    index = _resolve(path, "model.safetensors.index.json", hub_kwargs, required=False)
    if index is not None:
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [_resolve(path, shard, hub_kwargs) for shard in shards]
    pickles = [n for n in _PICKLE_NAMES if _resolve(path, n, hub_kwargs, required=False) is not None]
    if pickles:
        raise ValueError(
            f"{path} holds only pickle weights ({', '.join(pickles)}): refused, pickle files can run arbitrary "
            "code when loaded. Convert them to safetensors (model.safetensors) first."
        )
    raise FileNotFoundError(f"{path} has no model.safetensors or model.safetensors.index.json")


def read_safetensors_shapes(files: list[str]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes from safetensors headers, without reading the data."""
    shapes = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def check_tensors(found: dict, expected: dict, where: str) -> None:
    """One `ValueError` naming every missing, unexpected and wrongly shaped tensor."""

    def names(items, limit=8):
        items = sorted(items)
        return ", ".join(items[:limit]) + (f" (+{len(items) - limit} more)" if len(items) > limit else "")

    missing = expected.keys() - found.keys()
    unexpected = found.keys() - expected.keys()
    wrong = [f"{n} {list(found[n])} (expected {list(expected[n])})" for n in sorted(found.keys() & expected.keys()) if tuple(found[n]) != tuple(expected[n])]
    problems = []
    if missing:
        problems.append(f"missing tensors: {names(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {names(unexpected)}")
    if wrong:
        problems.append(f"wrong shapes: {'; '.join(wrong[:8])}")
    if problems:
        raise ValueError(f"checkpoint {where} does not match its drafter config: " + " | ".join(problems))


def expected_shapes(cls, config) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = cls(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def load_drafter_state_dict(cls, path, *args, **kwargs):
    """Implementation of `AdaFlashDrafter.from_pretrained` for every layout (see the module docstring)."""
    path = str(path)
    hub_kwargs = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
    config = kwargs.pop("config", None)
    config_file = _resolve(path, "config.json", hub_kwargs, required=False)
    if config is None and config_file is None:
        raise FileNotFoundError(f"{path} has no config.json")
    config_dict = {}
    if config_file is not None:
        with open(config_file, encoding="utf-8") as f:
            config_dict = json.load(f)
    # Refuse a config that is not a drafter's before looking for weights, so the error names the real problem.
    if config is None and not is_dflash_layout(config_dict) and config_dict.get("model_type") != AdaFlashConfig.model_type:
        raise ValueError(
            f"{path}: config.json is not a drafter config (model_type={config_dict.get('model_type')!r}, "
            "no dflash_config). Expected an AdaFlash, DFlash (z-lab) or released AdaFlash checkpoint."
        )
    files = weight_files(path, hub_kwargs)
    found = read_safetensors_shapes(files)

    if config is None and is_dflash_layout(config_dict):
        config = config_from_dflash_dict(config_dict)
        rename = to_native_keys(found)
        check_tensors({rename[n]: s for n, s in found.items()}, expected_shapes(cls, config), path)
        return _load_renamed(cls, config, files, rename, kwargs)

    if config is None:
        config = AdaFlashConfig.from_pretrained(path, **hub_kwargs)
    check_tensors(found, expected_shapes(cls, config), path)
    from transformers.modeling_utils import PreTrainedModel

    kwargs.setdefault("use_safetensors", True)
    return PreTrainedModel.from_pretrained.__func__(cls, path, *args, config=config, **kwargs)


def _load_renamed(cls, config, files, rename, kwargs):
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if kwargs.get("attn_implementation"):
        config._attn_implementation = kwargs["attn_implementation"]
    state = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                state[rename[name]] = f.get_tensor(name)
    if dtype is None or dtype == "auto":
        dtype = next(iter(state.values())).dtype if dtype == "auto" else torch.get_default_dtype()
    elif isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    config.dtype = dtype
    with torch.device("meta"):
        model = cls(config)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    # Non-persistent buffers (rotary frequencies) were created on meta: rebuild them for real.
    model.rotary_emb = type(model.rotary_emb)(config)
    device = kwargs.get("device_map")
    if isinstance(device, (str, torch.device, int)) and device != "auto":
        model = model.to(device)
    return model.eval()


def write_dflash_checkpoint(model, path: str) -> None:
    """Write `model` in the z-lab DFlash layout (+ AdaFlash head keys when present) into `path`.

    Written into a temporary sibling directory first and renamed into place, so a crash never
    leaves a half-written checkpoint at `path`.
    """
    import shutil
    import tempfile

    from safetensors.torch import save_file

    path = os.path.abspath(path)
    if os.path.exists(path) and os.listdir(path):
        raise FileExistsError(f"{path} exists and is not empty: choose a new directory")
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    renamed = to_dflash_keys(state)
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        save_file({renamed[k]: v for k, v in state.items()}, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        config = dflash_dict_from_config(model.config)
        config["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        if os.path.exists(path):
            os.rmdir(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


__all__ = [
    "config_from_dflash_dict",
    "dflash_dict_from_config",
    "is_dflash_layout",
    "load_drafter_state_dict",
    "read_safetensors_shapes",
    "check_tensors",
    "to_dflash_keys",
    "to_native_keys",
    "write_dflash_checkpoint",
]
