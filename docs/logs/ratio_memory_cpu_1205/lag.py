"""How much a request's last length-head ratio says about its next round (dev CPU): the reference pair's whole-block
rounds (`fixed`, float32, prompt n-grams off), one request at a time so the rounds of a request are consecutive,
first N validation prompts of each set, 96 new tokens. Per set: correlations within a request of the previous
round's ratio with this round's ratio and with this round's accepted drafts, against this round's own ratio with
them (what the mid-round read knows).

    ADAFLASH_DATA=/work/shared/data python docs/logs/ratio_memory_cpu_1205/lag.py gsm8k,spec_bench:summarization,spec_bench:rag 8
"""
import sys

import numpy as np
import torch

from adaflash_hf import load_reference_pair
from adaflash_hf.bench.prompts import load_prompt_set
from adaflash_hf.bench.replay import RecordedTrace

torch.manual_seed(0)
target, drafter, tok = load_reference_pair()
n = int(sys.argv[2])
print("| set | prompts | rounds | corr(last ratio, ratio) | corr(last ratio, accepted) | corr(ratio, accepted) | corr(last accepted, accepted) |")
print("|---|---|---|---|---|---|---|")
for name in sys.argv[1].split(","):
    ps = load_prompt_set(name, n, "/work/shared/data", split="validation")
    prompts = [tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False) if isinstance(p, list)
               else tok(p)["input_ids"] for p in ps.prompts][:n]
    pairs = []  # (last ratio, last accepted, ratio, accepted) within each request
    for p in prompts:
        t = RecordedTrace.record(target, drafter, [p], 96, name=name, eos_token_id=tok.eos_token_id, max_slots=1,
                                 token_budget=max(1024, len(p) + 32))
        r = np.array([(x.accepted, x.ratio) for x in t.rounds], dtype=float)
        pairs += [(r[i - 1, 1], r[i - 1, 0], r[i, 1], r[i, 0]) for i in range(1, len(r))]
    q0, a0, q, a = np.array(pairs).T
    c = lambda x, y: np.corrcoef(x, y)[0, 1]
    print(f"| {name} | {len(prompts)} | {len(pairs)} | {c(q0, q):.2f} | {c(q0, a):.2f} | {c(q, a):.2f} | {c(a0, a):.2f} |", flush=True)
