"""`adaflash serve`: one-line errors for bad flags (no model loaded for most), a port in use, and an
end-to-end run on the embedded reference pair (the default) answering a real HTTP request."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time

import httpx
import openai
import pytest
import torch
from conftest import build_drafter, build_tiny_target

import adaflash_hf.serve.server as server_mod
from adaflash_hf.cli import main
from adaflash_hf.engine import Engine
from adaflash_hf.serve.settings import EXIT_ENGINE_FAILED


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-ckpts")
    target = build_tiny_target("qwen3", seed=1)
    target.save_pretrained(root / "target")  # no tokenizer saved next to it
    build_drafter(target, num_layers=1, block_size=4, seed=2).save_pretrained(root / "drafter")
    return {k: str(root / k) for k in ("target", "drafter")} | {"missing": str(root / "nope")}


@pytest.fixture
def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()


def _cases(c, port):
    return {
        "port-out-of-range": (["--port", "70000"], ["--port", "70000"]),
        "zero-slots": (["--max-slots", "0"], ["--max-slots", "positive integer"]),
        "max-len-one": (["--max-len", "1"], ["--max-len", "integer >= 2"]),
        "bad-length-policy": (["--length-policy", "expected_gain"], ["--length-policy", "expected_gain"]),
        "plain-with-drafter": (["--plain", "--target", c["target"], "--drafter", c["drafter"]], ["--plain serves the target alone"]),
        "zero-decode-steps": (["--decode-steps", "0"], ["--decode-steps", "positive integer"]),
        "zero-spec-rounds": (["--spec-rounds", "0"], ["--spec-rounds", "positive integer"]),
        "spec-rounds-without-fixed": (["--spec-rounds", "4"], ["--spec-rounds 4 queues fixed rounds", "--length-policy fixed"]),
        "spec-rounds-online": (["--length-policy", "fixed", "--spec-rounds", "4", "--online"],
                               ["--spec-rounds queues rounds the online adapter would not see"]),
        "zero-concurrency": (["--max-concurrent-requests", "0"], ["--max-concurrent-requests", "positive integer"]),
        "negative-body-timeout": (["--body-timeout", "-1"], ["--body-timeout", "seconds >= 0"]),
        "negative-header-timeout": (["--header-timeout", "-1"], ["--header-timeout", "seconds >= 0"]),
        "zero-max-connections": (["--max-connections", "0"], ["--max-connections", "positive integer"]),
        "drafter-without-target": (["--drafter", c["drafter"]], ["--drafter given without --target"]),
        "reference-and-target": (["--reference", "--target", c["target"], "--drafter", c["drafter"]], ["not both"]),
        "missing-target": (["--target", c["missing"], "--drafter", c["drafter"]], ["--target", "not found"]),
        "target-without-drafter": (["--target", c["target"]], ["no drafter given", "--plain"]),
        "drafter-as-target": (["--target", c["drafter"], "--drafter", c["drafter"]], ["is a drafter checkpoint"]),
        "port-in-use": (["--port", str(port)], ["cannot listen on", f"127.0.0.1:{port}"]),
        "online-flag-without-online": (["--lr", "1e-4", "--guard-samples", "4"], ["without --online: --lr, --guard-samples"]),
        "empty-api-key": (["--api-key", ""], ["--api-key is empty"]),  # `--api-key "$KEY"` with KEY unset
        "blank-api-key": (["--api-key", "  "], ["--api-key is empty"]),
        "padded-api-key": (["--api-key", "sk-1 "], ["--api-key is padded with whitespace"]),
        "output-dir-under-a-file": (["--online", "--output-dir", c["target"] + "/config.json/versions"],
                                    ["--output-dir", "cannot be written"]),
        "fresh-without-online": (["--fresh"], ["--fresh given without --online"]),
        "negative-drain-timeout": (["--drain-timeout", "-1"], ["--drain-timeout", "seconds >= 0"]),
    }


@pytest.mark.parametrize("case", sorted(_cases({"drafter": "", "target": "", "missing": ""}, 0)))
def test_serve_user_errors_are_one_line(case, ckpts, busy_port, capsys):
    argv, words = _cases(ckpts, busy_port)[case]
    rc = main(["serve", *argv])
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    line = err.strip().splitlines()[-1]
    assert line.startswith("adaflash: error: ") and "(hint: " in line, line
    for w in words:
        assert w in line, (w, line)
    assert "Traceback" not in out + err


@pytest.mark.parametrize("argv,env_key,key,warned", [
    (["--host", "0.0.0.0"], None, None, True),  # every interface, no key: warned
    (["--host", "0.0.0.0"], "sk-env", "sk-env", False),  # the key from $ADAFLASH_API_KEY
    (["--host", "::", "--api-key", "sk-flag"], "sk-env", "sk-flag", False),  # the flag wins
    (["--host", "127.0.0.1"], None, None, False),
    (["--host", "::1"], None, None, False),
    (["--host", "localhost"], "sk-env", "sk-env", False),
    (["--host", "myhost.example"], None, None, True),  # a name may resolve anywhere
])  # fmt: skip
def test_serve_takes_the_key_from_flag_or_env_and_warns_without_one_beyond_loopback(monkeypatch, capsys, argv, env_key,
                                                                                     key, warned):
    """issue 34: the settings `adaflash serve` binds with (stopped there: no model loads), the warning on stderr."""
    seen = {}

    class Stop(server_mod.OpenAIServer):
        def __init__(self, address, service=None, settings=None):
            seen["settings"] = settings
            raise OSError(98, "stopped by the test")

    monkeypatch.setattr(server_mod, "OpenAIServer", Stop)
    if env_key is None:
        monkeypatch.delenv("ADAFLASH_API_KEY", raising=False)
    else:
        monkeypatch.setenv("ADAFLASH_API_KEY", env_key)
    rc = main(["serve", "--header-timeout", "3", "--max-connections", "77", *argv])
    err = capsys.readouterr().err
    settings = seen["settings"]
    assert rc == 2 and "stopped by the test" in err
    assert (settings.api_key, settings.header_timeout_s, settings.max_connections) == (key, 3.0, 77)
    assert ("warning: listening on" in err and "without an API key" in err) == warned, err
    assert "sk-" not in err  # the key is never printed


@pytest.mark.parametrize("value", ["", " ", "\t"])
def test_serve_refuses_an_empty_key_variable_before_binding(monkeypatch, capsys, value):
    """An empty or blank $ADAFLASH_API_KEY is a usage error (it used to turn authentication off), raised before
    the port is bound or a model loads."""
    monkeypatch.setattr(server_mod, "OpenAIServer", None)  # binding would fail loudly
    monkeypatch.setenv("ADAFLASH_API_KEY", value)
    rc = main(["serve", "--port", "0"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and "$ADAFLASH_API_KEY is empty" in line, line


def _serve_in_main_thread(monkeypatch, argv, client):
    """Run `adaflash serve ARGV` here (uvicorn takes the signals on the main thread) while ``client(server)``
    talks to it from another thread; returns (exit status, the server)."""
    seen, original = {}, server_mod.OpenAIServer.serve_forever

    def talk():
        while "server" not in seen:
            time.sleep(0.01)
        server = seen["server"]
        for _ in range(500):  # until uvicorn answers
            try:
                if httpx.get(server.url + "/health", timeout=5).status_code:
                    break
            except httpx.TransportError:
                time.sleep(0.02)
        try:
            client(server)
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            seen["error"] = e

    def recording(self):
        seen["server"] = self
        original(self)

    monkeypatch.setattr(server_mod.OpenAIServer, "serve_forever", recording)
    thread = threading.Thread(target=talk, daemon=True)
    thread.start()
    rc = main(["serve", "--port", "0", "--max-len", "128", "--max-slots", "2", "--threads", "1", *argv])
    thread.join(30)
    if "error" in seen:
        raise seen["error"]
    return rc, seen["server"]


def test_serve_runs_the_reference_pair_by_default(monkeypatch, capsys):
    """No --target: the embedded reference pair; a real request answered with plain greedy's text; SIGTERM
    stops it with status 0 and the engine closed."""
    seen = {}

    def client(server):
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        seen["completion"] = api.completions.create(model="adaflash-reference", prompt="Once upon a time",
                                                    max_tokens=6, temperature=0)
        os.kill(os.getpid(), signal.SIGTERM)  # what a container runtime sends

    rc, server = _serve_in_main_thread(monkeypatch, [], client)
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "model 'adaflash-reference' at http://127.0.0.1:" in out and "max_len 128" in out
    assert "stopping" in err
    svc = server.service
    assert svc.engine.closed  # the server closed its engine on the way out
    tok, target = svc.tokenizer, svc.engine.engine.target
    ids = tok("Once upon a time")["input_ids"]
    with torch.no_grad():
        ref = target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=6)[0, len(ids):]
    assert seen["completion"].choices[0].text == tok.decode(ref, skip_special_tokens=True)
    assert "POST /v1/completions 200 prompt_tokens=" in err and "Once upon" not in err
    assert not logging.getLogger("adaflash_hf.server").handlers  # the CLI's log handler is removed again


def test_engine_failure_fails_the_request_reports_503_and_exits_3(monkeypatch, capsys):
    """A CUDA OOM inside the engine: the request in flight gets a 500 naming it, /health turns 503, and the
    process exits with status 3 (EXIT_ENGINE_FAILED) so that a supervisor restarts it."""
    seen = {}

    def oom(self):
        raise RuntimeError("CUDA out of memory (injected)")

    monkeypatch.setattr(Engine, "step", oom)

    def client(server):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4}, timeout=30)
        seen["completion"] = (r.status_code, r.json())
        r = httpx.get(server.url + "/health", timeout=5)
        seen["health"] = (r.status_code, r.json())

    rc, _ = _serve_in_main_thread(monkeypatch, ["--exit-after-failure", "1.5"], client)
    err = capsys.readouterr().err
    assert rc == EXIT_ENGINE_FAILED == 3, err
    status, body = seen["completion"]
    assert status == 500 and "CUDA out of memory (injected)" in body["error"]["message"]
    status, body = seen["health"]
    assert status == 503 and body["status"] == "error" and "CUDA out of memory" in body["error"]
    assert "exit status 3" in err and "exit code 3" in err


@pytest.mark.parametrize("missing", [("uvicorn", "fastapi"), ("prometheus_client",)])
def test_without_the_serve_extra_serve_names_it(missing, monkeypatch, capsys):
    """uvicorn / fastapi / prometheus_client missing: `adaflash serve` fails at once (before loading a model) with
    one line naming `pip install 'adaflash-hf[serve]'` (that `--help` imports none is checked in test_cli)."""
    for name in missing:
        monkeypatch.setitem(sys.modules, name, None)  # `import uvicorn` now raises ImportError
    for name in [m for m in sys.modules if m.startswith("adaflash_hf.serve.")]:
        monkeypatch.delitem(sys.modules, name)  # imported afresh, as in a process without the extra
    rc = main(["serve", "--port", "0"])
    err = capsys.readouterr().err
    assert rc == 2, err
    line = err.strip().splitlines()[-1]
    assert f"needs the `serve` extra ({missing[0]} is missing)" in line and "pip install 'adaflash-hf[serve]'" in line, line
