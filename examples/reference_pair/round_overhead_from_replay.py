"""What a replay's rounds cost in wall time against what its round-cost model predicts (issue 35): per row of
``replay_bench.json`` (``examples/replay_bench.py --measure-cost``), the wall time of one round while every request
of the concurrency runs (``c x tau / full-batch tok/s``), the model's time of that round (``RoundCost.round_time`` at
the row's mean verify length: the measured graph times, plus the overheads the table carries), and the gap, in ms
and in the model's unit (the target's 1-token forward at batch 1). A gap that the model leaves out is host time
(scheduling, packing, reads, launches) or device time the graph replays did not see. Where the run measured its
overheads, the model's plain round is the drafting engine's (``measure_round_cost`` times it there), which costs more
than the ``off`` engine's steps (eight greedy steps per read): the ``off`` rows' gaps then come out below 0.

The table is stored normalised; its unit in ms comes from ``meta.round_cost.unit_ms`` (recorded since the overhead
term) or ``--unit-ms`` (for the 2026-12-04 run: 4.41, the ``off`` forward at 128 requests, 7.17 ms of kernels in the
profiled run of 2026-12-02 (BENCHMARKS section 9), over the table's 1.626 units at 128 x 1; the ``off`` round at
c=1, 4.40 ms of wall time, agrees). Rounds of the closed batch's tail (fewer requests) are not in the full-batch rate;
``tau`` and the mean verify length are the whole run's: an approximation.

    python examples/reference_pair/round_overhead_from_replay.py docs/logs/replay_h200_1204/replay_bench.json --unit-ms 4.41
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

from adaflash_hf.speculation.length.cost import SPEC_ROWS, RoundCost


def model_of(meta: dict) -> RoundCost:
    """The run's measured :class:`RoundCost` (overheads where the run recorded them)."""
    m = meta["round_cost"]
    return RoundCost(rows=tuple(m["rows"]), tokens_per_row=tuple(m["tokens_per_row"]),
                     verify=tuple(tuple(r) for r in m["verify"]), draft_fraction=m["draft_fraction"],
                     spec_overhead=m.get("spec_overhead", 0.0), plain_overhead=m.get("plain_overhead", 0.0),
                     read_overhead=m.get("read_overhead", 0.0))


def round_rows(res: dict, unit_ms: float) -> list[dict]:
    """One entry per closed-batch replay row with a full-batch rate: wall and model ms per round, and the gap."""
    cost, block, out = model_of(res["meta"]), res["meta"]["block_size"], []
    for r in res["rows"]:
        if r.get("kind") != "replay" or r.get("arrival") != "closed" or not r.get("full_batch_tok_per_s"):
            continue
        c, tau, v = r["concurrency"], r["tau"], r["mean_verify_len"]
        wall = c * tau / r["full_batch_tok_per_s"] * 1e3
        model = cost.round_time(c, c * v, block) * unit_ms
        out.append({"trace": r.get("trace") or "-", "mode": r["mode"], "c": c, "tau": tau, "verify_len": v,
                    "wall_ms": wall, "model_ms": model, "gap_ms": wall - model, "gap_units": (wall - model) / unit_ms})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("replay_json")
    p.add_argument("--unit-ms", type=float, default=None, help="ms of the table's unit (default: meta.round_cost.unit_ms)")
    a = p.parse_args(argv)
    res = json.load(open(a.replay_json))
    unit = a.unit_ms or res["meta"]["round_cost"].get("unit_ms")
    if not unit:
        raise SystemExit("the run did not record its unit (meta.round_cost.unit_ms): pass --unit-ms")
    rows = round_rows(res, unit)
    print(f"unit {unit:.3f} ms\n\n| trace | mode | c | tau | verify len | wall ms / round | model ms | gap ms | gap, units |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['trace']} | {r['mode']} | {r['c']} | {r['tau']:.2f} | {r['verify_len']:.2f} | {r['wall_ms']:.2f} | "
              f"{r['model_ms']:.2f} | {r['gap_ms']:.2f} | {r['gap_units']:.2f} |")
    print("\nmedian gap, ms, by concurrency: plain rounds (`off`); packed rounds that draft (`packed:adaptive`); fixed")
    med = {}
    for c in sorted({r["c"] for r in rows}):
        for m in ("off", "packed:adaptive", "fixed"):
            gaps = [r["gap_ms"] for r in rows if r["c"] == c and r["mode"] == m]
            if gaps:
                med.setdefault(m, {})[c] = statistics.median(gaps)
        print(f"c={c}: " + ", ".join(f"{m} {v[c]:.2f}" for m, v in med.items() if c in v))
    for m, key in (("packed:adaptive", "spec"), ("off", "plain")):  # SPEC_H200_OVERHEAD_MS's rows, interpolated
        if m in med:
            cs = sorted(med[m])
            at = np.interp(SPEC_ROWS, cs, [max(med[m][c], 0.0) for c in cs])
            print(f"at SPEC_ROWS {SPEC_ROWS}, {key} ({m}, negative read as 0): ({', '.join(f'{v:.2f}' for v in at)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
