"""`adaflash serve` under the faults a deployment meets, as real processes on the reference pair (CPU): a kill and a
restart, damaged versions on disk, a full disk, shutdown under load, bad keys and headers. Every greedy answer is
checked against plain greedy decoding of the target (what `--plain` serves), and `/metrics` is read with
prometheus_client's own parser.

One online server life per step of `test_online_server_survives_kills_full_disks_and_damaged_versions` (each step
starts from what the previous one left on disk), and one plain-API server for the HTTP faults, shared by its checks.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file

from adaflash_hf import load_reference_pair
from adaflash_hf.online.versions import METADATA_FILE, file_checksums, latest_version, list_versions

MAX_TOKENS = 12
PROMPTS = [f"Question {i}: what is {i} + {2 * i}? Answer:" for i in range(8)]
LONG_PROMPT, SHORT_TOKENS, LONG_TOKENS = "Once upon a time, in a small village,", 24, 230

# The server under a disk that fills: every version write fails with ENOSPC while the file DISK_FULL names exists.
_CHILD = """
import errno, os, sys
import adaflash_hf.online.publish as publish

real = publish.save_version

def save_version(drafter, path, layout="native"):
    if os.path.exists(os.environ["DISK_FULL"]):
        raise OSError(errno.ENOSPC, "No space left on device")
    return real(drafter, path, layout)

publish.save_version = save_version
from adaflash_hf.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def plain():
    """Token ids of PROMPTS and plain greedy decoding's answers to them (and to LONG_PROMPT)."""
    target, _, tok = load_reference_pair()
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    long_ids = tok(LONG_PROMPT)["input_ids"]

    def greedy(x, n):
        with torch.inference_mode():
            out = target.generate(torch.tensor([x]), max_new_tokens=n, do_sample=False)[0, len(x):]
        return tok.decode(out, skip_special_tokens=True)

    return {"ids": ids, "answers": [greedy(x, MAX_TOKENS) for x in ids], "long_ids": long_ids,
            "short": greedy(long_ids, SHORT_TOKENS), "long": greedy(long_ids, LONG_TOKENS)}


class Server:
    """One `adaflash serve` process (through _CHILD), its URL, and its stderr in ``log``."""

    def __init__(self, tmp, name: str, args: list[str], headers: dict | None = None):
        self.log, self.headers = tmp / f"{name}.log", headers
        cmd = [sys.executable, "-c", _CHILD, "serve", "--port", "0", "--max-len", "256", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "DISK_FULL": str(tmp / "disk-full"),
}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(self.log, "w"), text=True, env=env)
        line = self.proc.stdout.readline()
        m = re.search(r"at (http://[\d.]+:\d+)/v1", line)
        if m is None:
            self.proc.kill()
            pytest.fail(f"the server did not start: {line!r}\n{self.text()[-3000:]}")
        self.url = m.group(1)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=30).text
        return {s.name + "".join(f"{{{v}}}" for _, v in sorted(s.labels.items())): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=30).json()

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def _ask(url: str, ids: list[int], headers: dict | None = None, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", headers=headers, timeout=120,
                      json={"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, **body})


def _serve_until(server: Server, plain, done, limit_s: float = 150) -> int:
    """Send PROMPTS four at a time, each answer checked against plain greedy decoding, until ``done(metrics)``;
    the number of requests sent."""
    sent, deadline = 0, time.monotonic() + limit_s
    with ThreadPoolExecutor(4) as pool:
        while not done(server.metrics()):
            assert time.monotonic() < deadline, f"gave up waiting; {server.metrics()}\n{server.text()[-3000:]}"
            batch = [(sent + k) % len(PROMPTS) for k in range(4)]
            for i, r in zip(batch, pool.map(lambda i: _ask(server.url, plain["ids"][i]), batch)):
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain["answers"][i], (i, r.text)
            sent += 4
    return sent


def _meta(path) -> dict:
    return json.loads((path / METADATA_FILE).read_text())


def test_online_server_survives_kills_full_disks_and_damaged_versions(plain, tmp_path):
    out = tmp_path / "versions"
    args = ["--online", "--output-dir", str(out), "--samples-per-update", "2", "--epochs", "1", "--max-slots", "4",
            "--train-share", "1", "--trainer", "thread", "--keep-versions", "3"]

    # 1. A full disk: the update is swapped in but cannot be written; /metrics and /health say so. Freed, versions go on.
    (tmp_path / "disk-full").touch()
    s = Server(tmp_path, "s1", args)
    try:
        _serve_until(s, plain, lambda m: m["adaflash_online_write_failures_total"] >= 1)
        health = s.health()["online"]
        assert health["status"] == "degraded" and "No space left on device" in health["last_error"], health
        assert list_versions(out) == [] and s.metrics()["adaflash_online_served_version"] == 0
        (tmp_path / "disk-full").unlink()
        _serve_until(s, plain, lambda m: m["adaflash_online_served_version"] >= 2)  # v00002 on disk
    finally:
        assert s.stop(signal.SIGKILL) == -signal.SIGKILL
    killed_at = int(latest_version(out).name[1:])  # a later version may have been written meanwhile
    assert killed_at >= 2

    # 2. Killed and restarted with the same command: LATEST serves again, and the next update trains from it.
    s = Server(tmp_path, "s2", args)
    try:
        m = s.metrics()
        assert (m["adaflash_online_served_version"], m["adaflash_online_versions_rejected_total"]) == (killed_at, 0)
        assert f"online: resuming from {out / f'v{killed_at:05d}'}" in s.text()
        assert s.health()["online"]["resumed_from"] == killed_at
        _serve_until(s, plain, lambda m: m["adaflash_online_served_version"] > killed_at)
        assert _meta(out / f"v{killed_at + 1:05d}")["base_version"] == killed_at  # (a batch may make two updates)
    finally:
        assert s.stop() == 0
    assert "Traceback" not in s.text()

    # 3. The newest version truncated, the one before it overwritten with NaN (its checksum rewritten to match, so
    # only the finite check can catch it): both skipped with a warning, the one before them serves.
    versions = [p for _, p in list_versions(out)]
    assert len(versions) == 3, versions  # --keep-versions 3
    weights = versions[-1] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    nan = versions[-2]
    state = load_file(nan / "model.safetensors")
    first = sorted(state)[0]
    state[first] = torch.full_like(state[first], float("nan"))
    save_file(state, nan / "model.safetensors", metadata={"format": "pt"})
    meta = _meta(nan)
    meta["sha256"] = file_checksums(nan)
    (nan / METADATA_FILE).write_text(json.dumps(meta))
    good = int(versions[-3].name[1:])
    s = Server(tmp_path, "s3", args)
    try:
        m = s.metrics()
        assert (m["adaflash_online_served_version"], m["adaflash_online_versions_rejected_total"]) == (good, 2), m
        log = s.text()
        assert f"version {versions[-1].name} in {out} skipped: model.safetensors does not match its checksum" in log
        assert f"version {nan.name} in {out} skipped: holds non-finite values (in {first})" in log
        assert s.health()["online"]["status"] == "degraded"
        _serve_until(s, plain, lambda m: m["adaflash_online_served_version"] > good)  # new versions follow the last
        assert _meta(out / f"v{int(versions[-1].name[1:]) + 1:05d}")["base_version"] == good
    finally:
        assert s.stop() == 0
    assert "Traceback" not in s.text()

    # 4. --fresh: the shipped drafter serves, said in one line; numbering still goes on after what is on disk.
    # Then two SIGTERMs under load: the second cuts the drain short, every request left gets the JSON 503.
    s = Server(tmp_path, "s4", [*args, "--fresh", "--drain-timeout", "60"])
    results = []
    try:
        assert s.metrics()["adaflash_online_served_version"] == 0
        newest = max(n for n, _ in list_versions(out))
        assert s.text().count("online: starting fresh from the given drafter") == 1
        assert f"(new versions from v{newest + 1:05d})" in s.text()
        assert "resuming" not in s.text()
        threads = [threading.Thread(target=lambda: results.append(
            _ask(s.url, plain["long_ids"], max_tokens=LONG_TOKENS))) for _ in range(6)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while s.health()["pending"] < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        t0 = time.monotonic()
        assert s.stop() == 0 and time.monotonic() - t0 < 15  # the second signal, well before the 60 s drain
        for t in threads:
            t.join(30)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    assert len(results) == 6 and all(r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
                                     for r in results), [r.text[:80] for r in results]
    assert "Traceback" not in s.text()


def test_a_damaged_version_given_as_drafter_is_one_line(tmp_path, capsys):
    """`--drafter OUT/vNNNNN` whose weights were truncated: a usage error naming the damage, before any model loads
    (it was a loader's traceback)."""
    from generation_helpers import make_drafter, make_target

    from adaflash_hf.cli import main
    from adaflash_hf.online import VersionPublisher

    target = make_target(layers=2, seed=1)
    target.save_pretrained(tmp_path / "target")
    _, path = VersionPublisher(str(tmp_path / "out")).publish(make_drafter(target, block_size=4, num_layers=1, seed=0),
                                                             card=lambda n: {}, metadata={}, commit_message="")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert main(["serve", "--port", "0", "--target", str(tmp_path / "target"), "--drafter", str(path)]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "is a damaged online version: model.safetensors does not match its checksum" in line, line


# ----------------------------------------------------------------------------------- the HTTP faults, one server


def _partial_headers(url: str) -> None:
    """Open a connection, send half a request's headers and stall (the server answers 408 after --header-timeout)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 408")


def test_sigterm_under_load_keys_headers_and_metrics(plain, tmp_path):
    key = {"Authorization": "Bearer sk-test"}
    s = Server(tmp_path, "api", ["--api-key", "sk-test", "--max-slots", "2", "--max-concurrent-requests", "8",
                                 "--drain-timeout", "3", "--header-timeout", "0.5"], headers=key)
    ids, answers = plain["ids"], plain["answers"]
    try:
        # refusals, each counted by status
        assert _ask(s.url, ids[0]).status_code == 401
        dup = httpx.post(s.url + "/v1/completions", json={"prompt": ids[0]}, timeout=30,
                         headers=[("Authorization", "Bearer sk-test"), ("Authorization", "Bearer other")])
        assert dup.status_code == 400 and "more than one Authorization header" in dup.json()["error"]["message"]
        hot = _ask(s.url, ids[0], key, temperature=1e300)
        assert hot.status_code == 400 and hot.json()["error"]["param"] == "temperature"
        _partial_headers(s.url)
        with ThreadPoolExecutor(10) as pool:  # 10 requests at once, 8 admitted: 429s
            burst = list(pool.map(lambda _: _ask(s.url, ids[0], key, max_tokens=48), range(10)))
        assert sorted(r.status_code for r in burst).count(429) >= 1 and {r.status_code for r in burst} <= {200, 429}
        # finish reasons as the client sees them: length, a stop string (not a cancellation), a client gone
        assert _ask(s.url, ids[1], key).json()["choices"][0]["finish_reason"] == "length"
        word = answers[2].split()[2]
        r = _ask(s.url, ids[2], key, stop=[word]).json()["choices"][0]
        assert (r["text"], r["finish_reason"]) == (answers[2][: answers[2].index(word)], "stop")
        with pytest.raises(httpx.ReadTimeout):  # a client that leaves before its answer
            httpx.post(s.url + "/v1/completions", headers=key, timeout=0.3,
                       json={"prompt": ids[3], "max_tokens": LONG_TOKENS, "temperature": 0})
        time.sleep(0.5)
        m = s.metrics()
        finished = sum(v for k, v in m.items() if k.startswith("adaflash_requests_total{"))
        assert m["adaflash_requests_total{stop}"] == 1 and m["adaflash_requests_total{cancelled}"] == 1
        assert m["adaflash_requests_total{length}"] == finished - 2
        rejected = {k: v for k, v in m.items() if k.startswith("adaflash_requests_rejected_total{")}
        assert rejected == {"adaflash_requests_rejected_total{400}": 2, "adaflash_requests_rejected_total{401}": 1,
                            "adaflash_requests_rejected_total{408}": 1,
                            "adaflash_requests_rejected_total{429}": [r.status_code for r in burst].count(429)}
        for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
            assert m[f"adaflash_{name}_count"] == finished and m[f"adaflash_{name}_sum"] > 0
        assert m["adaflash_inter_token_latency_seconds_count"] >= m["adaflash_spec_decode_num_drafts_total"] > 0
        assert m["adaflash_spec_decode_num_emitted_tokens_total"] == \
            m["adaflash_spec_decode_num_accepted_tokens_total"] + m["adaflash_spec_decode_num_drafts_total"]
        assert s.health()["status"] == "ok"

        # SIGTERM with 2 short requests running on the 2 slots and 6 long ones queued behind them: the short ones
        # finish within the drain (whole greedy answers), at least the last long ones cannot (about three rounds of
        # slots); those, and every request sent after the signal, are JSON 503s with Retry-After
        results = {}

        def ask(i: int, n: int) -> None:
            results[i] = (n, _ask(s.url, plain["long_ids"], key, max_tokens=n))

        threads = []
        for i, n in enumerate([SHORT_TOKENS] * 2 + [LONG_TOKENS] * 6):
            threads.append(threading.Thread(target=ask, args=(i, n)))
            threads[-1].start()
            deadline = time.monotonic() + 30  # submitted in this order: the engine runs them first come, first served
            while s.health()["pending"] + len(results) < i + 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        late = _ask(s.url, ids[0], key)
        health = httpx.get(s.url + "/health", timeout=30)
        for t in threads:
            t.join(60)
        code = s.proc.wait(60)
        took = time.monotonic() - t0
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    assert code == 0 and took < 15, (code, took)
    assert (late.status_code, late.headers.get("retry-after")) == (503, "1") and late.json()["error"]["message"]
    assert health.status_code == 503 and health.json()["status"] == "draining"
    statuses = [results[i][1].status_code for i in range(8)]
    assert statuses[:2] == [200, 200] and set(statuses) <= {200, 503} and statuses[-1] == 503, statuses
    for n, r in results.values():
        if r.status_code == 200:
            assert r.json()["choices"][0]["text"] == plain["short" if n == SHORT_TOKENS else "long"]
        else:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "server_shutting_down", r.text
    log = s.text()
    assert "Traceback" not in log and "exception was never retrieved" not in log, log[-3000:]
    assert "drain deadline passed; cancelling" in log
