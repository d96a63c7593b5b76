"""The README's tables from the raw JSONs: python docs/logs/plain_plan_h100_1207c/tables.py"""
import json
from pathlib import Path

here = Path(__file__).parent
for run in ("a_c4f01db", "b_f0f1174"):
    rows = json.loads((here / run / "real.json").read_text())["rows"]
    real = {(r["mode"], r["concurrency"]): r for r in rows}
    print(f"{run}: real runs, tok/s off / fixed / default, default / max, tau, timeline ms a plain stretch of 8 off -> default")
    for c in sorted({c for _, c in real}):
        o, f, d = (real[(m, c)] for m in ("off", "fixed", "default"))
        st = ""
        if "timeline" in o and "timeline" in d:
            bo, bd = o["timeline"]["by_kind"].get("plain x8"), d["timeline"]["by_kind"].get("plain x8")
            if bo and bd:
                st = f"  stretch {bo['ms'] / bo['n']:.3f} -> {bd['ms'] / bd['n']:.3f} ms ({bd['ms'] / bd['n'] / (bo['ms'] / bo['n']):.3f}x)"
        print(f"  c={c:3d} {o['tok_per_s']:7.0f} / {f['tok_per_s']:7.0f} / {d['tok_per_s']:7.0f}  "
              f"{d['tok_per_s'] / max(o['tok_per_s'], f['tok_per_s']):.3f}  tau {d['tau']:.2f}  runs {[round(x) for x in d['decode_runs']]}{st}")
    rows = json.loads((here / run / "replay.json").read_text())["rows"]
    rep = {(r.get("trace") or "-", r["concurrency"], r["mode"]): r for r in rows}
    print(f"{run}: 8B-shaped replay, default / max(off, fixed), default / adaptive; default tau and verify length")
    for tr in ("paper", "paper_ref", "gsm8k"):
        for c in sorted({c for _, c, _ in rep}):
            if (tr, c, "default") in rep:
                d, off, f, a = (rep[k]["tok_per_s"] for k in ((tr, c, "default"), ("-", c, "off"), (tr, c, "fixed"), (tr, c, "packed:adaptive")))
                dr = rep[(tr, c, "default")]
                print(f"  {tr:9s} c={c:3d} off {off:7.0f} fixed {f:7.0f} adaptive {a:7.0f} default {d:7.0f}  "
                      f"{d / max(off, f):.3f}  {d / a:.3f}  tau {dr['tau']:.2f} vlen {dr['mean_verify_len']:.2f}")
