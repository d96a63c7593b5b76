"""The default engine's reads in a closed batch (gsm8k prompts, 128 new tokens) under the round cost the H100 measured
on 12-06 (docs/logs/plain_plan_h100_1206), on the CPU's static path: p<n> a plain stretch of n steps behind one read,
d<n> a round that ran the target's normal forward (prefill, drafting). Run from the repository root:

    python docs/logs/stretch_tail_cpu_1207/reads.py 32,128
    python docs/logs/stretch_tail_cpu_1207/reads.py 8,32 3 monotone   # 3 batches on one engine (the first warms it
                                                                       # up), the table made monotone (monotone_table)
"""
import dataclasses, json, sys, torch
sys.path.insert(0, "examples")
import gpu_common as common
from adaflash_hf.engine import Engine
from adaflash_hf.speculation.length.cost import RoundCost
torch.set_num_threads(2)
rc = RoundCost.from_json(json.load(open("docs/logs/plain_plan_h100_1206/run1/pt/plan_trace.json"))["default_c1"]["round_cost"])
batches = int(sys.argv[2]) if len(sys.argv) > 2 else 1
if "monotone" in sys.argv[3:]:
    from adaflash_hf.engine.warmup import monotone_table
    rc = dataclasses.replace(rc, verify=tuple(tuple(r) for r in monotone_table(rc.verify)))
target, drafter, prompts, eos, _ = common.reference_pair("cpu", torch.float32, "gsm8k", 128)
for c in [int(x) for x in sys.argv[1].split(",")]:
    eng = Engine(target, drafter=drafter, round_cost=rc, max_slots=c, max_len=1200, token_budget=max(4096, 400 + c * 16), cuda_graphs=True)
    print("c", c, "probe holds", eng.planner.probe_holds(c), *(["never_pays", eng.planner.never_pays(c)] if batches > 1 else []), flush=True)
    for batch in range(batches):
        hs = [eng.submit(p, 128, eos_token_id=eos) for p in prompts[:c]]
        seq = []
        while not all(h.done for h in hs):
            s0, k0 = eng.num_steps, eng.skipped_drafts
            eng.step()
            steps, sk = eng.num_steps - s0, eng.skipped_drafts - k0
            seq.append(("p" if sk == steps and steps > 0 else "d") + str(steps))
        if batches == 1:
            print(" ".join(seq), flush=True)
        else:
            print(f"  batch {batch}: {len(seq)} reads, {sum(s.startswith('d') for s in seq)} d-rounds:", " ".join(seq), flush=True)
