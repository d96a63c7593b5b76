"""Readers and writers of the drafter checkpoint layouts.

- native: `config.json` with `model_type: "adaflash"`, weights named as our modules.
- DFlash (z-lab): a Qwen3 `config.json` plus `block_size`, `num_target_layers`, `dflash_config`;
  weights without prefix, without embeddings / LM head. Read by SGLang and vLLM.
- AdaFlash: the DFlash layout plus the length head as `thresh_head_two_model.*`.

Self-contained (torch + transformers + safetensors) so it travels with the modeling files.
"""

import json
import os
import re

import torch
from safetensors import safe_open
from transformers.utils import cached_file

from .atomic_save import save_atomically
from .configuration_adaflash import AdaFlashConfig, default_target_layer_ids

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


LENGTH_HEAD_SUBFOLDER = "length_head"
EMBED_TOKENS = "embed_tokens.weight"
# dflash_config features of other drafter families (MiMo, Domino, DSpark, ...) that we do not run:
# refused by name rather than silently drafting wrongly.
_UNSUPPORTED_DFLASH_FEATURES = (
    "attention_sink_bias", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
    "projector_type", "final_logit_softcapping", "attention_value_scale",
)  # fmt: skip


def is_dflash_layout(config_dict: dict) -> bool:
    """True for a z-lab DFlash or released AdaFlash `config.json` (they carry `dflash_config`)."""
    return "dflash_config" in config_dict and config_dict.get("model_type") != AdaFlashConfig.model_type


def _qwen3_view(config_dict: dict):
    """The config as the engines see it: transformers' `Qwen3Config` (vLLM and SGLang load it so), which
    resolves `layer_types` from `use_sliding_window` / `max_window_layers` and drops `sliding_window` when
    sliding windows are off."""
    from transformers import Qwen3Config

    keys = ("num_hidden_layers", "layer_types", "use_sliding_window", "sliding_window", "max_window_layers")
    return Qwen3Config(**{k: config_dict[k] for k in keys if k in config_dict})


def _attention_fields(config_dict: dict, dflash: dict, where: str) -> dict:
    """`layer_types` / `sliding_window` as the three DFlash implementations read them.

    z-lab (`dflash/model.py`): a layer is windowed iff `layer_types[i] == "sliding_attention"`, window
    `config.sliding_window`. SGLang (`srt/models/dflash.py`, `_get_dflash_layer_attention_params`):
    sliding layers are causal (`AttentionType.DECODER`) with `window_left = sliding_window - 1`, full
    layers non-causal. vLLM (`models/qwen3_dflash.py`, `_resolve_layer_attention`): the same, window
    `dflash_config.swa_window_size` first, then `sliding_window`; `use_swa` and `causal` overrides.
    """
    n = config_dict.get("num_hidden_layers")
    view = _qwen3_view(config_dict)
    layer_types = list(view.layer_types) if view.layer_types is not None else ["full_attention"] * n
    if len(layer_types) != n:
        raise ValueError(f"{where}: layer_types has {len(layer_types)} entries for num_hidden_layers={n}")
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"{where}: layer_types {unknown} unsupported (drafter layers are full_attention or sliding_attention)")
    sliding = "sliding_attention" in layer_types
    if dflash.get("use_swa") and not all(t == "sliding_attention" for t in layer_types):
        raise ValueError(
            f"{where}: dflash_config.use_swa=true on layers that layer_types does not mark sliding_attention: vLLM "
            "runs them as non-causal sliding windows, SGLang as full attention; refused rather than guessed. Declare "
            "the sliding layers in layer_types instead."
        )
    for field, value in (("is_causal", config_dict.get("is_causal")), ("dflash_config.causal", dflash.get("causal"))):
        if value is not None and not (bool(value) == sliding and all(t == layer_types[0] for t in layer_types)):
            raise ValueError(
                f"{where}: {field}={value!r} overrides the per-layer attention (causal exactly on sliding_attention "
                "layers), which only vLLM reads; unsupported"
            )
    window = None
    if sliding:
        window = dflash.get("swa_window_size", view.sliding_window)
        if window is None:
            raise ValueError(
                f"{where}: layer_types has sliding_attention layers but no window: set sliding_window (with "
                "use_sliding_window: true, else transformers drops it) or dflash_config.swa_window_size"
            )
        if view.sliding_window is not None and int(view.sliding_window) != int(window):
            raise ValueError(
                f"{where}: dflash_config.swa_window_size={window} differs from sliding_window={view.sliding_window} "
                "(vLLM reads the first, SGLang and z-lab the second)"
            )
    return {"layer_types": layer_types, "sliding_window": None if window is None else int(window)}


def config_from_dflash_dict(config_dict: dict, where: str = "config.json") -> AdaFlashConfig:
    """Translate a DFlash / AdaFlash `config.json` dict into an [`AdaFlashConfig`].

    Every field the three implementations read (z-lab `dflash/model.py`, SGLang
    `speculative/dflash_utils.py::parse_dflash_draft_config`, vLLM `models/qwen3_dflash.py`):
    `dflash_config.block_size` before the top-level `block_size` (default 16);
    `dflash_config.num_target_layers` before the top-level one; `target_layer_ids` from
    `dflash_config`, else the top level, else the z-lab default for `num_target_layers`;
    `mask_token_id` from `dflash_config`, else the top level; sliding-window layers. `where` names the
    file in errors.
    """
    dflash = config_dict.get("dflash_config")
    if not isinstance(dflash, dict):
        raise ValueError(f"{where}: dflash_config must be a JSON object, got {type(dflash).__name__}")
    for field in _UNSUPPORTED_DFLASH_FEATURES:
        if dflash.get(field) not in (None, False, 0, 0.0):
            raise ValueError(f"{where}: dflash_config.{field}={dflash[field]!r} is a feature this drafter does not implement")
    if dflash.get("output_multiplier", 1.0) != 1.0:
        raise ValueError(f"{where}: dflash_config.output_multiplier={dflash['output_multiplier']!r} is unsupported (1.0 only)")
    for field in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        if field not in config_dict:
            raise ValueError(f"{where}: required field {field} is missing")
    fields = {k: config_dict[k] for k in _DECODER_FIELDS if k in config_dict}
    rope = config_dict.get("rope_parameters") or config_dict.get("rope_scaling") or {}
    rope = dict(rope)
    if "rope_theta" in config_dict:
        rope.setdefault("rope_theta", config_dict["rope_theta"])
    if rope:
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope.setdefault("rope_theta", AdaFlashConfig.default_theta)  # vLLM: set_default_rope_theta(1e6)
        fields["rope_parameters"] = rope
    if fields.get("head_dim") is None:
        fields["head_dim"] = config_dict["hidden_size"] // config_dict["num_attention_heads"]
    fields.update(_attention_fields(config_dict, dflash, where))

    def pick(name):
        return dflash[name] if dflash.get(name) is not None else config_dict.get(name)

    n_layers = config_dict["num_hidden_layers"]
    num_target_layers, target_layer_ids = pick("num_target_layers"), pick("target_layer_ids")
    if target_layer_ids is None and num_target_layers is None:
        raise ValueError(
            f"{where}: neither dflash_config.target_layer_ids nor num_target_layers is set: the target layers "
            "the drafter reads cannot be known"
        )
    if target_layer_ids is None:
        # z-lab: dflash_config.get("target_layer_ids", build_target_layer_ids(num_target_layers, n)).
        target_layer_ids = default_target_layer_ids(int(num_target_layers), n_layers)
    if not isinstance(target_layer_ids, (list, tuple)) or not target_layer_ids:
        raise ValueError(f"{where}: dflash_config.target_layer_ids must be a non-empty list, got {target_layer_ids!r}")
    if num_target_layers is None:
        # Unknown target depth (vLLM never reads it): the smallest target these ids fit. check_target
        # then compares against this lower bound only (num_target_layers_known=False).
        num_target_layers = max(int(i) for i in target_layer_ids) + 1
        fields["num_target_layers_known"] = False
    mask_token_id = pick("mask_token_id")
    if mask_token_id is None:
        raise ValueError(
            f"{where}: dflash_config has no mask_token_id: the checkpoint cannot be used as a drafter (SGLang would "
            "look the mask token up in the tokenizer; pass a config with mask_token_id)"
        )
    block_size = pick("block_size")
    has_head = bool(dflash.get("use_thresh_head_two_model", False))
    fields.update(
        block_size=int(block_size) if block_size is not None else 16,
        num_target_layers=int(num_target_layers),
        target_layer_ids=[int(i) for i in target_layer_ids],
        mask_token_id=int(mask_token_id),
        use_length_head=has_head,
        length_head_dim=dflash.get("thresh_head_bottleneck_dim", 256),
        # Released AdaFlash heads ship trained; a DFlash checkpoint has none.
        length_head_trained=has_head,
    )
    try:
        return AdaFlashConfig(**fields)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None


def dflash_dict_from_config(config: AdaFlashConfig, dtype=None, with_head: bool | None = None) -> dict:
    """The z-lab `config.json` for `config`, as vLLM and SGLang parse it.

    `with_head` (default: `config.use_length_head`) adds the AdaFlash head keys; `export_dflash` leaves
    them out of the top level (the head lives in `length_head/`). `dtype` sets `torch_dtype` / `dtype`.
    """
    out = {k: getattr(config, k) for k in _DECODER_FIELDS}
    rope = dict(config.rope_parameters or {})
    theta = rope.get("rope_theta", config.default_theta)
    layer_types = list(config.layer_types or ["full_attention"] * config.num_hidden_layers)
    sliding = "sliding_attention" in layer_types
    if dtype is None:
        dtype = config.dtype if config.dtype is not None else "bfloat16"
    dtype = str(dtype).removeprefix("torch.")
    dflash = {
        "target_layer_ids": list(config.target_layer_ids),
        "mask_token_id": config.mask_token_id,
        # SGLang reads these from dflash_config first; the top-level copies are z-lab's.
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
    }
    if sliding:
        dflash["swa_window_size"] = config.sliding_window  # vLLM reads this before sliding_window
    out.update(
        model_type="qwen3",
        architectures=[DFLASH_ARCHITECTURE],
        rope_theta=theta,
        rope_scaling=None if rope.get("rope_type", "default") == "default" else rope,
        # Written out so transformers' Qwen3Config (what both engines load) cannot derive other values.
        layer_types=layer_types,
        use_sliding_window=sliding,
        sliding_window=config.sliding_window if sliding else None,
        max_window_layers=0 if sliding else config.num_hidden_layers,
        block_size=config.block_size,
        num_target_layers=config.num_target_layers,
        dflash_config=dflash,
        torch_dtype=dtype,
        dtype=dtype,
    )
    if config.use_length_head if with_head is None else with_head:
        out["dflash_config"].update(length_head_dflash_keys(config))
    return out


def length_head_dflash_keys(config: AdaFlashConfig) -> dict:
    """The released AdaFlash `dflash_config` keys describing the length head."""
    return {
        "thresh_head_bottleneck_dim": config.length_head_dim,
        "use_thresh_head_two_model": True,
        "thresh_head_direct_len": True,
    }


# ----------------------------------------------------------------------------- embed_tokens fingerprint
_FINGERPRINT_ROWS = 64


def embedding_fingerprint(weight: torch.Tensor) -> dict:
    """A small, dtype-robust summary of an embedding matrix: per sampled row its L2 norm and its
    projection on a fixed random direction. Two embeddings that agree to bf16 precision match."""
    w = weight.detach().float().cpu()
    rows = sorted({int(i) for i in torch.linspace(0, w.shape[0] - 1, min(_FINGERPRINT_ROWS, w.shape[0])).round()})
    direction = torch.randn(w.shape[1], generator=torch.Generator().manual_seed(0))
    sample = w[rows]
    return {
        "shape": list(w.shape),
        "rows": rows,
        "norms": [round(float(x), 6) for x in sample.norm(dim=1)],
        "projections": [round(float(x), 6) for x in sample @ direction],
    }


def embedding_fingerprint_mismatch(fingerprint: dict | None, embedding) -> str | None:
    """None when `embedding` (a module or tensor) matches `fingerprint` (or there is none), else why not."""
    if not fingerprint or embedding is None:
        return None
    weight = embedding.weight if hasattr(embedding, "weight") else embedding
    if list(weight.shape) != list(fingerprint["shape"]):
        return f"embedding shape: target {list(weight.shape)}, the drafter checkpoint's embed_tokens {fingerprint['shape']}"
    ours = embedding_fingerprint(weight)
    d_norm = 1.0 + torch.randn(weight.shape[1], generator=torch.Generator().manual_seed(0)).norm().item()
    for n_a, n_b, p_a, p_b in zip(fingerprint["norms"], ours["norms"], fingerprint["projections"], ours["projections"]):
        # bf16 rounding moves a row by <= 2^-8 of its norm; a different embedding moves it by O(norm).
        tol = 1e-2 * max(n_a, n_b) + 1e-6
        if abs(n_a - n_b) > tol or abs(p_a - p_b) > tol * d_norm:
            return "embedding: the drafter checkpoint ships an embed_tokens.weight that differs from the target's"
    return None


def to_native_keys(names):
    """Released AdaFlash head names -> ours (`thresh_head_two_model.*` -> `length_head.*`)."""
    return {n: NATIVE_HEAD_PREFIX + n[len(RELEASED_HEAD_PREFIX) :] if n.startswith(RELEASED_HEAD_PREFIX) else n for n in names}


def to_dflash_keys(names):
    """Our names -> the z-lab / AdaFlash layout."""
    return {n: RELEASED_HEAD_PREFIX + n[len(NATIVE_HEAD_PREFIX) :] if n.startswith(NATIVE_HEAD_PREFIX) else n for n in names}


def _read_json(file):
    """A checkpoint's JSON file; a `ValueError` naming the file when it is not valid JSON."""
    with open(file, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file} is not valid JSON ({e}): fix or re-save the checkpoint") from None


def _check_local_path(path: str) -> None:
    """A missing local folder, said so (transformers would answer "Repo id must be in the form ...")."""
    if os.path.exists(path):
        return
    hub_id = re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", path) is not None
    if not hub_id or path.startswith((".", "~")) or os.path.isabs(path):
        raise FileNotFoundError(f"{path} does not exist: pass an existing local checkpoint folder or a Hub id (org/name)")


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
        shards = sorted(set(_read_json(index)["weight_map"].values()))
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


def _subfolder_kwargs(hub_kwargs: dict, name: str) -> dict:
    sub = hub_kwargs.get("subfolder") or ""
    return {**hub_kwargs, "subfolder": f"{sub}/{name}" if sub else name}


def read_length_head(path, hub_kwargs) -> tuple[dict, dict[str, torch.Tensor], str] | None:
    """The length head `export_dflash` writes beside the engines' files: `length_head/config.json` +
    `length_head/model.safetensors` (released `thresh_head_two_model.*` names). None when absent."""
    kw = _subfolder_kwargs(hub_kwargs, LENGTH_HEAD_SUBFOLDER)
    config_file = _resolve(path, "config.json", kw, required=False)
    if config_file is None:
        return None
    where = f"{path}/{LENGTH_HEAD_SUBFOLDER}"
    head_config = _read_json(config_file)
    weights = _resolve(path, "model.safetensors", kw, required=False)
    if weights is None:
        raise FileNotFoundError(f"{where} has a config.json but no model.safetensors")
    with safe_open(weights, framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    return head_config, tensors, where


def load_drafter_state_dict(cls, path, *args, **kwargs):
    """Implementation of `AdaFlashDrafter.from_pretrained` for every layout (see the module docstring)."""
    path = str(path)
    _check_local_path(path)
    hub_kwargs = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
    config = kwargs.pop("config", None)
    if config is not None and getattr(config, "model_type", None) != AdaFlashConfig.model_type:
        # transformers' AutoModel (remote code of an export) hands us the engines' Qwen3 view of a DFlash
        # config.json: read the file ourselves instead.
        config = None
    config_file = _resolve(path, "config.json", hub_kwargs, required=False)
    if config is None and config_file is None:
        raise FileNotFoundError(f"{path} has no config.json")
    config_dict = {}
    if config_file is not None:
        config_dict = _read_json(config_file)
    # Refuse a config that is not a drafter's before looking for weights, so the error names the real problem.
    if config is None and not is_dflash_layout(config_dict) and config_dict.get("model_type") != AdaFlashConfig.model_type:
        raise ValueError(
            f"{path}: config.json is not a drafter config (model_type={config_dict.get('model_type')!r}, "
            "no dflash_config). Expected an AdaFlash, DFlash (z-lab) or released AdaFlash checkpoint."
        )
    files = weight_files(path, hub_kwargs)
    found = read_safetensors_shapes(files)

    if config is None and is_dflash_layout(config_dict):
        config = config_from_dflash_dict(config_dict, where=f"{path}/config.json")
        head = read_length_head(path, hub_kwargs)
        if head is not None:
            if any(n.startswith(RELEASED_HEAD_PREFIX) for n in found):
                raise ValueError(f"{path}: length head tensors both in model.safetensors and in {LENGTH_HEAD_SUBFOLDER}/")
            head_config, head_tensors, where = head
            for key in ("length_head_dim", "length_head_trained", "length_rate", "length_min"):
                if key in head_config:
                    setattr(config, key, head_config[key])
            config.use_length_head = True
            found.update({n: tuple(t.shape) for n, t in head_tensors.items()})
        else:
            head_tensors = {}
        embed = found.pop(EMBED_TOKENS, None)
        if embed is not None:
            if tuple(embed) != (config.vocab_size, config.hidden_size):
                raise ValueError(
                    f"{path}: {EMBED_TOKENS} has shape {list(embed)}, expected [vocab_size={config.vocab_size}, "
                    f"hidden_size={config.hidden_size}]"
                )
            config.embed_tokens_fingerprint = embedding_fingerprint(_read_tensor(files, EMBED_TOKENS))
        rename = to_native_keys(found)
        check_tensors({rename[n]: s for n, s in found.items()}, expected_shapes(cls, config), path)
        return _load_renamed(cls, config, files, rename, kwargs, extra=head_tensors)

    if config is None:
        config = AdaFlashConfig.from_pretrained(path, **hub_kwargs)
    check_tensors(found, expected_shapes(cls, config), path)
    from transformers.modeling_utils import PreTrainedModel

    kwargs.setdefault("use_safetensors", True)
    return PreTrainedModel.from_pretrained.__func__(cls, path, *args, config=config, **kwargs)


def _read_tensor(files, name):
    for file in files:
        with safe_open(file, framework="pt") as f:
            if name in f.keys():
                return f.get_tensor(name)
    raise KeyError(name)


def _load_renamed(cls, config, files, rename, kwargs, extra=None):
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if kwargs.get("attn_implementation"):
        config._attn_implementation = kwargs["attn_implementation"]
    state = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name in rename:  # embed_tokens.weight is fingerprinted, not loaded
                    state[rename[name]] = f.get_tensor(name)
    extra = extra or {}
    state.update({rename[n]: t for n, t in extra.items()})
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


def write_dflash_checkpoint(model, path: str, dtype="bfloat16", remote_code_dir: str | None = None, head_layout: str = "subfolder") -> None:
    """Write `model` in the z-lab DFlash layout into `path`: what vLLM and SGLang load, nothing else.

    - `config.json` + `model.safetensors`: the DFlash tensors only (vLLM's `load_weights` rejects any
      name it does not know and reads every top-level `*.safetensors`), cast to `dtype` (None keeps
      the model's).
    - `length_head/config.json` + `length_head/model.safetensors`: the length head (released
      `thresh_head_two_model.*` names), where neither engine looks; our reader picks it up again.
    - `remote_code_dir`: copy its `*.py` beside the weights and add `auto_map` (AutoModel only: the
      engines keep reading config.json as a Qwen3 config).
    - `head_layout="released"` instead writes the released AdaFlash layout: the head at the top level
      under `thresh_head_two_model.*` with its `dflash_config` keys (AdaFlash's own code reads it;
      stock vLLM refuses it).

    Written into a temporary sibling directory first and renamed into place (`save_atomically`), so a
    crash never leaves a half-written checkpoint at `path`; folders and files get the modes the umask
    gives a plain save (0755 / 0644 under the usual 022).
    """
    import shutil

    from safetensors.torch import save_file

    if model.config.use_length_head and getattr(model.config, "length_head_type", "released") != "released":
        raise ValueError("the paper's length-head variant has no DFlash / released layout: save it with save_pretrained")
    path = os.path.abspath(path)
    if os.path.exists(path) and os.listdir(path):
        raise FileExistsError(f"{path} exists and is not empty: choose a new directory")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    out_dtype = next(iter(state.values())).dtype
    if head_layout not in ("subfolder", "released"):
        raise ValueError(f"head_layout must be 'subfolder' or 'released', got {head_layout!r}")
    head = {RELEASED_HEAD_PREFIX + k[len(NATIVE_HEAD_PREFIX) :]: v for k, v in state.items() if k.startswith(NATIVE_HEAD_PREFIX)}
    body = {k: v for k, v in state.items() if not k.startswith(NATIVE_HEAD_PREFIX)}
    config = dflash_dict_from_config(model.config, dtype=out_dtype, with_head=bool(head) and head_layout == "released")
    if head_layout == "released":
        body, head = {**body, **head}, {}

    def fill(tmp: str) -> None:
        save_file(body, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        if head:
            os.mkdir(os.path.join(tmp, LENGTH_HEAD_SUBFOLDER))
            save_file(head, os.path.join(tmp, LENGTH_HEAD_SUBFOLDER, "model.safetensors"), metadata={"format": "pt"})
            c = model.config
            head_config = {
                "format": "adaflash-length-head",
                "tensor_prefix": RELEASED_HEAD_PREFIX,
                "hidden_size": c.hidden_size,
                "block_size": c.block_size,
                "length_head_dim": c.length_head_dim,
                "length_head_trained": bool(c.length_head_trained),
                "length_rate": c.length_rate,
                "length_min": c.length_min,
                "dflash_config": length_head_dflash_keys(c),
                "torch_dtype": str(out_dtype).removeprefix("torch."),
            }
            with open(os.path.join(tmp, LENGTH_HEAD_SUBFOLDER, "config.json"), "w", encoding="utf-8") as f:
                json.dump(head_config, f, indent=2, sort_keys=True)
        if remote_code_dir is not None:
            for name in sorted(os.listdir(remote_code_dir)):
                if name.endswith(".py") and name != "__init__.py":
                    shutil.copyfile(os.path.join(remote_code_dir, name), os.path.join(tmp, name))
            config["auto_map"] = {"AutoModel": "modeling_adaflash.AdaFlashDrafter"}
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)

    save_atomically(fill, path)


__all__ = [
    "LENGTH_HEAD_SUBFOLDER",
    "check_tensors",
    "config_from_dflash_dict",
    "dflash_dict_from_config",
    "embedding_fingerprint",
    "embedding_fingerprint_mismatch",
    "is_dflash_layout",
    "load_drafter_state_dict",
    "read_length_head",
    "read_safetensors_shapes",
    "to_dflash_keys",
    "to_native_keys",
    "write_dflash_checkpoint",
]
