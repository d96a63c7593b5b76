"""Where the GPU waited for the host, from a Chrome trace of ``replay_bench.py --kernels-at`` (CPU, no GPU needed).

Finds the gaps between consecutive device kernels longer than ``--min-gap-ms`` and sums, per host operator, the
time it ran inside them and its longest single call (nested operators count once each, so a parent and its child
both appear).

    python examples/engine_probes/trace_gaps.py docs/logs/replay_h200_one_read/trace_packed_c128.json.gz

``--rounds``: per speculative round of a batch-1 trace (``fast_generate_gpu.py``'s), from one target verify (the
only device burst longer than ``--verify-ms``) to the next: the round's span, the device's busy time, and its idle
time before the drafter's first burst and before the verify (medians over the rounds).
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


def bursts(events: list[dict], join_us: float = 8.0) -> list[list[float]]:
    """Device activity (kernels, copies, memsets) merged into bursts ``[start, end]`` wherever it idles less than ``join_us``."""
    acts = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e), key=lambda e: e["ts"])
    out: list[list[float]] = []
    for e in acts:
        if out and e["ts"] - out[-1][1] < join_us:
            out[-1][1] = max(out[-1][1], e["ts"] + e["dur"])
        else:
            out.append([e["ts"], e["ts"] + e["dur"]])
    return out


def round_profile(events: list[dict], verify_ms: float = 3.0) -> dict:
    """Medians (ms) over the rounds between consecutive verifies: span, busy, idle after the verify until the next
    burst of at least 0.5 ms (the drafter body), and idle just before the verify."""
    import statistics

    b = bursts(events)
    verifies = [i for i, (s, e) in enumerate(b) if e - s > 1e3 * verify_ms]
    rows = []
    for i, j in zip(verifies, verifies[1:]):
        body = next(k for k in range(i + 1, j + 1) if b[k][1] - b[k][0] > 500 or k == j)
        idle = [b[k + 1][0] - b[k][1] for k in range(i, j)]
        rows.append((b[j][0] - b[i][0], sum(e - s for s, e in b[i:j]), sum(idle[: body - i]), idle[-1]))
    med = [statistics.median(r[c] for r in rows) / 1e3 for c in range(4)]
    return {"rounds": len(rows), "span_ms": med[0], "busy_ms": med[1], "idle_before_drafter_ms": med[2],
            "idle_before_verify_ms": med[3]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--min-gap-ms", type=float, default=0.1)
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--rounds", action="store_true", help="per-round medians of a batch-1 speculative trace")
    ap.add_argument("--verify-ms", type=float, default=3.0)
    a = ap.parse_args()
    for path in a.traces:
        with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
            events = json.load(f)["traceEvents"]
        if a.rounds:
            print(f"{path}: {round_profile(events, a.verify_ms)}")
            continue
        span, gaps, ops, longest = gaps_and_ops(events, 1e3 * a.min_gap_ms)
        print(f"{path}: kernel span {span / 1e3:.1f} ms, {len(gaps)} gaps > {a.min_gap_ms} ms, "
              f"{sum(e - s for s, e in gaps) / 1e3:.1f} ms in all")
        for name, us in ops.most_common(a.top):
            print(f"    {us / 1e3:8.2f} ms  {name} (longest call {longest[name] / 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
