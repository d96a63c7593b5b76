"""`adaflash export`: a drafter in the DFlash (z-lab) layout that SGLang and vLLM load, and their commands."""

from __future__ import annotations

import os

from ..loading import UsageError, check_drafter_path, loading_errors
from .common import positive_int

HELP = "write a drafter in the DFlash (z-lab) layout that SGLang and vLLM load; print their commands"
DESCRIPTION = (
    "Convert a drafter checkpoint (any layout) into the z-lab DFlash layout read by SGLang\n"
    "(--speculative-algorithm DFLASH) and vLLM ({\"method\": \"dflash\"}) for multi-GPU serving, in bf16 by\n"
    "default; a length head goes to length_head/ (the engines ignore it). Atomic; never overwrites.\n\n"
    "example:\n  adaflash export runs/drafter runs/drafter-dflash --target Qwen/Qwen3-8B --tp 2"
)


def add_arguments(p) -> None:
    p.add_argument("drafter", nargs="?", help="drafter checkpoint: local folder or Hub id")
    p.add_argument("output", help="new (or empty) output directory")
    p.add_argument("--reference", action="store_true", help="export the embedded reference drafter (then give only OUTPUT)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32", "keep"), default="bf16",
                   help="weight dtype of the export (bf16: what the engines' targets run in; keep: the checkpoint's own)")
    p.add_argument("--target", help="target model path / Hub id, to fill in the printed serving commands")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size for the printed commands")


def run(args) -> int:
    import torch

    from ..export import export_dflash, launch_commands
    from ..modeling import AdaFlashDrafter

    if args.reference:
        if args.drafter:
            raise UsageError("pass either a drafter checkpoint or --reference, not both", "drop one of them")
        from ..reference import REFERENCE_DIR

        args.drafter = os.path.join(REFERENCE_DIR, "drafter")
    out = os.path.abspath(args.output)
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"output {args.output} is a file", "choose a new directory; export never overwrites")
    if os.path.isdir(out) and os.listdir(out):
        raise UsageError(f"output directory {args.output} exists and is not empty", "choose a new directory; export never overwrites")
    _, _, layout = check_drafter_path(args.drafter, "drafter checkpoint")
    dtypes = {"keep": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    with loading_errors("drafter", args.drafter, "`adaflash info PATH` checks a drafter checkpoint without loading it"):
        drafter = AdaFlashDrafter.from_pretrained(args.drafter, dtype="auto")
    export_dflash(drafter, out, dtype=dtypes[args.dtype])
    cfg = drafter.config
    head = "; the length head in length_head/ (the engines ignore it)" if cfg.use_length_head else ""
    n_params = sum(p.numel() for p in drafter.parameters())
    written = str(dtypes[args.dtype] or next(drafter.parameters()).dtype).replace("torch.", "")
    print(f"exported {args.drafter} ({layout} layout) -> {out}")
    print(f"  DFlash layout{head}; {n_params / 1e6:.2f}M params, {written}")
    print(f"  fits a target with {cfg.num_target_layers} layers, hidden size {cfg.hidden_size}, vocab {cfg.vocab_size}; "
          f"target_layer_ids {list(cfg.target_layer_ids)}, block {cfg.block_size}, mask token id {cfg.mask_token_id}")
    cmds = launch_commands(out, args.target, {"tp": args.tp})
    print("\nSGLang:\n  " + cmds["sglang"])
    print("\nvLLM:\n  " + cmds["vllm"])
    if not args.target:
        print("\n(replace <target-model> with the model this drafter was trained for; --target NAME fills it in)")
    return 0
