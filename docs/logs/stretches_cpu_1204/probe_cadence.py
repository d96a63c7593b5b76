"""Tau of the engine's cost policy on the reference pair at concurrency 1 (dev CPU) against how often a plain stretch
probes the length head (PLAIN_PROBE_ROUNDS 8, 2, 0), with fixed as the reference: 6 validation prompts of a set, 96
new tokens, prompt n-grams off, the default RoundCost (SPEC's H200 table). Tau only: the CPU says nothing of speed.

    ADAFLASH_DATA=/work/shared/data python docs/logs/stretches_cpu_1204/probe_cadence.py spec_bench:rag
"""
import sys, torch
import adaflash_hf.engine.verify_lengths as VL
from adaflash_hf import load_reference_pair
from adaflash_hf.bench.prompts import load_prompt_set
from adaflash_hf.engine import Engine
torch.manual_seed(0)
target, drafter, tok = load_reference_pair()
name = sys.argv[1]
ps = load_prompt_set(name, 6, "/work/shared/data", split="validation")
prompts = [tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False) for p in ps.prompts][:6]
for probe in (8, 2, 0):
    VL.PLAIN_PROBE_ROUNDS = probe
    for policy in (["fixed", "cost"] if probe == 8 else ["cost"]):
        toks = fw = plain = 0
        e = Engine(target, drafter, length_policy=policy, max_slots=1, max_len=4096, token_budget=4096, cuda_graphs=True, prompt_ngrams=0)
        for p in prompts:
            s0, k0 = e.num_steps, e.skipped_drafts
            o = e.generate([p], max_new_tokens=96)[0]
            toks += len(o.token_ids) - 1; fw += e.num_steps - s0 - 1; plain += e.skipped_drafts - k0
        print(f"{name} probe every {probe+1} {policy}: tau {toks/fw:.2f} forwards {fw} plain {plain}", flush=True)
