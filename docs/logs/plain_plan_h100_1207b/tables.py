"""The README's tables from the raw JSONs: python docs/logs/plain_plan_h100_1207b/tables.py"""
import json
from pathlib import Path

here = Path(__file__).parent
for run in ("a_2ef7123", "b_bc95ef9"):
    rows = json.loads((here / run / "real.json").read_text())["rows"]
    real = {(r["mode"], r["concurrency"]): r for r in rows}
    print(f"{run}: real runs, tok/s off / fixed / default, default / max, tau, phases ms a step off -> default")
    for c in sorted({c for _, c in real}):
        o, f, d = (real[(m, c)] for m in ("off", "fixed", "default"))
        po, pd = o.get("phases", {}), d.get("phases", {})
        ph = " ".join(f"{k[:-3]} {po.get(k, 0):.3f}->{pd.get(k, 0):.3f}" for k in ("host_ms", "target_ms", "accept_ms", "draft_ms"))
        print(f"  c={c:3d} {o['tok_per_s']:7.0f} / {f['tok_per_s']:7.0f} / {d['tok_per_s']:7.0f}  "
              f"{d['tok_per_s'] / max(o['tok_per_s'], f['tok_per_s']):.3f}  tau {d['tau']:.2f}  {ph}")
    rows = json.loads((here / run / "replay.json").read_text())["rows"]
    rep = {(r.get("trace") or "-", r["concurrency"], r["mode"]): r["tok_per_s"] for r in rows}
    print(f"{run}: 8B-shaped replay, default / max(off, fixed), default / adaptive")
    for tr in ("paper", "paper_ref", "gsm8k"):
        for c in sorted({c for _, c, _ in rep}):
            if (tr, c, "default") in rep:
                d, off, f, a = rep[(tr, c, "default")], rep[("-", c, "off")], rep[(tr, c, "fixed")], rep[(tr, c, "packed:adaptive")]
                print(f"  {tr:9s} c={c:3d} off {off:7.0f} fixed {f:7.0f} adaptive {a:7.0f} default {d:7.0f}  "
                      f"{d / max(off, f):.3f}  {d / a:.3f}")
