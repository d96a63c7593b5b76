"""Export a drafter for multi-GPU serving in SGLang or vLLM (the z-lab DFlash layout).

    python examples/export_for_sglang_vllm.py --out runs/drafter-dflash
    python examples/export_for_sglang_vllm.py --smoke

`export_dflash(drafter, path)` writes exactly what both engines' DFlash loaders read (a Qwen3
`config.json` with `dflash_config`, unprefixed bf16 safetensors, no embeddings / LM head); the length
head goes to `length_head/`, which no engine opens. The export reloads in adaflash-hf too (head
included) and decodes exactly as before. `launch_commands` prints the launch lines (docs/export.md).
CLI equivalent: `adaflash export DRAFTER OUT --target TARGET`.
"""

import argparse
import json
import os
import tempfile

import torch

from adaflash_hf import AdaFlashDrafter, export_dflash, load_reference_pair
from adaflash_hf.export import launch_commands


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny settings (16 tokens for the check)")
    ap.add_argument("--out", default=None, help="new output directory (default: a temporary folder)")
    ap.add_argument("--target-name", default="<your-target-model>", help="target path / Hub id for the printed commands")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = None if args.out else tempfile.TemporaryDirectory(prefix="adaflash-export-")
    out = args.out or os.path.join(tmp.name, "drafter-dflash")

    target, drafter, tok = load_reference_pair()
    export_dflash(drafter, out)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    print(f"exported to {out}: {sorted(os.listdir(out))}")
    print(f"  architectures {cfg['architectures']}, model_type {cfg['model_type']}, block_size {cfg['block_size']}, "
          f"num_target_layers {cfg['num_target_layers']}, dflash_config {cfg['dflash_config']}")

    # The export loads back (any layout goes through AdaFlashDrafter.from_pretrained) and decodes the same.
    reloaded = AdaFlashDrafter.from_pretrained(out, dtype=torch.float32).eval().bind_target(target)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about the sea."}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    n = 16 if args.smoke else 64
    a = target.generate(ids, assistant_model=drafter, max_new_tokens=n, do_sample=False)
    b = target.generate(ids, assistant_model=reloaded, max_new_tokens=n, do_sample=False)
    plain = target.generate(ids, max_new_tokens=n, do_sample=False)
    identical = torch.equal(b, plain) and torch.equal(a, plain)
    print(f"reloaded export decodes like the original: {torch.equal(a, b)}; identical: {identical}")

    cmds = launch_commands(out, args.target_name, {"tp": 2})
    print("\nServe with SGLang (tensor parallel over 2 GPUs):\n  " + cmds["sglang"])
    print("Serve with vLLM:\n  " + cmds["vllm"])
    if tmp is not None:
        tmp.cleanup()
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
