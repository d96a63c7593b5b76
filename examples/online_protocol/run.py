"""Online learning on one family of prompts, through the product: `adaflash serve --online` serves the family's
training prompts (their first user turns, sent as OpenAI completion requests), and every version the server publishes
is measured on the family's held-out slice.

    python examples/online_protocol/run.py --family math --target T --drafter D --out runs/protocol/math-s1 --seed 1
    python examples/online_protocol/run.py --smoke        # the reference pair on the CPU, about 20 s

Give it the drafter trained without the family (the start); the in-domain drafter and an offline fine-tune are runs of
the same script with their own --drafter and --method off (measured as they are: no server, no traffic). Traffic: the
first user turn of each sample of the family's "train" split (`adaflash_hf.training.data.chat_samples`), in file
order for seed 0, else a seeded permutation; held out: the first --test prompts of its "eval" split after the first
--skip (0; a validation slice: --skip 64). The server verifies with --length-policy (default fixed: every round
drafts, so OPD learns from served rounds whatever the drafter's tau).

A measurement is greedy decoding of every held-out prompt at once through the engine: tau, acceptance per draft
position, the length head's error, and whether every output is plain greedy decoding's. Plain greedy decoding's
outputs are computed once and their engine freed; the start drafter (v0) and every version are measured through one
speculative engine (a version's weights are copied into the drafter in place), freed while the traffic runs (runs side
by side fill the GPU) and built again after it. Order: before the traffic (while the
server starts), the references and v0, and OUT/protocol.json is written at once (a run stopped later still reports tau
at the start); after the traffic, the newest version, then the others. OUT/protocol.json and OUT/protocol.md (the
table) are rewritten after every measurement, OUT/tau.png (held-out tau against requests served) at the end, beside
OUT/versions (the server's versions) and OUT/serve.log (its log lines).

--run-s bounds the whole run (from its start, loading included): the traffic stops early enough that the update it
owes (at most --wait), the server's exit and the newest version's measurement end by then. That measurement decodes
the same prompts through the same engine as v0's, so v0's measured time, with the engine's build, says what it takes
(`Reserve`); the intermediate versions are measured while the same estimate fits, and those left are listed as
unmeasured. In
protocol.json, "newest" is the newest version when the traffic ended (null while it runs: a run stopped during its
traffic has v0 alone), and "timings" what each phase took.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from adaflash_hf.loading import load_models, resolve_device_dtype
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


@dataclass(frozen=True)
class Reserve:
    """What a run bounded by --run-s keeps after its traffic, from its own v0 measurement: the update the traffic owes
    (``wait_s``), the server's exit (``stop_s``) and the newest version's measurement. That one decodes the same prompts
    through the same engine as v0's (fewer rounds if the version drafts better), so it takes about v0's time; ``margin``
    covers a GPU that other runs load differently by then, ``fixed_s`` loading the version and writing the outputs.

    Example:
        >>> Reserve().measurement(20.0)
        40.0
        >>> Reserve().after_traffic(20.0, wait_s=30.0)
        80.0
    """

    margin: float = 1.5
    fixed_s: float = 10.0
    stop_s: float = 10.0

    def measurement(self, measured_s: float) -> float:
        """Seconds kept for one more measurement, given one that took ``measured_s``."""
        return self.margin * measured_s + self.fixed_s

    def after_traffic(self, measured_s: float, wait_s: float) -> float:
        """Seconds kept after the traffic's last request: the owed update, the server's exit, the newest version."""
        return wait_s + self.stop_s + self.measurement(measured_s)


RESERVE = Reserve()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="the reference pair, 12 requests, 3 held out (CPU)")
    p.add_argument("--reference", action="store_true", help="the embedded reference pair")
    p.add_argument("--target", help="target model folder or Hub id")
    p.add_argument("--drafter", help="the start drafter (folder or Hub id)")
    p.add_argument("--family", choices=TRAIN_DOMAINS, default="math")
    p.add_argument("--method", choices=("opd", "osd", "off"), default="opd")
    p.add_argument("--requests", type=int, default=2000, help="requests served (at most the training split's size)")
    p.add_argument("--test", type=int, default=64, help="held-out prompts measured (all at once: one engine slot each)")
    p.add_argument("--skip", type=int, default=0,
                   help="held-out prompts start after this many of the eval split (a validation slice: --skip 64)")
    p.add_argument("--seed", type=int, default=0, help="the traffic's order (0: file order)")
    p.add_argument("--samples-per-update", type=int, default=128)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--train-share", type=float, default=None, help="serve's --train-share (default: serve's)")
    p.add_argument("--wait", type=float, default=600, help="seconds to wait after the traffic for its last update")
    p.add_argument("--run-s", type=float, default=None,
                   help="the whole run's wall clock, loading included: the traffic stops in time for the newest "
                        "version's measurement (default: no bound)")
    p.add_argument("--length-policy", default="fixed", help="serve's --length-policy")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight (and the server's --max-slots)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--device", default="auto", help="where the held-out measurements run (auto: CUDA when available)")
    p.add_argument("--out", default=None, help="output folder (default: runs/online_protocol/FAMILY-METHOD-sSEED)")
    a = p.parse_args(argv)
    if a.smoke:
        a = p.parse_args([*SMOKE, *(argv if argv is not None else sys.argv[1:])])
    if a.reference == bool(a.target or a.drafter) or (a.target is None) != (a.drafter is None):
        p.error("pass --reference, or --target and --drafter")
    if a.test < 1 or (a.run_s is not None and a.run_s <= 0):
        p.error("--test must be at least 1 and --run-s positive")
    a.out = Path(a.out or f"runs/online_protocol/{a.family}-{a.method}-s{a.seed}")
    return a


class HeldOut:
    """The held-out slice's measurements: plain greedy decoding's outputs once (their engine freed after), then the
    drafter's, every prompt at once, through one speculative engine for every version (freed while the traffic runs:
    :meth:`release`)."""

    def __init__(self, a, target, drafter, tok, prompts: list[list[int]]):
        self.prompts, self.drafter = prompts, drafter
        self.settings = ProtocolSettings(concurrency=len(prompts), max_new_tokens=a.max_new_tokens, max_len=a.max_len)
        self.eos = eos_ids(tok, target)
        t = time.monotonic()
        plain = serving_engine(target, None, self.settings, None)
        self.references = [o.token_ids for o in plain.generate(prompts, a.max_new_tokens, eos_token_id=self.eos)]
        del plain
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.references_s = time.monotonic() - t
        self.target, self.engine = target, None
        self.engine_s = self._build()

    def _build(self) -> float:
        """The measuring engine (its build's seconds). The round sink (HeadError, for the length head's error) also
        keeps the prompt n-gram rule off: tau is the drafter's own."""
        t = time.monotonic()
        self.router = RoundRouter()
        self.engine = serving_engine(self.target, self.drafter, self.settings, self.router)
        return time.monotonic() - t

    def release(self) -> None:
        """Free the engine's device memory while the server's traffic runs (runs side by side fill a GPU); the next
        :meth:`measure` builds it again, in about ``engine_s``."""
        self.engine = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def measure(self, version: Path | None = None) -> tuple[dict, float]:
        """The held-out measurement of ``version`` (None: the drafter as it is now), and the seconds it took to
        decode. A version's weights are copied into the drafter in place: the engine's graphs and fused projections
        read them where they are."""
        if version is not None:
            loaded = AdaFlashDrafter.from_pretrained(str(version), dtype=next(self.drafter.parameters()).dtype)
            self.drafter.load_state_dict(loaded.state_dict())
        if self.engine is None:
            self._build()
        t = time.monotonic()
        point = measure_held_out(self.engine, self.router, self.prompts, self.references, self.settings, self.eos)
        return point, time.monotonic() - t


class Report:
    """What the run measured so far: OUT/protocol.json and OUT/protocol.md, rewritten by every :meth:`write`."""

    def __init__(self, a, command: str, device: str):
        self.a, self.command, self.device = a, command, device
        self.rows: list[dict] = []
        self.newest: int | None = None  # set when the traffic ended
        self.served, self.failed, self.traffic_end = None, 0, None
        self.unmeasured: list[int] = []
        self.timings: dict[str, float] = {}

    def add(self, version: int, update, served, point: dict, seconds: float) -> None:
        row = {"version": version, "update": update, "served": served, "measure_s": round(seconds, 1), **point}
        self.rows.append(row)
        self.rows.sort(key=lambda r: r["version"])
        print(f"[protocol] v{version}: held-out tau {point['tau']:.3f}, identical {point['identical']} "
              f"({seconds:.1f} s)", flush=True)
        self.write()

    def write(self) -> None:
        a = self.a
        self.timings["total_s"] = time.monotonic() - STARTED
        result = {"command": self.command, "family": a.family, "method": a.method, "seed": a.seed, "drafter": a.drafter,
                  "requests_served": self.served, "requests_failed": self.failed, "traffic_end": self.traffic_end,
                  "newest": self.newest, "unmeasured": self.unmeasured, "versions": self.rows,
                  "timings": {k: round(v, 1) for k, v in self.timings.items()}, "run_s": a.run_s,
                  "date": time.strftime("%Y-%m-%d", time.gmtime()), "device": self.device}
        write_text_atomic(a.out / "protocol.json", json.dumps(result, indent=2, default=str))
        write_text_atomic(a.out / "protocol.md", self.markdown())

    def markdown(self) -> str:
        start = self.rows[0]["tau"]
        lines = [f"`{self.command}`", "", "| version | update | requests served | held-out tau | vs start | acceptance pos 1 | "
                 "acceptance last verified pos | identical |", "|---|---|---|---|---|---|---|---|"]
        for r in self.rows:
            acc = r["acceptance_by_position"]
            last = max((j for j, x in enumerate(acc) if x is not None), default=0)  # the deepest position ever verified
            lines.append(f"| v{r['version']} | {r['update'] if r['update'] is not None else '-'} | {r['served']} | "
                         f"{r['tau']:.3f} | {100 * (r['tau'] / start - 1):+.1f}% | {_pct(acc[0])} | "
                         f"{_pct(acc[last])} (pos {last + 1}) | {r['identical']} |")
        if self.newest is None and self.a.method != "off":
            lines += ["", "Traffic not finished: the start alone is measured."]
        if self.traffic_end:
            lines += ["", f"Traffic: {self.served} requests served ({self.failed} failed), ended by "
                      f"{self.traffic_end}; newest version v{self.newest}."]
        if self.unmeasured:
            lines += ["", f"Not measured (no time left in --run-s): {', '.join(f'v{n}' for n in self.unmeasured)}."]
        return "\n".join(lines) + "\n"


def start_server(a) -> subprocess.Popen:
    """`adaflash serve --online` on the start drafter, every version kept in OUT/versions; it prints its URL once it
    listens (:func:`server_url`), meanwhile the run measures its start."""
    models = ["--reference"] if a.reference else ["--target", a.target, "--drafter", a.drafter]
    cmd = [sys.executable, "-m", "adaflash_hf.cli", "serve", *models, "--port", "0", "--online", "--online-method",
           a.method, "--output-dir", str(a.out / "versions"), "--keep-versions", "1000000", "--samples-per-update",
           str(a.samples_per_update), "--max-slots", str(a.concurrency), "--max-len", str(a.max_len), "--length-policy",
           a.length_policy]
    for flag, value in (("--epochs", a.epochs), ("--lr", a.lr), ("--train-share", a.train_share)):
        cmd += [flag, str(value)] if value is not None else []
    log = open(a.out / "serve.log", "w")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def server_url(a, proc: subprocess.Popen, by: float | None) -> str | None:
    """The server's base URL once it listens, or None when it does not by ``by`` (monotonic seconds; None: no limit)."""
    if by is not None and not select.select([proc.stdout], [], [], max(by - time.monotonic(), 0.0))[0]:
        return None
    line = proc.stdout.readline()  # printed once the server listens
    m = re.search(r"at (http://[\d.]+:\d+)/v1", line)
    if m is None:
        raise SystemExit(f"the server did not start ({line!r}); see {a.out / 'serve.log'}")
    return m.group(1)


def serve(a, proc: subprocess.Popen, traffic: list[list[int]], end: float | None,
          measured_s: float) -> tuple[dict[int, int], int, int, str]:
    """The started server's traffic (cut so that the newest version is measured by ``end``, from the start's
    measurement that took ``measured_s``), the update it owes, its stop; ({version: requests answered when first
    seen}, served, failed, why the traffic ended)."""
    cut = None if end is None else end - RESERVE.after_traffic(measured_s, a.wait)
    try:
        if cut is not None and time.monotonic() >= cut:
            return {0: 0}, 0, 0, "no time left for traffic in --run-s"
        url = server_url(a, proc, cut)
        if url is None:
            return {0: 0}, 0, 0, "the server was not listening by the traffic's cut"
        idle_by = None if end is None else end - RESERVE.stop_s - RESERVE.measurement(measured_s)
        return serve_traffic(a, url, traffic, cut, idle_by)
    finally:
        stop(proc, 30.0 if end is None else RESERVE.stop_s)


def serve_traffic(a, url: str, traffic: list[list[int]], cut: float | None,
                  idle_by: float | None) -> tuple[dict[int, int], int, int, str]:
    """Send ``traffic`` ``concurrency`` requests at a time while the next batch, as long as the last one, ends by
    ``cut``; then wait (at most --wait, and not past ``idle_by``) for the update the served requests owe. ({version:
    requests answered when it was first seen}, requests answered, requests that failed, why the traffic ended)."""
    import httpx

    client = httpx.Client(base_url=url + "/v1", timeout=3600)
    model = client.get("/models").raise_for_status().json()["data"][0]["id"]
    seen: dict[int, int] = {0: 0}
    answered, failed, batch_s, why = 0, [], 0.0, "the stream's end"

    def ask(ids: list[int]) -> None:  # a failed request is counted, not fatal: the versions so far still get measured
        body = {"model": model, "prompt": ids, "max_tokens": a.max_new_tokens, "temperature": 0}
        try:
            client.post("/completions", json=body).raise_for_status()
        except httpx.HTTPError as e:
            failed.append(f"{type(e).__name__}: {e}")

    with ThreadPoolExecutor(a.concurrency) as pool:
        for start in range(0, len(traffic), a.concurrency):
            if cut is not None and time.monotonic() + batch_s > cut:
                why = "--run-s (the newest version's measurement kept)"
                print(f"[protocol] traffic stops at {answered} requests: the rest of --run-s {a.run_s:g} is kept for "
                      "the owed update and the newest version's measurement", flush=True)
                break
            t = time.monotonic()
            list(pool.map(ask, traffic[start : start + a.concurrency]))
            batch_s = time.monotonic() - t
            answered = min(start + a.concurrency, len(traffic))
            for number, _ in list_versions(a.out / "versions"):
                seen.setdefault(number, answered)
            print(f"[protocol] {answered}/{len(traffic)} requests answered ({len(failed)} failed), versions {sorted(seen)}",
                  flush=True)
            if failed and len(failed) == answered:
                why = f"every request failed ({failed[-1]})"
                print(f"[protocol] {why}: traffic stops", flush=True)
                break
    deadline, settled = time.monotonic() + a.wait, 0
    deadline = deadline if idle_by is None else min(deadline, idle_by)
    while settled < 2 and time.monotonic() < deadline:  # idle at two polls in a row: no sample arrives late
        settled = settled + 1 if _idle(url, a.samples_per_update) else 0
        time.sleep(1.0)
    for number, _ in list_versions(a.out / "versions"):
        seen.setdefault(number, answered)
    return seen, answered, len(failed), why


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


def stop(proc: subprocess.Popen, timeout: float) -> None:
    proc.send_signal(signal.SIGTERM)  # an update in progress is abandoned; the versions on disk are whole
    try:
        proc.wait(timeout)  # nothing is in flight: a server that takes longer is stuck, and the measurements wait
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def measure_versions(a, held: HeldOut, report: Report, seen: dict[int, int], end: float | None) -> None:
    """After the traffic: the newest version, then the others oldest first, each while one more measurement (as long
    as the last) fits before ``end``; those left are the report's unmeasured ones."""
    versions = list_versions(a.out / "versions")
    report.newest = versions[-1][0] if versions else 0
    report.write()
    last_s = report.rows[0]["measure_s"]
    order = versions[::-1][:1] + versions[:-1]
    for i, (number, path) in enumerate(order):
        if i > 0 and end is not None and time.monotonic() + RESERVE.measurement(last_s) > end:
            report.unmeasured = [n for n, _ in order[i:]]
            report.write()
            print(f"[protocol] no time left in --run-s for {len(report.unmeasured)} versions: not measured", flush=True)
            return
        point, last_s = held.measure(path)
        meta = json.loads((path / METADATA_FILE).read_text())
        report.add(number, meta.get("update"), seen.get(number), point, last_s)


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
    end = None if a.run_s is None else STARTED + a.run_s
    device, _ = resolve_device_dtype(a.device, "fp32")  # not the loader's default, the CPU
    target, drafter, tok, _ = load_models(a.target, a.drafter, reference=a.reference, need_drafter=True, device=device,
                                          dtype=torch.float32)
    traffic, held_prompts = traffic_and_held_out(a, tok)
    print(f"[protocol] {a.family}: {len(traffic)} requests to serve, {len(held_prompts)} held out, method {a.method}",
          flush=True)
    report = Report(a, command, torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    report.timings["load_s"] = time.monotonic() - STARTED
    proc = start_server(a) if a.method != "off" else None  # it starts while the start is measured
    try:
        held = HeldOut(a, target, drafter, tok, held_prompts)
        report.timings.update(references_s=held.references_s, engine_s=held.engine_s)
        point, v0_s = held.measure()
        report.add(0, None, 0, point, v0_s)  # written before any traffic: a run stopped later still has its start
        if proc is None:  # --method off: the drafter is measured as it is, nothing to serve
            report.served, report.newest = 0, 0
        else:
            t = time.monotonic()
            held.release()  # rebuilt for the newest version: its reserve counts the build
            seen, report.served, report.failed, report.traffic_end = serve(a, proc, traffic, end, v0_s + held.engine_s)
            report.timings["traffic_s"] = time.monotonic() - t
            measure_versions(a, held, report, seen, end)
    finally:
        if proc is not None and proc.poll() is None:  # the measurement failed: the server goes too
            stop(proc, RESERVE.stop_s)
    report.write()
    print((a.out / "protocol.md").read_text())
    plot(a, report.rows)
    return 0 if all(r["identical"] for r in report.rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
