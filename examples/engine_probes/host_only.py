"""The host's own work per engine step, the forward taken away: the reference pair's engine on the CPU's static path
(``cuda_graphs=True``, as on a GPU), its decode replays and drafter body replaced by no-ops, so each step's time is
the scheduler's, the planner's and the commits' alone. ``off`` against the default (``cost``) made to decode plainly
(a cost table where drafting never pays), in plain stretches of ``decode_steps`` tokens, or a drafting layout
(``--modes fixed``: every round drafts; its replays repeat the last real round's outputs).

    python examples/engine_probes/host_only.py --concurrency 1,32,128

Prints the median step time per mode and concurrency, and with ``--profile`` the top functions by self time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gpu_common as common  # noqa: E402

from adaflash_hf.engine import Engine  # noqa: E402
from adaflash_hf.speculation.length.cost import RoundCost  # noqa: E402
from adaflash_hf.speculation.length.names import layout_args  # noqa: E402

NEVER = RoundCost.flat(spec_overhead=1e9)  # drafting never pays: the default decodes plainly


def host_steps(target, drafter, prompts, mode: str, c: int, steps: int, profile: bool) -> float:
    margs = {"drafter": drafter, "round_cost": NEVER} if mode == "default" else layout_args(drafter, mode, "cost")
    eng = Engine(target, **margs, max_slots=c, max_len=2000, token_budget=max(4096, 256 * c), cuda_graphs=True)
    handles = [eng.submit(p, 1500) for p in prompts[:c]]
    while not all(h.token_ids for h in handles):
        eng.step()
    for _ in range(3):  # into the plain stretches
        eng.step()
    g = eng.graphs
    g.step_tokens.fill_(5)  # every step decodes token 5 (never EOS for this pair), filled once: a replay does nothing
    g.replay = lambda bucket: None  # a drafting round reads the last real replay's verdict and drafts again
    if eng.draft_graphs is not None:
        eng.draft_graphs.replay = lambda bucket: None
    prof = cProfile.Profile() if profile else None
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        if prof:
            prof.enable()
        eng.step()
        if prof:
            prof.disable()
        times.append(time.perf_counter() - t)
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    return 1e3 * statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--modes", default="off,default")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    conc = [int(c) for c in args.concurrency.split(",")]
    target, drafter, prompts, _, _ = common.reference_pair("cpu", torch.float32, "gsm8k", max(conc))
    prompts = [prompts[i % len(prompts)] for i in range(max(conc))]
    for c in conc:
        for mode in args.modes.split(","):
            ms = host_steps(target, drafter, prompts, mode, c, args.steps, args.profile)
            what = "a round" if mode not in ("off", "default") else f"a step of {8} tokens a request"
            print(f"{mode:8s} c={c:4d}: {ms:.3f} ms {what} (median of {args.steps})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
