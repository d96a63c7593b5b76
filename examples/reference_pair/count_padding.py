"""Padding of drafter training batches, counted on a regeneration cache (no model, no timing).

A training batch has as many block anchors per sample as its longest answer has response tokens, and as many
context positions as its longest sample: the rest is padding the drafter still computes. This counts both, for
random batches and for batches of similar total length (transformers' ``group_by_length`` order, here: sorted).

    python examples/reference_pair/count_padding.py --regen-cache regen.jsonl --batch-sizes 32,128
"""

from __future__ import annotations

import argparse
import json
import random


def padding(batches: list[list[tuple[int, int]]]) -> tuple[float, float]:
    """``(padded block share, padded context share)`` of batches of ``(sample length, response tokens)``."""
    blocks = sum(r for b in batches for _, r in b) / sum(max(r for _, r in b) * len(b) for b in batches)
    context = sum(t for b in batches for t, _ in b) / sum(max(t for t, _ in b) * len(b) for b in batches)
    return 1 - blocks, 1 - context


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regen-cache", required=True, help="train_drafter's --regen-cache jsonl")
    ap.add_argument("--batch-sizes", default="32,128")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    with open(a.regen_cache) as f:
        sizes = [(len(s["input_ids"]), sum(s["loss_mask"])) for s in map(json.loads, f) if s]
    print(f"{len(sizes)} samples, mean length {sum(t for t, _ in sizes) / len(sizes):.1f}, "
          f"mean response {sum(r for _, r in sizes) / len(sizes):.1f} (max {max(r for _, r in sizes)})")
    for bs in map(int, a.batch_sizes.split(",")):
        order = list(range(len(sizes)))
        random.Random(a.seed).shuffle(order)
        by_len = sorted(range(len(sizes)), key=lambda i: sizes[i][0])
        for name, idx in (("random", order), ("by length", by_len)):
            blk, ctx = padding([[sizes[i] for i in idx[j:j + bs]] for j in range(0, len(idx), bs)])
            print(f"batch {bs}, {name}: padded blocks {100 * blk:.1f}%, padded context {100 * ctx:.1f}%")


if __name__ == "__main__":
    main()
