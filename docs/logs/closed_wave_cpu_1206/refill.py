"""Issue 35, PROJECTION (dev CPU): is the cost rule's loss to plain decoding at c=64 on the pair's own acceptance the
closed wave's tail? The same rounds and pricing as `docs/logs/first_hold_cpu_1205/model_time.py` (the reference pair,
float32, n-grams off, 96 new tokens, validation prompts), run two ways per policy:
- `waves`: c prompts at a time, each wave to its end (model_time's `drive`, the replay's closed batch);
- `refill`: every prompt submitted at once to an engine of c slots, a finished request's slot taken by the next
  (a server with a queue; only the last requests run a tail).
Tokens per modelled time x `off` run the same way; every output compared with `off`'s.

    ADAFLASH_DATA=/work/shared/data python docs/logs/closed_wave_cpu_1206/refill.py gsm8k 64 256
    COST=h200 ADAFLASH_DATA=/work/shared/data python docs/logs/closed_wave_cpu_1206/refill.py gsm8k 128 384
    HOW=refill COST=h200 ADAFLASH_DATA=/work/shared/data python docs/logs/closed_wave_cpu_1206/refill.py gsm8k 128 384

`HOW` (default `waves,refill`) picks the ways run. Each line also gives the engine's steps, drafter bodies (probes
included), skipped drafts, and (steps, modelled time, mean rows running) per kind of step.
"""
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "first_hold_cpu_1205"))
import model_time as mt  # noqa: E402


def refill(e, bodies, cost, prompts, block, on_step):
    """Every prompt submitted at once; each step priced as `mt.drive` prices it and shown to ``on_step`` as there.
    (modelled time, results, mean rows per step)."""
    t, rows, steps = 0.0, 0, 0
    handles = [e.submit(p, 96) for p in prompts]
    while not e.idle:
        n, f0, b0, r0 = e.num_running, len(e.forward_tokens), bodies[0], e.host_syncs
        e.step()
        fwd = e.forward_tokens[f0:]
        dt = mt.step_time(cost, max(n, 1), fwd, block, bodies[0] > b0, e.host_syncs - r0 == 1)
        on_step(n, fwd, bodies[0] > b0, dt)
        t, rows, steps = t + dt, rows + n, steps + 1
    return t, [h.result() for h in handles], rows / max(steps, 1)


def step_kinds():
    """An ``on_step`` that sums (steps, modelled time, rows) per kind of step, and the dict it fills: a drafting
    round (`body`: the drafter's body ran, a probe included) or a plain step, with or without a prompt's prefill."""
    agg = collections.defaultdict(lambda: [0, 0.0, 0])

    def on_step(n, fwd, body, dt):
        a = agg[("body" if body else "plain") + ("+prefill" if fwd and fwd[0] > 16 * max(n, 1) else "")]
        a[0], a[1], a[2] = a[0] + 1, a[1] + dt, a[2] + n

    return on_step, agg


def main():
    name, c, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    policies = (sys.argv[4] if len(sys.argv) > 4 else "off,fixed,cost").split(",")
    torch.manual_seed(0)
    pair, cost = mt.load_reference_pair(), mt.cost_model()
    prompts = mt.validation_prompts(name, n, pair[2])
    block = pair[1].config.block_size
    print(f"{name} c={c} prompts={len(prompts)} cost={os.environ.get('COST', 'spec')}")
    base, ref = {}, None
    for how in os.environ.get("HOW", "waves,refill").split(","):
        for policy in policies:
            e, bodies = mt.counted_engine(pair, cost, c, policy)
            on_step, agg = step_kinds()
            if how == "waves":
                t, results, _ = mt.drive(e, bodies, cost, prompts, c, block, on_step=on_step)
                rows = float("nan")
            else:
                t, results, rows = refill(e, bodies, cost, prompts, block, on_step)
            outs = [r.token_ids for r in results]
            assert ref is None or outs == ref, (how, policy)
            ref = ref or outs
            rate = sum(map(len, outs)) / t
            base.setdefault(how, rate)
            kinds = {k: (v[0], round(v[1], 1), round(v[2] / v[0], 1)) for k, v in sorted(agg.items())}
            print(f"{how:6s} {policy:5s} tokens/time {rate:.3f} x off {rate / base[how]:.3f} rows/step {rows:.1f} "
                  f"steps {e.num_steps} bodies {bodies[0]} skipped {e.skipped_drafts}; (steps, time, rows) by kind "
                  f"{kinds}", flush=True)


if __name__ == "__main__":
    main()
