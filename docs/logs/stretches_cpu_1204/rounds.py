"""How often the engine's two stretches apply on the reference pair (dev CPU; what the rounds do, not their speed).

For each set's first validation prompts, concurrency c (the prompts run together), the shipped pair under the default
`cost` policy with the default RoundCost (SPEC's H200 table and overheads), prompt n-grams off: drafting rounds, those
that verified whole blocks on the last ratios without the mid-round read (`whole_rounds`), plain rounds queued as
greedy steps (`skipped_drafts`), device reads per target forward; with both stretches off as the control (decode_steps=1,
whole_block_stretches=False). Outputs are compared with each other (both lossless).

    ADAFLASH_DATA=/work/shared/data python docs/logs/stretches_cpu_1204/rounds.py gsm8k,spec_bench:rag 1,8
"""
import sys

import torch

from adaflash_hf import load_reference_pair
from adaflash_hf.bench.prompts import load_prompt_set
from adaflash_hf.engine import Engine

torch.manual_seed(0)
target, drafter, tok = load_reference_pair()
sets, concs = sys.argv[1].split(","), [int(c) for c in sys.argv[2].split(",")]
print("| set | c | stretches | forwards | drafting rounds | whole-block (no mid read) | plain steps | reads / forward | mean verify len | tokens |")
print("|---|---|---|---|---|---|---|---|---|---|")
for name in sets:
    ps = load_prompt_set(name, max(concs), "/work/shared/data", split="validation")
    prompts = [tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False) if isinstance(p, list) else tok(p)["input_ids"]
               for p in ps.prompts][: max(concs)]
    for c in concs:
        outs = {}
        for on in (True, False):
            e = Engine(target, drafter, length_policy="cost", max_slots=c, max_len=4096, token_budget=4096,
                       cuda_graphs=True, prompt_ngrams=0, decode_steps=8 if on else 1)
            e.whole_block_stretches = on
            res = e.generate(prompts[:c], max_new_tokens=96)
            outs[on] = [o.token_ids for o in res]
            drafting = e.num_steps - e.skipped_drafts
            lens = [v for o in res for v in o.verify_lengths]
            print(f"| {name} | {c} | {'on' if on else 'off'} | {e.num_steps} | {drafting} | {e.whole_rounds} | "
                  f"{e.skipped_drafts} | {e.host_syncs / e.num_steps:.2f} | {sum(lens) / len(lens):.1f} | "
                  f"{sum(map(len, outs[on]))} |", flush=True)
        assert outs[True] == outs[False]
