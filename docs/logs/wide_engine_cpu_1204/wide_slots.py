"""What the engine's wide prompt n-gram candidates cost in verify slots and buy in tau (dev CPU; slots, not speed).

The engine plans each round's widths on the host before the drafts exist, so a greedy request with a long candidate
sends up to 32 slots even when the drafter then disagrees with every candidate (padding, never accepted). For the
first validation prompts of each set (run together, 96 new tokens, the shipped pair, `fixed`, the engine's static
path run eagerly on the CPU): tau, mean slots verified per request-round, and wide rounds, for max_width None and 31.

    ADAFLASH_DATA=/work/shared/data python docs/logs/wide_engine_cpu_1204/wide_slots.py spec_bench:summarization,spec_bench:rag 6
"""
import sys

import torch

from adaflash_hf import load_reference_pair
from adaflash_hf.bench.prompts import load_prompt_set
from adaflash_hf.engine import Engine
from adaflash_hf.speculation.prompt_ngrams import PromptNgrams

torch.manual_seed(0)
target, drafter, tok = load_reference_pair()
sets, n = sys.argv[1].split(","), int(sys.argv[2])
print("| set | max_width | tau | mean slots per request-round | rounds past the block | identical |")
print("|---|---|---|---|---|---|")
for name in sets:
    ps = load_prompt_set(name, n, "/work/shared/data", split="validation")
    prompts = [tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False) for p in ps.prompts][:n]
    outs = {}
    for width in (None, 31):
        e = Engine(target, drafter, length_policy="fixed", max_slots=n, max_len=4096, token_budget=8192,
                   cuda_graphs=True, prompt_ngrams=PromptNgrams(max_width=width))
        res = e.generate(prompts, max_new_tokens=96)
        outs[width] = [o.token_ids for o in res]
        lens = [v for o in res for v in o.verify_lengths]
        tokens = sum(len(o.token_ids) - 1 for o in res)
        slots = sum(e.forward_tokens) - sum(len(p) for p in prompts)  # verify slots sent (prompts' prefill left out)
        print(f"| {name} | {width} | {tokens / len(lens):.2f} | {slots / len(lens):.1f} | {e.wide_rounds} | "
              f"{outs[width] == outs[None]} |", flush=True)
