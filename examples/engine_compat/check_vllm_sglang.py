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
import shlex
import subprocess
import sys
import tempfile
import traceback
import types
import zipfile

import torch

VLLM_VERSION = "0.33.0"
SGLANG_VERSION = "0.5.23"
ENGINE_ROOTS = ("vllm", "sglang")


# ----------------------------------------------------------------------------- stubs for absent third-party modules
class _AnyMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub

    def __getitem__(cls, item):
        return _Stub

    def __or__(cls, other):
        return _Stub

    __ror__ = __or__

    def __iter__(cls):
        return iter(())


class _Stub(metaclass=_AnyMeta):
    """Stands for any attribute of a module this environment lacks (only used at import time)."""

    def __init_subclass__(cls, **kwargs):
        pass

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):
        from pydantic_core import core_schema

        return core_schema.any_schema()

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Stub()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub()

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False


class _MissingModuleStubber(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on `sys.meta_path`: answers only for top-level third-party modules nothing else could find."""

    # Modules the engines import at module level for serving (networking, serialization, grammars, ...),
    # none of which the model classes or their weight loading use. GPU / platform probes (pynvml,
    # amdsmi, flashinfer, ...) stay missing, so both engines see the CPU platform they run on here.
    allowed = {
        "zmq", "urllib3", "cbor2", "aiohttp", "requests", "openai_harmony", "openai", "pybase64", "cachetools",
        "cloudpickle", "uvloop", "cpuinfo", "prometheus_client", "xgrammar", "fastapi",
        "partial_json_parser", "llguidance", "einops", "dill", "orjson", "starlette", "uvicorn", "setproctitle",
        "IPython", "outlines", "compressed_tensors", "gguf", "sentencepiece", "torchvision", "pydantic_settings",
        "blobfile", "pillow", "PIL", "interegular", "decord", "soundfile", "torchao", "hf_transfer", "modelscope",
        "anthropic", "tiktoken", "xxhash", "pybind11", "nvtx", "psutil", "sgl_kernel", "ray", "watchfiles",
        "python_multipart", "multipart", "httpx", "anyio", "prometheus_fastapi_instrumentator", "lark", "jinja2",
        "tabulate", "mistral_common", "tvm_ffi", "timm", "scipy", "librosa", "av", "smg_grpc_proto", "grpc", "grpcio",
    }  # fmt: skip

    def __init__(self, site: str):
        self.site = site
        self.stubbed = set()

    def _engine_is_importing(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None and (frame.f_code.co_filename.startswith("<frozen") or "importlib" in frame.f_code.co_filename):
            frame = frame.f_back
        return frame is not None and frame.f_code.co_filename.startswith(self.site)

    def find_spec(self, name, path, target=None):
        root = name.split(".")[0]
        if root not in self.allowed or ("." in name and root not in self.stubbed):
            return None  # a missing submodule of a real package stays missing
        if root not in self.stubbed and not self._engine_is_importing():
            return None  # other libraries' optional imports keep failing as they expect
        self.stubbed.add(root)
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    aliases = {"dill": "pickle"}  # dill pickles classes by reference just as pickle does

    def create_module(self, spec):
        if spec.name in self.aliases:
            return importlib.import_module(self.aliases[spec.name])
        module = types.ModuleType(spec.name)
        module.__path__ = []

        def getattr_(attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _Stub

        module.__getattr__ = getattr_
        return module

    def exec_module(self, module):
        pass


# ----------------------------------------------------------------------------- wheels
def fetch_wheels(folder: str, vllm_version: str, sglang_version: str) -> dict[str, str]:
    wheels = {}
    for name, version in (("vllm", vllm_version), ("sglang", sglang_version)):
        found = sorted(glob.glob(os.path.join(folder, f"{name}-{version}-*.whl")))
        if not found:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", folder, f"{name}=={version}"], check=True
            )
            found = sorted(glob.glob(os.path.join(folder, f"{name}-{version}-*.whl")))
        wheels[name] = found[0]
    return wheels


# Real (small) packages whose classes the engines subclass at import time: stubs would not do.
REAL_DEPS = ("msgspec",)


def install_real_deps(folder: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", folder, *REAL_DEPS], check=True
    )


def unpack_sources(wheel: str, site: str, root: str) -> None:
    with zipfile.ZipFile(wheel) as z:
        for member in z.namelist():
            if member.startswith(root + "/") and not member.endswith(".so"):
                z.extract(member, site)


def single_rank():
    """Tensor parallelism of one rank, wherever the engines' layers ask for it."""
    one = {"get_tensor_model_parallel_world_size": lambda *a, **k: 1, "get_tensor_model_parallel_rank": lambda *a, **k: 0}
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "") or ""
        if name.split(".")[0] in ENGINE_ROOTS:
            for attr, fn in one.items():
                if hasattr(module, attr):
                    setattr(module, attr, fn)


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
    """The vLLM / SGLang lines README.md and docs/export.md show (None where the file is not there)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = {}
    for doc in ("README.md", os.path.join("docs", "export.md")):
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
    stubber = _MissingModuleStubber(site)
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
