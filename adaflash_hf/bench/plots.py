"""PNG plots of a run (matplotlib, ``pip install adaflash-hf[plot]``): tau per domain, acceptance by
draft position, tau over online updates."""

from __future__ import annotations

from pathlib import Path

from .results import BenchResult, online_records


def _save(fig, path: Path, files: list[str]) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    files.append(str(path))


def _tau_per_domain(result: BenchResult, out_dir: Path, files: list[str]) -> None:
    from matplotlib.figure import Figure

    with_tau = [c for c in result.cells if c.tau is not None]
    if not with_tau:
        return
    datasets = list(dict.fromkeys(c.dataset for c in result.cells))
    series = list(dict.fromkeys((c.method, c.concurrency) for c in with_tau))
    multi_c = len({s[1] for s in series}) > 1
    fig = Figure(figsize=(max(6, 1.2 * len(datasets) * max(1, len(series)) / 2), 4))
    ax = fig.add_subplot()
    width = 0.8 / len(series)
    for k, (m, conc) in enumerate(series):
        vals = []
        for d in datasets:
            hit = [c.tau for c in with_tau if (c.method, c.concurrency, c.dataset) == (m, conc, d)]
            vals.append(hit[0] if hit else float("nan"))
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(datasets))]
        ax.bar(xs, vals, width, label=f"{m} (c={conc})" if multi_c else m)
    ax.set_xticks(range(len(datasets)), datasets)
    ax.set_ylabel("mean tokens per round (tau)")
    ax.set_title("Acceptance length per domain")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    _save(fig, out_dir / "tau_per_domain.png", files)


def _acceptance_by_position(result: BenchResult, out_dir: Path, files: list[str]) -> None:
    from matplotlib.figure import Figure

    with_pos = [c for c in result.cells if c.position_acceptance]
    if not with_pos:
        return
    datasets = list(dict.fromkeys(c.dataset for c in with_pos))
    multi_c = len({c.concurrency for c in with_pos}) > 1
    fig = Figure(figsize=(5 * len(datasets), 4))
    for i, d in enumerate(datasets):
        ax = fig.add_subplot(1, len(datasets), i + 1)
        for c in (c for c in with_pos if c.dataset == d):
            ys = [float("nan") if v is None else v for v in c.position_acceptance]
            ax.plot(range(1, len(ys) + 1), ys, marker="o", label=f"{c.method} (c={c.concurrency})" if multi_c else c.method)
        ax.set_title(d)
        ax.set_xticks(range(1, max(len(c.position_acceptance) for c in with_pos) + 1))
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize="small")
    _save(fig, out_dir / "acceptance_by_position.png", files)


def _tau_online(result: BenchResult, out_dir: Path, files: list[str]) -> None:
    from matplotlib.figure import Figure

    records = [r for r in online_records(result.online) if r.get("tau") is not None]
    if not records:
        return
    series: dict[tuple, list] = {}
    for r in records:
        series.setdefault((r.get("method"), r.get("dataset"), r.get("concurrency")), []).append(r)
    multi_c = len({k[2] for k in series}) > 1
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    for (m, d, conc), rs in series.items():
        rs = sorted(rs, key=lambda r: r["update"])
        label = " / ".join(str(x) for x in (m, d) if x is not None) or "tau"
        label += f" (c={conc})" if multi_c and conc is not None else ""
        ax.plot([r["update"] for r in rs], [r["tau"] for r in rs], marker="o", label=label)
    ax.set_xlabel("online updates applied")
    ax.set_ylabel("tau since the previous update")
    ax.set_title("Acceptance length over online updates")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    _save(fig, out_dir / "tau_online.png", files)


def write_plots(result: BenchResult, out_dir) -> list[str]:
    """PNG plots: tau per domain, acceptance by position, tau over online updates (when present)."""
    from matplotlib.figure import Figure  # noqa: F401 - ImportError here when matplotlib is missing

    out_dir = Path(out_dir)
    files: list[str] = []
    for plot in (_tau_per_domain, _acceptance_by_position, _tau_online):
        plot(result, out_dir, files)
    return files
