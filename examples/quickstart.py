"""Quickstart: speculative decoding with the embedded reference pair, checked against plain greedy.

    python examples/quickstart.py            # a few prompts, 96 new tokens each
    python examples/quickstart.py --smoke    # one prompt, 24 tokens (a few seconds)

`import adaflash_hf` teaches `generate` one thing: when `assistant_model` is an AdaFlash drafter,
decoding runs through the AdaFlash loop (block drafting, adaptive verify length, lossless check).
With your own models, replace `load_reference_pair()` by

    target = AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-8B", dtype=torch.bfloat16)
    drafter = AdaFlashDrafter.from_pretrained("z-lab/Qwen3-8B-DFlash-b16", dtype=torch.bfloat16)
"""

import argparse

import torch

import adaflash_hf  # noqa: F401  (registers the drafter and the generate hook)
from adaflash_hf import load_reference_pair


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny settings (one prompt, 24 tokens)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(1)  # the reference pair is tiny: one CPU thread is fastest
    max_new = 24 if args.smoke else args.max_new_tokens

    target, drafter, tok = load_reference_pair()  # offline: the files ship inside the package
    prompts = ["Tell me a short story about a cat.", "Write a Python function that adds two numbers.", "What is 15 + 27?"]
    if args.smoke:
        prompts = prompts[:1]

    all_identical = True
    for prompt in prompts:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        # Speculative decoding: the drafter proposes a block, the target verifies what the length head picks.
        out, stats = target.generate(ids, assistant_model=drafter, max_new_tokens=max_new, do_sample=False, return_stats=True)
        # Plain greedy decoding of the target alone, for comparison.
        plain = target.generate(ids, max_new_tokens=max_new, do_sample=False)
        identical = torch.equal(out, plain)
        all_identical &= identical
        print(f"prompt: {prompt}")
        print(f"answer: {tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)!r}")
        print(f"tau {stats.tau:.2f} over {stats.rounds} rounds, policy {stats.policy}, "
              f"verify lengths {stats.verify_lengths[:12]}{' ...' if stats.rounds > 12 else ''}")
        print(f"identical to plain greedy: {identical}\n")
    print(f"identical: {all_identical}")
    return 0 if all_identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
