"""The cost rule with and without the read whole blocks spare (issue 35 item 2), on the reference pair (dev CPU; what
the rounds do and tau, not speed).

Per set, the first N validation prompts, at concurrency 1 (each prompt alone) and at N (all together), 96 new tokens,
prompt n-grams off: `fixed`, the `cost` policy on the default RoundCost (SPEC's H200 table, overheads and the read
estimate) and the same with `read_overhead=0` (the rule before the term). Tau is committed tokens per verify forward
(prefill left out, plain rounds counted), every output compared with `fixed`'s (all lossless).

    ADAFLASH_DATA=/work/shared/data python docs/logs/read_term_cpu_1205/rounds.py gsm8k,spec_bench:rag 8
"""
import dataclasses
import sys

import torch

from adaflash_hf import load_reference_pair
from adaflash_hf.bench.prompts import load_prompt_set
from adaflash_hf.engine import Engine
from adaflash_hf.speculation.round_cost import RoundCost
from adaflash_hf.speculation.rounds import mean_tokens_per_round

torch.manual_seed(0)
target, drafter, tok = load_reference_pair()
sets, n = sys.argv[1].split(","), int(sys.argv[2])
RULES = {"fixed": ("fixed", None), "cost": ("cost", RoundCost()),
         "cost, no read term": ("cost", dataclasses.replace(RoundCost(), read_overhead=0.0))}
print("| set | c | rule | tau | x fixed | mean verify len | drafting rounds | whole-block (no mid read) | plain | reads / forward |")
print("|---|---|---|---|---|---|---|---|---|---|")
for name in sets:
    ps = load_prompt_set(name, n, "/work/shared/data", split="validation")
    prompts = [tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False) if isinstance(p, list)
               else tok(p)["input_ids"] for p in ps.prompts][:n]
    for c in (1, n):
        ref, tau_fixed = None, None
        for rule, (policy, cost) in RULES.items():
            kw = dict(round_cost=cost) if cost is not None else {}
            e = Engine(target, drafter, length_policy=policy, max_slots=c, max_len=4096, token_budget=4096,
                       cuda_graphs=True, prompt_ngrams=0, **kw)
            outs = [o for i in range(0, n, c) for o in e.generate(prompts[i: i + c], max_new_tokens=96)]
            ids = [o.token_ids for o in outs]
            assert ref is None or ids == ref, (name, c, rule)
            ref = ids
            acc = [a for o in outs for a in o.accepted]
            lens = [v for o in outs for v in o.verify_lengths]
            tau = mean_tokens_per_round(acc)
            tau_fixed = tau_fixed or tau
            print(f"| {name} | {c} | {rule} | {tau:.3f} | {tau / tau_fixed:.3f} | {sum(lens) / len(lens):.1f} | "
                  f"{e.num_steps - e.skipped_drafts} | {e.whole_rounds} | {e.skipped_drafts} | "
                  f"{e.host_syncs / e.num_steps:.2f} |", flush=True)
