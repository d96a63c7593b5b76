"""The in-graph acceptance's kernels in trace_8b_fixed_c1.json.gz: per round, the verify graph's (the graph launch with
the most kernels) kernels after its argmax over the vocabulary (its longest kernel among its last 40).

    python docs/logs/round_kernels_h100_1207/a_rounds/8b/acceptance.py
"""
import gzip
import json
import statistics
from pathlib import Path

ev = json.load(gzip.open(Path(__file__).with_name("trace_8b_fixed_c1.json.gz"), "rt"))["traceEvents"]
rounds = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("name") == "round" and e.get("cat") == "user_annotation")
launch = {e["args"]["correlation"]: e for e in ev if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
kernels = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
busy, span, argmax = [], [], []
for start, end in rounds:
    graphs = {}
    for k in kernels:
        h = launch.get(k["args"].get("correlation"))
        if h and h["name"] == "cudaGraphLaunch" and start <= h["ts"] <= end:
            graphs.setdefault(k["args"]["correlation"], []).append(k)
    g = max(graphs.values(), key=len)
    top = max(range(len(g) - 40, len(g)), key=lambda i: g[i]["dur"])
    tail = g[top + 1 :]
    busy.append(sum(k["dur"] for k in tail))
    span.append(tail[-1]["ts"] + tail[-1]["dur"] - tail[0]["ts"])
    argmax.append(g[top]["dur"])
print(f"{len(rounds)} rounds: acceptance {len(tail)} kernels, {statistics.median(busy):.1f} us busy, "
      f"{statistics.median(span):.1f} us span; the argmax before it {statistics.median(argmax):.1f} us (medians)")
