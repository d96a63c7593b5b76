"""Engine round time with many sampled requests on the reference pair (the sampled round's cost, issue: sampling at
concurrency 64), and optionally ``generate(do_sample=True)`` on the engine against the eager loop.

Submits ``--rows`` requests (temperature 0.7, top-p 0.95; ``--seeded``: each with its own seed, the position-keyed
path ``generate``'s fast path takes), steps the engine to the end three times and prints the median time of the
rounds in which every request is running, and each phase's time per step (``Engine(profile=True)``: a device sync
at each phase boundary). ``--generate``: three timed 12-token calls of ``--rows`` rows each way instead.

Usage: python examples/reference_pair/sampled_round_time.py --rows 64 [--seeded] [--generate] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from adaflash_hf import load_reference_pair
from adaflash_hf.engine import Engine, SamplingParams
from adaflash_hf.generation.prompts import encode_prompt

QUESTIONS = ["What is 17 times 23?", "Name three prime numbers above 50.", "Explain why the sky is blue.",
             "Write a haiku about rain.", "How many minutes are in a week?", "Summarise the plot of Hamlet."]


def run_requests(engine: Engine, prompts, params, new_tokens: int) -> list[float]:
    """Seconds of each round that ran every request, for one batch stepped to the end."""
    handles = [engine.submit(p, new_tokens, sp) for p, sp in zip(prompts, params)]
    full = []
    while not engine.idle:
        t0 = time.perf_counter()
        engine.step()
        if engine.num_running == len(prompts) and engine.num_steps > 1:
            full.append(time.perf_counter() - t0)
    assert all(h.result().finish_reason == "length" for h in handles), [h.result().error for h in handles]
    return full


def time_generate(target, drafter, prompt, rows: int, sync) -> None:
    ids = torch.tensor([prompt], device=next(target.parameters()).device)
    for name, fast_path in (("engine", True), ("eager", False)):
        times = []
        for _ in range(3):
            torch.manual_seed(0)
            sync()
            t0 = time.perf_counter()
            with torch.inference_mode():
                target.generate(ids.expand(rows, -1), attention_mask=torch.ones_like(ids).expand(rows, -1), assistant_model=drafter,
                                do_sample=True, temperature=0.7, top_p=0.95, top_k=0, max_new_tokens=12, pad_token_id=0,
                                fast_path=fast_path)  # fmt: skip
            sync()
            times.append(time.perf_counter() - t0)
        print(f"generate, {rows} rows, {name}: " + ", ".join(f"{t:.2f}" for t in times) + " s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--seeded", action="store_true")
    ap.add_argument("--generate", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (CPU runs only)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    target, drafter, tok = load_reference_pair(device=args.device)
    prompts = [encode_prompt(tok, [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]) for i in range(args.rows)]
    if args.generate:
        time_generate(target, drafter, prompts[0], args.rows, sync)
        return
    engine = Engine(target, drafter, max_slots=args.rows, max_len=512, token_budget=8192, profile=True)
    params = [SamplingParams(0.7, top_p=0.95, seed=i if args.seeded else None) for i in range(args.rows)]
    torch.manual_seed(0)
    run_requests(engine, prompts, params, 8)  # warm-up
    for rep in range(3):
        engine.phase_seconds.clear()
        engine.profiled_steps = 0
        torch.manual_seed(rep)
        full = run_requests(engine, prompts, params, args.tokens)
        phases = ", ".join(f"{k} {1e3 * v / engine.profiled_steps:.1f}" for k, v in sorted(engine.phase_seconds.items()))
        print(f"rep {rep}: {len(full)} rounds with every request running, median {1e3 * statistics.median(full):.1f} ms;"
              f" per step: {phases} ms")


if __name__ == "__main__":
    main()
