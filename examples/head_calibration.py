"""The reference pair's length head against realised acceptance on prompts outside its training sets (issue 35
item 3): a reliability table per predicted-k bucket and per draft position, per set and pooled.

Every prompt runs greedily through the engine in ``fixed`` mode (whole blocks verified, so no accepted count is
cut by a verify length); each whole-block round keeps its accepted drafts ``L`` and the head's ratio ``a``
(:meth:`adaflash_hf.bench.replay.RecordedTrace.record`), and :mod:`adaflash_hf.bench.calibration` compares the
head's predicted ``k = a * B`` with the realised ``L + 1``. Sets: Spec-Bench's five categories of its own and
MT-bench (none of them a training source of the pair).

Writes ``head_calibration.json`` and ``head_calibration.md`` into ``--out``.

Usage:
    python examples/head_calibration.py --prompts 20 --threads 1 --out docs/logs/head_calibration_cpu  # CPU, minutes
    python examples/head_calibration.py --smoke --out /tmp/calib                             # CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from adaflash_hf.bench import calibration as C
from adaflash_hf.bench.replay import RecordedTrace

SETS = ("spec_bench:translation", "spec_bench:summarization", "spec_bench:qa", "spec_bench:math_reasoning",
        "spec_bench:rag", "mt_bench")
RATES = (1.0, 2.0)


def record(sets, n: int, max_new: int, device: str) -> tuple[dict, dict]:
    """``({set: RecordedTrace}, {set: prompts used})`` of the reference pair (float32) on each set."""
    from adaflash_hf import load_reference_pair
    from adaflash_hf.bench.prompts import load_prompts
    from adaflash_hf.generation.prompts import encode_prompt

    target, drafter, tok = load_reference_pair(device=device, dtype=torch.float32)
    traces, used = {}, {}
    for name in sets:
        t = time.perf_counter()
        _, messages = load_prompts(name, n, None)
        prompts = [encode_prompt(tok, m) for m in messages]
        traces[name] = RecordedTrace.record(target.eval(), drafter.eval(), prompts, max_new, name=name,
                                            eos_token_id=tok.eos_token_id, max_slots=len(prompts),
                                            token_budget=max(1024, max(map(len, prompts)) + 16 * len(prompts)))
        used[name] = len(prompts)
        print(f"{name}: {len(prompts)} prompts, {len(traces[name].rounds)} whole-block rounds, tau "
              f"{traces[name].tau:.2f} ({time.perf_counter() - t:.1f}s)", flush=True)
    return traces, used


def summarise(rounds, block: int, policy_rate: float) -> dict:
    """Every table of :mod:`adaflash_hf.bench.calibration` for one pool of rounds."""
    scale = C.fitted_scale(rounds, block)
    rates = sorted({*RATES, policy_rate, round(scale, 2)})
    return {"rounds": len(rounds), "tau_whole_block": C.rule_outcome(rounds, block, 1e9)["tau"],
            "mean_predicted_k": sum(r.ratio * block for r in rounds) / len(rounds),
            "mean_realised_k": sum(r.accepted + 1 for r in rounds) / len(rounds), "fitted_scale": scale,
            "buckets": C.by_bucket(rounds, block, policy_rate), "positions": C.by_position(rounds, block, policy_rate),
            "rules": [C.rule_outcome(rounds, block, r) for r in rates]}


def markdown(res: dict) -> str:
    m = res["meta"]
    out = ["# Length head calibration, reference pair (whole blocks verified)", "",
           f"{m['device']}, float32; {m['max_new_tokens']} new tokens per prompt; block {m['block_size']}, shipped rate "
           f"{m['policy']['length_rate']}, min len {m['policy']['length_min']}. Predicted k = a * B (the head's "
           "label is (L + 1) / B); realised k = L + 1 (accepted drafts + bonus). ratio = realised / predicted "
           "(> 1: the head under-predicts).", ""]
    out += ["| set | prompts | rounds | tau (whole block) | mean predicted k | mean realised k | realised / predicted | "
            "fitted scale |", "|---|---|---|---|---|---|---|---|"]
    for name, s in res["sets"].items():
        out.append(f"| {name} | {res['prompts'].get(name, '-')} | {s['rounds']} | {s['tau_whole_block']:.2f} | "
                   f"{s['mean_predicted_k']:.2f} | {s['mean_realised_k']:.2f} | "
                   f"{s['mean_realised_k'] / s['mean_predicted_k']:.2f}x | {s['fitted_scale']:.2f} |")
    pooled = res["sets"]["pooled"]
    out += ["", f"## Pooled: per predicted-k bucket (floor rule at the shipped rate {m['policy']['length_rate']})", "",
            "| predicted k | rounds | mean predicted k | mean realised k | realised / predicted | k_hat (shipped) | "
            "rounds cut (k_hat < L + 1) |", "|---|---|---|---|---|---|---|"]
    out += [f"| {b['bucket']} | {b['count']} | {b['predicted_k']:.2f} | {b['realised_k']:.2f} | {b['ratio']:.2f}x | "
            f"{b['k_hat']:.2f} | {b['cut']:.1%} |" for b in pooled["buckets"]]
    out += ["", "## Per draft position: P(L >= j)", "", "Pooled, then the realised / predicted ratio per set.", "",
            "| j | predicted | realised | realised / predicted | realised P(accept j \\| j-1 accepted) | verified at the "
            "shipped rate | accepted but not verified | " + " | ".join(n for n in res["sets"] if n != "pooled") + " |",
            "|---" * (7 + len(res["sets"]) - 1) + "|"]
    for i, p in enumerate(pooled["positions"]):
        per_set = [f"{s['positions'][i]['ratio']:.2f}x" for n, s in res["sets"].items() if n != "pooled"]
        out.append(f"| {p['position']} | {p['predicted']:.3f} | {p['realised']:.3f} | {p['ratio']:.2f}x | {p['cond']:.2f} "
                   f"| {p['verified']:.1%} | {p['lost']:.1%} | " + " | ".join(per_set) + " |")
    out += ["", "## The floor rule at several rates (pooled; each round scored alone)", "",
            "| rate | tau | of the whole block's tau | mean verify length |", "|---|---|---|---|"]
    out += [f"| {r['rate']:g} | {r['tau']:.2f} | {r['tau_share']:.1%} | {r['verify_len']:.2f} |" for r in pooled["rules"]]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "head_calibration_out"))
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--prompts", type=int, default=20, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default; 1 is "
                    "fastest on a few shared cores)")
    ap.add_argument("--smoke", action="store_true", help="2 sets x 2 prompts x 24 tokens")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sets = list(SETS[:2]) if args.smoke else [s for s in args.sets.split(",") if s]
    n, max_new = (2, 24) if args.smoke else (args.prompts, args.max_new_tokens)
    if not sets or n < 1 or max_new < 1:
        raise SystemExit("need at least one set, --prompts >= 1 and --max-new-tokens >= 1")
    t0 = time.perf_counter()
    traces, used = record(sets, n, max_new, args.device)
    policy = next(iter(traces.values())).policy
    block = policy.block_size
    res = {"meta": {"device": args.device, "max_new_tokens": max_new, "block_size": block, "policy": policy.to_json()},
           "prompts": used, "sets": {name: summarise(t.rounds, block, policy.length_rate) for name, t in traces.items()}}
    res["sets"]["pooled"] = summarise([r for t in traces.values() for r in t.rounds], block, policy.length_rate)
    res["traces"] = {name: t.to_json() for name, t in traces.items()}
    res["meta"]["total_s"] = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "head_calibration.json").write_text(json.dumps(res, indent=1))
    (out / "head_calibration.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
