"""What one update buys on fresh requests of its source: for every candidate the guard judged (swapped in or
refused), its acceptance on the held-back requests over the serving weights' on the same requests, minus 1; per source
and method over seeds, for these runs and the four unseen sources of 2026-12-05 14:29Z.

    python docs/logs/online_item3_trained_h100_1205/guard_gains.py [RUNS_DIR ...]    # default: the two folders
"""

import collections
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOTS = [HERE, HERE.parent / "online_item3_h100_1205" / "per_update"]


def main() -> None:
    gains = collections.defaultdict(list)
    for root in [Path(p) for p in sys.argv[1:]] or ROOTS:
        for path in sorted(root.rglob("protocol.json")):
            source = path.parent.name.rsplit("__", 1)[0]
            for method, res in json.loads(path.read_text(encoding="utf-8"))["methods"].items():
                for u in res.get("updates", []):
                    if u.get("rollback_of") is None and u.get("guard_serving"):
                        gains[source, method].append(u["guard_candidate"] / u["guard_serving"] - 1)
    print("source | method | candidates | mean | median | min | max | raised acceptance")
    for (source, method), g in sorted(gains.items()):
        print(f"{source} | {method} | {len(g)} | {statistics.mean(g):+.3f} | {statistics.median(g):+.3f} | "
              f"{min(g):+.3f} | {max(g):+.3f} | {sum(x > 0 for x in g)}")


if __name__ == "__main__":
    main()
