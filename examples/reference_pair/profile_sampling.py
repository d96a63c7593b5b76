"""Where speculative *sampling* through `generate` spends its time on the GPU (the reference pair, float32).

Times ``generate(assistant_model=drafter, do_sample=True)`` against plain sampling on one prompt repeated ``b``
times (12 new tokens), on the engine's fast path (``fast_path=True``) and on the eager loop (``fast_path=False``), then
(``--profile``) profiles the slowest configuration: the top operators by CPU and by CUDA time.

Usage: python examples/reference_pair/profile_sampling.py --out $OUT
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_common import log, reference_pair  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="64,500")
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--profile", action="store_true", help="also profile the slowest configuration")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    target, drafter, prompts, _, _ = reference_pair(args.device, torch.float32, "gsm8k", 1)
    ids = torch.tensor([prompts[0]], device=args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def call(b, drafter_kw):
        torch.manual_seed(0)
        with torch.inference_mode():
            target.generate(ids.expand(b, -1), attention_mask=torch.ones_like(ids).expand(b, -1), do_sample=True,
                            temperature=0.7, top_p=0.95, top_k=0, max_new_tokens=args.tokens, pad_token_id=0, **drafter_kw)  # fmt: skip

    configs = {"plain": {}, "engine": dict(assistant_model=drafter, fast_path=True),
               "eager": dict(assistant_model=drafter, fast_path=False)}
    slowest = (0.0, None)
    for b in map(int, args.batches.split(",")):
        for name, kw in configs.items():
            times = []
            for _ in range(3):
                sync()
                t0 = time.perf_counter()
                call(b, kw)
                sync()
                times.append(time.perf_counter() - t0)
            log(f"b={b} {name}: " + ", ".join(f"{t:.3f}" for t in times) + " s")
            if times[-1] > slowest[0]:
                slowest = (times[-1], (b, name))
    if not args.profile:
        return
    b, name = slowest[1]
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        call(b, configs[name])
        sync()
    log(f"profile of b={b} {name}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
    if args.device == "cuda":
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
