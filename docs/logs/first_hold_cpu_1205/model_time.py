"""PROJECTION from real rounds (dev CPU): the reference pair's own rounds decided by the real engine under a cost model
and timed by that model instead of a clock (issue 35). Here: the first probe's hold after a plain decision and a new
request's guess (tried, reverted). The one implementation of this projection: `docs/logs/probe_cap_cpu_1205/model_time.py` runs it
with that folder's variants and its original pricing (`probes_charged=False`).

Each engine step of the shipped pair (float32, prompt n-grams off, 96 new tokens) is priced with the cost model: a
round that ran the drafter's body costs the verify of its tokens, the body and a drafting round's overhead, less the
read when it made one device read, not two (`fixed`'s rounds, the whole-block stretches); with `probes_charged=False`
a round that ran the body but verified 1 token per request (a probe that decided plain) is priced as a plain round,
as the earlier script did, which leaves out what probes cost. Every plain forward costs `verify_time(n, n)` and a plain
overhead; prefill forwards alike (the same for every variant). Tokens per modelled time of each variant, against `off`
(no drafter) and `fixed`, per set and concurrency c (the first c validation prompts run together; at c=1 the first N
one at a time). Every output is compared with `off`'s.

Variants here: `verify_lengths.FIRST_PROBE_SHARE` 1.0 (the new default: the first probe after a plain decision waits
until the plain rounds have cost what it adds) or 1e9 (a first hold of 1, the rule before). The cost model: SPEC section 6's table (`RoundCost()`), or with `COST=real` the reference pair's own round cost as the
H200 measured it on 2026-12-05 (`docs/logs/replay_h200_1205/replay/replay_bench.json`, `round_cost_real`: its
drafter costs 3-9 of its target's plain steps), or with `COST=h200` the 8B shape's cost measured in the same run.

    ADAFLASH_DATA=/work/shared/data python docs/logs/first_hold_cpu_1205/model_time.py gsm8k,spec_bench:rag 1:8
    COST=real ADAFLASH_DATA=/work/shared/data python docs/logs/first_hold_cpu_1205/model_time.py gsm8k,spec_bench:rag 1:8,8
"""
import json
import os
import sys

import torch

import adaflash_hf.engine.verify_lengths as vl
from adaflash_hf import load_reference_pair
from adaflash_hf.bench.prompts import load_prompt_set
from adaflash_hf.engine import Engine
from adaflash_hf.speculation.round_cost import RoundCost

def cost_model() -> RoundCost:
    """SPEC's table; with ``COST=real`` the reference pair's measured cost, with ``COST=h200`` the 8B shape's."""
    which = os.environ.get("COST")
    if which not in ("real", "h200"):
        return RoundCost()
    m = json.load(open(os.path.join(os.path.dirname(__file__), "..", "replay_h200_1205", "replay", "replay_bench.json")))
    m = m["meta"]["round_cost_real"]["gsm8k"] if which == "real" else m["meta"]["round_cost"]
    return RoundCost(rows=m["rows"], tokens_per_row=m["tokens_per_row"], verify=m["verify"],
                     draft_fraction=m["draft_fraction"], spec_overhead=m["spec_overhead"],
                     plain_overhead=m["plain_overhead"], read_overhead=m["read_overhead"])


def counted_engine(pair, cost, c, policy):
    """The engine of a run (``policy``: ``off``, ``fixed`` or ``cost``) and a one-element list counting its drafter
    bodies (probes included)."""
    target, drafter, _ = pair
    e = Engine(target, drafter if policy != "off" else None, length_policy=None if policy == "off" else policy,
               round_cost=cost, max_slots=c, max_len=4096, token_budget=max(4096, 64 * c), cuda_graphs=True,
               prompt_ngrams=0)
    bodies = [0]
    if e.draft_graphs is not None:
        real = e.draft_graphs.run_body

        def body(slots, ctx, bonus):
            bodies[0] += bonus is not None
            return real(slots, ctx, bonus)

        e.draft_graphs.run_body = body
    return e, bodies


def step_time(cost, n, fwd, block, body, read_once, probes_charged=True) -> float:
    """Modelled time of one engine step of ``n`` running requests whose forwards carried ``fwd`` tokens: with a drafter
    ``body`` the verify, the body and a drafting round's overhead (less the read when the step made one device read);
    else each forward's verify and a plain overhead."""
    read = cost.read_time(n) if read_once else 0.0
    if body and probes_charged:  # a round that ran the drafter's body: a probe that ends plain too
        return cost.verify_time(n, fwd[0]) + cost.draft_time(n, block) + cost.overhead(n, True) - read
    if body:
        return cost.round_time(n, fwd[0], block) - read
    return sum(cost.verify_time(n, x) + cost.overhead(n, False) for x in fwd)


def validation_prompts(name, n, tok):
    """The first ``n`` validation prompts of set ``name``, as token ids (chat prompts through the chat template)."""
    ps = load_prompt_set(name, n, os.environ.get("ADAFLASH_DATA", "/work/shared/data"), split="validation")
    return [tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False) if isinstance(p, list)
            else tok(p)["input_ids"] for p in ps.prompts][:n]


def drive(e, bodies, cost, prompts, c, block, probes_charged=True, on_step=None):
    """Run ``prompts`` through engine ``e`` (``counted_engine``'s) ``c`` at a time, 96 new tokens each, pricing every
    step: (modelled time, the requests' results in order, probes: bodies that ran for a round of bonus tokens only).
    ``on_step(n, fwd, body, t)``, if given, sees each step's running requests, forward tokens, whether the drafter's
    body ran, and its modelled time."""
    t, results, probes = 0.0, [], 0
    for i in range(0, len(prompts), c):
        handles = [e.submit(p, 96) for p in prompts[i: i + c]]
        while not e.idle:
            n, f0, b0, r0 = e.num_running, len(e.forward_tokens), bodies[0], e.host_syncs
            e.step()
            fwd = e.forward_tokens[f0:]
            dt = step_time(cost, max(n, 1), fwd, block, bodies[0] > b0, e.host_syncs - r0 == 1, probes_charged)
            t += dt
            if on_step is not None:
                on_step(n, fwd, bodies[0] > b0, dt)
            probes += bodies[0] > b0 and fwd[0] <= max(n, 1)
        results += [h.result() for h in handles]
    return t, results, probes


def modelled(pair, cost, prompts, c, policy, settings: dict, probes_charged=True):
    """(tokens, modelled time, outputs, counters) of `prompts` run c at a time, with `settings` set on
    `verify_lengths` (module constants) first."""
    for k, v in settings.items():
        setattr(vl, k, v)
    e, bodies = counted_engine(pair, cost, c, policy)
    t, results, probes = drive(e, bodies, cost, prompts, c, pair[1].config.block_size, probes_charged)
    outs = [r.token_ids for r in results]
    return sum(map(len, outs)), t, outs, (e.num_steps, e.skipped_drafts, probes)


def tau_run(pair, cost, prompts, c, policy):
    """(tokens per modelled time, outputs, tau, counters) of `prompts` run c at a time under `policy`. Tau: tokens per
    round over every round (a plain round counts 1), as the benchmark counts it."""
    e, bodies = counted_engine(pair, cost, c, policy)
    t, results, _ = drive(e, bodies, cost, prompts, c, pair[1].config.block_size)
    outs = [r.token_ids for r in results]
    rounds = [a + 1 for r in results for a in r.accepted]
    verify = [v for r in results for v in r.verify_lengths]
    counts = {"rounds": len(rounds), "bodies": bodies[0], "skipped": e.skipped_drafts, "reads": e.host_syncs,
              "whole": e.whole_rounds, "verify": round(sum(verify) / max(len(verify), 1), 2)}
    return sum(map(len, outs)) / t, outs, sum(rounds) / max(len(rounds), 1), counts


def tau_table(sets, runs, variants, apply) -> None:
    """Print tau and modelled time against ``fixed`` for each set and ``(c, prompts)`` of ``runs``; ``variants``:
    ``(label, policy, setting)``, ``off`` first and ``fixed`` second, ``apply(setting)`` called before each run."""
    torch.manual_seed(0)
    pair, cost = load_reference_pair(), cost_model()
    print("| set | c | prompts | variant | tau | tau / fixed | modelled tokens per time x fixed | counters |")
    print("|---|---|---|---|---|---|---|---|")
    for name in sets:
        for c, n in runs:
            prompts = validation_prompts(name, n, pair[2])
            ref = fixed = off = None
            for label, policy, setting in variants:
                apply(setting)
                rate, outs, tau, counts = tau_run(pair, cost, prompts, c, policy)
                assert ref is None or outs == ref, (name, label)
                ref = ref or outs
                fixed = fixed or ((rate, tau) if policy == "fixed" else None)
                if policy == "off":
                    off = rate
                    continue
                print(f"| {name} | {c} | {len(prompts)} | {label} | {tau:.2f} | {tau / fixed[1]:.3f} | "
                      f"{rate / fixed[0]:.3f} | {counts} |", flush=True)
                if policy == "fixed" and off is not None:  # plain decoding's modelled rate on the same scale
                    print(f"| {name} | {c} | {len(prompts)} | off | 1.00 | - | {off / fixed[0]:.3f} | - |", flush=True)


def run(sets, runs, variants, probes_charged=True) -> None:
    """Print the table for each set and ``(c, prompts)`` of ``runs``; ``variants``: ``(label, policy, settings)``,
    ``off`` first and ``fixed`` second."""
    torch.manual_seed(0)
    pair, cost = load_reference_pair(), cost_model()
    tok = pair[2]
    print("| set | c | prompts | variant | tokens / modelled time (x off) | x fixed | forwards | plain forwards | probes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in sets:
        for c, n in runs:
            prompts = validation_prompts(name, n, tok)
            base = fixed = ref = None
            for label, policy, settings in variants:
                tokens, t, outs, (steps, skipped, probes) = modelled(pair, cost, prompts, c, policy, settings, probes_charged)
                assert ref is None or outs == ref, (name, c, label)
                ref = ref or outs
                rate = tokens / t
                base = base or rate
                fixed = rate if policy == "fixed" else fixed
                print(f"| {name} | {c} | {len(prompts)} | {label} | {rate / base:.3f} | "
                      f"{rate / fixed if fixed else float('nan'):.3f} | {steps} | {skipped} | {probes} |", flush=True)


def parse_runs(arg: str):
    return [(int(x.split(":")[0]), int(x.split(":")[1]) if ":" in x else int(x)) for x in arg.split(",")]


if __name__ == "__main__":
    run(sys.argv[1].split(","), parse_runs(sys.argv[2]),
        [("off", "off", {}), ("fixed", "fixed", {}),
         ("cost, first hold: what a probe costs (default)", "cost", {"FIRST_PROBE_SHARE": 1.0}),
         ("cost, first hold 1 (before)", "cost", {"FIRST_PROBE_SHARE": 1e9})])
