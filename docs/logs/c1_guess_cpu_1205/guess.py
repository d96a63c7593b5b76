"""Issue 35's tau goal at concurrency 1 against the guess before a round (dev CPU; the time is a PROJECTION): the
reference pair's validation prompts through the real engine, `fixed` against the `cost` rule with the guess before a
round taken as the request's last head ratio (`GUESS_WINDOW` 0, the rule until this change) or as the mean acceptance
of its last W rounds that verified drafts (`GUESS_WINDOW` W; 4 is the default now), every output compared with `off`'s.
Each step is priced by `docs/logs/first_hold_cpu_1205/model_time.py`'s `step_time` (the one implementation) under
SPEC's table. Tau: tokens per round over every round (a plain round counts 1), as the benchmark counts it.

    ADAFLASH_DATA=/work/shared/data python docs/logs/c1_guess_cpu_1205/guess.py spec_bench:translation,prose 1:12,64:64
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "first_hold_cpu_1205"))
import model_time as mt  # noqa: E402

import adaflash_hf.engine.verify_lengths as vl  # noqa: E402
from adaflash_hf import load_reference_pair  # noqa: E402

PRIORS = [float(w) for w in os.environ.get("PRIORS", "0,8").split(",")]
VARIANTS = [("off", "off", None), ("fixed", "fixed", None)] + [
    (f"cost, guess {'last ratio' if w == 0 else f'shrunk by {w:g}'}", "cost", w) for w in PRIORS]


def run_one(pair, cost, prompts, c, policy, window):
    vl.GUESS_PRIOR_ROUNDS = 8.0 if window is None else window
    B = pair[1].config.block_size
    e, bodies = mt.counted_engine(pair, cost, c, policy)
    t, outs, rounds, verify = 0.0, [], [], []
    for i in range(0, len(prompts), c):
        handles = [e.submit(p, 96) for p in prompts[i : i + c]]
        while not e.idle:
            n, f0, b0, r0 = e.num_running, len(e.forward_tokens), bodies[0], e.host_syncs
            e.step()
            t += mt.step_time(cost, max(n, 1), e.forward_tokens[f0:], B, bodies[0] > b0, e.host_syncs - r0 == 1)
        for h in handles:
            res = h.result()
            outs.append(res.token_ids)
            rounds += [a + 1 for a in res.accepted]
            verify += list(res.verify_lengths)
    counts = {"rounds": len(rounds), "bodies": bodies[0], "skipped": e.skipped_drafts, "reads": e.host_syncs,
              "whole": e.whole_rounds, "verify": round(sum(verify) / max(len(verify), 1), 2)}
    return sum(map(len, outs)) / t, outs, sum(rounds) / max(len(rounds), 1), counts


def main(sets, runs):
    torch.manual_seed(0)
    pair, cost = load_reference_pair(), mt.cost_model()
    print("| set | c | prompts | variant | tau | tau / fixed | modelled tokens per time x fixed | counters |")
    print("|---|---|---|---|---|---|---|---|")
    for name in sets:
        for c, n in runs:
            prompts = mt.validation_prompts(name, n, pair[2])
            ref = fixed = None
            for label, policy, window in VARIANTS:
                rate, outs, tau, counts = run_one(pair, cost, prompts, c, policy, window)
                assert ref is None or outs == ref, (name, label)
                ref = ref or outs
                fixed = fixed or ((rate, tau) if policy == "fixed" else None)
                if policy == "off":
                    continue
                print(f"| {name} | {c} | {len(prompts)} | {label} | {tau:.2f} | {tau / fixed[1]:.3f} | "
                      f"{rate / fixed[0]:.3f} | {counts} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(","), mt.parse_runs(sys.argv[2]))
