"""Item 6: the default guard (`guard_confidence=0`) against one that asks a candidate's paired gain to clear one
standard error (`=1`), on the four unseen sources, over the first 4 updates of each run (3 seeds, OPD and OSD).

    python docs/logs/online_item3_final_h100_1205/guard_confidence.py

Guard 0: docs/logs/online_item3_h100_1205/per_update/SOURCE__METHOD_sN (8-update runs, one point per training,
cut at update 4).
Guard 1: raw_*/z1_SOURCE__METHOD_sN here.
"""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
GUARD0 = HERE.parent / "online_item3_h100_1205" / "per_update"
UPDATES = 4


def run_path(root: Path, name: str):
    found = sorted(root.glob(f"{name}/protocol.json")) + sorted(root.glob(f"raw_*/{name}/protocol.json"))
    return found[0] if found else None


def summary(path: Path, method: str):
    curve = json.loads(path.read_text(encoding="utf-8"))["methods"][method]["curve"][: UPDATES + 1]
    start = curve[0]["tau"]
    swaps = sum(p.get("outcome") == "swapped" for p in curve[1:])
    return len(curve) - 1, min(p["tau"] for p in curve) / start, curve[-1]["tau"] / start, swaps


def main() -> None:
    rows = {0: [], 1: []}
    print("source | method | seed | guard 0: updates, lowest / start, last / start, swaps | guard 1: the same")
    for source in ("alpaca_eval", "summarization", "rag", "qa"):
        for method in ("opd", "osd"):
            for seed in range(3):
                name = f"{source}__{method}_s{seed}"
                cells = []
                for guard, root, run in ((0, GUARD0, name), (1, HERE, "z1_" + name)):
                    path = run_path(root, run)
                    if path is None:
                        cells.append("-")
                        continue
                    n, low, last, swaps = summary(path, method)
                    rows[guard].append((low, last, swaps, n))
                    cells.append(f"{n}, {low:.3f}, {last:.3f}, {swaps}")
                print(f"{source} | {method} | {seed} | {cells[0]} | {cells[1]}")
    for guard, r in rows.items():
        below = sum(low < 1 for low, *_ in r)
        mean_last = sum(last for _, last, *_ in r) / len(r)
        print(f"\nguard {guard}: {len(r)} runs, {sum(n for *_, n in r)} updates, {sum(s for _, _, s, _ in r)} swaps; "
              f"{below} runs ever below start; mean last / start {mean_last:.4f}")


if __name__ == "__main__":
    main()
