"""The default engine's reads in three closed batches of the same engine, one after another (the first warms it up,
as replay_bench's warm-up run does): gsm8k prompts, 128 new tokens, the round cost the H100 measured on 12-06 made
monotone (`monotone_table`, as `measure_round_cost` now does), the CPU's static path. p<n>: a plain stretch of n steps
behind one read; d<n>: a round through the target's normal forward (prefill, drafting). From the repository root:

    ADAFLASH_DATA=/work/shared/data python docs/logs/stretch_tail_cpu_1207/reads_warm.py 8,32
"""
import json, sys, torch
sys.path.insert(0, "examples")
import gpu_common as common
from adaflash_hf.engine import Engine
from adaflash_hf.speculation.length.cost import RoundCost
from adaflash_hf.engine.warmup import monotone_table
torch.set_num_threads(2)
rc = RoundCost.from_json(json.load(open("docs/logs/plain_plan_h100_1206/run1/pt/plan_trace.json"))["default_c1"]["round_cost"])
import dataclasses
rc = dataclasses.replace(rc, verify=tuple(tuple(r) for r in monotone_table(rc.verify)))
target, drafter, prompts, eos, _ = common.reference_pair("cpu", torch.float32, "gsm8k", 128)
for c in [int(x) for x in sys.argv[1].split(",")]:
    eng = Engine(target, drafter=drafter, round_cost=rc, max_slots=c, max_len=1200, token_budget=max(4096, 400 + c * 16), cuda_graphs=True)
    print("c", c, "probe holds", eng.planner.probe_holds(c), "never_pays", eng.planner.never_pays(c), flush=True)
    for batch in range(3):
        hs = [eng.submit(p, 128, eos_token_id=eos) for p in prompts[:c]]
        seq = []
        while not all(h.done for h in hs):
            s0, k0 = eng.num_steps, eng.skipped_drafts
            eng.step()
            steps, sk = eng.num_steps - s0, eng.skipped_drafts - k0
            seq.append(("p" if sk == steps and steps > 0 else "d") + str(steps))
        print(f"  batch {batch}: {len(seq)} reads, {sum(s.startswith('d') for s in seq)} d-rounds:", " ".join(seq), flush=True)
