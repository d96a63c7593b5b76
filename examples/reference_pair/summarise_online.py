"""The table of a set of online runs (`examples/research/online_experiment.py`), rebuilt from their JSONs.

    python examples/reference_pair/summarise_online.py RUNS_DIR [--out RUNS_DIR]

Reads every ``RUNS_DIR/**/online.json`` (one per process of `gpu_online.sh`: a domain, a method
with its OPD clip mode, a seed) and writes ``summary.json`` and ``summary.md`` into ``--out``: per
domain and method, over seeds, the held-out tau after each update (mean ± sample standard
deviation, and the range; beside it with the fixed policy where measured), the length head's mean absolute error on the held-out rounds at each
measurement and on the served rounds before / after each update (the adapter's records), whether
every output was identical to plain greedy, and the seconds; then OPD minus OSD per update, paired
by seed (same stream order and held-out prompts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path


def variant(run: dict, method: str) -> str:
    """``opd-token`` / ``opd-entry`` for OPD (its clip mode matters), else the method's name."""
    return f"opd-{run.get('clip_mode', 'token')}" if method == "opd" else method


def load_runs(root: Path) -> list[dict]:
    """One row per (JSON, method): domain, policy, variant, seed and the method's result."""
    rows = []
    for path in sorted(root.rglob("online.json")):
        run = json.loads(path.read_text(encoding="utf-8"))
        for method, res in run["methods"].items():
            rows.append({"dataset": run.get("dataset", "?"), "policy": run.get("policy", "fixed"),
                         "variant": variant(run, method), "seed": run.get("seed", 0), "path": str(path), **res})
    return rows


def spread(values: list) -> dict | None:
    """Mean, sample standard deviation (0 for one value), min, max and count of the non-None values."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return None
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return {"mean": statistics.fmean(xs), "sd": sd, "min": min(xs), "max": max(xs), "n": len(xs)}


def _per_update(rows: list[dict], pick) -> list[dict | None]:
    """``spread`` over rows of ``pick(row, update)`` for update 0..the longest curve's last."""
    last = max((len(r["curve"]) for r in rows), default=0)
    return [spread([pick(r, u) for r in rows]) for u in range(last)]


def _curve_value(key):
    return lambda r, u: r["curve"][u].get(key) if u < len(r["curve"]) else None


def _record_value(key):
    """The adapter's record of update ``u`` (updates are 1-based; index 0 has none)."""
    return lambda r, u: r.get("updates", [])[u - 1].get(key) if 1 <= u <= len(r.get("updates", [])) else None


def _gain(rows: list[dict]) -> dict | None:
    """Held-out tau after the last update minus before the first, over the runs that reached the
    group's last update (so every value spans the same updates)."""
    last = max(len(r["curve"]) for r in rows)
    return spread([r["curve"][-1]["tau"] - r["curve"][0]["tau"] for r in rows if len(r["curve"]) == last > 1])


def summarise(rows: list[dict]) -> dict:
    """Per (dataset, policy, variant), over seeds; then OPD - OSD per update paired by seed."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["dataset"], r["policy"], r["variant"]), []).append(r)
    out = []
    for (dataset, policy, var), rs in sorted(groups.items()):
        out.append({
            "dataset": dataset, "policy": policy, "variant": var, "seeds": sorted(r["seed"] for r in rs),
            "complete": sum(bool(r.get("complete")) for r in rs),
            "identical": all(c.get("identical") for r in rs for c in r["curve"]),
            "tau": _per_update(rs, _curve_value("tau")),
            "fixed_tau": _per_update(rs, _curve_value("fixed_tau")),
            "gain": _gain(rs),
            "mean_verify_length": _per_update(rs, _curve_value("mean_verify_length")),
            "head_mae_heldout": _per_update(rs, _curve_value("head_mae")),
            "head_mae_served_before": _per_update(rs, _record_value("head_mae_before")),
            "head_mae_served_after": _per_update(rs, _record_value("head_mae_after")),
            "loss": _per_update(rs, _curve_value("loss")),
            "seconds": spread([r.get("seconds") for r in rs]),
        })
    return {"groups": out, "opd_minus_osd": _paired(groups)}


def _paired(groups: dict) -> list[dict]:
    """Each OPD variant minus OSD, per update, over the seeds both ran (same stream, same held-out)."""
    out = []
    for (dataset, policy, var), rs in sorted(groups.items()):
        osd = {r["seed"]: r for r in groups.get((dataset, policy, "osd"), [])}
        if not var.startswith("opd") or not osd:
            continue
        pairs = [(r, osd[r["seed"]]) for r in rs if r["seed"] in osd]
        last = max((min(len(a["curve"]), len(b["curve"])) for a, b in pairs), default=0)
        diff = [spread([a["curve"][u]["tau"] - b["curve"][u]["tau"] for a, b in pairs
                        if u < min(len(a["curve"]), len(b["curve"]))]) for u in range(last)]
        out.append({"dataset": dataset, "policy": policy, "variant": var, "seeds": sorted(r["seed"] for r, _ in pairs), "diff": diff})
    return out


def _fmt(s: dict | None, digits: int = 3, of: int = 0) -> str:
    """``mean ± sd [min, max]``, with ``(n=k)`` where fewer than ``of`` seeds gave a value."""
    if s is None:
        return "-"
    text = f"{s['mean']:.{digits}f}"
    if s["n"] > 1:
        text += f" ± {s['sd']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"
    return text + (f" (n={s['n']})" if s["n"] < of else "")


def _series(values: list, digits: int = 3, of: int = 0) -> str:
    return "<br>".join(f"{u}: {_fmt(v, digits, of)}" for u, v in enumerate(values) if v is not None) or "-"


def markdown(summary: dict) -> str:
    """The tables of ``summary`` (mean ± sample sd [min, max] over seeds; update 0 is before any)."""
    lines = [
        "Held-out tau and the length head's mean absolute error per update: mean ± sample sd [min, max] over seeds",
        "((n=k): only k seeds reached that update before the time limit).",
        "Head MAE held-out: on the measured held-out rounds. Served before / after update u: on the stream's rounds",
        "served with the weights before / after update u, none of them trained on yet (the adapter's records).",
        "",
        "| domain | policy | method | seeds (complete) | held-out tau after update u | tau gain, update 0 to the last | held-out tau, fixed policy | mean verify length | head MAE held-out | head MAE served before / after update u | seconds | identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in summary["groups"]:
        n = len(g["seeds"])
        served = "<br>".join(f"{u}: {_fmt(b, of=n)} / {_fmt(a, of=n)}" for u, (b, a) in enumerate(zip(g["head_mae_served_before"], g["head_mae_served_after"]))
                             if u > 0 and (b is not None or a is not None)) or "-"
        lines.append(
            f"| {g['dataset']} | {g['policy']} | {g['variant']} | {','.join(map(str, g['seeds']))} ({g['complete']}) | "
            f"{_series(g['tau'], of=n)} | {_fmt(g['gain'], of=n)} | {_series(g['fixed_tau'], of=n)} | {_series(g['mean_verify_length'], 2, n)} | {_series(g['head_mae_heldout'], of=n)} | "
            f"{served} | {_fmt(g['seconds'], 1)} | {'yes' if g['identical'] else '**NO**'} |"
        )
    if summary["opd_minus_osd"]:
        lines += ["", "OPD minus OSD, held-out tau per update, paired by seed:", "",
                  "| domain | policy | method | seeds | tau difference after update u |", "|---|---|---|---|---|"]
        for p in summary["opd_minus_osd"]:
            lines.append(f"| {p['dataset']} | {p['policy']} | {p['variant']} | {','.join(map(str, p['seeds']))} | {_series(p['diff'], of=len(p['seeds']))} |")
    return "\n".join(lines) + "\n"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", help="folder searched for online.json files")
    ap.add_argument("--out", default=None, help="where summary.json / summary.md go (default: the runs folder)")
    a = ap.parse_args(argv)
    root = Path(a.runs)
    if not root.is_dir():
        ap.error(f"no such folder: {root}")
    rows = load_runs(root)
    if not rows:
        print(f"no online.json under {root}", file=sys.stderr)
        return 1
    summary = summarise(rows)
    out = Path(a.out or root)
    out.mkdir(parents=True, exist_ok=True)
    _write_atomic(out / "summary.json", json.dumps(summary, indent=2))
    text = markdown(summary)
    _write_atomic(out / "summary.md", text)
    print(text)
    return 0 if all(g["identical"] for g in summary["groups"]) else 2


if __name__ == "__main__":
    raise SystemExit(main())
