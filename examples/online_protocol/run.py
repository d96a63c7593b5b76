"""Online learning on one family of prompts, through the product: `adaflash serve --online` serves the family's
training prompts (their first user turns, sent as OpenAI completion requests), and every version the server publishes
is measured on the family's held-out slice.

    python examples/online_protocol/run.py --family math --target T --drafter D --out runs/protocol/math-s1 --seed 1
    python examples/online_protocol/run.py --smoke        # the reference pair on the CPU, about a minute

Give it the drafter trained without the family (the start); the in-domain drafter and an offline fine-tune are runs of
the same script with their own --drafter and --method off (measured as they are: no server, no traffic). Traffic: the
first user turn of each sample of the family's "train" split (`adaflash_hf.training.data.chat_samples`), in file
order for seed 0, else a seeded permutation; held out: the first --test prompts of its "eval" split after the first
--skip (0; a validation slice: --skip 64). The server verifies with --length-policy (default fixed: every round
drafts, so OPD learns from served rounds whatever the drafter's tau). After the traffic (cut once the run is --serve-s
seconds old, if given) the server finishes the update the traffic owes (at most --wait seconds) and is stopped; then
each version (v0: the start drafter) is measured with greedy decoding through the engine: tau, acceptance per draft
position, and whether every output is plain greedy decoding's; v0 and the newest version first, so a run stopped
early keeps both ends. Writes OUT/protocol.json and OUT/protocol.md (the table) after every measurement and
OUT/tau.png (held-out tau against requests served) at the end, beside OUT/versions (the server's versions) and
OUT/serve.log (its log lines).
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
from adaflash_hf.online.versions import METADATA_FILE, write_text_atomic
from adaflash_hf.training.data import PROSE_PROMPT_CHARS, TRAIN_DOMAINS, chat_samples

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "research"))  # the engine protocol's measurement
from online_experiment import stream_order  # noqa: E402
from online_protocol import ProtocolSettings, RoundRouter, eos_ids, measure_held_out, prompt_ids, serving_engine  # noqa: E402

STARTED = time.monotonic()
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
    p.add_argument("--skip", type=int, default=0,
                   help="held-out prompts start after this many of the eval split (a validation slice: --skip 64)")
    p.add_argument("--seed", type=int, default=0, help="the traffic's order (0: file order)")
    p.add_argument("--samples-per-update", type=int, default=128)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--train-share", type=float, default=None, help="serve's --train-share (default: serve's)")
    p.add_argument("--wait", type=float, default=600, help="seconds to wait after the traffic for its last update")
    p.add_argument("--serve-s", type=float, default=None,
                   help="stop sending traffic once the run is this many seconds old (loading and the server's start count)")
    p.add_argument("--length-policy", default="fixed", help="serve's --length-policy")
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
           str(a.samples_per_update), "--max-slots", str(a.concurrency), "--max-len", str(a.max_len), "--length-policy",
           a.length_policy]
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


def serve_traffic(a, url: str, traffic: list[list[int]]) -> tuple[dict[int, int], int, int]:
    """Send ``traffic`` ``concurrency`` requests at a time (until ``--serve-s``), then wait for the update the served
    requests owe; ({version: requests answered when it was first seen}, requests sent, requests that failed)."""
    import httpx

    client = httpx.Client(base_url=url + "/v1", timeout=3600)
    model = client.get("/models").raise_for_status().json()["data"][0]["id"]
    seen: dict[int, int] = {0: 0}
    cut = None if a.serve_s is None else STARTED + a.serve_s
    answered, failed = 0, []

    def ask(ids: list[int]) -> None:  # a failed request is counted, not fatal: the versions so far still get measured
        body = {"model": model, "prompt": ids, "max_tokens": a.max_new_tokens, "temperature": 0}
        try:
            client.post("/completions", json=body).raise_for_status()
        except httpx.HTTPError as e:
            failed.append(f"{type(e).__name__}: {e}")

    with ThreadPoolExecutor(a.concurrency) as pool:
        for start in range(0, len(traffic), a.concurrency):
            if cut is not None and time.monotonic() > cut:
                print(f"[protocol] --serve-s {a.serve_s:g} reached: traffic stops at {answered} requests", flush=True)
                break
            list(pool.map(ask, traffic[start : start + a.concurrency]))
            answered = min(start + a.concurrency, len(traffic))
            for number, _ in list_versions(a.out / "versions"):
                seen.setdefault(number, answered)
            print(f"[protocol] {answered}/{len(traffic)} requests answered ({len(failed)} failed), versions {sorted(seen)}",
                  flush=True)
            if failed and len(failed) == answered:
                print(f"[protocol] every request failed ({failed[-1]}): traffic stops", flush=True)
                break
    deadline, settled = time.monotonic() + a.wait, 0
    while settled < 2 and time.monotonic() < deadline:  # idle at two polls in a row: no sample arrives late
        settled = settled + 1 if _idle(url, a.samples_per_update) else 0
        time.sleep(1.0)
    for number, _ in list_versions(a.out / "versions"):
        seen.setdefault(number, answered)
    return seen, answered, len(failed)


def _idle(url: str, samples_per_update: int) -> bool:
    """Whether the server owes no update: fewer than a full update's samples buffered, and every update that took its
    samples finished (swapped in, refused or failed). An update takes ``samples_per_update`` samples from the buffer;
    the rest leave it as drops (full buffer, or superseded by a swap), so the samples taken are those seen less
    those dropped and still buffered."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(url + "/metrics", timeout=30).raise_for_status().text
    except httpx.HTTPError:
        return True  # the server is gone: nothing more will come
    v = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    finished = sum(v.get(f"adaflash_online_{n}_total", 0.0) for n in ("updates", "swaps_refused", "update_failures"))
    buffered = v.get("adaflash_online_samples_buffered", 0.0)
    taken = v.get("adaflash_online_samples_seen_total", 0.0) - v.get("adaflash_online_samples_dropped_total", 0.0) - buffered
    return buffered < samples_per_update and finished * samples_per_update >= taken


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)  # an update in progress is abandoned; the versions on disk are whole
    try:
        proc.wait(30)  # nothing is in flight: a server that takes longer is stuck, and the measurements wait
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def measure_versions(a, target, drafter, tok, held: list[list[int]], seen: dict[int, int], served: int,
                     record) -> list[dict]:
    """Each version's held-out measurement (v0: the start drafter), v0 and the newest first, then the others;
    ``record(rows)`` after each (rows in version order)."""
    settings = ProtocolSettings(concurrency=a.concurrency, max_new_tokens=a.max_new_tokens, max_len=a.max_len)
    eos = eos_ids(tok, target)
    refs = [o.token_ids for o in serving_engine(target, None, settings, None).generate(held, a.max_new_tokens, eos_token_id=eos)]
    device, dtype = next(drafter.parameters()).device, next(drafter.parameters()).dtype
    versions = [(0, None), *list_versions(a.out / "versions")] if a.method != "off" else [(0, None)]
    rows = []
    for number, path in versions[:1] + versions[:0:-1][:1] + versions[1:-1]:
        d = drafter if path is None else AdaFlashDrafter.from_pretrained(path).to(device, dtype).eval().bind_target(target)
        router = RoundRouter()
        point = measure_held_out(serving_engine(target, d, settings, router), router, held, refs, settings, eos)
        meta = json.loads((path / METADATA_FILE).read_text()) if path is not None else {}
        rows.append({"version": number, "update": meta.get("update"), "served": seen.get(number), **point})
        rows.sort(key=lambda r: r["version"])
        print(f"[protocol] v{number}: held-out tau {point['tau']:.3f}, identical {point['identical']}", flush=True)
        record(rows, served)
    return rows


def write_outputs(a, rows: list[dict], served: int, failed: int, command: str, device: str) -> None:
    """OUT/protocol.json and OUT/protocol.md (the table) from ``rows`` (version order, v0 first)."""
    result = {"command": command, "family": a.family, "method": a.method, "seed": a.seed, "drafter": a.drafter,
              "requests_served": served, "requests_failed": failed, "versions": rows,
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


def plot(a, rows: list[dict]) -> None:
    """OUT/tau.png: held-out tau against requests served."""
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


def traffic_and_held_out(a, tok) -> tuple[list[list[int]], list[list[int]]]:
    """The family's train-split prompts in the seed's order (the first --requests that fit), and its held-out ones."""
    limit = a.max_len - a.max_new_tokens
    traffic = [] if a.method == "off" else _first(tok, stream_order(chat_samples(a.family, "train"), a.seed), limit,
                                                   a.requests)
    held = _first(tok, chat_samples(a.family, "eval")[a.skip :], limit, a.test)
    if (a.method != "off" and not traffic) or not held:
        raise SystemExit(f"no {a.family} prompts of at most {limit} tokens to serve or to hold out")
    return traffic, held


def _first(tok, records: list[dict], limit: int, n: int) -> list[list[int]]:
    """The first ``n`` prompts of ``records`` of at most ``limit`` tokens (tokenising no more records than it needs)."""
    out: list[list[int]] = []
    for start in range(0, len(records), max(n, 1)):
        if len(out) >= n:
            break
        out += prompt_ids(tok, [_prompt(r) for r in records[start : start + n]], limit)
    return out[:n]


def _prompt(record: dict) -> dict:
    """What a client sends for a training sample: its first user turn (the answers in the sample are the data's,
    not the target's), or a prose chunk's opening."""
    if "messages" in record:
        first = next(j for j, m in enumerate(record["messages"]) if m["role"] == "user")
        return {"messages": record["messages"][: first + 1]}
    return {"text": record["text"][:PROSE_PROMPT_CHARS]}


def main(argv=None) -> int:
    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    command = "python examples/online_protocol/run.py " + " ".join(sys.argv[1:] if argv is None else argv)
    target, drafter, tok, _ = load_models(a.target, a.drafter, reference=a.reference, need_drafter=True,
                                          dtype=torch.float32)
    traffic, held = traffic_and_held_out(a, tok)
    print(f"[protocol] {a.family}: {len(traffic)} requests to serve, {len(held)} held out, method {a.method}", flush=True)
    seen, served, failed = {0: 0}, 0, 0
    if a.method != "off":  # off: the drafter is measured as it is, nothing to serve
        proc, url = start_server(a)
        try:
            seen, served, failed = serve_traffic(a, url, traffic)
        finally:
            stop(proc)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    rows = measure_versions(a, target, drafter, tok, held, seen, served,
                            lambda rows, served: write_outputs(a, rows, served, failed, command, device))
    print((a.out / "protocol.md").read_text())
    plot(a, rows)
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
