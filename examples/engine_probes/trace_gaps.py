"""Where the GPU waited for the host, from a Chrome trace of ``replay_bench.py --kernels-at`` (CPU, no GPU needed).

Finds the gaps between consecutive device kernels longer than ``--min-gap-ms`` and sums, per host operator, the
time it ran inside them and its longest single call (nested operators count once each, so a parent and its child
both appear).

    python examples/engine_probes/trace_gaps.py docs/logs/replay_h200_one_read/trace_packed_c128.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter


def gaps_and_ops(events: list[dict], min_gap_us: float) -> tuple[float, list[tuple[float, float]], Counter, dict]:
    """``(kernel span us, gaps [(start, end)], host operator us inside the gaps, its longest call us)``."""
    kernels = sorted((e for e in events if e.get("cat") == "kernel" and "dur" in e), key=lambda e: e["ts"])
    gaps = [(a["ts"] + a["dur"], b["ts"]) for a, b in zip(kernels, kernels[1:]) if b["ts"] - a["ts"] - a["dur"] > min_gap_us]
    ops, longest = Counter(), {}
    cpu = [e for e in events if e.get("cat") == "cpu_op" and "dur" in e]
    for start, end in gaps:
        for e in cpu:
            if start <= e["ts"] < end:
                ops[e["name"]] += min(e["dur"], end - e["ts"])
                longest[e["name"]] = max(longest.get(e["name"], 0.0), e["dur"])
    return kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"], gaps, ops, longest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--min-gap-ms", type=float, default=0.1)
    ap.add_argument("--top", type=int, default=6)
    a = ap.parse_args()
    for path in a.traces:
        with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
            events = json.load(f)["traceEvents"]
        span, gaps, ops, longest = gaps_and_ops(events, 1e3 * a.min_gap_ms)
        print(f"{path}: kernel span {span / 1e3:.1f} ms, {len(gaps)} gaps > {a.min_gap_ms} ms, "
              f"{sum(e - s for s, e in gaps) / 1e3:.1f} ms in all")
        for name, us in ops.most_common(a.top):
            print(f"    {us / 1e3:8.2f} ms  {name} (longest call {longest[name] / 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
