"""PROJECTION from real rounds (dev CPU): the reference pair's own rounds, decided by the real engine under the 8B-shaped
H200 cost model, timed by that model instead of a clock.

Each engine step of the shipped pair (float32, prompt n-grams off, 96 new tokens) is priced with the engine's own
`RoundCost` (default: SPEC section 6's H200 table, overheads and read estimate): a round that ran the drafter's body
costs `round_time(n, tokens, B)` less the read when it made one device read, not two (`fixed`'s rounds, the whole-block
stretches: the ratios not read mid-round); every plain forward
`verify_time(n, n) + plain overhead`; prefill forwards alike (the same for every variant). Tokens per modelled time
of each variant, against `off` (no drafter) and `fixed`, per set and concurrency c (the first c validation prompts run
together; at c=1 the first N one at a time). Variants: the `cost` policy with the probe cap at PROBE_SHARE = 0.02
(the default), 0.05, and 1.0 (the cap stays at PLAIN_PROBE_ROUNDS = 8, the rule before the change). Every output is
compared with `off`'s.

    ADAFLASH_DATA=/work/shared/data python docs/logs/probe_cap_cpu_1205/model_time.py gsm8k 1:8,64,128
"""
import sys

import torch

import adaflash_hf.engine.verify_lengths as vl
from adaflash_hf import load_reference_pair
from adaflash_hf.bench.prompts import load_prompt_set
from adaflash_hf.engine import Engine
from adaflash_hf.speculation.round_cost import RoundCost

torch.manual_seed(0)
target, drafter, tok = load_reference_pair()
COST = RoundCost()
B = drafter.config.block_size


def modelled(prompts, c, policy, share=None):
    """(tokens, modelled time, outputs, counters) of `prompts` run c at a time."""
    if share is not None:
        vl.PROBE_SHARE = share
    e = Engine(target, drafter if policy != "off" else None, length_policy=None if policy == "off" else policy,
               round_cost=COST, max_slots=c, max_len=4096, token_budget=max(4096, 64 * c), cuda_graphs=True,
               prompt_ngrams=0)
    bodies = [0]
    if e.draft_graphs is not None:
        real = e.draft_graphs.run_body

        def body(slots, ctx, bonus):
            bodies[0] += bonus is not None
            return real(slots, ctx, bonus)

        e.draft_graphs.run_body = body
    t, outs, probes = 0.0, [], 0
    for i in range(0, len(prompts), c):
        handles = [e.submit(p, 96) for p in prompts[i: i + c]]
        while not e.idle:
            n, f0, b0, r0 = e.num_running, len(e.forward_tokens), bodies[0], e.host_syncs
            e.step()
            fwd = e.forward_tokens[f0:]
            n = max(n, 1)
            if bodies[0] > b0:  # a round that drafted (a probe too)
                t += COST.round_time(n, fwd[0], B) - (COST.read_time(n) if e.host_syncs - r0 == 1 else 0.0)
                probes += fwd[0] <= n
            else:
                t += sum(COST.verify_time(n, x) + COST.overhead(n, False) for x in fwd)
        outs += [h.result().token_ids for h in handles]
    return sum(map(len, outs)), t, outs, (e.num_steps, e.skipped_drafts, probes)


sets = sys.argv[1].split(",")
runs = [(int(x.split(":")[0]), int(x.split(":")[1]) if ":" in x else int(x)) for x in sys.argv[2].split(",")]
variants = [("off", "off", None), ("fixed", "fixed", None), ("cost, probes <= 2% (default)", "cost", 0.02),
            ("cost, probes <= 5%", "cost", 0.05), ("cost, cap 8 (before)", "cost", 1.0)]
print("| set | c | prompts | variant | tokens / modelled time (x off) | x fixed | forwards | plain forwards | probes |")
print("|---|---|---|---|---|---|---|---|---|")
for name in sets:
    for c, n in runs:
        ps = load_prompt_set(name, n, "/work/shared/data", split="validation")
        prompts = [tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False) if isinstance(p, list)
                   else tok(p)["input_ids"] for p in ps.prompts][:n]
        base = fixed = ref = None
        for label, policy, share in variants:
            tokens, t, outs, (steps, skipped, probes) = modelled(prompts, c, policy, share)
            assert ref is None or outs == ref, (name, c, label)
            ref = ref or outs
            rate = tokens / t
            base = base or rate
            fixed = rate if policy == "fixed" else fixed
            print(f"| {name} | {c} | {len(prompts)} | {label} | {rate / base:.3f} | {rate / fixed if fixed else float('nan'):.3f} | "
                  f"{steps} | {skipped} | {probes} |", flush=True)
