"""What indexing prompt n-grams costs the engine's host: ``--requests`` requests of ``--prompt`` random prompt tokens
and 8 generated ones indexed from nothing (a batch's first catch-up), then 8 more tokens each (a plain stretch's
worth), through :func:`adaflash_hf.engine.round_ngrams.index_while` with the device always busy, the garbage collector
on as in a server. Median of ``--reps`` fresh runs.

    python examples/engine_probes/ngram_index.py --requests 128 --prompt 200
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from adaflash_hf.engine.requests import Request
from adaflash_hf.engine.round_ngrams import index_while
from adaflash_hf.engine.sampling import SamplingParams
from adaflash_hf.speculation.prompt_ngrams import PromptNgrams


def one_run(requests: int, prompt: int, seed: int) -> tuple[float, float]:
    rule, g = PromptNgrams(), torch.Generator().manual_seed(seed)
    rows = []
    for i in range(requests):
        r = Request(i, torch.randint(0, 8192, (prompt,), generator=g).tolist(), 400, SamplingParams(), None)
        r.tokens = torch.randint(0, 8192, (8,), generator=g).tolist()
        rows.append(r)
    t = time.perf_counter()
    index_while(rule, rows, lambda: True)
    first = time.perf_counter() - t
    for r in rows:
        r.tokens += torch.randint(0, 8192, (8,), generator=g).tolist()
    t = time.perf_counter()
    index_while(rule, rows, lambda: True)
    return first, time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    runs = [one_run(args.requests, args.prompt, s) for s in range(args.reps)]
    print(f"{args.requests} requests x {args.prompt + 8} tokens indexed: {1e3 * statistics.median(a for a, _ in runs):.1f} ms; "
          f"8 more tokens each: {1e3 * statistics.median(b for _, b in runs):.2f} ms (median of {args.reps})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
