"""`adaflash serve`: one-line errors for bad flags (no model loaded for most), a port in use, and an
end-to-end run on the embedded reference pair (the default) answering a real HTTP request."""

from __future__ import annotations

import json
import logging
import socket
import threading
import urllib.request

import pytest
import torch
from conftest import build_drafter, build_tiny_target

import adaflash_hf.engine.serve.server as server_mod
from adaflash_hf.cli import main


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
        "drafter-without-target": (["--drafter", c["drafter"]], ["--drafter given without --target"]),
        "reference-and-target": (["--reference", "--target", c["target"], "--drafter", c["drafter"]], ["not both"]),
        "missing-target": (["--target", c["missing"], "--drafter", c["drafter"]], ["--target", "not found"]),
        "target-without-drafter": (["--target", c["target"]], ["no drafter given", "--plain"]),
        "drafter-as-target": (["--target", c["drafter"], "--drafter", c["drafter"]], ["is a drafter checkpoint"]),
        "port-in-use": (["--port", str(port)], ["cannot listen on", f"127.0.0.1:{port}"]),
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


def test_serve_runs_the_reference_pair_by_default(monkeypatch, capsys):
    """No --target: the embedded reference pair; a real request answered with plain greedy's text."""
    seen = {}
    original = server_mod.OpenAIServer.serve_forever

    def serve_briefly(self, poll_interval=0.5):
        thread = threading.Thread(target=original, args=(self, 0.05), daemon=True)
        thread.start()
        try:
            body = json.dumps({"model": "adaflash-reference", "prompt": "Once upon a time", "max_tokens": 6,
                               "temperature": 0}).encode()
            req = urllib.request.Request(self.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                seen["completion"] = json.loads(r.read())
            seen["service"] = self.service
        finally:
            self.shutdown()
            thread.join()

    monkeypatch.setattr(server_mod.OpenAIServer, "serve_forever", serve_briefly)
    rc = main(["serve", "--port", "0", "--max-len", "128", "--max-slots", "2", "--threads", "1"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "model 'adaflash-reference' at http://127.0.0.1:" in out and "max_len 128" in out
    svc = seen["service"]
    assert svc.engine.closed  # the server closed its engine on the way out
    tok, target = svc.tokenizer, svc.engine.engine.target
    ids = tok("Once upon a time")["input_ids"]
    with torch.no_grad():
        ref = target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=6)[0, len(ids):]
    assert seen["completion"]["choices"][0]["text"] == tok.decode(ref, skip_special_tokens=True)
    assert "POST /v1/completions 200 prompt_tokens=" in err and "Once upon" not in err
    assert not logging.getLogger("adaflash_hf.server").handlers  # the CLI's log handler is removed again
