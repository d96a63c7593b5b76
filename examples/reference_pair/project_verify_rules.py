"""PROJECTION, not a measurement: a replay trace's recorded rounds run through the round-cost model a replay measured
(``examples/replay_bench.py --measure-cost`` writes both into ``replay_bench.json``), for the verify-length rules side
by side, as x ``off`` per concurrency. Host time enters only as the run's measured overheads per round (runs since the
overhead term; before, none: it flattered every drafting layout at 8-32).

    python examples/reference_pair/project_verify_rules.py docs/logs/replay_h200_cost/replay/replay_bench.json --trace gsm8k

``--calibration head_calibration.json`` (``examples/head_calibration.py``'s rounds, on other prompts) adds the cost rule
fed a calibrated head: the head's predicted ``k = a B`` mapped to the mean realised ``L + 1`` of its calibration rounds
(20 equal-count bins by prediction, interpolated), the issue 35 item 3 question of whether correcting the head pays.

``--read-ms 1:0.89,8:1.62,32:0.64,64:0`` (ms per round by concurrency, interpolated; default: what the run recorded,
else none) is the part of a drafting round's overhead that a round verifying whole blocks without the mid-round read
of its ratios does not pay: ``fixed`` rounds, and the cost rule's whole-block stretches (rule "cost rule +
stretches": each row's ratio of its previous draw stands for its last ratio, no correlation between rounds, the
guess's worst case; when the guess, counting the read, gives every row its whole block the round verifies whole
blocks without the read, else the rule reads the round's own ratios and pays it).

The last column, "oracle (knows acceptance)", is the bound on any head: each round decodes plainly or drafts and
verifies what will be accepted (plus the bonus token; more slots where the measured curve makes that cheaper), whichever pays more at the rule's long-run throughput.
The column before it, "this head's bound", is the bound on any rule that reads this head: it knows, for each of 20
equal-count bins of the head's ratio (a bin per value where the head gives at most 64), the trace's own chance that slot ``j`` is accepted (fitted on the very rounds it
is scored on) and sees each round's ratios for free (no body when it then decodes plainly, no read); each round it
verifies the slots of most expected acceptance first, as many as pay at its long-run throughput, or none.

``--trace paper_ref`` rebuilds the replay's ``paper_ref`` rounds (the paper's per-slot acceptance, each round given a
ratio the recorded ``--ratio-set`` trace's head gave a round that accepted as many: ``paper_dflash_trace``), 5,000 draws.
"""

from __future__ import annotations

import argparse
import json
import random

import numpy as np
import torch

from adaflash_hf.speculation.length.rules import adaptive_verify_length, cost_aware_verify_length
from adaflash_hf.speculation.length.cost import RoundCost

ORACLE = "oracle (knows acceptance)"
HEAD_BOUND = "this head's bound"
RULES = ("off", "fixed", "floor rule (rate 2)", "cost rule, rate 2", "cost rule, rate 1", "cost rule + stretches", HEAD_BOUND,
         ORACLE)


def calibration_map(path: str, block: int):
    """``k -> realised k``: the mean realised ``L + 1`` per bin of predicted ``k = a B`` over the file's rounds."""
    rounds = [r for t in json.load(open(path))["traces"].values() for r in t["rounds"]]
    pts = np.array(sorted((q * block, accepted + 1) for accepted, q in rounds))
    bins = np.array_split(np.arange(len(pts)), 20)
    xs, ys = np.array([pts[b, 0].mean() for b in bins]), np.array([pts[b, 1].mean() for b in bins])
    return lambda k: np.interp(k, xs, ys)


def lengths(rule: str, ratio: torch.Tensor, cost: RoundCost, block: int, calibrated=None) -> torch.Tensor:
    if rule == "cost rule, calibrated":
        ratio = torch.tensor(calibrated(ratio.numpy() * block) / block, dtype=torch.float32)
        return cost_aware_verify_length(ratio, block, cost, rate=1.0)
    if rule == "off":
        return torch.ones(len(ratio), dtype=torch.long)
    if rule == "fixed":
        return torch.full((len(ratio),), block)
    if rule.startswith("floor"):
        return adaptive_verify_length(ratio, block, rate=2.0)
    return cost_aware_verify_length(ratio, block, cost, rate=float(rule[-1]))


def oracle_round(accepted: torch.Tensor, cost: RoundCost, block: int, rho: float) -> tuple[int, float]:
    """The bound no head can beat: a rule that knows each row's acceptance verifies exactly ``accepted + 1`` where it
    drafts (every slot committed) and pays no mid-round read. A round's cost depends only on its rows and total slots,
    so its options are plain decoding or drafting with the rows of most acceptance first; it takes the one of most
    ``tokens - rho * time`` (``rho``: the long-run throughput, found by iterating ``oracle_throughput``)."""
    c = len(accepted)
    totals = c + np.cumsum(np.sort(accepted.numpy())[::-1])
    # verifying more slots than needed may cost less (the measured curve is not monotone at every point): the time
    # of committing t tokens is the least over every total of at least t
    slots = np.arange(c + 1, c * block + 1)
    least = np.minimum.accumulate(cost.round_time(c, slots, block)[::-1])[::-1] - cost.read_time(c)
    options = [(c, cost.round_time(c, c, block))] + [(int(t), float(least[t - c - 1])) for t in totals if t > c]
    return max(options, key=lambda o: o[0] - rho * o[1])


def head_survival(rounds, block: int, bins: int = 20):
    """``ratio -> [P(accepted >= j) for j = 1 .. block - 1]``: the trace's own acceptance per draft slot in each of
    ``bins`` equal-count bins of the head's ratio (one bin per value where the head gives at most 64)."""
    pts = np.array(sorted((q, min(a, block - 1)) for a, q in rounds))
    values = np.unique(pts[:, 0])
    if len(values) <= 64:
        edges, groups = values[:-1], [pts[pts[:, 0] == v] for v in values]
    else:
        groups = np.array_split(pts, bins)
        edges = np.array([g[-1, 0] for g in groups[:-1]])
    surv = np.array([[(g[:, 1] >= j).mean() for j in range(1, block)] for g in groups])
    return lambda ratio: surv[np.searchsorted(edges, np.asarray(ratio), side="left")]


def head_bound_round(accepted: torch.Tensor, ratio: torch.Tensor, survival, cost: RoundCost, block: int,
                     rho: float) -> tuple[int, float]:
    """A round of the rule that knows the head's acceptance per ratio bin (``survival``): slots taken in order of
    their expected acceptance (a row's slots in order, as their chances fall), as many as maximise expected
    ``tokens - rho * time``, or none (a plain round); what it commits is what the trace accepts within them."""
    c = len(accepted)
    chance = survival(ratio.numpy())  # [c, block - 1]
    order = np.argsort(-chance, axis=None, kind="stable")
    expected = c + np.concatenate([[0.0], np.cumsum(chance.flat[order])])
    spent = cost.round_time(c, c + np.arange(len(expected)), block) - np.where(np.arange(len(expected)) > 0,
                                                                               cost.read_time(c), 0.0)
    m = int(np.argmax(expected - rho * spent))
    k = np.ones(c, dtype=np.int64)
    np.add.at(k, order[:m] // (block - 1), 1)
    return int((torch.minimum(accepted, torch.from_numpy(k) - 1) + 1).sum()), float(spent[m])


def tokens_per_time(rounds, cost: RoundCost, c: int, rule: str, block: int, n: int = 300, calibrated=None,
                    rho: float = 0.0, survival=None) -> float:
    rng, tokens, time, last = random.Random(0), 0, 0.0, None
    for _ in range(n):
        drawn = [rounds[rng.randrange(len(rounds))] for _ in range(c)]
        accepted, ratio = torch.tensor([a for a, _ in drawn]), torch.tensor([q for _, q in drawn])
        if rule in (ORACLE, HEAD_BOUND):
            clipped = torch.clamp(accepted, max=block - 1)
            got, spent = (oracle_round(clipped, cost, block, rho) if rule == ORACLE
                          else head_bound_round(clipped, ratio, survival, cost, block, rho))
            tokens, time = tokens + got, time + spent
            continue
        unread = rule == "fixed"
        if rule == "cost rule + stretches":
            unread = last is not None and bool((cost_aware_verify_length(last, block, cost, unread_whole=True) == block).all())
            k = torch.full((c,), block) if unread else lengths("cost rule, rate 1", ratio, cost, block)
            last = ratio
        else:
            k = lengths(rule, ratio, cost, block, calibrated)
        tokens += int((torch.minimum(accepted, k - 1) + 1).sum())
        time += cost.round_time(c, int(k.sum()), block) - (cost.read_time(c) if unread else 0.0)
    return tokens / time


def paper_ref_rounds(res: dict, ratio_set: str, block: int, n: int = 5000) -> list[tuple[int, float]]:
    """The replay's ``paper_ref`` rounds: the paper's per-slot acceptance, each with a ratio ``ratio_set``'s head gave a
    round that accepted as many."""
    from adaflash_hf.bench.replay import RecordedTrace, ReplayPolicy, TraceRound, paper_dflash_trace

    rec = res["traces"][ratio_set]
    recorded = RecordedTrace([TraceRound(int(a), float(q)) for a, q in rec["rounds"]], ReplayPolicy.from_json(rec["policy"]))
    trace, rng = paper_dflash_trace(block, ratio_from=recorded), random.Random(0)
    return [(r.accepted, r.ratio) for r in (trace.draw(rng, block) for _ in range(n))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("replay_json")
    p.add_argument("--trace", default="gsm8k", help="a recorded trace of the run (its rounds: accepted, head ratio), "
                   "or paper_ref (rebuilt from --ratio-set's rounds)")
    p.add_argument("--ratio-set", default="gsm8k", help="the recorded trace whose head ratios paper_ref takes")
    p.add_argument("--concurrency", default="1,8,32,128")
    p.add_argument("--calibration", default=None, help="head_calibration.json: also the cost rule on the calibrated head")
    p.add_argument("--read-ms", default=None, help="c:ms,...: the mid-round read's ms per round by concurrency (module doc)")
    a = p.parse_args(argv)
    res = json.load(open(a.replay_json))
    m = res["meta"]["round_cost"]
    read = m.get("read_overhead", 0.0)
    if a.read_ms:
        pts = sorted((float(c), float(ms)) for c, ms in (x.split(":") for x in a.read_ms.split(",")))
        read = tuple(float(np.interp(r, *zip(*pts))) / m["unit_ms"] for r in m["rows"])
    cost = RoundCost(rows=m["rows"], tokens_per_row=m["tokens_per_row"], verify=m["verify"], draft_fraction=m["draft_fraction"],
                     spec_overhead=m.get("spec_overhead", 0.0), plain_overhead=m.get("plain_overhead", 0.0),
                     read_overhead=read)
    block = res["meta"]["block_size"]
    rounds = paper_ref_rounds(res, a.ratio_set, block) if a.trace == "paper_ref" else res["traces"][a.trace]["rounds"]
    survival = head_survival(rounds, block)
    rules = RULES + (("cost rule, calibrated",) if a.calibration else ())
    calibrated = calibration_map(a.calibration, block) if a.calibration else None
    print("| c | " + " | ".join(rules[1:]) + " |\n|---" * 1 + "|---" * (len(rules) - 1) + "|")
    for c in (int(x) for x in a.concurrency.split(",")):
        v = {rule: tokens_per_time(rounds, cost, c, rule, block, calibrated=calibrated) for rule in rules
             if rule not in (ORACLE, HEAD_BOUND)}
        for bound in (HEAD_BOUND, ORACLE):
            rho = v["off"]
            for _ in range(4):  # the throughput the bound's per-round choice is weighed at: a fixed point
                rho = tokens_per_time(rounds, cost, c, bound, block, rho=rho, survival=survival)
            v[bound] = rho
        print(f"| {c} | " + " | ".join(f"{v[r] / v['off']:.2f}" for r in rules[1:]) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
