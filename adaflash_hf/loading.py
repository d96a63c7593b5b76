"""What the command line and the benchmark share: checking checkpoint paths, picking the device and
dtype, loading the target / drafter / tokenizer (or the embedded reference pair), reading prompt files.

Every mistake in what was asked raises `UsageError` (a `ValueError`) with a hint; `adaflash` prints
it as one line and exits with status 2, the library lets it propagate. Nothing here imports torch or
transformers at module level, so the CLI can build its parser and answer ``--help`` without them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Any, NamedTuple

__all__ = [
    "PROMPTS_HINT",
    "LoadedModels",
    "UsageError",
    "check_drafter_path",
    "check_target_path",
    "drafter_layout",
    "hub_offline_unless_reachable",
    "load_models",
    "locate",
    "read_config",
    "read_jsonl",
    "record_messages",
    "resolve_device_dtype",
    "set_cpu_threads",
]

PROG = "adaflash"
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
PROMPTS_HINT = 'a .jsonl file with one {"prompt": "..."} or {"messages": [...]} object per line'


class UsageError(ValueError):
    """A mistake in what was asked: reported as one line with a hint (``adaflash`` exits with status 2)."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def line(self) -> str:
        text = " ".join(str(self.message).split())
        if self.hint:
            text += f" (hint: {' '.join(str(self.hint).split())})"
        return f"{PROG}: error: {text}"


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# ============================================================================ the Hub, offline
HUB_PROBE_TIMEOUT_S = 2.0
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
_hub_offline: bool | None = None  # this process's answer, once probed


def hub_offline_unless_reachable() -> bool:
    """Whether the Hub is off limits for this process: set so by ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``
    (respected as given, ``0`` included), or found unreachable by one TCP connection to its host (the host of
    ``$HF_ENDPOINT``, else huggingface.co; `HUB_PROBE_TIMEOUT_S`). Unreachable switches the Hugging Face
    libraries to their offline mode for the rest of the process (local files and the cache only), with a
    one-line note on stderr: without it every Hub call (``datasets.load_dataset``, ``hf_hub_download``) retries
    for about 20 s before the local data or the built-in sample is used.

    Example:
        >>> if hub_offline_unless_reachable(): print("local files and the cache only")  # doctest: +SKIP
    """
    global _hub_offline
    if _hub_offline is not None:
        return _hub_offline
    given = [os.environ[v].strip().upper() for v in _OFFLINE_VARS if os.environ.get(v, "").strip()]
    if given:
        _hub_offline = given[0] in ("1", "ON", "YES", "TRUE")
        return _hub_offline
    _hub_offline = not _hub_reachable()
    if _hub_offline:
        _go_offline()
        import sys

        print(f"{PROG}: the Hugging Face Hub is unreachable: offline mode for this run (local files and the cache "
              "only; set HF_HUB_OFFLINE=0 to insist, HF_HUB_OFFLINE=1 to skip this check)", file=sys.stderr)
    return _hub_offline


def _hub_reachable() -> bool:
    import socket
    from urllib.parse import urlparse

    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=HUB_PROBE_TIMEOUT_S).close()
    except OSError:  # no DNS, no route, refused, timed out
        return False
    return True


def _go_offline() -> None:
    """Offline mode for this process and its children: the variables, and the flags the libraries already
    imported read them into (huggingface_hub and datasets read the variables once, at import)."""
    import sys

    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].constants.HF_HUB_OFFLINE = True
    if "datasets" in sys.modules:
        config = sys.modules["datasets"].config
        config.HF_HUB_OFFLINE = config.HF_DATASETS_OFFLINE = True


# ============================================================================ checkpoints
def locate(path: str, flag: str) -> bool:
    """True when `path` is a local directory, False for a Hub id; `UsageError` otherwise."""
    if os.path.isdir(path):
        return True
    if os.path.exists(path):
        raise UsageError(f"{flag} {path} is a file, not a checkpoint directory", "pass the folder that holds config.json")
    if HUB_ID.match(path) and not path.startswith((".", "~")):
        return False
    where = f"{flag}: checkpoint" if flag.startswith("-") else flag
    raise UsageError(f"{where} not found: {path}", "check the path, or pass a Hub id like org/name")


def read_config(path: str, local: bool, flag: str) -> dict:
    """`config.json` of a local folder or a Hub repository (downloads that one file only)."""
    if local:
        file = os.path.join(path, "config.json")
        if not os.path.isfile(file):
            raise UsageError(f"{flag} {path} has no config.json: not a model checkpoint", "pass the folder a model was saved to")
    else:
        hub_offline_unless_reachable()  # offline: the cache only, at once, instead of ~20 s of retries
        try:
            from huggingface_hub import hf_hub_download

            file = hf_hub_download(path, "config.json")
        except Exception as e:  # noqa: BLE001 - offline, no such repo, gated, ...: all about the id given
            where = f"{flag}: " if flag.startswith("-") else ""
            raise UsageError(
                f"{where}could not fetch config.json of Hub repo {path} ({type(e).__name__})",
                "check the id, network access and HF_TOKEN, or pass a local directory",
            ) from None
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"{flag}: cannot read {file}: {one_line(e)}", "the checkpoint's config.json must be valid JSON") from None
    if not isinstance(config, dict):
        raise UsageError(f"{flag}: {file} is not a JSON object", "the checkpoint's config.json must be a JSON object")
    return config


def drafter_layout(config: dict) -> str | None:
    """``"native"``, ``"DFlash"`` or ``"AdaFlash"`` for a drafter ``config.json``; None otherwise."""
    from .modeling.checkpoint_layouts import is_dflash_layout

    if config.get("model_type") == "adaflash":
        return "native"
    if is_dflash_layout(config):
        dflash = config.get("dflash_config") or {}
        return "AdaFlash" if dflash.get("use_thresh_head_two_model") else "DFlash"
    return None


def check_drafter_path(path: str, flag: str = "--drafter") -> tuple[bool, dict, str]:
    """``(is_local, config, layout)`` of a drafter checkpoint; `UsageError` when it is not one."""
    local = locate(path, flag)
    config = read_config(path, local, flag)
    layout = drafter_layout(config)
    if layout is None:
        raise UsageError(
            f"{flag} {path} is not a drafter checkpoint (config.json has model_type={config.get('model_type')!r} "
            "and no dflash_config)",
            "pass an AdaFlash / DFlash drafter folder; `adaflash info PATH` shows what a checkpoint is",
        )
    return local, config, layout


def check_target_path(path: str, flag: str = "--target") -> bool:
    """Whether a target checkpoint is local; `UsageError` when it is missing or is a drafter."""
    local = locate(path, flag)
    config = read_config(path, local, flag)
    layout = drafter_layout(config)
    if layout is not None:
        raise UsageError(
            f"{flag} {path} is a drafter checkpoint ({layout} layout), not a target model",
            "pass it as --drafter, and the model it drafts for as --target",
        )
    return local


@contextlib.contextmanager
def loading_errors(what: str, path: str, hint: str):
    """Turn a failure to load a user-given checkpoint into a `UsageError`."""
    try:
        yield
    except UsageError:
        raise
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"could not load the {what} from {path}: {one_line(e)}", hint) from None


# ============================================================================ device, dtype, models
_DTYPES = {
    "fp32": "float32", "float32": "float32", "float": "float32",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16",
}  # fmt: skip


def resolve_device_dtype(device: str | None = "auto", dtype: str | None = "auto"):
    """``(torch.device, torch.dtype)``: ``auto`` is CUDA when available, and bf16 on CUDA, fp32 on CPU."""
    import torch

    name = device or "auto"
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UsageError(f"unknown device {name!r}", "use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available on this machine", "use --device cpu")
    dname = dtype or "auto"
    if dname == "auto":
        dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    elif dname in _DTYPES:
        dt = getattr(torch, _DTYPES[dname])
    else:
        raise UsageError(f"unknown dtype {dname!r}", "use auto, fp32, bf16 or fp16")
    return dev, dt


SMALL_MODEL_PARAMS = 100_000_000  # below this, a CPU decode step is per-op overhead that extra threads only add to


def set_cpu_threads(requested: int | None, device, *models) -> int:
    """Set torch's CPU threads for a command that generates, and return the count: `requested` when given;
    torch's own count when ``OMP_NUM_THREADS`` sets it; otherwise, on the CPU, one thread when the models together hold fewer than `SMALL_MODEL_PARAMS`
    parameters (the reference pair: each op is too small to split, and extra threads spin and contend on a
    loaded machine; measured 7-15 tok/s with torch's default against 120 with one, on a busy 2-core CPU), and
    torch's default for larger models or another device.

    Example:
        >>> set_cpu_threads(None, torch.device("cpu"), target, drafter)  # doctest: +SKIP
        1
    """
    import torch

    if requested:
        torch.set_num_threads(requested)
    elif torch.device(device).type == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
        params = sum(p.numel() for m in models if m is not None for p in m.parameters())
        if params < SMALL_MODEL_PARAMS:
            torch.set_num_threads(1)
    return torch.get_num_threads()


class LoadedModels(NamedTuple):
    target: Any
    drafter: Any
    tokenizer: Any
    assistant: Any = None


def _is_path(x) -> bool:
    return isinstance(x, (str, os.PathLike))


def load_models(
    target=None, drafter=None, tokenizer=None, *, reference: bool = False, assistant=None, device=None, dtype=None,
    attn_implementation: str | None = None, need_drafter: bool = False, threads: int | None = None,
) -> LoadedModels:  # fmt: skip
    """Load what a command runs: the embedded reference pair (``reference=True``) or ``target`` /
    ``drafter`` / ``tokenizer`` / ``assistant``, each a local folder, a Hub id or an already loaded
    object. Paths are checked first (a drafter passed as target and the like are `UsageError`s);
    models are moved to `device` / `dtype`, put in eval mode, and the drafter is bound to the target.
    Torch's CPU threads are then set for generating with them (`set_cpu_threads`: `threads`, else one
    thread for small models on the CPU)."""
    from transformers import AutoTokenizer

    from .modeling import AdaFlashDrafter

    attn = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if reference and (_is_path(target) or _is_path(drafter)):
        raise UsageError("pass either --reference or --target/--drafter, not both", "drop --reference to use your own models")
    if not reference:
        if target is None:
            raise UsageError("no target model given", "pass --target PATH_OR_HUB_ID --drafter PATH_OR_HUB_ID, or --reference")
        if need_drafter and drafter is None:
            raise UsageError("no drafter given", "pass --drafter PATH_OR_HUB_ID (an AdaFlash or DFlash checkpoint), or --reference")
        if tokenizer is None and not _is_path(target):
            raise UsageError("pass a tokenizer with an in-memory target")
    _check_paths(None if reference else target, None if reference else drafter, assistant)  # before anything loads
    if reference:
        from .reference import load_reference_pair

        target, drafter, ref_tok = load_reference_pair(device=device, dtype=dtype, **attn)
        tokenizer = ref_tok if tokenizer is None else tokenizer
    else:
        tokenizer = str(target) if tokenizer is None else tokenizer
        target = _load_causal_lm(target, "target", device, dtype, attn)
        drafter = _load_drafter(AdaFlashDrafter, drafter, target, device, dtype, attn)
    if _is_path(tokenizer):
        with loading_errors("tokenizer", str(tokenizer), "pass --tokenizer PATH_OR_HUB_ID"):
            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    assistant = _load_causal_lm(assistant, "assistant", device, dtype, attn) if assistant is not None else None
    set_cpu_threads(threads, next(target.parameters()).device, target, drafter, assistant)
    return LoadedModels(target, drafter, tokenizer, assistant)


def _check_paths(target, drafter, assistant) -> None:
    for model, flag in ((target, "--target"), (assistant, "--assistant")):
        if _is_path(model):
            check_target_path(str(model), flag)
    if _is_path(drafter):
        check_drafter_path(str(drafter))


def _load_causal_lm(model, what: str, device, dtype, attn: dict):
    if _is_path(model):
        from transformers import AutoModelForCausalLM

        with loading_errors(what, str(model), "pass a causal LM checkpoint (a folder saved with save_pretrained, or a Hub id)"):
            model = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype, **attn)
    return model.to(device=device, dtype=dtype).eval()


def _load_drafter(cls, drafter, target, device, dtype, attn: dict):
    if drafter is None:
        return None
    path = str(drafter)
    if _is_path(drafter):
        with loading_errors("drafter", path, "`adaflash info PATH` checks a drafter checkpoint without loading it"):
            drafter = cls.from_pretrained(path, dtype=dtype, **attn)
    drafter = drafter.to(device=device, dtype=dtype).eval()
    with loading_errors("drafter", path, "the drafter must be trained for this target (`adaflash info` shows what it fits)"):
        drafter.bind_target(target)
    return drafter


# ============================================================================ prompt files
def read_jsonl(path: str, flag: str = "--prompts-file") -> list[tuple[int, Any]]:
    """``(line number, record)`` of every non-empty line of a jsonl prompts file."""
    if not os.path.isfile(path):
        raise UsageError(f"{flag}: prompts file not found: {path}", f"pass {PROMPTS_HINT}")
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append((lineno, json.loads(line)))
            except json.JSONDecodeError as e:
                raise UsageError(f"{path}:{lineno}: not valid JSON ({e.msg})", f"the file must be {PROMPTS_HINT}") from None
    return out


def record_messages(rec) -> list[dict] | None:
    """The chat messages of a prompt record (a string, ``{"prompt": str}`` or ``{"messages": [...]}``),
    up to the last user turn; None when the record holds neither."""
    if isinstance(rec, str):
        return [{"role": "user", "content": rec}]
    if not isinstance(rec, dict):
        return None
    msgs = rec.get("messages", rec.get("prompt"))
    if isinstance(msgs, str):
        return [{"role": "user", "content": msgs}]
    if isinstance(msgs, list) and msgs and all(isinstance(m, dict) and "content" in m for m in msgs):
        msgs = [{"role": m.get("role", "user"), "content": m["content"]} for m in msgs]
        if msgs[-1]["role"] == "assistant":  # a full conversation: prompt with what precedes the answer
            msgs = msgs[:-1]
        return msgs or None
    return None
