"""PROJECTION, not a measurement: a replay trace's recorded rounds run through the round-cost model a replay measured
(``examples/replay_bench.py --measure-cost`` writes both into ``replay_bench.json``), for the verify-length rules side
by side, as x ``off`` per concurrency. Host time enters only as the run's measured overheads per round (runs since the
overhead term; before, none: it flattered every drafting layout at 8-32).

    python examples/reference_pair/project_verify_rules.py docs/logs/replay_h200_cost/replay/replay_bench.json --trace gsm8k
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from adaflash_hf.speculation.length_policy import adaptive_verify_length, cost_aware_verify_length
from adaflash_hf.speculation.round_cost import RoundCost

RULES = ("off", "fixed", "floor rule (rate 2)", "cost rule, rate 2", "cost rule, rate 1")


def lengths(rule: str, ratio: torch.Tensor, cost: RoundCost, block: int) -> torch.Tensor:
    if rule == "off":
        return torch.ones(len(ratio), dtype=torch.long)
    if rule == "fixed":
        return torch.full((len(ratio),), block)
    if rule.startswith("floor"):
        return adaptive_verify_length(ratio, block, rate=2.0)
    return cost_aware_verify_length(ratio, block, cost, rate=float(rule[-1]))


def tokens_per_time(rounds, cost: RoundCost, c: int, rule: str, block: int, n: int = 300) -> float:
    rng, tokens, time = random.Random(0), 0, 0.0
    for _ in range(n):
        drawn = [rounds[rng.randrange(len(rounds))] for _ in range(c)]
        accepted = torch.tensor([a for a, _ in drawn])
        k = lengths(rule, torch.tensor([q for _, q in drawn]), cost, block)
        tokens += int((torch.minimum(accepted, k - 1) + 1).sum())
        time += cost.round_time(c, int(k.sum()), block)
    return tokens / time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("replay_json")
    p.add_argument("--trace", default="gsm8k", help="a recorded trace of the run (its rounds: accepted, head ratio)")
    p.add_argument("--concurrency", default="1,8,32,128")
    a = p.parse_args(argv)
    res = json.load(open(a.replay_json))
    m = res["meta"]["round_cost"]
    cost = RoundCost(rows=m["rows"], tokens_per_row=m["tokens_per_row"], verify=m["verify"], draft_fraction=m["draft_fraction"],
                     spec_overhead=m.get("spec_overhead", 0.0), plain_overhead=m.get("plain_overhead", 0.0))
    rounds, block = res["traces"][a.trace]["rounds"], res["meta"]["block_size"]
    print("| c | " + " | ".join(RULES[1:]) + " |\n|---" * 1 + "|---" * (len(RULES) - 1) + "|")
    for c in (int(x) for x in a.concurrency.split(",")):
        v = {rule: tokens_per_time(rounds, cost, c, rule, block) for rule in RULES}
        print(f"| {c} | " + " | ".join(f"{v[r] / v['off']:.2f}" for r in RULES[1:]) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
