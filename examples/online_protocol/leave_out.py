"""Leave-domain-out drafters for the online protocol: the target answers the four families' training prompts once, then
a drafter is trained from scratch without each family of --leave-out, and an in-domain twin with every family, all
with one recipe and one training budget.

    python examples/online_protocol/leave_out.py --out runs/leave_out           # one H100 or H200 (defaults below)
    python examples/online_protocol/leave_out.py --smoke --out /tmp/leave_out   # the CPU, toy scale: checks the plumbing

Each drafter is `python -m adaflash_hf.training.train_drafter` on the shared regeneration (`--regen-cache`), its
families picked by `--train-domains`: `twin` learns from every family, `no-math` from all but math, and so on; every
other setting (the other families' samples, architecture, learning rate, batch, --minutes of training wall clock) is
the same. They train one after another, each with the device to itself for its budget, or --parallel N at a time
(N side by side, each for its whole budget: their steps and peak memory are in the table). Every drafter also reports
the held-out acceptance proxy per family (`train_summary.json`): the gap a left-out family opens shows there first.

Writes OUT/drafters/NAME (bf16 weights; NAME: twin, no-math, ...), OUT/logs/NAME.log (and regen.log),
OUT/leave_out.json and OUT/leave_out.md (steps, training seconds and the acceptance proxy of each drafter). --budget-s
bounds the whole command: the regeneration gets at most --regen-limit seconds, and a drafter whose budget no longer
fits before the deadline is not started (reported as skipped), so the command never outlives its device call.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from adaflash_hf.atomic_io import write_text_atomic
from adaflash_hf.training.data import TRAIN_DOMAINS

REFERENCE_TARGET = str(Path(__file__).resolve().parents[2] / "adaflash_hf" / "reference" / "target")


@dataclass(frozen=True)
class Recipe:
    """One regeneration and one training recipe for every drafter (the flags of train_drafter they become)."""

    num_prompts: int = 12000  # split evenly over the four families
    prompts_per_sample: int = 16
    max_new_tokens: int = 160
    max_prompt_tokens: int = 384
    gen_batch_size: int = 4096
    # the 2-layer recipe (batch 32, lr 6e-4), not v9's 5 layers at batch 64-128: in a minute from scratch it takes
    # about ten times the optimizer steps and reaches a higher acceptance, so a left-out family opens a wider gap
    num_layers: int = 2
    target_layer_ids: str = "1,3"
    batch_size: int = 32
    lr: float = 6e-4
    max_length: int = 1024
    num_workers: int = 4
    # training wall clock per drafter. This recipe's training acceptance climbs from ~1.2 at 100 steps to ~2.2 at 1,000
    # (on an H100 it takes 4-6 steps/s); at 36 s (150-220 steps) a drafter drafts like an untrained one (held-out tau
    # 1.1-1.3) and no family opens a gap. Two minutes: the regeneration and four drafters take about 11 minutes
    minutes: float = 2.0
    eval_per_domain: int = 8
    seed: int = 0

    def regen_flags(self, target: str, cache: Path, device: str) -> list[str]:
        """The flags that decide the regeneration (train_drafter refuses a cache made with others)."""
        return ["--target", target, "--device", device, "--domains", ",".join(TRAIN_DOMAINS), "--seed", str(self.seed),
                "--num-prompts", str(self.num_prompts), "--prompts-per-sample", str(self.prompts_per_sample),
                "--max-new-tokens", str(self.max_new_tokens), "--max-prompt-tokens", str(self.max_prompt_tokens),
                "--gen-batch-size", str(self.gen_batch_size), "--regen-cache", str(cache), "--no-progress"]

    def train_flags(self) -> list[str]:
        return ["--num-layers", str(self.num_layers), "--target-layer-ids", self.target_layer_ids,
                "--batch-size", str(self.batch_size), "--lr", str(self.lr), "--max-length", str(self.max_length),
                "--num-workers", str(self.num_workers), "--minutes", str(self.minutes),
                "--eval-per-domain", str(self.eval_per_domain)]


# toy scale for the CPU: a few prompts, a 2-layer drafter, seconds of training
SMOKE = Recipe(num_prompts=16, prompts_per_sample=1, max_new_tokens=12, gen_batch_size=16, num_layers=2,
               target_layer_ids="1,4", batch_size=4, max_length=256, num_workers=0, minutes=0.1, eval_per_domain=1)
OVERHEAD_S = 40  # a drafter's start, held-out regeneration, evaluation and saving beside its --minutes (~25 s on a GPU)
GROUP_OVERHEAD_S = 10  # each drafter trained side by side adds to the others' start and evaluation


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--target", default=REFERENCE_TARGET, help="the target (default: the reference pair's)")
    p.add_argument("--leave-out", default="math,code,chat", help="families to leave out, one drafter each (each adds "
                   "--minutes and ~30 s: in one 600 s device call only two fit, --leave-out math,code --budget-s 550)")
    p.add_argument("--device", default="auto")
    p.add_argument("--minutes", type=float, default=None, help=f"training wall clock per drafter ({Recipe.minutes})")
    p.add_argument("--num-prompts", type=int, default=None, help=f"prompts regenerated ({Recipe.num_prompts})")
    p.add_argument("--batch-size", type=int, default=None, help=f"({Recipe.batch_size})")
    p.add_argument("--budget-s", type=float, default=900, help="the whole command's wall clock")
    p.add_argument("--parallel", type=int, default=1,
                   help="drafters trained side by side on the device, each for --minutes (same budget and contention for "
                        "each: the steps each took are in the table)")
    p.add_argument("--num-workers", type=int, default=None, help=f"data loader workers per drafter ({Recipe.num_workers})")
    p.add_argument("--regen-limit", type=float, default=120, help="seconds the regeneration may take")
    p.add_argument("--smoke", action="store_true", help="toy scale on the CPU (a 2-layer drafter, 16 prompts)")
    a = p.parse_args(argv)
    a.leave_out = [f.strip() for f in a.leave_out.split(",") if f.strip()]
    wrong = [f for f in a.leave_out if f not in TRAIN_DOMAINS]
    if a.parallel < 1:
        p.error(f"--parallel must be at least 1, got {a.parallel}")
    if wrong or not a.leave_out:
        p.error(f"--leave-out takes families of {', '.join(TRAIN_DOMAINS)}, got {','.join(wrong) or 'none'}")
    base = SMOKE if a.smoke else Recipe()
    given = {"minutes": a.minutes, "num_prompts": a.num_prompts, "batch_size": a.batch_size, "num_workers": a.num_workers}
    changes = {k: v for k, v in given.items() if v is not None}
    a.recipe = Recipe(**{**asdict(base), **changes})
    if a.smoke:
        a.device = "cpu"
    return a


def drafters(leave_out: list[str]) -> dict[str, list[str]]:
    """{name: the families it trains on}: the twin first (every R needs it), then one per family left out.

    Example:
        >>> drafters(["math"])
        {'twin': ['math', 'code', 'chat', 'prose'], 'no-math': ['code', 'chat', 'prose']}
    """
    return {"twin": list(TRAIN_DOMAINS), **{f"no-{f}": [d for d in TRAIN_DOMAINS if d != f] for f in leave_out}}


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)


def _wait(procs: dict[str, subprocess.Popen], deadline: float) -> dict[str, tuple[int | None, float]]:
    """Wait for every process, killing those still running at ``deadline``; {name: (exit status or None, seconds)}."""
    t, done = time.monotonic(), {}
    for name, proc in procs.items():
        try:
            rc = proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = None
        done[name] = (rc, round(time.monotonic() - t, 1))
    return done


def _run(cmd: list[str], log: Path, timeout: float) -> tuple[int | None, float]:
    """Run ``cmd`` with its output in ``log``, killed after ``timeout`` seconds; (exit status or None, seconds)."""
    return _wait({"": _start(cmd, log)}, time.monotonic() + max(timeout, 1.0))[""]


def _summary(folder: Path) -> dict:
    path = folder / "train_summary.json"
    if not path.is_file():
        return {}
    s = json.loads(path.read_text())
    return {"steps": s.get("steps"), "train_s": s.get("timings", {}).get("train_s"),
            "peak_memory_gb": s.get("timings", {}).get("peak_memory_gb"),
            "samples": s.get("regeneration", {}).get("per_domain"),
            "accept_proxy": {d: v["accept_len"] for d, v in (s.get("eval_accept_proxy") or {}).items()}}


def build(a) -> dict:
    """Regenerate once, then train every drafter that fits the budget; the record of what happened."""
    t0, r = time.monotonic(), a.recipe
    deadline = t0 + a.budget_s
    out = Path(a.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    cache = out / "regen.jsonl"
    td = [sys.executable, "-m", "adaflash_hf.training.train_drafter"]
    regen = r.regen_flags(a.target, cache, a.device)
    rc, secs = _run([*td, "--out", str(out / "regen"), *regen, "--regen-only"], out / "logs" / "regen.log",
                    min(a.regen_limit, deadline - time.monotonic()))
    record = {"recipe": asdict(r), "target": a.target, "budget_s": a.budget_s, "regeneration": {"rc": rc, "s": secs},
              "drafters": {}}
    print(f"[leave_out] regeneration: exit {rc} in {secs} s", flush=True)
    if rc != 0:
        return record
    names = list(drafters(a.leave_out).items())
    for group in (names[i : i + a.parallel] for i in range(0, len(names), a.parallel)):
        need = r.minutes * 60 + OVERHEAD_S + GROUP_OVERHEAD_S * (len(group) - 1)
        left = deadline - time.monotonic()
        if left < need:
            for name, families in group:
                record["drafters"][name] = {"families": families, "status": f"skipped: {left:.0f} s left, {need:.0f} needed"}
                print(f"[leave_out] {name}: skipped ({left:.0f} s left of the budget, {need:.0f} s needed)", flush=True)
            continue
        procs = {name: _start([*td, "--out", str(out / "drafters" / name), *regen, "--train-domains", ",".join(families),
                               *r.train_flags()], out / "logs" / f"{name}.log") for name, families in group}
        for name, (rc, secs) in _wait(procs, deadline).items():
            families = dict(group)[name]
            info = {"families": families, "status": "ok" if rc == 0 else f"exit {rc}", "s": secs,
                    "side_by_side": len(group), **_summary(out / "drafters" / name)}
            record["drafters"][name] = info
            print(f"[leave_out] {name} ({','.join(families)}): {info['status']} in {secs} s, {info.get('steps')} steps, "
                  f"acceptance proxy {info.get('accept_proxy')}", flush=True)
    record["total_s"] = round(time.monotonic() - t0, 1)
    return record


def table(record: dict) -> str:
    """The drafters' table: steps, training seconds, held-out acceptance proxy per family."""
    lines = ["| drafter | trained on | status | side by side | steps | train s | peak GB | "
             + " | ".join(f"proxy {d}" for d in TRAIN_DOMAINS) + " |", "|---|---|---|---|---|---|---|" + "---|" * len(TRAIN_DOMAINS)]
    for name, d in record["drafters"].items():
        proxy = d.get("accept_proxy") or {}
        lines.append(f"| {name} | {','.join(d['families'])} | {d['status']} | {d.get('side_by_side', '-')} | "
                     f"{d.get('steps', '-')} | {d.get('train_s', '-')} | {d.get('peak_memory_gb') or '-'} | " + " | ".join(f"{proxy[f]:.3f}" if f in proxy else "-"
                                                               for f in TRAIN_DOMAINS) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    record = build(a)
    record["command"] = "python examples/online_protocol/leave_out.py " + " ".join(sys.argv[1:] if argv is None else argv)
    out = Path(a.out)
    write_text_atomic(out / "leave_out.json", json.dumps(record, indent=2))
    md = f"`{record['command']}`\n\nrecipe: {json.dumps(record['recipe'])}\n\n{table(record)}"
    write_text_atomic(out / "leave_out.md", md)
    print(md)
    ok = record["regeneration"]["rc"] == 0 and all(d["status"] == "ok" for d in record["drafters"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
