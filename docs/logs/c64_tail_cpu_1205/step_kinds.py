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
    agg = collections.defaultdict(lambda: [0, 0.0, 0, 0])  # steps, time, tokens, rows
    handles = []
    for i in range(0, len(prompts), c):
        hs = [e.submit(p, 96) for p in prompts[i: i + c]]
        while not e.idle:
            nrun, f0, b0, r0 = e.num_running, len(e.forward_tokens), bodies[0], e.host_syncs
            e.step()
            fwd = e.forward_tokens[f0:]
            t = mt.step_time(cost, max(nrun, 1), fwd, B, bodies[0] > b0, e.host_syncs - r0 == 1)
            kind = ("body" if bodies[0] > b0 else "plain") + ("+prefill" if fwd and fwd[0] > 16 * max(nrun, 1) else "")
            a = agg[kind]; a[0] += 1; a[1] += t; a[3] += nrun
        handles += hs
    total_t = sum(a[1] for a in agg.values())
    toks = sum(len(h.result().token_ids) for h in handles)
    kinds = {k: (v[0], round(v[1], 1), round(v[3] / v[0], 1)) for k, v in agg.items()}
    print(policy, "tokens", toks, "time", round(total_t, 1), "rate", round(toks / total_t, 2), kinds, flush=True)
