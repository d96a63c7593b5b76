"""Issue 35 (dev CPU): each Spec-Bench summarization test prompt through `generate`'s engine path at batch 1 (`cost`,
128 new tokens, float32), one call per prompt as `adaflash bench` makes them: each round's kind, in order (c: its
verify read the round's ratios and stopped short of the block, W: a whole block, P: a plain forward) and tau.
`replacements.py` names the prompts whose call replaced the cached engine (a longer prompt than it was built for).

    ADAFLASH_DATA=/work/shared/data python docs/logs/c1_traffic_cpu_1205/decisions.py 32
"""
import sys

import torch

sys.path.insert(0, "/work/main/docs/logs/first_hold_cpu_1205")
import model_time as mt
from adaflash_hf.generation import speculative_generate

torch.manual_seed(0)
target, drafter, tok = mt.load_reference_pair()
n = int(sys.argv[1])
ps = mt.load_prompt_set("spec_bench:summarization", n, "/work/shared/data", split="test")
prompts = [tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False) for p in ps.prompts][:n]
for i, p in enumerate(prompts):
    ids = torch.tensor([p])
    _, st = speculative_generate(target, drafter, ids, torch.ones_like(ids), length_policy="cost", length_rate=2.0,
                                 return_stats=True, fast_path=True, max_new_tokens=128, do_sample=False)
    kinds = "".join("P" if v <= 1 else ("W" if v >= 16 else "c") for v in st.verify_lengths)
    print(i, round(st.tau, 2), kinds, flush=True)
