"""`adaflash info`: what a drafter checkpoint is, from `config.json` and safetensors headers only."""

from __future__ import annotations

import json
import math
import os
import shlex

from ..loading import UsageError, check_drafter_path, drafter_layout, locate, one_line, read_config
from .common import PROG

HELP = "inspect a drafter checkpoint (layout, target it fits, layer ids, head) without loading weights"
DESCRIPTION = (
    "Inspect a drafter checkpoint folder or Hub id from its config.json and safetensors headers only (no\n"
    "weights are read): its layout (native / DFlash / AdaFlash), the target it fits (layers, hidden size,\n"
    "vocab), target_layer_ids, block size, mask token id, length head present / trained, parameter\n"
    "count, and whether the tensors match the config. --target also checks the fit against a target.\n\n"
    "--round-costs prints the round costs measured on this machine (what the cost verify-length rule weighs, cached\n"
    "per models, device, dtype and versions); --profile-cost loads the drafter and --target and measures them again.\n\n"
    "example:\n  adaflash info z-lab/Qwen3-8B-DFlash-b16\n  adaflash info runs/drafter --target Qwen/Qwen3-8B --json\n"
    "  adaflash info --reference\n  adaflash info --round-costs\n  adaflash info --reference --profile-cost --device cuda"
)


def add_arguments(p) -> None:
    p.add_argument("checkpoint", nargs="?", help="drafter checkpoint: local folder or Hub id")
    p.add_argument("--reference", action="store_true", help="inspect the embedded reference drafter (checked against its target)")
    p.add_argument("--target", help="also check that the drafter fits this target (its config.json only)")
    p.add_argument("--json", action="store_true", help="print the facts as JSON")
    p.add_argument("--round-costs", action="store_true",
                   help="print the round costs measured on this machine (the cost rule's tables) and exit")
    p.add_argument("--profile-cost", action="store_true",
                   help="load the drafter and --target, measure their round cost on --device again and cache it")
    p.add_argument("--device", default="auto", help="--profile-cost: where to measure (default: cuda if available)")
    p.add_argument("--dtype", default="auto", help="--profile-cost: the models' dtype (default: the device's)")
    p.add_argument("--max-slots", type=int, default=16, help="--profile-cost: the engine's concurrent requests")


# ============================================================================ facts
def _tensor_headers_local(path: str) -> tuple[dict, list[str]]:
    from safetensors import safe_open

    from ..modeling.checkpoint_layouts import weight_files

    files = weight_files(path, {})
    tensors = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                tensors[name] = (tuple(sl.get_shape()), str(sl.get_dtype()))
    return tensors, [os.path.basename(f) for f in files]


def _tensor_headers_hub(repo: str) -> tuple[dict, list[str]]:
    from huggingface_hub import HfApi

    meta = HfApi().get_safetensors_metadata(repo)
    tensors = {}
    for fm in meta.files_metadata.values():
        for name, info in fm.tensors.items():
            tensors[name] = (tuple(info.shape), str(info.dtype))
    return tensors, sorted(meta.files_metadata)


def _drafter_config(path: str, raw: dict, layout: str):
    from ..modeling import AdaFlashConfig
    from ..modeling.checkpoint_layouts import config_from_dflash_dict

    try:
        return AdaFlashConfig.from_dict(raw) if layout == "native" else config_from_dflash_dict(raw)
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{path}: invalid drafter config.json: {one_line(e)}", "the checkpoint's config.json is damaged") from None


def _weights(path: str, local: bool, layout: str, expected: dict) -> tuple[dict, int, bool | None, str]:
    """(weights facts, parameter count, length head in the weights, where the count comes from)."""
    from ..modeling.checkpoint_layouts import NATIVE_HEAD_PREFIX, RELEASED_HEAD_PREFIX, check_tensors, to_native_keys

    weights: dict = {"files": [], "status": None}
    try:
        tensors, files = _tensor_headers_local(path) if local else _tensor_headers_hub(path)
        weights["files"] = files
    except Exception as e:  # noqa: BLE001 - missing / pickle-only / unreachable weights: reported, not fatal
        weights["status"] = f"not readable: {one_line(e)}"
        return weights, sum(math.prod(s) for s in expected.values()), None, "config (weights not readable)"
    names = to_native_keys(tensors) if layout != "native" else {n: n for n in tensors}
    found = {names[n]: shape for n, (shape, _) in tensors.items()}
    try:
        check_tensors(found, expected, path)
        weights["status"] = "match the config"
    except ValueError as e:
        weights["status"] = one_line(e)
    weights["dtypes"] = sorted({d for _, d in tensors.values()})
    params = sum(math.prod(s) for s, _ in tensors.values())
    head_in_weights = any(n.startswith((NATIVE_HEAD_PREFIX, RELEASED_HEAD_PREFIX)) for n in tensors)
    return weights, params, head_in_weights, "safetensors headers"


def inspect_checkpoint(path: str) -> dict:
    """What a drafter checkpoint is, from `config.json` and safetensors headers only (no weights read).

    Raises `UsageError` when `path` is missing or not a drafter checkpoint.
    """
    from ..modeling import AdaFlashDrafter
    from ..modeling.checkpoint_layouts import expected_shapes

    local, raw, layout = check_drafter_path(path, "checkpoint")
    config = _drafter_config(path, raw, layout)
    weights, params, head_in_weights, params_from = _weights(path, local, layout, expected_shapes(AdaFlashDrafter, config))
    has_head = bool(config.use_length_head)
    if layout == "native":
        trained = bool(config.length_head_trained) if has_head else None
    else:
        trained = True if has_head else None  # released AdaFlash heads ship trained; DFlash has none
    return {
        "checkpoint": path,
        "source": "local directory" if local else "Hugging Face Hub",
        "layout": layout,
        "model_type": raw.get("model_type"),
        "architectures": raw.get("architectures"),
        "target": {"num_target_layers": config.num_target_layers, "hidden_size": config.hidden_size, "vocab_size": config.vocab_size},
        "target_layer_ids": list(config.target_layer_ids),
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "drafter": {
            "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "intermediate_size": config.intermediate_size,
        },
        "length_head": {"present": has_head, "in_weights": head_in_weights, "trained": trained,
                        "dim": config.length_head_dim if has_head else None},
        "parameters": params,
        "parameters_from": params_from,
        "weights": weights,
        "loads_with": (
            ["AdaFlashDrafter.from_pretrained", "AutoModel (trust_remote_code)" if raw.get("auto_map") else None]
            if layout == "native"
            else ["AdaFlashDrafter.from_pretrained", "SGLang --speculative-algorithm DFLASH", 'vLLM {"method": "dflash"}']
        ),
    }  # fmt: skip


def _fit_problems(info: dict, target_path: str) -> list[str]:
    local = locate(target_path, "--target")
    cfg = read_config(target_path, local, "--target")
    if drafter_layout(cfg) is not None:
        raise UsageError(f"--target {target_path} is a drafter checkpoint, not a target model", "pass the model the drafter is for")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    t = info["target"]
    problems = []
    for key, theirs in (("num_target_layers", text.get("num_hidden_layers")), ("hidden_size", text.get("hidden_size")),
                        ("vocab_size", text.get("vocab_size"))):
        if theirs != t[key]:
            problems.append(f"{key}: drafter {t[key]}, target {theirs}")
    return problems


# ============================================================================ the command
_LAYOUT_TEXT = {
    "native": 'native (adaflash-hf, model_type "adaflash")',
    "DFlash": "DFlash (z-lab; SGLang / vLLM read it)",
    "AdaFlash": "AdaFlash (DFlash + length head; SGLang / vLLM read it and ignore the head)",
}


def _rows(info: dict, checkpoint: str, problems) -> list[tuple[str, str]]:
    t, d, h, w = info["target"], info["drafter"], info["length_head"], info["weights"]
    if h["present"]:
        head = f"present, {'trained' if h['trained'] else 'NOT trained (adaptive policy would guess)'}, dim {h['dim']}"
        if h["in_weights"] is False:
            head += " (but missing from the weights)"
    else:
        head = "absent (use --length-policy fixed or expected_gain)"
    block = info["block_size"]
    rows = [
        ("checkpoint", f"{info['checkpoint']} ({info['source']})"),
        ("layout", _LAYOUT_TEXT[info["layout"]]),
        ("fits target", f"{t['num_target_layers']} layers, hidden size {t['hidden_size']}, vocab {t['vocab_size']}"),
        ("target_layer_ids", f"{info['target_layer_ids']} (K={len(info['target_layer_ids'])} target layers read)"),
        ("block_size", f"{block} ({block - 1} draft tokens + 1 bonus token: up to {block} tokens per round)"),
        ("mask_token_id", str(info["mask_token_id"])),
        ("drafter", f"{d['num_hidden_layers']} layers, {d['num_attention_heads']} heads / {d['num_key_value_heads']} KV heads, "
                    f"head_dim {d['head_dim']}, intermediate {d['intermediate_size']}"),
        ("length head", head),
        ("parameters", f"{info['parameters']:,} (from {info['parameters_from']})"),
        ("weights", f"{w['status']}" + (f"; {', '.join(w['files'])}, {'/'.join(w.get('dtypes', []))}" if w["files"] else "")),
        ("loads with", ", ".join(x for x in info["loads_with"] if x)),
    ]
    if info["layout"] == "native":
        rows.append(("serving", f"SGLang / vLLM need the DFlash layout: {PROG} export {shlex.quote(checkpoint)} OUT_DIR"))
    if problems is not None:
        rows.append(("fits --target", "yes" if not problems else "NO: " + "; ".join(problems)))
    return rows


def _cost_lines(key: dict, cost) -> list[str]:
    """One cached round cost, for people: what it was measured on, then its table."""
    unit = f"{cost.unit_ms:.3f} ms" if cost.unit_ms else "?"
    lines = [f"{key['target']['name']} + {key['drafter']['name']} on {key['device']} ({key['dtype']}), {key['layout']}, "
             f"{key['max_slots']} slots, block {key['block_size']}; torch {key.get('torch')}, ours {key.get('adaflash_hf')}",
             f"  unit (1 token at 1 row) {unit}, draft fraction {cost.draft_fraction:.3f}",
             "  verify time by rows x tokens per row " + " ".join(str(q) for q in cost.tokens_per_row)]
    for r, row, spec, plain, read in zip(cost.rows, cost.verify, cost.spec_overhead, cost.plain_overhead, cost.read_overhead):
        lines.append(f"  rows {r:>4}: " + " ".join(f"{v:7.2f}" for v in row)
                     + f"   overhead drafting {spec:.2f}, plain {plain:.2f}, read {read:.2f}")
    return lines


def _round_costs() -> int:
    from ..engine.cost_cache import cached_costs
    from ..engine.kernels.tuning_cache import cache_dir

    costs = cached_costs()
    print(f"round costs in {cache_dir('round_cost')}: {len(costs) or 'no round cost measured yet'}")
    for key, cost in costs:
        print("\n".join(_cost_lines(key, cost)))
    return 0


def _profile_cost(args) -> int:
    from ..engine import Engine, EngineConfig
    from ..engine.cost_cache import cached_round_cost, round_cost_key
    from ..loading import load_models, resolve_device_dtype

    if not args.target:
        raise UsageError("--profile-cost needs the target", "pass --target PATH_OR_HUB_ID, or --reference")
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    models = load_models(args.target, args.checkpoint, device=device, dtype=dtype, need_drafter=True)
    engine = Engine(models.target, models.drafter, EngineConfig(max_slots=args.max_slots, max_len=1024,
                                                                token_budget=max(512, 16 * args.max_slots), cuda_graphs=True))
    cost = cached_round_cost(engine, refresh=True)
    print("\n".join(_cost_lines(round_cost_key(engine), cost)))
    return 0


def run(args) -> int:
    if args.round_costs:
        return _round_costs()
    if args.reference:
        if args.checkpoint:
            raise UsageError("pass either a checkpoint or --reference, not both", "drop one of them")
        from ..reference import REFERENCE_DIR

        args.checkpoint = os.path.join(REFERENCE_DIR, "drafter")
        args.target = args.target or os.path.join(REFERENCE_DIR, "target")
    if not args.checkpoint:
        raise UsageError("no checkpoint given", "pass a drafter folder or Hub id, or --reference")
    if args.profile_cost:
        return _profile_cost(args)
    info = inspect_checkpoint(args.checkpoint)
    problems = None
    if args.target:
        problems = _fit_problems(info, args.target)
        info["fits"] = {"target": args.target, "ok": not problems, "problems": problems}
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0 if not problems else 1
    rows = _rows(info, args.checkpoint, problems)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0 if not problems else 1
