"""Export drafters for serving engines that outgrow one machine (SGLang, vLLM).

`export_dflash` writes exactly what the engines' own DFlash loaders read (checked against their
code: vLLM `vllm/model_executor/models/qwen3_dflash.py`, SGLang `python/sglang/srt/models/dflash.py`
and `srt/speculative/dflash_utils.py`; docs/export.md lists the facts and
`examples/engine_compat/check_vllm_sglang.py` runs the engines' loaders on an export).
`launch_commands` gives the matching launch lines.
"""

from __future__ import annotations

import json
import os
import shlex

import torch

from .modeling import AdaFlashDrafter, write_dflash_checkpoint


def export_dflash(drafter: AdaFlashDrafter, path: str, dtype: torch.dtype | str | None = torch.bfloat16, remote_code: bool = False) -> str:
    """Write `drafter` in the z-lab DFlash layout that SGLang and vLLM load.

    - `config.json` + `model.safetensors` at the top level: a Qwen3 config with `dflash_config`, and the
      DFlash tensors only. vLLM's `DFlashQwen3ForCausalLM.load_weights` raises on any tensor name it does
      not know and loads every top-level `*.safetensors`, so nothing else is written there.
    - `dtype` (default bfloat16, the dtype of the targets these drafters serve): the weights are cast to
      it and `torch_dtype` says so. SGLang's `dtype="auto"` turns a float32 checkpoint into float16, not
      into the target's bf16; pass `dtype=None` to keep the drafter's own dtype.
    - The length head, when present, goes to `length_head/` (its own `config.json` and
      `model.safetensors`, released `thresh_head_two_model.*` names). Neither engine reads it;
      `AdaFlashDrafter.from_pretrained(path)` loads it back, so a round trip keeps the head.
    - `remote_code=True` also copies our modeling files and adds `auto_map`, so
      `AutoModel.from_pretrained(path, trust_remote_code=True)` builds our drafter without adaflash-hf.
    - Files are 0644 and folders 0755 (an engine may run as another user). The export is atomic:
      `path` appears complete or not at all; an existing non-empty `path` is refused.

    Serve it with the lines [`launch_commands`] prints.

    Example:
        >>> export_dflash(drafter, "out/my-drafter-dflash")  # doctest: +SKIP
        'out/my-drafter-dflash'
    """
    if not isinstance(drafter, AdaFlashDrafter):
        raise TypeError(f"export_dflash expects an AdaFlashDrafter, got {type(drafter).__name__}")
    remote_dir = os.path.dirname(_modeling_file()) if remote_code else None
    write_dflash_checkpoint(drafter, path, dtype=dtype, remote_code_dir=remote_dir)
    return str(path)


def _modeling_file() -> str:
    import importlib

    return importlib.import_module(AdaFlashDrafter.__module__).__file__


def launch_commands(export_dir: str, target: str | None = None, settings: dict | None = None) -> dict[str, str]:
    """The vLLM and SGLang command lines that serve `target` with the DFlash export in `export_dir`.

    `settings` (all optional): `tp` (tensor-parallel size, default 1), `port`, `num_draft_tokens`
    (tokens verified per round including the bonus token, default the export's `block_size`). vLLM
    needs `num_speculative_tokens` for dflash (it does not default to `block_size - 1`); SGLang's
    `--speculative-num-draft-tokens` counts the bonus token too.

    Example:
        >>> cmds = launch_commands("out/my-drafter-dflash", "Qwen/Qwen3-8B", {"tp": 2})  # doctest: +SKIP
        >>> print(cmds["vllm"])  # doctest: +SKIP
    """
    settings = dict(settings or {})
    with open(os.path.join(export_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    block = (config.get("dflash_config") or {}).get("block_size") or config.get("block_size") or 16
    draft_tokens = int(settings.get("num_draft_tokens", block))
    if not 2 <= draft_tokens <= block:
        raise ValueError(f"num_draft_tokens must be in 2..block_size={block}, got {draft_tokens}")
    tp = int(settings.get("tp", 1))
    target = target or "<target-model>"
    draft = os.path.abspath(export_dir)
    spec = json.dumps({"method": "dflash", "model": draft, "num_speculative_tokens": draft_tokens - 1})
    vllm = f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(spec)} --tensor-parallel-size {tp}"
    sglang = (
        f"python -m sglang.launch_server --model-path {shlex.quote(target)} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path {shlex.quote(draft)} --speculative-num-draft-tokens {draft_tokens} --tp-size {tp}"
    )
    if "port" in settings:
        vllm += f" --port {int(settings['port'])}"
        sglang += f" --port {int(settings['port'])}"
    return {"vllm": vllm, "sglang": sglang}


__all__ = ["export_dflash", "launch_commands"]
