"""One figure comparing online-adaptation runs: held-out tau per update, one panel per dataset.

    python examples/reference_pair/plot_online_methods.py OUT.png LABEL=RUN_DIR[:METHOD] ...

Each ``RUN_DIR`` holds the ``online.json`` of ``python examples/research/online_experiment.py``; ``METHOD``
picks one of its methods (default: every method in it, labelled ``LABEL method``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if len(argv) < 2:
        raise SystemExit(__doc__)
    out, specs = argv[0], argv[1:]
    curves: dict[str, list[tuple[str, list[int], list[float]]]] = {}
    for spec in specs:
        label, _, where = spec.partition("=")
        path, _, only = where.partition(":")
        result = json.loads((Path(path) / "online.json").read_text())
        for method, r in result["methods"].items():
            if only and method != only:
                continue
            name = label if only else f"{label} {method}"
            curves.setdefault(result["dataset"], []).append(
                (name, [c["update"] for c in r["curve"]], [c["tau"] for c in r["curve"]]))
    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 3.6), squeeze=False)
    for ax, (dataset, runs) in zip(axes[0], sorted(curves.items())):
        for name, x, y in runs:
            ax.plot(x, y, marker="o", label=name)
        ax.set_title(f"held-out {dataset}")
        ax.set_xlabel("online update")
        ax.set_ylabel("greedy tau")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
