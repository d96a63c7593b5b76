"""Load our DFlash exports with vLLM's and SGLang's own DFlash loaders (on CPU) and compare every tensor.

    python examples/engine_compat/check_vllm_sglang.py                  # downloads the wheels (no deps)
    python examples/engine_compat/check_vllm_sglang.py --wheels DIR     # wheels already downloaded
    python examples/engine_compat/check_vllm_sglang.py --no-8b --json out.json

Not part of CI (the wheels are ~400 MB): tests/test_export.py and tests/test_dflash_reader.py keep
small tests of the same facts. What it does:

1. `pip download --no-deps vllm==VLLM sglang==SGLANG` into a temporary folder (or `--wheels`), and
   unpacks their Python sources (no compiled extensions) into it.
2. Imports vLLM's `DFlashQwen3ForCausalLM` (`vllm/model_executor/models/qwen3_dflash.py`) and SGLang's
   `DFlashDraftModel` (`sglang/srt/models/dflash.py`) on CPU. Third-party modules the engines import
   but this environment lacks (zmq, msgspec, fastapi, ...) are stubbed; the tensor-parallel world is
   one rank; nothing of the engines' own code is replaced except the attention kernels' backend
   selection, which needs a GPU.
3. Exports the embedded reference drafter and an 8B-shaped drafter (Qwen3-8B DFlash shapes: 5 layers,
   hidden 4096, 32 / 8 heads, head_dim 128, intermediate 12288, block 16) with `export_dflash`, parses
   each `config.json` with the engine's own config code, builds the engine's drafter module, runs its
   `load_weights` over the folder's top-level `*.safetensors` (as the engines' model loaders do), and
   compares every parameter with our tensors (q/k/v and gate/up stacked as the engines stack them).
4. Parses the reader fixtures (sliding-window layers, absent `target_layer_ids`, `dflash_config.block_size`,
   a shipped `embed_tokens.weight`) with the engines' config code and checks that they agree with our
   reader on block size, target layer ids and each layer's attention (window, causal).
5. A control: the previous export layout (length head at the top level) must make vLLM's loader fail.
6. The launch lines: `adaflash_hf.export.launch_commands` for the 8B-shaped export with target
   "Qwen/Qwen3-8B" and tp 2 (the README's call; README.md and docs/export.md must show exactly these
   lines, export path aside) and for the reference export with the reference target folder (tp 2,
   port). Each line is split with shlex and run through the engine's own entry code:
   - vLLM: the `vllm serve` parser as `vllm/entrypoints/cli/main.py` builds it (FlexibleArgumentParser,
     `ServeSubcommand.subparser_init` -> `make_arg_parser`), `validate_parsed_serve_args`,
     `AsyncEngineArgs.from_cli_args` and `create_engine_config` (ModelConfig of the target,
     SpeculativeConfig for dflash with the draft folder, ParallelConfig, VllmConfig); control: the same
     line without `num_speculative_tokens` must be refused.
   - SGLang: `prepare_server_args` (what `python -m sglang.launch_server` calls), then
     `ServerArgs.resolve_once` (the resolution pipeline, `_handle_dflash` included) and
     `check_server_args`, as `Engine` launches do; and `parse_dflash_draft_config` block size ==
     draft-token count (what DFlashWorker checks at start-up).
   No Hub: "Qwen/Qwen3-8B" resolves through an offline HF cache that holds only its published
   config.json. `NOT_CHECKED_ON_CPU` (printed, and in the JSON) lists what needs a GPU.

Exit status 0 when every check passes. Prints one line per check and the versions.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
import tempfile
import traceback

import torch

from engine_sources import MissingModuleStubber, fetch_wheels, install_real_deps, single_rank, unpack_sources
from launch_lines import (
    NOT_CHECKED_ON_CPU,
    README_EXPORT_DIR,
    launch_cases,
    offline_hub_cache,
    patch_sglang_runtime,
    sglang_launch_check,
    vllm_launch_check,
)

VLLM_VERSION = "0.33.0"
SGLANG_VERSION = "0.5.23"


# ----------------------------------------------------------------------------- our side
def our_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update(load_file(file))
    return out


def expected_param(name: str, ours: dict[str, torch.Tensor], prefix: str) -> torch.Tensor | None:
    """Our tensor(s) for an engine parameter `name` (stacked ones concatenated as the engines stack them)."""
    n = name[len(prefix) :] if name.startswith(prefix) else name
    if n.endswith("qkv_proj.weight"):
        base = n[: -len("qkv_proj.weight")]
        return torch.cat([ours[base + p + ".weight"] for p in ("q_proj", "k_proj", "v_proj")])
    if n.endswith("gate_up_proj.weight"):
        base = n[: -len("gate_up_proj.weight")]
        return torch.cat([ours[base + p + ".weight"] for p in ("gate_proj", "up_proj")])
    return ours.get(n)


def compare(module: torch.nn.Module, ours: dict[str, torch.Tensor], prefix: str, skip=()) -> tuple[int, list[str]]:
    problems, n = [], 0
    for name, param in module.named_parameters():
        if any(s in name for s in skip):
            continue
        want = expected_param(name, ours, prefix)
        if want is None:
            problems.append(f"{name}: no tensor of ours maps to it")
            continue
        n += 1
        if tuple(param.shape) != tuple(want.shape) or not torch.equal(param.detach().to(want.dtype), want):
            problems.append(f"{name}: differs (shape {tuple(param.shape)} vs {tuple(want.shape)})")
    return n, problems


def make_exports(root: str, with_8b: bool) -> dict[str, dict]:
    """Export folders + what our reader makes of each (AdaFlashConfig)."""
    from adaflash_hf import AdaFlashConfig, AdaFlashDrafter, export_dflash, load_reference_pair
    from adaflash_hf.modeling import write_dflash_checkpoint

    cases = {}
    _, ref, _ = load_reference_pair()
    cases["reference"] = {"path": export_dflash(ref, os.path.join(root, "reference")), "target_layers": ref.config.num_target_layers}
    if with_8b:
        torch.manual_seed(0)
        cfg = AdaFlashConfig(
            vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=5, num_attention_heads=32,
            num_key_value_heads=8, head_dim=128, num_target_layers=36, block_size=16, mask_token_id=151669,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, max_position_embeddings=40960,
        )  # fmt: skip
        torch.set_default_dtype(torch.bfloat16)  # build it in bf16 directly: 2 GB, not 4
        try:
            big = AdaFlashDrafter(cfg)
        finally:
            torch.set_default_dtype(torch.float32)
        with torch.no_grad():
            for p in big.parameters():  # norms start at ones: make every tensor distinct
                p.add_(torch.randn_like(p) * 0.01)
        cases["8b_shaped"] = {"path": export_dflash(big, os.path.join(root, "8b")), "target_layers": 36}
        del big
    # Reader fixtures: the reference export with config.json edited the way other DFlash checkpoints are.
    fixtures = {
        "sliding_window": lambda c: c.update(layer_types=["sliding_attention", "full_attention"], use_sliding_window=True,
                                             sliding_window=4, max_window_layers=0),
        "no_target_layer_ids": lambda c: c["dflash_config"].pop("target_layer_ids"),
        "dflash_config_block_size": lambda c: (c.update(block_size=16), c["dflash_config"].update(block_size=8)),
    }  # fmt: skip
    for name, edit in fixtures.items():
        path = export_dflash(ref, os.path.join(root, name))
        file = os.path.join(path, "config.json")
        config = json.load(open(file))
        edit(config)
        json.dump(config, open(file, "w"), indent=2)
        cases[name] = {"path": path, "target_layers": ref.config.num_target_layers, "fixture": True}
    # embed_tokens.weight shipped (z-lab Qwen3.5 / gemma drafters do): both engines accept it.
    from safetensors.torch import load_file, save_file

    target, _, _ = load_reference_pair()
    path = export_dflash(ref, os.path.join(root, "with_embed_tokens"))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().to(torch.bfloat16).contiguous()
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cases["with_embed_tokens"] = {"path": path, "target_layers": ref.config.num_target_layers, "fixture": True}
    # Control: the layout exports had before (length head at the top level).
    control = os.path.join(root, "old_layout")
    write_dflash_checkpoint(ref, control, dtype="bfloat16", head_layout="released")
    cases["old_layout_control"] = {"path": control, "target_layers": ref.config.num_target_layers, "control": True}
    from adaflash_hf.modeling import config_from_dflash_dict

    for case in cases.values():  # what our reader makes of each config.json
        with open(os.path.join(case["path"], "config.json")) as f:
            case["ours"] = None if "control" in case else config_from_dflash_dict(json.load(f))
    return cases


def our_attention(config, i):
    """(window, causal) of layer i as our drafter runs it."""
    if config.layer_types[i] == "sliding_attention":
        return config.sliding_window, True
    return None, False


# ----------------------------------------------------------------------------- vLLM
def vllm_check(case: dict, log) -> None:
    from types import SimpleNamespace

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
    from vllm.model_executor.models import qwen3_dflash
    from vllm.transformers_utils.config import get_config

    path = case["path"]
    from vllm.transformers_utils.configs.eagle import EAGLEConfig

    # vLLM's own config parsing: get_config, then SpeculativeConfig wraps a dflash draft config in
    # EAGLEConfig(method="dflash") (vllm/config/speculative.py) before the model reads it.
    hf_config = EAGLEConfig(get_config(path, trust_remote_code=False), method="dflash", model_type="eagle")
    assert hf_config.architectures == ["DFlashDraftModel"], hf_config.architectures  # registry -> qwen3_dflash
    vllm_config = VllmConfig()
    draft = SimpleNamespace(hf_config=hf_config, model=path, revision=None, quantization=None, dtype=torch.bfloat16,
                            hf_text_config=hf_config)  # fmt: skip
    spec = SimpleNamespace(draft_model_config=draft, method="dflash")
    model_config = SimpleNamespace(
        get_total_num_hidden_layers=lambda: case["target_layers"], get_vocab_size=lambda: hf_config.vocab_size,
        dtype=torch.bfloat16, head_dtype=torch.bfloat16, hf_config=hf_config, hf_text_config=hf_config,
    )  # fmt: skip
    object.__setattr__(vllm_config, "speculative_config", spec)
    object.__setattr__(vllm_config, "model_config", model_config)
    qwen3_dflash.get_draft_quant_config = lambda cfg: None  # unquantized drafter

    class CurrentConfig:
        """The current config as the V2 model runner sets it (mixed sliding / full drafters need it)."""

        use_v2_model_runner = True

        def __getattr__(self, name):
            return getattr(vllm_config, name)

    class NoBackendAttention(torch.nn.Module):
        """vLLM's `Attention` picks a GPU kernel backend at construction; it holds no checkpoint weights."""

        def __init__(self, *args, **kwargs):
            super().__init__()

    qwen3_dflash.get_current_vllm_config = CurrentConfig
    qwen3_dflash.Attention = NoBackendAttention
    with set_current_vllm_config(vllm_config):
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = qwen3_dflash.DFlashQwen3ForCausalLM(vllm_config=vllm_config)
        finally:
            torch.set_default_dtype(torch.float32)
        ours = case["ours"]
        if ours is not None:  # the engine's view of each layer's attention equals ours
            for i, layer in enumerate(model.model.layers):
                got = (layer.self_attn.sliding_window, layer.self_attn.causal)
                assert got == our_attention(ours, i), f"layer {i}: vLLM {got}, ours {our_attention(ours, i)}"
            assert model.model.mask_token_id == ours.mask_token_id
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))  # DefaultModelLoader: top-level *.safetensors
        model.load_weights(safetensors_weights_iterator(files, False))
    ours_t = our_tensors(path)
    # The LM head (and the embedding, unless the checkpoint ships one) are the target's, shared by the engine.
    skip = ("mask_embedding", "draft_id_to_target_id", "lm_head") + (() if "embed_tokens.weight" in ours_t else ("embed_tokens",))
    n, problems = compare(model, ours_t, "model.", skip=skip)
    assert not problems, "; ".join(problems[:5])
    log(f"vLLM loads {os.path.basename(path)}: {n} parameters equal to ours")


# ----------------------------------------------------------------------------- SGLang
def sglang_check(case: dict, log) -> None:
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
    from sglang.srt.models import dflash
    from sglang.srt.speculative import dflash_utils
    from sglang.srt.utils.hf_transformers_utils import get_config

    path = case["path"]
    hf_config = get_config(path, trust_remote_code=False)  # SGLang's own config parsing
    parsed = dflash_utils.parse_dflash_draft_config(draft_hf_config=hf_config)
    ours = case["ours"]
    if ours is not None:
        assert parsed.resolve_block_size(default=16) == ours.block_size, (parsed.block_size, ours.block_size)
        n_target = parsed.num_target_layers if parsed.num_target_layers is not None else hf_config.num_hidden_layers
        ids = parsed.resolve_target_layer_ids(target_num_layers=n_target, draft_num_layers=hf_config.num_hidden_layers)
        assert list(ids) == ours.target_layer_ids, (ids, ours.target_layer_ids)
        for i in range(hf_config.num_hidden_layers):
            window_left, kind = dflash._get_dflash_layer_attention_params(hf_config, i)
            got = (None if window_left == -1 else window_left + 1, kind == dflash.AttentionType.DECODER)
            assert got == our_attention(ours, i), f"layer {i}: SGLang {got}, ours {our_attention(ours, i)}"
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = dflash.DFlashDraftModel(hf_config)
    finally:
        torch.set_default_dtype(torch.float32)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    model.load_weights(safetensors_weights_iterator(files))
    n, problems = compare(model, our_tensors(path), "", skip=("embed_tokens",))
    assert not problems, "; ".join(problems[:5])
    log(f"SGLang loads {os.path.basename(path)}: {n} parameters equal to ours")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheels", default=None, help="folder holding (or receiving) the wheels; default: a temporary one")
    ap.add_argument("--vllm", default=VLLM_VERSION)
    ap.add_argument("--sglang", default=SGLANG_VERSION)
    ap.add_argument("--no-8b", action="store_true", help="skip the 8B-shaped drafter (needs ~10 GB of memory)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))

    work = tempfile.mkdtemp(prefix="engine-compat-")
    offline_hub_cache(os.path.join(work, "hf_cache"))  # no Hub: Qwen/Qwen3-8B resolves to its config.json only
    wheels = fetch_wheels(args.wheels or work, args.vllm, args.sglang)
    site = os.path.join(work, "site")
    for name, wheel in wheels.items():
        unpack_sources(wheel, site, name)
    install_real_deps(os.path.join(work, "deps"))
    sys.path.insert(0, site)
    sys.path.insert(1, os.path.join(work, "deps"))
    stubber = MissingModuleStubber(site)
    sys.meta_path.append(stubber)

    results, failures = [], 0

    def log(line):
        print(line, flush=True)

    cases = make_exports(os.path.join(work, "exports"), not args.no_8b)
    launches = launch_cases(cases)
    for lc in launches:
        log(f"launch_commands {lc['name']}:\n  {lc['lines']['vllm']}\n  {lc['lines']['sglang']}")
        if "docs_match" in lc:
            ok = bool(lc["docs_match"]) and all(lc["docs_match"].values())
            log(f"README / docs show these lines (export at {README_EXPORT_DIR}): {lc['docs_match']}")
            results.append({"engine": "docs", "case": "launch:" + lc["name"], "ok": ok, "error": None if ok else str(lc["docs_match"])})
            failures += 0 if ok else 1
    launch_facts = {}
    for engine, check in (("vllm", vllm_check), ("sglang", sglang_check)):
        try:
            importlib.import_module("vllm.model_executor.models.qwen3_dflash" if engine == "vllm" else "sglang.srt.models.dflash")
            single_rank()
            if engine == "vllm":  # this machine has no GPU: vLLM's CPU platform (its detection reads the wheel's metadata)
                import vllm.platforms
                from vllm.platforms.cpu import CpuPlatform

                vllm.platforms.current_platform = CpuPlatform()
            if engine == "sglang":
                patch_sglang_runtime()
        except Exception:  # noqa: BLE001 - reported, the other engine still runs
            traceback.print_exc()
            results.append({"engine": engine, "case": "import", "ok": False, "error": traceback.format_exc(limit=3)})
            failures += 1
            continue
        for name, case in cases.items():
            expect_fail = bool(case.get("control")) and engine == "vllm"
            try:
                check(case, log)
                ok, error = not expect_fail, None if not expect_fail else "loaded, but vLLM should refuse the old layout"
            except Exception as e:  # noqa: BLE001
                ok = expect_fail and "thresh_head_two_model" in str(e)
                error = f"{type(e).__name__}: {e}"
                if ok:
                    log(f"{engine} refuses {name} as expected: {error[:160]}")
                else:
                    traceback.print_exc()
            if not case.get("control") or engine == "vllm":
                results.append({"engine": engine, "case": name, "ok": ok, "error": error})
                failures += 0 if ok else 1
        for lc in launches:  # the launch lines, through the engine's own command-line parser and config checks
            try:
                launch_facts[f"{engine}:{lc['name']}"] = (vllm_launch_check if engine == "vllm" else sglang_launch_check)(lc, log)
                ok, error = True, None
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                ok, error = False, f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
            results.append({"engine": engine, "case": "launch:" + lc["name"], "ok": ok, "error": error})
            failures += 0 if ok else 1
    versions = {"vllm": args.vllm, "sglang": args.sglang, "torch": torch.__version__,
                "transformers": importlib.import_module("transformers").__version__}  # fmt: skip
    summary = {"versions": versions, "results": results, "stubbed_modules": sorted(stubber.stubbed), "failures": failures,
               "launch_lines": {lc["name"]: {"target": lc["target"], "settings": lc["settings"], **lc["lines"]} for lc in launches},
               "launch_facts": launch_facts, "launch_not_checked": NOT_CHECKED_ON_CPU}  # fmt: skip
    for engine, gaps in NOT_CHECKED_ON_CPU.items():
        print(f"not checked here ({engine}): " + " | ".join(gaps))
    print(json.dumps({"versions": versions, "stubbed_modules": sorted(stubber.stubbed)}))
    print(f"{sum(r['ok'] for r in results)} passed, {failures} failed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
