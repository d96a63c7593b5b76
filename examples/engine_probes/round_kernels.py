"""What each engine round launches and what the device spends on it, from ``round_trace.py --trace-at``'s Chrome
trace (CPU, no GPU needed).

The trace marks each round (``record_function("round")``) and records Python stacks. Every device activity (kernel,
copy, memset) is tied to the host call that launched it (a CUDA graph replay launches many) by its correlation id,
and that call to the package's two innermost Python frames around it. Per round it reports:

- by launch site: launches, kernels and device time a round (graph replays under the frame that replays them);
- the device's idle time inside the round, charged to the launch site of the activity that ends it (what the
  device waited for);
- the longest kernels by name and site;
- one round laid out launch by launch (the round of median length): host time, site, kernels, device start and busy.

    python examples/engine_probes/round_kernels.py docs/logs/round_trace_h100_1207/trace_ref_fixed_c1.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
PACKAGE = "adaflash_hf/"


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def frame(name: str) -> str:
    """``adaflash_hf/engine/graphs.py(137): replay`` -> ``graphs.py:replay``."""
    where, _, fn = name.partition(": ")
    return f"{where.rsplit('/', 1)[-1].split('(')[0]}:{fn}"


def launch_sites(events: list[dict]) -> dict[int, str]:
    """Correlation id -> the two innermost package frames around the host call that launched it (outer > inner)."""
    frames = sorted((e for e in events if e.get("cat") == "python_function" and PACKAGE in e.get("name", "")),
                    key=lambda e: (e["ts"], -e.get("dur", 0)))
    calls = sorted((e for e in events if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})),
                   key=lambda e: e["ts"])
    sites, stack, i = {}, [], 0
    for call in calls:
        while i < len(frames) and frames[i]["ts"] <= call["ts"]:
            f = frames[i]
            while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) < f["ts"]:
                stack.pop()
            stack.append(f)
            i += 1
        open_ = [f for f in stack if f["ts"] + f.get("dur", 0) >= call["ts"]]
        names = [frame(f["name"]) for f in open_[-2:]]
        sites[call["args"]["correlation"]] = " > ".join(names) or "(outside the package)"
    return sites


def rounds_of(events: list[dict]) -> list[tuple[float, float]]:
    marks = [e for e in events if e.get("name") == "round" and e.get("cat") in ("user_annotation", "cpu_op")]
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in marks)


def analyse(events: list[dict], top: int = 12) -> dict:
    sites = launch_sites(events)
    kinds = {e["args"]["correlation"]: e["name"] for e in events
             if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    host_ts = {e["args"]["correlation"]: e["ts"] for e in events
               if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATS and "dur" in e), key=lambda e: e["ts"])
    rounds = rounds_of(events)
    if not rounds:
        raise SystemExit("no 'round' marks in the trace: write it with round_trace.py --trace-at")
    n = len(rounds)
    by_site = defaultdict(lambda: {"launches": set(), "kernels": 0, "device_us": 0.0, "waited_us": 0.0})
    by_kernel = defaultdict(lambda: [0, 0.0])
    per_round = [[] for _ in rounds]
    starts = [r[0] for r in rounds]
    for k in device:
        corr = k.get("args", {}).get("correlation")
        h = host_ts.get(corr)
        if h is None:
            continue
        j = max((i for i, s in enumerate(starts) if s <= h), default=None)
        if j is None or h > rounds[j][1]:
            continue
        site = sites.get(corr, "?")
        s = by_site[site]
        s["launches"].add(corr)
        s["kernels"] += 1
        s["device_us"] += k["dur"]
        by_kernel[(k["name"][:80], site)][0] += 1
        by_kernel[(k["name"][:80], site)][1] += k["dur"]
        per_round[j].append((k, corr, site))
    busy, idle = [], []
    for j, ks in enumerate(per_round):
        ks.sort(key=lambda x: x[0]["ts"])
        end, b, gap_total = None, 0.0, 0.0
        for k, _, site in ks:
            s, e = k["ts"], k["ts"] + k["dur"]
            if end is not None and s > end:
                by_site[site]["waited_us"] += s - end
                gap_total += s - end
            b += e - max(s, end) if end is not None and s < end else k["dur"]
            end = e if end is None else max(end, e)
        busy.append(b)
        idle.append(gap_total)
    walls = [e - s for s, e in rounds]
    mid = sorted(range(n), key=lambda j: walls[j])[n // 2]
    layout, seen = [], {}
    for k, corr, site in per_round[mid]:
        if corr not in seen:
            seen[corr] = len(layout)
            layout.append({"host_ms": (host_ts[corr] - rounds[mid][0]) / 1e3, "call": kinds.get(corr, "?"), "site": site,
                           "kernels": 0, "device_start_ms": (k["ts"] - rounds[mid][0]) / 1e3, "device_us": 0.0})
        row = layout[seen[corr]]
        row["kernels"] += 1
        row["device_us"] += k["dur"]
    return {
        "rounds": n, "wall_ms": statistics.median(walls) / 1e3, "device_busy_ms": statistics.median(busy) / 1e3,
        "device_idle_between_ms": statistics.median(idle) / 1e3,
        "sites": sorted(({"site": site, "launches": len(v["launches"]) / n, "kernels": v["kernels"] / n,
                          "device_ms": v["device_us"] / n / 1e3, "waited_for_ms": v["waited_us"] / n / 1e3}
                         for site, v in by_site.items()), key=lambda r: -r["device_ms"]),
        "kernels": [{"name": name, "site": site, "count": c / n, "device_ms": us / n / 1e3}
                    for (name, site), (c, us) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:top]],
        "median_round": {"wall_ms": walls[mid] / 1e3, "launches": layout},
    }


def markdown(title: str, a: dict) -> str:
    lines = [f"## {title}", "",
             f"{a['rounds']} rounds: wall {a['wall_ms']:.3f} ms (profiled), device busy {a['device_busy_ms']:.3f} ms, "
             f"device idle between its first and last activity {a['device_idle_between_ms']:.3f} ms (medians)", "",
             "| launch site | launches | kernels | device ms | device waited ms |", "|---|---|---|---|---|"]
    lines += [f"| `{s['site']}` | {s['launches']:.1f} | {s['kernels']:.1f} | {s['device_ms']:.3f} | {s['waited_for_ms']:.3f} |"
              for s in a["sites"]]
    lines += ["", "| kernel | site | per round | device ms |", "|---|---|---|---|"]
    lines += [f"| `{k['name']}` | `{k['site']}` | {k['count']:.1f} | {k['device_ms']:.3f} |" for k in a["kernels"]]
    m = a["median_round"]
    lines += ["", f"The median round ({m['wall_ms']:.3f} ms), launch by launch:", "",
              "| host ms | call | site | kernels | device start ms | device us |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['host_ms']:.3f} | {r['call']} | `{r['site']}` | {r['kernels']} | {r['device_start_ms']:.3f} | "
              f"{r['device_us']:.1f} |" for r in m["launches"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--top", type=int, default=12, help="kernels listed by device time")
    ap.add_argument("--json", default=None, help="also write the analyses here")
    args = ap.parse_args(argv)
    out = {}
    for path in args.traces:
        out[path] = analyse(load(path), args.top)
        print(markdown(path.rsplit("/", 1)[-1], out[path]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
