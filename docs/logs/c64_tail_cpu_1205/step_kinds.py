"""Issue 35, PROJECTION (dev CPU): where a closed wave's modelled time goes, per kind of engine step (a drafting round
or a plain one, with or without prefill): (steps, modelled time, mean rows running), per policy. The engine and
pricing are `docs/logs/first_hold_cpu_1205/model_time.py`'s (SPEC's table, 96 new tokens, n-grams off); prompts run
c at a time, each wave to its end, as there.

    ADAFLASH_DATA=/work/shared/data python docs/logs/c64_tail_cpu_1205/step_kinds.py gsm8k 64 128 off,fixed,cost
"""
import sys, collections
sys.path.insert(0, "/work/main/docs/logs/first_hold_cpu_1205")
import model_time as mt
import torch
torch.manual_seed(0)
pair, cost = mt.load_reference_pair(), mt.cost_model()
name, c, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompts = mt.validation_prompts(name, n, pair[2])
B = pair[1].config.block_size
for policy in sys.argv[4].split(","):
    e, bodies = mt.counted_engine(pair, cost, c, policy)
    agg = collections.defaultdict(lambda: [0, 0.0, 0])  # steps, modelled time, rows running summed

    def on_step(nrun, fwd, body, t, agg=agg):
        kind = ("body" if body else "plain") + ("+prefill" if fwd and fwd[0] > 16 * max(nrun, 1) else "")
        a = agg[kind]
        a[0] += 1
        a[1] += t
        a[2] += nrun

    total_t, results, _ = mt.drive(e, bodies, cost, prompts, c, B, on_step=on_step)
    toks = sum(len(r.token_ids) for r in results)
    kinds = {k: (v[0], round(v[1], 1), round(v[2] / v[0], 1)) for k, v in agg.items()}
    print(policy, "tokens", toks, "time", round(total_t, 1), "rate", round(toks / total_t, 2), kinds, flush=True)
