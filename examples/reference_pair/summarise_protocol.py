"""The tables of a set of online protocol runs (`examples/research/online_protocol.py`, `gpu_protocol.sh`), from their JSONs.

    python examples/reference_pair/summarise_protocol.py RUNS_DIR [--out DIR]

Runs are grouped by their folder name without a trailing ``__<method>`` and ``_s<seed>``, and by method. Per group: held-out tau
after each update (mean ± sample sd over seeds, [min, max]), the change from update 0 to the last (relative),
the lowest tau after any update relative to the start, how many updates were swapped in (the others were refused by
the guard or failed; each seed's count), every output identical to plain greedy or not; then
acceptance per draft position before and after (mean over seeds); then OPD minus OSD per update, paired by seed.
Writes ``protocol_summary.md`` and ``protocol_summary.json`` into ``--out`` (default RUNS_DIR).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from summarise_online import spread  # noqa: E402 - one definition of mean ± sd [min, max]


def load(root: Path) -> dict[tuple[str, str], dict[int, dict]]:
    """``{(group, method): {seed: method result}}`` of every ``protocol.json`` under ``root``."""
    groups: dict[tuple[str, str], dict[int, dict]] = {}
    for path in sorted(root.rglob("protocol.json")):
        run = json.loads(path.read_text(encoding="utf-8"))
        group = re.sub(r"(__(opd|osd|off))?_s\d+$", "", path.parent.name)
        for method, res in run["methods"].items():
            groups.setdefault((group, method), {})[int(run.get("seed", 0))] = res | {"dataset": run.get("dataset")}
    return groups


def fmt(s: dict | None, digits: int = 3) -> str:
    if s is None:
        return "-"
    if s["n"] == 1:
        return f"{s['mean']:.{digits}f}"
    return f"{s['mean']:.{digits}f} ± {s['sd']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


def summarise(groups) -> tuple[list[dict], str]:
    rows, lines = [], ["| run | source | method | seeds | held-out tau after update 0, 1, ... | last / start | lowest / start | swapped in "
                       "| identical |", "|---|---|---|---|---|---|---|---|---|"]
    for (group, method), seeds in sorted(groups.items()):
        curves = [r["curve"] for r in seeds.values()]
        last = max(len(c) for c in curves)
        taus = [spread([c[u]["tau"] for c in curves if u < len(c)]) for u in range(last)]
        rel_last = spread([c[-1]["tau"] / c[0]["tau"] for c in curves if len(c) == last])
        rel_low = spread([min(x["tau"] for x in c[1:]) / c[0]["tau"] for c in curves if len(c) > 1])
        identical = all(x["identical"] for c in curves for x in c)
        swapped = [f"{sum(x.get('outcome', 'swapped') == 'swapped' for x in c[1:])}/{len(c) - 1}" for c in curves]
        row = {"run": group, "source": next(iter(seeds.values()))["dataset"], "method": method, "seeds": sorted(seeds),
               "tau": taus, "last_over_start": rel_last, "lowest_over_start": rel_low, "swapped": swapped,
               "identical": identical,
               "acceptance_before": _mean_lists([c[0]["acceptance_by_position"] for c in curves]),
               "acceptance_after": _mean_lists([c[-1]["acceptance_by_position"] for c in curves if len(c) == last])}
        rows.append(row)
        lines.append(f"| {group} | {row['source']} | {method} | {','.join(map(str, sorted(seeds)))} | "
                     + "<br>".join(f"{u}: {fmt(t)}" for u, t in enumerate(taus))
                     + f" | {fmt(rel_last)} | {fmt(rel_low)} | {', '.join(swapped) if method != 'off' else '-'} "
                     + f"| {'yes' if identical else '**no**'} |")
    lines += ["", "Acceptance per draft position (positions 1-8), before -> after the last update (mean over seeds):", "",
              "| run | method | before | after |", "|---|---|---|---|"]
    for r in rows:
        show = lambda xs: " ".join("-" if x is None else f"{x:.2f}" for x in (xs or [])[:8])  # noqa: E731
        lines.append(f"| {r['run']} | {r['method']} | {show(r['acceptance_before'])} | {show(r['acceptance_after'])} |")
    lines += ["", "OPD minus OSD, held-out tau per update, paired by seed:", "", "| run | seeds | difference after update u |",
              "|---|---|---|"]
    for (group, method), seeds in sorted(groups.items()):
        other = groups.get((group, "osd"))
        if method != "opd" or other is None:
            continue
        paired = [(seeds[s]["curve"], other[s]["curve"]) for s in sorted(set(seeds) & set(other))]
        last = min(min(len(a), len(b)) for a, b in paired)
        diffs = [spread([a[u]["tau"] - b[u]["tau"] for a, b in paired]) for u in range(last)]
        lines.append(f"| {group} | {len(paired)} | " + "<br>".join(f"{u}: {fmt(d)}" for u, d in enumerate(diffs)) + " |")
    return rows, "\n".join(lines) + "\n"


def _mean_lists(lists: list[list]) -> list | None:
    lists = [x for x in lists if x]
    if not lists:
        return None
    return [None if any(x[j] is None for x in lists) else sum(x[j] for x in lists) / len(lists) for j in range(len(lists[0]))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", type=Path)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    rows, md = summarise(load(a.runs))
    out = a.out or a.runs
    out.mkdir(parents=True, exist_ok=True)
    (out / "protocol_summary.md").write_text(md, encoding="utf-8")
    (out / "protocol_summary.json").write_text(json.dumps(rows, indent=1), encoding="utf-8")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
