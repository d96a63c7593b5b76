"""Batched speculative decoding: several prompts in one left-padded batch, each row lossless.

    python examples/batched_generation.py            # 4 prompts, 64 new tokens
    python examples/batched_generation.py --smoke    # 2 prompts, 16 tokens

`speculative_generate(target, drafter, input_ids, attention_mask, ...)` decodes a padded batch;
every row accepts its own number of draft tokens per round, finished rows leave the batch, and
each row equals that prompt decoded alone by plain greedy decoding.
"""

import argparse

import torch

from adaflash_hf import load_reference_pair, speculative_generate


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny settings (2 prompts, 16 tokens)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--length-policy", default="adaptive", choices=("adaptive", "fixed", "expected_gain"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    max_new = 16 if args.smoke else args.max_new_tokens

    target, drafter, tok = load_reference_pair()
    prompts = [
        "What is 12 times 7?",
        "Write a haiku about the sea.",
        "Write a Python function that checks whether a number is prime.",
        "Give me three tips for learning to cook.",
    ]
    if args.smoke:
        prompts = prompts[:2]
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False) for p in prompts]
    # Left padding: every row's next token sits in the last column.
    batch = tok(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)

    out, stats = speculative_generate(
        target, drafter, batch["input_ids"], batch["attention_mask"],
        max_new_tokens=max_new, do_sample=False, length_policy=args.length_policy, return_stats=True,
    )  # fmt: skip
    width = batch["input_ids"].shape[1]
    identical = True
    for i, prompt in enumerate(prompts):
        # The reference: this prompt alone, unpadded, plain greedy.
        alone = tok(texts[i], return_tensors="pt", add_special_tokens=False)["input_ids"]
        plain = target.generate(alone, max_new_tokens=max_new, do_sample=False)[0, alone.shape[1]:]
        row = out[i, width : width + plain.shape[0]]
        same = torch.equal(row, plain)
        identical &= same
        print(f"[{i}] {prompt}\n    {tok.decode(row, skip_special_tokens=True)!r}  (equals plain greedy alone: {same})")
    print(f"\nbatch of {len(prompts)}: tau {stats.tau:.2f} over {stats.rounds} row-rounds, "
          f"mean verify length {stats.mean_verify_length:.2f} ({stats.policy})")
    print(f"identical: {identical}")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
