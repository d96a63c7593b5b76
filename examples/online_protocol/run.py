"""Online learning on one family of prompts, through the product: `adaflash serve --online` serves the family's
training prompts, sent by the official `openai` client, and every version the server publishes is measured on the
family's held-out slice.

    python examples/online_protocol/run.py --family math --target T --drafter D --out runs/protocol/math-s1 --seed 1
    python examples/online_protocol/run.py --smoke        # the reference pair on the CPU, about a minute

Give it the drafter trained without the family (the start); the in-domain drafter and an offline fine-tune are runs of
the same script with their own --drafter and --method off (measured, never updated). Traffic: the family's "train"
split (`adaflash_hf.training.data.chat_samples`), in file order for seed 0, else a seeded permutation; held out: the
first --test prompts of its "eval" split. After the traffic the server is stopped and each version (v0: the start
drafter) is measured with greedy decoding through the engine: tau, acceptance per draft position, and whether every
output is plain greedy decoding's. Writes OUT/protocol.json, OUT/protocol.md (the table) and OUT/tau.png (held-out
tau against requests served), beside OUT/versions (the server's versions) and OUT/serve.log (its log lines).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from adaflash_hf.loading import load_models
from adaflash_hf.modeling import AdaFlashDrafter
from adaflash_hf.online import list_versions
from adaflash_hf.online.experiment import stream_order
from adaflash_hf.online.protocol import (ProtocolSettings, RoundRouter, eos_ids, measure_held_out, prompt_ids,
                                         serving_engine)
from adaflash_hf.online.versions import METADATA_FILE, write_text_atomic
from adaflash_hf.training.data import TRAIN_DOMAINS, chat_samples

SMOKE = ["--reference", "--family", "math", "--requests", "12", "--test", "3", "--samples-per-update", "4",
         "--concurrency", "4", "--max-new-tokens", "16", "--max-len", "256", "--epochs", "1", "--train-share", "1"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="the reference pair, 12 requests, 3 held out (CPU)")
    p.add_argument("--reference", action="store_true", help="the embedded reference pair")
    p.add_argument("--target", help="target model folder or Hub id")
    p.add_argument("--drafter", help="the start drafter (folder or Hub id)")
    p.add_argument("--family", choices=TRAIN_DOMAINS, default="math")
    p.add_argument("--method", choices=("opd", "osd", "off"), default="opd")
    p.add_argument("--requests", type=int, default=2000, help="requests served (at most the training split's size)")
    p.add_argument("--test", type=int, default=64, help="held-out prompts measured")
    p.add_argument("--seed", type=int, default=0, help="the traffic's order (0: file order)")
    p.add_argument("--samples-per-update", type=int, default=128)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--train-share", type=float, default=None, help="serve's --train-share (default: serve's)")
    p.add_argument("--wait", type=float, default=1800, help="seconds to wait after the traffic for its last update")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight (and the server's --max-slots)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--out", default=None, help="output folder (default: runs/online_protocol/FAMILY-METHOD-sSEED)")
    a = p.parse_args(argv)
    if a.smoke:
        a = p.parse_args([*SMOKE, *(argv if argv is not None else sys.argv[1:])])
    if a.reference == bool(a.target or a.drafter) or (a.target is None) != (a.drafter is None):
        p.error("pass --reference, or --target and --drafter")
    a.out = Path(a.out or f"runs/online_protocol/{a.family}-{a.method}-s{a.seed}")
    return a


def start_server(a) -> tuple[subprocess.Popen, str]:
    """`adaflash serve --online` on the start drafter, every version kept in OUT/versions; (process, base URL)."""
    models = ["--reference"] if a.reference else ["--target", a.target, "--drafter", a.drafter]
    cmd = [sys.executable, "-m", "adaflash_hf.cli", "serve", *models, "--port", "0", "--online", "--online-method",
           a.method, "--output-dir", str(a.out / "versions"), "--keep-versions", "1000000", "--samples-per-update",
           str(a.samples_per_update), "--max-slots", str(a.concurrency), "--max-len", str(a.max_len)]
    for flag, value in (("--epochs", a.epochs), ("--lr", a.lr), ("--train-share", a.train_share)):
        cmd += [flag, str(value)] if value is not None else []
    log = open(a.out / "serve.log", "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = proc.stdout.readline()  # printed once the server listens
    m = re.search(r"at (http://[\d.]+:\d+)/v1", line)
    if m is None:
        proc.kill()
        raise SystemExit(f"the server did not start ({line!r}); see {a.out / 'serve.log'}")
    return proc, m.group(1)


def serve_traffic(a, url: str, traffic: list[list[int]]) -> dict[int, int]:
    """Send ``traffic`` ``concurrency`` requests at a time; {version: requests answered when it was first seen}."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    model = client.models.list().data[0].id
    seen: dict[int, int] = {0: 0}

    def ask(ids: list[int]) -> None:
        client.completions.create(model=model, prompt=ids, max_tokens=a.max_new_tokens, temperature=0)

    with ThreadPoolExecutor(a.concurrency) as pool:
        for start in range(0, len(traffic), a.concurrency):
            list(pool.map(ask, traffic[start : start + a.concurrency]))
            answered = min(start + a.concurrency, len(traffic))
            for number, _ in list_versions(a.out / "versions"):
                seen.setdefault(number, answered)
            print(f"[protocol] {answered}/{len(traffic)} requests answered, versions {sorted(seen)}", flush=True)
    deadline, due = time.monotonic() + a.wait, len(traffic) // a.samples_per_update
    while _updates_tried(url) < due and time.monotonic() < deadline:  # the last full buffer's update
        time.sleep(1.0)
    for number, _ in list_versions(a.out / "versions"):
        seen.setdefault(number, len(traffic))
    return seen


def _updates_tried(url: str) -> float:
    """Updates the server has finished, whatever came of them (swapped in, refused by the guard, failed)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    names = ("adaflash_online_updates_total", "adaflash_online_swaps_refused_total",
             "adaflash_online_update_failures_total")
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in names)


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)  # an update in progress is abandoned; the versions on disk are whole
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()


def measure_versions(a, target, drafter, tok, held: list[list[int]], seen: dict[int, int]) -> list[dict]:
    """Each version's held-out measurement (v0: the start drafter), in version order."""
    settings = ProtocolSettings(concurrency=a.concurrency, max_new_tokens=a.max_new_tokens, max_len=a.max_len)
    eos = eos_ids(tok, target)
    refs = [o.token_ids for o in serving_engine(target, None, settings, None).generate(held, a.max_new_tokens, eos_token_id=eos)]
    device, dtype = next(drafter.parameters()).device, next(drafter.parameters()).dtype
    rows = []
    for number, path in [(0, None), *list_versions(a.out / "versions")]:
        d = drafter if path is None else AdaFlashDrafter.from_pretrained(path).to(device, dtype).eval().bind_target(target)
        router = RoundRouter()
        point = measure_held_out(serving_engine(target, d, settings, router), router, held, refs, settings, eos)
        meta = json.loads((path / METADATA_FILE).read_text()) if path is not None else {}
        rows.append({"version": number, "update": meta.get("update"), "served": seen.get(number), **point})
        print(f"[protocol] v{number}: held-out tau {point['tau']:.3f}, identical {point['identical']}", flush=True)
    return rows


def write_outputs(a, rows: list[dict], command: str, device: str) -> None:
    result = {"command": command, "family": a.family, "method": a.method, "seed": a.seed, "versions": rows,
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "device": device}
    write_text_atomic(a.out / "protocol.json", json.dumps(result, indent=2, default=str))
    start = rows[0]["tau"]
    lines = [f"`{command}`", "", "| version | update | requests served | held-out tau | vs start | acceptance pos 1 | "
             "acceptance last verified pos | identical |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = r["acceptance_by_position"]
        last = max((j for j, x in enumerate(acc) if x is not None), default=0)  # the deepest position ever verified
        lines.append(f"| v{r['version']} | {r['update'] if r['update'] is not None else '-'} | {r['served']} | "
                     f"{r['tau']:.3f} | {100 * (r['tau'] / start - 1):+.1f}% | {_pct(acc[0])} | "
                     f"{_pct(acc[last])} (pos {last + 1}) | {r['identical']} |")
    write_text_atomic(a.out / "protocol.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[protocol] no matplotlib: no plot (pip install 'adaflash-hf[plot]')")
        return
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([r["served"] for r in rows], [r["tau"] for r in rows], marker="o")
    ax.set(xlabel="requests served", ylabel="held-out tau", title=f"{a.family}, {a.method}, seed {a.seed}")
    fig.tight_layout()
    fig.savefig(a.out / "tau.png", dpi=120)
    plt.close(fig)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main(argv=None) -> int:
    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    target, drafter, tok, _ = load_models(a.target, a.drafter, reference=a.reference, need_drafter=True,
                                          dtype=torch.float32)
    limit = a.max_len - a.max_new_tokens
    traffic = stream_order(prompt_ids(tok, chat_samples(a.family, "train"), limit), a.seed)[: a.requests]
    held = prompt_ids(tok, chat_samples(a.family, "eval"), limit)[: a.test]
    if not traffic or not held:
        raise SystemExit(f"no {a.family} prompts of at most {limit} tokens to serve or to hold out")
    print(f"[protocol] {a.family}: {len(traffic)} requests served, {len(held)} held out, method {a.method}", flush=True)
    proc, url = start_server(a)
    try:
        seen = serve_traffic(a, url, traffic)
    finally:
        stop(proc)
    rows = measure_versions(a, target, drafter, tok, held, seen)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    write_outputs(a, rows, "python examples/online_protocol/run.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  device)
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
