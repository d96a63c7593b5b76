"""`adaflash serve --online` as a deployment runs it: a real process on the reference pair, the official
`openai` client, versions published and swapped in while every answer stays plain greedy decoding's,
`/metrics` parsed by prometheus_client's own parser, and SIGTERM leaving the newest version loadable."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from adaflash_hf import AdaFlashDrafter, load_reference_pair
from adaflash_hf.online import latest_version, list_versions

MAX_TOKENS = 16
PROMPTS = [f"Question {i}: what is {i} + {2 * i}? Answer:" for i in range(12)]


@pytest.fixture(scope="module")
def reference():
    target, _, tok = load_reference_pair()
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    with torch.inference_mode():
        plain = [target.generate(torch.tensor([x]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(x):] for x in ids]
    return ids, [tok.decode(o, skip_special_tokens=True) for o in plain]


def _start(out_dir, trainer: str) -> tuple[subprocess.Popen, str]:
    # --train-share 1: the worker trains flat out instead of sleeping three quarters of each update (serve's default
    # 0.25 paces it); the pacer and that default are tested in tests/test_online.py, and here they only doubled the
    # wall time (96 s -> 48 s) while the server waited for its second version
    cmd = [sys.executable, "-m", "adaflash_hf.cli", "serve", "--online", "--output-dir", str(out_dir), "--port", "0",
           "--samples-per-update", "4", "--epochs", "1", "--max-slots", "4", "--max-len", "128", "--train-share", "1",
           "--trainer", trainer]
    log = open(out_dir.parent / "serve.log", "w")  # read back when the test fails: the server's own account
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"})
    line = proc.stdout.readline()  # the one line printed once the server listens
    m = re.search(r"at (http://[\d.]+:\d+)/v1", line)
    if m is None:
        proc.kill()
        pytest.fail(f"adaflash serve --online did not start: {line!r}\n{_log_tail(out_dir)}")
    return proc, m.group(1)


def _log_tail(out_dir, chars: int = 4000) -> str:
    text = (out_dir.parent / "serve.log").read_text(errors="replace")
    return f"the server's stderr ends:\n{text[-chars:]}"


def _spawned_children(pid: int) -> list[int]:
    """The multiprocessing children of ``pid`` (Linux /proc): the online trainer process, if any."""
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(k) for k in f.read().split()]
    out = []
    for k in kids:
        try:
            with open(f"/proc/{k}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():  # not the resource tracker
                    out.append(k)
        except FileNotFoundError:
            pass
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.parametrize("trainer", ["thread", "process"])
def test_serve_online_publishes_swaps_and_stays_lossless(reference, tmp_path, trainer):
    ids, expected = reference
    proc, url = _start(tmp_path / "versions", trainer)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def ask(i: int) -> tuple[int, str]:
        out = client.completions.create(model="adaflash-reference", prompt=ids[i], max_tokens=MAX_TOKENS, temperature=0)
        return i, out.choices[0].text

    try:
        before = _metrics(url)
        answered, deadline = 0, time.monotonic() + 120
        with ThreadPoolExecutor(4) as pool:
            while _metrics(url)["adaflash_online_served_version"] < 2 and time.monotonic() < deadline:
                batch = [(answered + k) % len(PROMPTS) for k in range(4)]
                for i, text in pool.map(ask, batch):  # concurrent: decoded together by the engine
                    assert text == expected[i], (i, answered)
                answered += 4
            after = _metrics(url)
            assert after["adaflash_online_served_version"] >= 2, after
            for i, text in pool.map(ask, range(4)):  # served by a swapped-in version: still the target's own
                assert text == expected[i], i
        after = _metrics(url)
        assert sum(v for k, v in after.items() if k.startswith("adaflash_requests_total{")) == answered + 4
        assert before["adaflash_spec_decode_num_drafts_total"] == 0 < after["adaflash_spec_decode_num_drafts_total"]
        assert after["adaflash_online_updates_total"] >= 2 and after["adaflash_online_samples_seen_total"] >= 8
        assert after["adaflash_spec_decode_num_accepted_tokens_per_pos_total{position=1}"] <= \
            after["adaflash_spec_decode_num_draft_tokens_per_pos_total{position=1}"]
        assert 1.0 <= after["adaflash_spec_decode_tau"] <= after["adaflash_spec_decode_mean_verify_length"]
        with ThreadPoolExecutor(4) as pool:  # one more update's worth of requests: SIGTERM may land mid-update
            list(pool.map(ask, range(4)))
        trainers = _spawned_children(proc.pid)
        assert len(trainers) == (trainer == "process"), trainers
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        time.sleep(1.0)  # the trainer process, if any, is stopped by the server before it exits
        assert not [pid for pid in trainers if _alive(pid)], trainers
    except Exception as e:  # the client sees only a dropped connection when the server dies: say why it died
        raise AssertionError(f"{type(e).__name__}: {e}; server exit code {proc.poll()}\n{_log_tail(tmp_path / 'versions')}") from e
    finally:
        if proc.poll() is None:
            proc.kill()
    versions = list_versions(tmp_path / "versions")
    assert len(versions) >= 2
    newest = latest_version(tmp_path / "versions")
    assert newest == versions[-1][1]
    for _, path in versions:
        AdaFlashDrafter.from_pretrained(path)  # every listed version loads, the newest included
