"""Recovery of a left-out family through `adaflash serve --online`: for each family, `run.py` starts the server on the
drafter trained without it (`leave_out.py`'s no-FAMILY), serves the family's training prompts with OPD and with OSD,
one run per seed, and measures every version on the family's held-out slice; the in-domain twin is measured as it is
(`--method off`). Per family, method and seed:

    R = (tau_online - tau_start) / (tau_in_domain - tau_start)

tau_start: the start drafter's held-out tau (v0 of the run), tau_online: the newest version's (the weights serving
when the traffic ended), tau_in_domain: the twin's. Also per run: the lowest version against the start (no version
should fall below it by more than 1%); and the mean R of OPD beside OSD's per family. --skip N measures held-out
prompts N.. of the family's eval split instead of the first ones: a validation slice to choose settings on (--lr,
--epochs, --samples-per-update), the first --test prompts kept as the test slice.

    python examples/online_protocol/recovery.py --drafters runs/leave_out/drafters --out runs/recovery      # GPU
    python examples/online_protocol/recovery.py --smoke --drafters /tmp/leave_out/drafters --out /tmp/recovery

Runs go --parallel at a time (side by side on one GPU), seed by seed, so a budget cut leaves whole seeds. Each run gets
an equal slice of the budget as its whole wall clock (run.py --run-s): it measures the references and its start drafter
first, stops its traffic in time for the update it owes (--wait 30) and its newest version's measurement (the time its
own start measurement took says how long that is), and measures the other versions while they fit. A run still going
past its slice is stopped and keeps what it measured (run.py writes protocol.json after every measurement, the start's
before any traffic): its row has tau at the start, and R once its traffic ended and its newest version was measured
(R = 0 for a run that served requests and published nothing).

--offline-ft-minutes M adds the offline reference: the start drafter fine-tuned for M minutes (train_drafter
--init-from) on the target's answers to as many of the family's training prompts as the stream holds, measured as the
twin is. Writes OUT/recovery.json, OUT/recovery.md and OUT/recovery.png (held-out tau against requests served, one
panel per family), beside each run's folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from adaflash_hf.atomic_io import write_text_atomic

HERE = Path(__file__).resolve().parent
REFERENCE_TARGET = str(HERE.parents[1] / "adaflash_hf" / "reference" / "target")
SMOKE = ["--families", "math", "--seeds", "1", "--requests", "8", "--test", "2", "--samples-per-update", "4",
         "--concurrency", "4", "--max-new-tokens", "16", "--max-len", "256", "--epochs", "1", "--parallel", "2",
         "--budget-s", "400"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafters", required=True, help="leave_out.py's OUT/drafters (twin, no-math, ...)")
    p.add_argument("--out", required=True)
    p.add_argument("--target", default=REFERENCE_TARGET)
    p.add_argument("--families", default="math,code,chat", help="families left out (leave_out.py's --leave-out)")
    p.add_argument("--methods", default="opd,osd")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (0: the split's file order)")
    p.add_argument("--first-seed", type=int, default=0,
                   help="run seeds K..N-1 only: a later call adds seeds to the same --out, whose runs of seeds 0..K-1 "
                        "and measured twins it keeps (the table covers seeds 0..N-1)")
    p.add_argument("--requests", type=int, default=2000, help="requests per run (the stream)")
    p.add_argument("--test", type=int, default=64, help="held-out prompts")
    p.add_argument("--skip", type=int, default=0, help="held-out prompts start after this many (a validation slice)")
    p.add_argument("--samples-per-update", type=int, default=128)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--train-share", type=float, default=1.0, help="serve's --train-share (1: updates train flat out)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--parallel", type=int, default=9, help="runs side by side (each ~6 GB of GPU memory while it trains)")
    p.add_argument("--budget-s", type=float, default=420, help="the whole command's wall clock")
    p.add_argument("--offline-ft-minutes", type=float, default=0.0, help="the offline reference's training (0: none)")
    p.add_argument("--smoke", action="store_true", help="toy scale on the CPU")
    a = p.parse_args(argv)
    if a.smoke:
        a = p.parse_args([*SMOKE, *(argv if argv is not None else sys.argv[1:])])  # flags given override the smoke's
    a.families = [f for f in a.families.split(",") if f]
    a.methods = [m for m in a.methods.split(",") if m]
    missing = [str(Path(a.drafters) / n) for n in ["twin", *(f"no-{f}" for f in a.families)]
               if not (Path(a.drafters) / n / "config.json").is_file()]
    if missing:  # before any work: a fresh machine has not got the drafters of the call that trained them
        p.error(f"no drafter in {', '.join(missing)}: run leave_out.py first (on the same machine)")
    if set(a.methods) - {"opd", "osd"} or a.seeds < 1 or not 0 <= a.first_seed < a.seeds:
        p.error("--methods takes opd and osd; --seeds at least 1; --first-seed in 0..seeds-1")
    return a


def _run_args(a, family: str, method: str, seed: int, drafter: Path, out: Path) -> list[str]:
    args = ["--target", a.target, "--drafter", str(drafter), "--family", family, "--method", method, "--seed", str(seed),
            "--requests", str(a.requests), "--test", str(a.test), "--skip", str(a.skip),
            "--samples-per-update", str(a.samples_per_update),
            "--concurrency", str(a.concurrency), "--max-new-tokens", str(a.max_new_tokens), "--max-len", str(a.max_len),
            "--train-share", str(a.train_share), "--out", str(out)]
    for flag, value in (("--epochs", a.epochs), ("--lr", a.lr)):
        args += [flag, str(value)] if value is not None else []
    return args


def plan(a) -> list[list[tuple[str, list[str]]]]:
    """Waves of (run name, run.py arguments): the references first (no traffic: quick; with --first-seed, one an
    earlier call measured into --out is kept), then one wave per seed from --first-seed."""
    d, out = Path(a.drafters), Path(a.out)
    refs = [(f"{f}-twin", _run_args(a, f, "off", 0, d / "twin", out / f"{f}-twin")) for f in a.families]
    refs += [(f"{f}-offline", _run_args(a, f, "off", 0, out / "offline" / f, out / f"{f}-offline"))
             for f in a.families if a.offline_ft_minutes > 0]
    if a.first_seed > 0:  # adding seeds: the references measured by the call that ran seed 0 stand
        refs = [r for r in refs if _load(out, r[0]) is None]
    seeds = [[(f"{f}-{m}-s{s}", _run_args(a, f, m, s, d / f"no-{f}", out / f"{f}-{m}-s{s}"))
              for f in a.families for m in a.methods] for s in range(a.first_seed, a.seeds)]
    return [refs, *seeds]


def offline_finetunes(a, deadline: float) -> None:
    """The offline reference per family: the start drafter trained on the target's answers to the stream's prompts."""
    for f in a.families:
        left = deadline - time.monotonic()
        if left < a.offline_ft_minutes * 60 + 60:
            print(f"[recovery] offline fine-tune of no-{f} skipped: {left:.0f} s left", flush=True)
            continue
        start = Path(a.drafters) / f"no-{f}"
        cfg = json.loads((start / "config.json").read_text())
        cmd = [sys.executable, "-m", "adaflash_hf.training.train_drafter", "--target", a.target, "--out",
               str(Path(a.out) / "offline" / f), "--init-from", str(start), "--domains", f, "--num-prompts",
               str(a.requests), "--max-new-tokens", str(min(a.max_new_tokens, 160)), "--gen-batch-size", "4096",
               "--num-layers", str(cfg["num_hidden_layers"]), "--target-layer-ids",
               ",".join(map(str, cfg["target_layer_ids"])), "--batch-size", "16", "--lr", "1e-4",
               "--minutes", str(a.offline_ft_minutes), "--eval-per-domain", "0", "--no-progress"]
        log = Path(a.out) / "logs" / f"{f}-offline-train.log"
        with open(log, "w") as out:
            try:
                rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=left).returncode
            except subprocess.TimeoutExpired:
                rc = None
        print(f"[recovery] offline fine-tune of no-{f}: exit {rc}", flush=True)


def run_all(a, runs: list[tuple[str, list[str]]], deadline: float) -> dict[str, object]:
    """Every run: the references (no traffic) at once, the others --parallel at a time in the given order, each given an
    equal slice of the time left as its --run-s and stopped (its process group: run.py and its server) past it; {name:
    exit status}."""
    refs = [r for r in runs if "off" == r[1][r[1].index("--method") + 1]]
    queue = [r for r in runs if r not in refs]
    rounds = max(-(-len(queue) // a.parallel), 1)
    slice_s = (deadline - time.monotonic() - GRACE_S) / rounds
    print(f"[recovery] {len(queue)} runs, {rounds} rounds of {a.parallel}: {slice_s:.0f} s each, loading, measuring and "
          "the server's start included", flush=True)
    if slice_s < MIN_SLICE_S:
        print(f"[recovery] warning: a slice under {MIN_SLICE_S} s leaves little traffic: fewer seeds or a larger "
              "--budget-s would serve more", flush=True)
    status: dict[str, object] = {}
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    for name, args in refs:
        if (Path(args[args.index("--drafter") + 1]) / "config.json").is_file():
            running[name] = (_launch(a, name, args, deadline - GRACE_S - time.monotonic()), deadline - GRACE_S)
        else:  # an offline fine-tune that did not finish
            status[name] = "no drafter"
    while queue or running:
        while queue and len(running) - sum(n in dict(refs) for n in running) < a.parallel:
            name, args = queue.pop(0)
            stop_at = min(time.monotonic() + slice_s, deadline)
            if stop_at - time.monotonic() < MIN_RUN_S:
                status[name] = "not started: budget"
                continue
            shutil.rmtree(Path(a.out) / name, ignore_errors=True)  # nothing of an earlier run of this name is counted
            running[name] = (_launch(a, name, args, stop_at - time.monotonic()), stop_at)
        for name, (proc, stop_at) in list(running.items()):
            late = time.monotonic() > stop_at + GRACE_S
            if proc.poll() is None and not late:
                continue
            if proc.poll() is None:  # past its slice: it keeps what it measured
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            status[name] = proc.returncode if not late else f"stopped at its time limit ({proc.returncode})"
            del running[name]
            print(f"[recovery] {name}: exit {status[name]} at {time.monotonic() - STARTED:.0f} s", flush=True)
        time.sleep(1.0)
    return status


def _launch(a, name: str, args: list[str], slice_s: float) -> subprocess.Popen:
    """run.py in its own process group (stopping the group stops its server and trainer too), its --run-s the slice
    less the interpreter's start, which its clock does not see."""
    cmd = [sys.executable, str(HERE / "run.py"), *args, "--wait", "30", "--run-s", f"{max(slice_s - START_S, 1):.0f}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(Path(a.out) / "logs" / f"{name}.log", "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


# ------------------------------------------------------------------------------ the table


def _load(out: Path, name: str) -> dict | None:
    path = out / name / "protocol.json"
    return json.loads(path.read_text()) if path.is_file() else None


def summarise(a, status: dict) -> dict:
    """Per run: tau at the start, the newest version's, the lowest, R; per family and method: R's mean over seeds."""
    out, rows, groups = Path(a.out), [], {}
    for f in a.families:
        twin, offline = _load(out, f"{f}-twin"), _load(out, f"{f}-offline")
        tau_in = twin["versions"][0]["tau"] if twin else None
        for m in a.methods:
            for s in range(a.seeds):
                name = f"{f}-{m}-s{s}"
                run = _load(out, name)
                earlier = "an earlier call" if s < getattr(a, "first_seed", 0) else None
                row = {"run": name, "family": f, "method": m, "seed": s, "status": status.get(name, earlier),
                       "tau_in_domain": tau_in}
                if run:
                    row.update(_measured(run, tau_in))
                    if offline:
                        gap = None if tau_in is None else tau_in - row["tau_start"]
                        row["tau_offline"] = offline["versions"][0]["tau"]
                        row["R_offline"] = (row["tau_offline"] - row["tau_start"]) / gap if gap and gap > 0 else None
                rows.append(row)
                if row.get("R") is not None:
                    groups.setdefault((f, m), []).append(row["R"])
    means = {f"{f}/{m}": {"mean_R": statistics.fmean(r), "sd": statistics.stdev(r) if len(r) > 1 else None,
                          "seeds": len(r)} for (f, m), r in groups.items()}
    return {"runs": rows, "mean_R": means, "status": status}


def _measured(run: dict, tau_in: float | None) -> dict:
    """One run's columns from its protocol.json: the start's always; the newest version's, and R, once the traffic
    ended, some request was served and the version serving then (the newest; v0 if none was published) was measured."""
    v = run["versions"]
    start = v[0]["tau"]
    out = {"tau_start": start, "served": run.get("requests_served"), "versions": run.get("newest"),
           "lowest_vs_start": min(x["tau"] for x in v) / start - 1, "identical": all(x["identical"] for x in v),
           "acceptance_start": v[0]["acceptance_by_position"], "curve": [(x["served"], x["tau"]) for x in v]}
    newest = next((x for x in v if x["version"] == run.get("newest")), None)
    if newest is not None and run.get("requests_served"):
        gap = None if tau_in is None else tau_in - start
        out.update(tau_online=newest["tau"], acceptance_online=newest["acceptance_by_position"],
                   R=(newest["tau"] - start) / gap if gap and gap > 0 else None)
    return out


def markdown(a, result: dict) -> str:
    lines = [f"`{result['command']}`", "", f"{result['date']}, {result['device']}", "",
             "| family | method | seed | requests served | versions | tau start | tau newest | tau in-domain (twin) | R | "
             "R offline | lowest vs start | identical | status |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(f"| {r['family']} | {r['method']} | {r['seed']} | {_v(r.get('served'))} | {_v(r.get('versions'))} | "
                     f"{_f(r.get('tau_start'))} | {_f(r.get('tau_online'))} | {_f(r.get('tau_in_domain'))} | "
                     f"{_f(r.get('R'))} | {_f(r.get('R_offline'))} | {_pct(r.get('lowest_vs_start'))} | "
                     f"{r.get('identical', '-')} | {r['status']} |")
    lines += ["", "Mean R over seeds (the bar: R >= 0.5 with OPD on each family):", "",
              "| family | method | mean R | sd | seeds |", "|---|---|---|---|---|"]
    for key, g in result["mean_R"].items():
        f, m = key.split("/")
        lines.append(f"| {f} | {m} | {g['mean_R']:.3f} | {_f(g['sd'])} | {g['seeds']} |")
    first = next((r for r in result["runs"] if r["method"] == "opd" and r.get("acceptance_online")), None)
    if first is not None:
        lines += ["", f"Acceptance per draft position, {first['run']}: start -> newest version (first and last verified "
                  "positions are the paper's panel)", "", "| position | " + " | ".join(
                      str(j + 1) for j in range(len(first["acceptance_start"]))) + " |",
                  "|---|" + "---|" * len(first["acceptance_start"])]
        for label, key in (("start", "acceptance_start"), ("newest", "acceptance_online")):
            lines.append(f"| {label} | " + " | ".join(_f(x) for x in first[key]) + " |")
    return "\n".join(lines) + "\n"


def plot(a, result: dict) -> None:
    """OUT/recovery.png: held-out tau against requests served, a panel per family (twin: dashed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[recovery] no matplotlib: no plot (pip install 'adaflash-hf[plot]')")
        return
    fig, axes = plt.subplots(1, len(a.families), figsize=(4.5 * len(a.families), 3.4), squeeze=False)
    for ax, f in zip(axes[0], a.families):
        runs = [r for r in result["runs"] if r["family"] == f and r.get("curve")]
        for r in runs:
            xs, ys = zip(*[(x or 0, y) for x, y in r["curve"]])
            ax.plot(xs, ys, marker="o", ms=3, color="C0" if r["method"] == "opd" else "C1",
                    label=r["method"] if r["seed"] == 0 else None)
        tau_in = next((r["tau_in_domain"] for r in runs if r.get("tau_in_domain") is not None), None)
        tau_off = next((r["tau_offline"] for r in runs if r.get("tau_offline") is not None), None)
        for tau, style, label in ((tau_in, "--", "in-domain twin"), (tau_off, ":", "offline fine-tune")):
            if tau is not None:
                ax.axhline(tau, ls=style, color="k", lw=1, label=label)
        ax.set(title=f, xlabel="requests served", ylabel="held-out tau")
        if ax.get_legend_handles_labels()[0]:  # a family whose runs measured nothing has no line to name
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(Path(a.out) / "recovery.png", dpi=120)
    plt.close(fig)


def _f(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _v(x) -> str:
    return "-" if x is None else str(x)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def main(argv=None) -> int:
    a = parse_args(argv)
    deadline = STARTED + a.budget_s
    (Path(a.out) / "logs").mkdir(parents=True, exist_ok=True)
    if a.offline_ft_minutes > 0:
        offline_finetunes(a, deadline - a.budget_s / 2)  # at most half the budget
    status = run_all(a, [run for wave in plan(a) for run in wave], deadline)
    result = summarise(a, status)
    import torch

    result.update(command="python examples/online_protocol/recovery.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                  total_s=round(time.monotonic() - STARTED, 1))
    write_text_atomic(Path(a.out) / "recovery.json", json.dumps(result, indent=2, default=str))
    md = markdown(a, result)
    write_text_atomic(Path(a.out) / "recovery.md", md)
    print(md)
    plot(a, result)
    return 0 if result["runs"] and all(r.get("identical", False) for r in result["runs"]) else 1


GRACE_S = 15  # a run past its slice by this much is stopped
START_S = 10  # a run's interpreter start and imports, before its own clock (run.py's --run-s) starts
MIN_RUN_S = 60  # a run given less may not even measure its start
# a slice below this leaves little traffic after loading, the references, the start's measurement, the server's start
# (about 40 s on one H100 shared by eight runs) and what is kept for the newest version
MIN_SLICE_S = 240
STARTED = time.monotonic()

if __name__ == "__main__":
    raise SystemExit(main())
