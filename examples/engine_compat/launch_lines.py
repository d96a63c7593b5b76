"""The README's launch lines through each engine's own command-line parser and configuration checks,
on CPU and without the Hub (`launch_commands` output for our exports). Used by `check_vllm_sglang.py`."""

from __future__ import annotations

import json
import os
import shlex
import sys

import torch

# ----------------------------------------------------------------------------- launch lines
README_EXPORT_DIR = "/models/my-drafter-dflash"  # the export path README.md and docs/export.md show
README_TARGET, README_SETTINGS = "Qwen/Qwen3-8B", {"tp": 2}

# Qwen/Qwen3-8B's config.json as published on the Hub (no weights, no tokenizer): the README's target,
# placed in an offline Hugging Face cache so the engines resolve the name "Qwen/Qwen3-8B" as written.
QWEN3_8B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}  # fmt: skip


def offline_hub_cache(folder: str) -> None:
    """Point huggingface_hub at an offline cache holding only Qwen/Qwen3-8B's config.json (before it is imported)."""
    repo = os.path.join(folder, "models--Qwen--Qwen3-8B")
    revision = "0" * 40
    os.makedirs(os.path.join(repo, "snapshots", revision), exist_ok=True)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(revision)
    with open(os.path.join(repo, "snapshots", revision, "config.json"), "w") as f:
        json.dump(QWEN3_8B_CONFIG, f, indent=2)
    assert "huggingface_hub" not in sys.modules, "the offline cache must be set before huggingface_hub is imported"
    os.environ.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=folder, TRANSFORMERS_OFFLINE="1")


def readme_blocks() -> dict[str, dict[str, str]]:
    """The vLLM / SGLang lines docs/export.md shows (None where the file is not there)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = {}
    for doc in (os.path.join("docs", "export.md"),):
        path = os.path.join(root, doc)
        if not os.path.isfile(path):
            continue
        lines = open(path, encoding="utf-8").read().splitlines()
        out[doc] = {
            "vllm": next((line for line in lines if line.startswith("vllm serve ")), None),
            "sglang": next((line for line in lines if line.startswith("python -m sglang.launch_server ")), None),
        }
    return out


def launch_cases(cases: dict[str, dict]) -> list[dict]:
    """The exact lines `launch_commands` prints for our exports."""
    from adaflash_hf.export import launch_commands
    from adaflash_hf.reference import REFERENCE_DIR

    out = []
    if "8b_shaped" in cases:  # the README's line: a block-16 drafter of Qwen3-8B's shape, target by Hub name, tp 2
        out.append({"name": "readme_qwen3_8b", "export": cases["8b_shaped"]["path"], "target": README_TARGET,
                    "settings": dict(README_SETTINGS), "readme": True})  # fmt: skip
    # The reference pair: a real local target folder (config, tokenizer, weights), nothing resolved by name.
    out.append({"name": "reference_local_target", "export": cases["reference"]["path"],
                "target": os.path.join(REFERENCE_DIR, "target"), "settings": {"tp": 2, "port": 8001}})  # fmt: skip
    for lc in out:
        lc["lines"] = launch_commands(lc["export"], lc["target"], lc["settings"])
        with open(os.path.join(lc["export"], "config.json")) as f:
            config = json.load(f)
        lc["draft_tokens"] = int(config["dflash_config"]["block_size"])
        if lc.get("readme"):  # README / docs show these very lines, for an export at README_EXPORT_DIR
            want = {k: v.replace(os.path.abspath(lc["export"]), README_EXPORT_DIR) for k, v in lc["lines"].items()}
            lc["docs_match"] = {doc: shown == want for doc, shown in readme_blocks().items()}
    return out


def vllm_serve_config(argv: list[str]):
    """`vllm serve ...` as vLLM's CLI runs it, up to the engine config (no engine is started)."""
    import vllm.entrypoints.cli.serve as serve
    import vllm.model_executor.models.registry as registry
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.common.cli_args import propagate_flash_late_interaction
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # vLLM inspects model classes in a subprocess only so that CUDA is not initialised in the parent; the
    # subprocess would not see the unpacked sources, and there is no CUDA here: inspect in this process.
    registry._run_in_subprocess = lambda fn: fn()
    assert argv[:2] == ["vllm", "serve"], argv[:2]
    # vllm/entrypoints/cli/main.py: the top-level parser with the `serve` subcommand, validate, dispatch.
    parser = FlexibleArgumentParser(description="vLLM CLI")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    cmd = serve.ServeSubcommand()
    cmd.subparser_init(subparsers).set_defaults(dispatch_function=cmd.cmd)
    args = parser.parse_args(argv[1:])
    cmd.validate(args)  # validate_parsed_serve_args
    if args.model_tag is not None:  # ServeSubcommand.cmd
        args.model = args.model_tag
    # vllm/entrypoints/launchers/api_server/entry.py: build_async_engine_client(_from_engine_args)
    engine_args = AsyncEngineArgs.from_cli_args(args)
    propagate_flash_late_interaction(args, engine_args)
    return args, engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


def vllm_launch_check(lc: dict, log) -> dict:
    from vllm.transformers_utils.configs.eagle import EAGLEConfig

    argv = shlex.split(lc["lines"]["vllm"])
    args, config = vllm_serve_config(argv)
    spec, n = config.speculative_config, lc["draft_tokens"]
    draft = spec.draft_model_config
    facts = {
        "model_tag": args.model_tag, "target_model": config.model_config.model,
        "target_architectures": list(config.model_config.architectures),
        "target_layers": config.model_config.get_total_num_hidden_layers(), "method": spec.method,
        "num_speculative_tokens": spec.num_speculative_tokens, "draft_model": draft.model,
        "draft_architectures": list(draft.architectures), "draft_hf_config": type(draft.hf_config).__name__,
        "draft_dtype": str(draft.dtype), "target_dtype": str(config.model_config.dtype),
        "parallel_drafting": spec.parallel_drafting, "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
        "draft_tensor_parallel_size": spec.draft_tensor_parallel_size,
    }  # fmt: skip
    assert args.model_tag == lc["target"], args.model_tag
    assert spec.method == "dflash" and spec.num_speculative_tokens == n - 1, facts
    assert os.path.abspath(draft.model) == os.path.abspath(lc["export"]), draft.model
    assert draft.architectures == ["DFlashDraftModel"] and isinstance(draft.hf_config, EAGLEConfig), facts
    assert config.parallel_config.tensor_parallel_size == lc["settings"]["tp"], facts
    assert draft.dtype == config.model_config.dtype == torch.bfloat16, facts
    if "port" in lc["settings"]:
        assert args.port == lc["settings"]["port"], args.port
    log(f"vLLM parses and configures {lc['name']}: dflash, {n - 1} speculative tokens, tp {facts['tensor_parallel_size']}, "
        f"target {facts['target_architectures']} ({facts['target_layers']} layers)")  # fmt: skip
    # Control: the same line without num_speculative_tokens (the README's old line) must be refused.
    spec_at = argv.index("--speculative-config") + 1
    without = json.loads(argv[spec_at])
    without.pop("num_speculative_tokens")
    try:
        vllm_serve_config(argv[:spec_at] + [json.dumps(without)] + argv[spec_at + 1 :])
        raise AssertionError("vLLM accepted a dflash line without num_speculative_tokens")
    except Exception as e:  # noqa: BLE001
        if "num_speculative_tokens" not in str(e):
            raise
        message = " ".join(str(e).split())
        facts["control_without_num_speculative_tokens"] = message[max(0, message.find("A speculative")) :].split(" [type=")[0]
    return facts


def sglang_launch_check(lc: dict, log) -> dict:
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from sglang.srt.utils.hf_transformers_utils import get_config

    argv = shlex.split(lc["lines"]["sglang"])
    assert argv[:3] == ["python", "-m", "sglang.launch_server"], argv[:3]
    n = lc["draft_tokens"]
    facts = {}
    # As written, on this machine: SGLang infers the device and finds no accelerator.
    server_args = prepare_server_args(argv[3:])  # sglang/launch_server.py __main__
    try:
        server_args.resolve_once()
        facts["as_written_here"] = "resolved"
    except Exception as e:  # noqa: BLE001
        facts["as_written_here"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    # On an NVIDIA host SGLang infers device "cuda"; declared here (with "cpu", `_handle_dflash` refuses DFLASH).
    server_args = prepare_server_args(argv[3:])
    server_args.device = "cuda"
    server_args.resolve_once()  # run_server -> resolve_once: the resolution pipeline incl. _handle_dflash
    server_args.check_server_args()  # Engine launch: check_server_args after resolution
    cfg = resolving_view(server_args)
    model_config = getattr(server_args, "_model_config", None)
    draft_config = parse_dflash_draft_config(draft_hf_config=get_config(cfg.speculative_draft_model_path, trust_remote_code=False))
    facts.update({
        "model_path": cfg.model_path, "speculative_algorithm": str(cfg.speculative_algorithm),
        "speculative_draft_model_path": cfg.speculative_draft_model_path,
        "speculative_num_draft_tokens": cfg.speculative_num_draft_tokens, "speculative_num_steps": cfg.speculative_num_steps,
        "speculative_eagle_topk": cfg.speculative_eagle_topk, "tp_size": cfg.tp_size, "port": cfg.port,
        "attention_backend": cfg.attention_backend, "max_running_requests": cfg.max_running_requests,
        "target_layers": getattr(getattr(model_config, "hf_config", None), "num_hidden_layers", None),
        "draft_block_size": draft_config.resolve_block_size(default=None),
    })  # fmt: skip
    assert cfg.model_path == lc["target"] and "DFLASH" in facts["speculative_algorithm"], facts
    assert os.path.abspath(cfg.speculative_draft_model_path) == os.path.abspath(lc["export"]), facts
    assert cfg.speculative_num_draft_tokens == n and cfg.speculative_num_steps == 1 and cfg.speculative_eagle_topk == 1, facts
    assert cfg.tp_size == lc["settings"]["tp"], facts
    assert cfg.port == lc["settings"].get("port", cfg.port), facts
    # DFlashWorker (GPU start-up) warns when the draft count differs from the drafter's block size.
    assert facts["draft_block_size"] == n, facts
    log(f"SGLang parses and resolves {lc['name']}: DFLASH, {n} draft tokens, tp {cfg.tp_size}, "
        f"target layers {facts['target_layers']}; as written on this CPU host: {facts['as_written_here'][:90]}")  # fmt: skip
    return facts


def patch_sglang_runtime():
    """One rank of tensor parallelism for SGLang's layers (its runtime context is set up by the server)."""
    from types import SimpleNamespace

    from sglang.srt import runtime_context
    from sglang.srt.models import dflash

    parallel = SimpleNamespace(tp_size=1, tp_rank=0, tp_group=None, attn_tp_group=None, attn_tp_size=1, attn_tp_rank=0, pp_size=1, pp_rank=0,
                               attn_cp_size=1, attn_cp_rank=0, attn_dp_size=1, attn_dp_rank=0, moe_ep_size=1)  # fmt: skip
    for module in list(sys.modules.values()):
        if (getattr(module, "__name__", "") or "").startswith("sglang") and hasattr(module, "get_parallel"):
            module.get_parallel = lambda: parallel
    runtime_context.get_parallel = lambda: parallel
    dflash.get_parallel = lambda: parallel


# What the launch-line check cannot run on this CPU-only machine without the Hub (printed and recorded).
NOT_CHECKED_ON_CPU = {
    "vllm": [
        "platform: run with vLLM's CpuPlatform; CudaPlatform.check_and_update_config (GPU attention-backend choice for "
        "the non-causal DFlash draft, CUDA graphs, memory) needs a GPU",
        "model-class inspection runs in this process (vLLM runs it in a subprocess only to keep CUDA out of the parent)",
        "engine core / workers not started: no weights of the target loaded (only Qwen3-8B's config.json, "
        "no Hub), no KV cache sizing, no drafting; the drafter's target_layer_ids against the target depth is checked "
        "at model-runner start (get_eagle3_aux_layers_from_config), on a GPU",
    ],
    "sglang": [
        "device: the line as written fails here because SGLang finds no accelerator; resolution runs with device "
        "'cuda' declared (what it infers on an NVIDIA host); with 'cpu' _handle_dflash refuses DFLASH",
        "GPU-derived defaults (attention backend by compute capability, memory-based sizes) resolve without a GPU "
        "here and can differ on one",
        "scheduler / DFlashWorker not started: no weights or tokenizer of the target (only Qwen3-8B's config.json, "
        "no Hub), no drafting; the worker's block-size check is restated with SGLang's parse_dflash_draft_config",
    ],
}
