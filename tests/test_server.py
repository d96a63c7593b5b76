"""The OpenAI-compatible HTTP server (issue 6) on an ephemeral port: completions, chat completions,
streaming (SSE), stop strings, usage, models, health, 400s naming the problem, concurrency through the
continuous-batching engine, client disconnects, engine failures, one log line per request."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time

import pytest
import torch
from conftest import build_word_tokenizer

from adaflash_hf.engine import Engine
from adaflash_hf.serve.server import make_server

from generation_helpers import make_drafter, make_target

MAX_LEN, BUDGET, SLOTS = 96, 48, 4
MODEL = "tiny-test"
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w1{% endif %}"


@pytest.fixture(scope="module")
def setup():
    """One server for the module: a tiny target + drafter, a 128-word tokenizer with a chat template."""
    target = make_target("qwen3", seed=0)
    drafter = make_drafter(target, block_size=8)
    tok = build_word_tokenizer(128)
    tok.chat_template = TEMPLATE
    state = {"infos": [], "delay": 0.0}

    def hook(info):
        state["infos"].append(info)
        if state["delay"]:
            time.sleep(state["delay"])

    engine = Engine(target, drafter, length_policy="adaptive", max_slots=SLOTS, max_len=MAX_LEN, token_budget=BUDGET,
                    step_hook=hook)
    server = make_server(engine, tok, port=0, model_name=MODEL, default_max_tokens=8).start()
    yield dict(server=server, target=target, tok=tok, engine=engine, state=state, aengine=server.service.engine)
    server.close()


def _request(server, method, path, body=None, raw: bytes | None = None):
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=20)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, resp.getheader("Content-Type"), text


def post(server, path, body):
    status, ctype, text = _request(server, "POST", path, body)
    return status, (json.loads(text) if ctype == "application/json" else text)


def events(text):
    """SSE payloads: the JSON chunks, then the literal [DONE]."""
    out = [block[len("data: "):] for block in text.split("\n\n") if block.strip()]
    assert all(not block.startswith("data:") for block in out)
    return [e if e == "[DONE]" else json.loads(e) for e in out]


def greedy(setup, ids, n):
    out = setup["target"].generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n)
    return out[0, len(ids):].tolist()


def _idle(setup, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if setup["aengine"].num_pending == 0 and setup["engine"].cache.num_free == SLOTS:
            return True
        time.sleep(0.005)
    return False


# ---------------------------------------------------------------- the endpoints
def test_completion_equals_plain_greedy_with_usage(setup):
    tok, server = setup["tok"], setup["server"]
    prompt = "w5 w17 w42 w9"
    ids = tok(prompt)["input_ids"]
    ref = greedy(setup, ids, 12)
    status, body = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert status == 200, body
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["text"] == tok.decode(ref, skip_special_tokens=True) and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 12, "total_tokens": len(ids) + 12}
    # The same prompt as token ids; no max_tokens: the server default (8) applies.
    status, body = post(server, "/v1/completions", {"prompt": ids, "temperature": 0})
    assert status == 200 and body["choices"][0]["text"] == tok.decode(ref[:8], skip_special_tokens=True)
    assert body["usage"]["completion_tokens"] == 8


def test_chat_completion_applies_the_template(setup):
    tok, server = setup["tok"], setup["server"]
    messages = [{"role": "system", "content": "w3"}, {"role": "user", "content": [{"type": "text", "text": "w8 w11"}]}]
    ids = tok(tok.apply_chat_template([{"role": "system", "content": "w3"}, {"role": "user", "content": "w8 w11"}],
                                      add_generation_prompt=True, tokenize=False), add_special_tokens=False)["input_ids"]
    assert ids == tok("w3 w8 w11 w1")["input_ids"]  # what the test template renders
    ref = greedy(setup, ids, 10)
    status, body = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 10, "temperature": 0})
    assert status == 200, body
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    msg = body["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": tok.decode(ref, skip_special_tokens=True)}
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 10


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streaming_matches_the_non_streamed_answer(setup, kind):
    server = setup["server"]
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    req = {"prompt": "w20 w21 w22"} if kind == "completion" else {"messages": [{"role": "user", "content": "w20 w21"}]}
    req.update(max_tokens=14, temperature=0)
    _, full = post(server, path, req)
    status, ctype, text = _request(server, "POST", path, {**req, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and ctype == "text/event-stream"
    evs = events(text)
    assert evs[-1] == "[DONE]"
    chunks, usage = evs[:-2], evs[-2]
    assert usage["choices"] == [] and usage["usage"] == full["usage"]
    assert all(c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    if kind == "completion":
        assert all(c["object"] == "text_completion" for c in chunks)
        streamed = "".join(c["choices"][0]["text"] for c in chunks)
        expected = full["choices"][0]["text"]
    else:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        expected = full["choices"][0]["message"]["content"]
    assert streamed == expected and len(chunks) > 5  # token by token, not one blob


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_n_choices_each_answer_the_prompt(setup, kind):
    """``n`` choices: one engine request each, indexed 0..n-1, the prompt counted once in the usage; streamed, each
    choice's deltas carry its index and add up to its non-streamed text, each with its own finish chunk."""
    server, tok = setup["server"], setup["tok"]
    path = C if kind == "completion" else CHAT
    req = {"prompt": "w20 w21 w22"} if kind == "completion" else {"messages": [{"role": "user", "content": "w20 w21"}]}
    req.update(max_tokens=9, temperature=0, n=3)
    status, full = post(server, path, req)
    assert status == 200, full
    texts = [c["text"] if kind == "completion" else c["message"]["content"] for c in full["choices"]]
    ids = tok(req["prompt"])["input_ids"] if kind == "completion" else tok("w20 w21 w1")["input_ids"]
    assert [c["index"] for c in full["choices"]] == [0, 1, 2]
    assert texts == [tok.decode(greedy(setup, ids, 9), skip_special_tokens=True)] * 3  # greedy: the same answer
    assert full["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 27, "total_tokens": len(ids) + 27}
    status, _, text = _request(server, "POST", path, {**req, "stream": True, "stream_options": {"include_usage": True}})
    evs = events(text)
    assert status == 200 and evs[-1] == "[DONE]" and evs[-2]["usage"] == full["usage"]
    streamed, finishes = ["", "", ""], [[], [], []]
    for e in evs[:-2]:
        (c,) = e["choices"]
        streamed[c["index"]] += c["text"] if kind == "completion" else c["delta"].get("content", "")
        finishes[c["index"]].append(c["finish_reason"])
    assert streamed == texts
    assert all(f[-1] == "length" and not any(f[:-1]) for f in finishes)


def test_n_seeded_choices_sample_with_seed_plus_index(setup):
    """A seeded request's choice i is the request alone with seed + i: reproducible, and not n copies."""
    server = setup["server"]
    req = {"prompt": "w40 w41", "max_tokens": 12, "temperature": 1.0, "seed": 11}
    status, both = post(server, C, {**req, "n": 2})
    assert status == 200, both
    alone = [post(server, C, {**req, "seed": 11 + i})[1]["choices"][0]["text"] for i in range(2)]
    assert [c["text"] for c in both["choices"]] == alone
    assert alone[0] != alone[1]  # control: two seeds, two samples (else the check above could not tell)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_truncates_and_finishes_early(setup, stream):
    tok, server, state = setup["tok"], setup["server"], setup["state"]
    prompt = "w30 w31 w32"
    ids = tok(prompt)["input_ids"]
    ref = greedy(setup, ids, 60)
    full = tok.decode(ref, skip_special_tokens=True)
    stop = full.split()[2]
    expected = full[: full.find(stop)]
    needed = next(n for n in range(1, 61) if stop in tok.decode(ref[:n], skip_special_tokens=True))
    assert needed < 20
    state["infos"].clear()
    body = {"prompt": prompt, "max_tokens": 60, "temperature": 0, "stop": ["w999", stop], "stream": stream}
    status, _, text = _request(server, "POST", "/v1/completions", body)
    assert status == 200
    if stream:
        evs = events(text)
        assert evs[-1] == "[DONE]"
        got = "".join(e["choices"][0]["text"] for e in evs[:-1])
        finish = evs[-2]["choices"][0]["finish_reason"]
    else:
        res = json.loads(text)
        got, finish = res["choices"][0]["text"], res["choices"][0]["finish_reason"]
        assert res["usage"]["completion_tokens"] == needed
    assert got == expected and stop not in got and finish == "stop"
    assert _idle(setup)
    assert len(state["infos"]) < 45  # cancelled when the stop string appeared, not run to 60 tokens


def test_models_and_health(setup):
    server = setup["server"]
    status, _, text = _request(server, "GET", "/v1/models")
    data = json.loads(text)
    assert status == 200 and data["object"] == "list"
    assert [m["id"] for m in data["data"]] == [MODEL] and data["data"][0]["max_model_len"] == MAX_LEN
    status, _, text = _request(server, "GET", "/health")
    assert status == 200 and json.loads(text)["status"] == "ok"


# ---------------------------------------------------------------- bad requests
C, CHAT = "/v1/completions", "/v1/chat/completions"
BAD = {
    "missing-prompt": (C, {"max_tokens": 4}, 400, "prompt", "missing required field `prompt`"),
    "empty-prompt": (C, {"prompt": ""}, 400, "prompt", "empty"),
    "prompts-with-an-empty-one": (C, {"prompt": ["w1", ""]}, 400, "prompt", "empty"),
    "too-many-prompts": (C, {"prompt": ["w1"] * 65}, 400, "prompt", "at most 64"),
    "max-tokens-zero": (C, {"prompt": "w1", "max_tokens": 0}, 400, "max_tokens", "positive integer (0 only with `echo`)"),
    "max-tokens-string": (C, {"prompt": "w1", "max_tokens": "8"}, 400, "max_tokens", "positive integer"),
    "too-long-for-a-slot": (C, {"prompt": " ".join(["w2"] * 40), "max_tokens": MAX_LEN}, 400, "max_tokens", "can never fit"),
    "prompt-fills-the-slot": (C, {"prompt": list(range(1, MAX_LEN + 1))}, 400, "prompt", f"at most {MAX_LEN - 1} prompt tokens"),
    "prompt-over-token-budget": (C, {"prompt": list(range(1, BUDGET + 2)), "max_tokens": 2}, 400, "prompt", "token budget"),
    "token-id-out-of-range": (C, {"prompt": [1, 100000]}, 400, "prompt", "token ids must lie in"),
    "negative-temperature": (C, {"prompt": "w1", "temperature": -1}, 400, "temperature", ">= 0"),
    "top-p-too-big": (C, {"prompt": "w1", "top_p": 1.5}, 400, "top_p", "(0, 1]"),
    "top-k-float": (C, {"prompt": "w1", "top_k": 2.5}, 400, "top_k", "integer"),
    "seed-string": (C, {"prompt": "w1", "seed": "x"}, 400, "seed", "integer"),
    "empty-stop": (C, {"prompt": "w1", "stop": [""]}, 400, "stop", "non-empty"),
    "stream-not-bool": (C, {"prompt": "w1", "stream": "yes"}, 400, "stream", "true or false"),
    "n-zero": (C, {"prompt": "w1", "n": 0}, 400, "n", "integer from 1 to 16"),
    "n-too-many": (C, {"prompt": "w1", "n": 17}, 400, "n", "integer from 1 to 16"),
    "best-of-two": (C, {"prompt": "w1", "best_of": 2}, 400, "best_of", "not supported"),
    "unknown-model": (C, {"prompt": "w1", "model": "gpt-4"}, 404, "model", "does not exist"),
    "missing-messages": (CHAT, {"max_tokens": 4}, 400, "messages", "missing required field `messages`"),
    "messages-not-list": (CHAT, {"messages": "hi"}, 400, "messages", "non-empty list"),
    "message-without-role": (CHAT, {"messages": [{"content": "w1"}]}, 400, "messages", "`role`"),
    "image-part": (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages", "only text"),
    "body-not-object": (C, [1, 2], 400, None, "JSON object"),
    # issue 34: a prompt no tokenization could fit is refused by its length in characters, before tokenizing
    "prompt-over-char-limit": (C, {"prompt": "w1 " * 200}, 400, "prompt", "600 characters; this server fits at most 95 prompt tokens"),
    "messages-over-char-limit": (CHAT, {"messages": [{"role": "user", "content": "w1 " * 200}]}, 400, "messages", "600 characters"),
    "prompt-over-slot-with-max-tokens": (C, {"prompt": list(range(1, MAX_LEN + 1)), "max_tokens": 2}, 400, "prompt", "at most 95 prompt tokens"),
    # issue 34: a lone surrogate (JSON "\\ud800") is not text: a 400 naming the field, not a 500
    "surrogate-prompt": (C, {"prompt": "w1 \ud800"}, 400, "prompt", "`prompt` is not valid Unicode"),
    "surrogate-model": (C, {"prompt": "w1", "model": "\ud800"}, 400, "model", "`model` is not valid Unicode"),
    "surrogate-content": (CHAT, {"messages": [{"role": "user", "content": "\udfff w2"}]}, 400, "messages",
                          "`messages[0].content` is not valid Unicode"),
    "surrogate-text-part": (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, 400,
                            "messages", "`messages[0].content` is not valid Unicode"),
    "surrogate-stop": (C, {"prompt": "w1", "stop": ["w2", "\ud800"]}, 400, "stop", "`stop` is not valid Unicode"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_requests_get_a_clear_openai_error(setup, case):
    path, body, status, param, words = BAD[case]
    got, _, text = _request(setup["server"], "POST", path, body)
    err = json.loads(text)["error"]
    assert got == status, err
    assert err["param"] == param and words in err["message"], err
    assert err["type"] == "invalid_request_error"
    assert _idle(setup)  # nothing left in the engine


# issue 34: a wrongly typed field is named with the type it got, never its text (prompt text must not reach the log)
SECRET = "w99 hunter2 w98"
TYPED = {
    "messages-object": (CHAT, {"messages": {"role": "user", "content": SECRET}}, 400,
                        '`messages` must be a non-empty list of {"role", "content"} objects, got an object'),
    "prompt-object": (C, {"prompt": {"text": SECRET}}, 400, "`prompt` must be a string, a list of token ids, or a list of either (one prompt each), got an object"),
    "stop-list-of-objects": (C, {"prompt": "w1", "stop": [{"s": SECRET}]}, 400, "`stop` must be a non-empty string or a list of non-empty strings, got a list"),
    "model-list": (C, {"prompt": "w1", "model": [SECRET]}, 400, "`model` must be a string, got a list"),
    "max-tokens-text": (C, {"prompt": "w1", "max_tokens": SECRET}, 400, "`max_tokens` must be a positive integer, got a string"),
    "role-text": (CHAT, {"messages": [{"role": SECRET, "content": "w1"}]}, 400, "`messages[0].role` must be one of system"),
    "content-object": (CHAT, {"messages": [{"role": "user", "content": {"t": SECRET}}]}, 400, "got an object"),
    "long-model-name": (C, {"prompt": "w1", "model": SECRET * 10}, 404, "the model named in `model` (150 characters) does not exist"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(TYPED))
def test_errors_name_the_type_never_the_text(setup, case, caplog):
    caplog.set_level(logging.INFO, logger="adaflash_hf.server")
    path, body, status, words = TYPED[case]
    got, _, text = _request(setup["server"], "POST", path, body)
    err = json.loads(text)["error"]
    assert got == status and words in err["message"], err
    assert "hunter2" not in text
    end = time.monotonic() + 5
    while not any(f"{path} {status}" in r.getMessage() for r in caplog.records) and time.monotonic() < end:
        time.sleep(0.01)
    lines = [r.getMessage() for r in caplog.records if r.name == "adaflash_hf.server"]
    assert any(f"{path} {status}" in line for line in lines) and not any("hunter2" in line for line in lines), lines


@pytest.mark.parametrize("ctype,status,words", [
    ("text/plain", 400, "Content-Type must be application/json, got text/plain"),
    ("application/x-www-form-urlencoded", 400, "got application/x-www-form-urlencoded"),  # curl -d without -H
    ("application/json; charset=utf-8", 200, ""),
    (None, 400, "Content-Type must be application/json, got none"),  # as FastAPI and vLLM
])  # fmt: skip
def test_a_json_body_sent_as_another_content_type_is_told_so(setup, ctype, status, words):
    """issue 34: not "the request body must be a JSON object" (it is one): the Content-Type is named."""
    conn = http.client.HTTPConnection(*setup["server"].server_address[:2], timeout=20)
    headers = {} if ctype is None else {"Content-Type": ctype}
    conn.request("POST", C, body=json.dumps({"prompt": "w1 w2", "max_tokens": 2, "temperature": 0}), headers=headers)
    resp = conn.getresponse()
    body = json.loads(resp.read())
    conn.close()
    assert resp.status == status, body
    if status == 400:
        assert words in body["error"]["message"] and body["error"]["type"] == "invalid_request_error", body
    else:
        assert body["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("method,path,raw,status,words", [
    ("POST", C, b"{not json", 400, "not valid JSON"),
    ("GET", "/v1/nothing", None, 404, "no such endpoint"),
    ("GET", C, None, 405, "takes POST"),
    ("POST", "/health", b"{}", 405, "takes GET"),
])  # fmt: skip
def test_bad_routes_and_bodies(setup, method, path, raw, status, words):
    got, ctype, text = _request(setup["server"], method, path, raw=raw)
    assert got == status and ctype == "application/json" and words in json.loads(text)["error"]["message"]


# ---------------------------------------------------------------- concurrency, disconnects, logging
def test_concurrent_requests_are_batched_and_exact(setup):
    tok, server, state = setup["tok"], setup["server"], setup["state"]
    prompts = [f"w{10 + i} w{40 + 2 * i} w{70 + 3 * i}" for i in range(6)]
    refs = [tok.decode(greedy(setup, tok(p)["input_ids"], 16), skip_special_tokens=True) for p in prompts]
    state["infos"].clear()
    state["delay"] = 0.002  # keeps requests overlapping on a fast machine
    results = [None] * len(prompts)

    def call(i):
        results[i] = post(server, C, {"prompt": prompts[i], "max_tokens": 16, "temperature": 0, "stream": i % 2 == 1})

    try:
        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
    finally:
        state["delay"] = 0.0
    for i, (status, body) in enumerate(results):
        assert status == 200
        text = body["choices"][0]["text"] if isinstance(body, dict) else "".join(
            e["choices"][0]["text"] for e in events(body)[:-1])
        assert text == refs[i], i
    assert max(i.slots_in_use for i in state["infos"]) > 1  # decoded together


@pytest.mark.parametrize("n", [1, 3])
def test_client_disconnect_cancels_the_request(setup, caplog, n):
    server, state = setup["server"], setup["state"]
    state["infos"].clear()
    state["delay"] = 0.01
    caplog.set_level(logging.INFO, logger="adaflash_hf.server")
    try:
        body = json.dumps({"prompt": "w5 w6", "max_tokens": 80, "temperature": 0, "stream": True, "n": n}).encode()
        sock = socket.create_connection(server.server_address[:2], timeout=10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        while b"data: " not in got:
            got += sock.recv(4096)
        assert got.startswith(b"HTTP/1.1 200")
        sock.close()  # the client goes away mid-stream
        assert _idle(setup)
    finally:
        state["delay"] = 0.0
    assert len(state["infos"]) < 70  # far fewer rounds than 80 tokens need
    end = time.monotonic() + 5
    while not any("client disconnected" in r.getMessage() for r in caplog.records) and time.monotonic() < end:
        time.sleep(0.01)
    assert any("client disconnected" in r.getMessage() for r in caplog.records)


def test_one_log_line_per_request_without_prompt_text(setup, caplog):
    caplog.set_level(logging.INFO, logger="adaflash_hf.server")
    server = setup["server"]
    post(server, C, {"prompt": "w77 w78 w79", "max_tokens": 3, "temperature": 0})
    post(server, C, {"prompt": "w77 w78", "max_tokens": 0})
    _request(server, "GET", "/health")
    end = time.monotonic() + 5
    while len(caplog.records) < 3 and time.monotonic() < end:
        time.sleep(0.01)
    time.sleep(0.05)
    lines = [r.getMessage() for r in caplog.records if r.name == "adaflash_hf.server"]
    assert len(lines) == 3, lines
    # Each handler thread logs after its response is sent, so the lines' order is not the requests' order.
    ok = [line for line in lines if "POST /v1/completions 200" in line]
    assert len(ok) == 1 and "prompt_tokens=3 completion_tokens=3 finish_reason=length" in ok[0], lines
    assert sum("POST /v1/completions 400" in line for line in lines) == 1, lines
    assert sum("GET /health 200" in line for line in lines) == 1, lines
    assert not any("w77" in line or "w78" in line for line in lines)


def test_engine_failure_is_a_500_then_503(tiny_tokenizer):
    target = make_target("qwen3", seed=1)

    def explode(info):
        raise RuntimeError("device lost")

    engine = Engine(target, None, max_slots=2, max_len=32, token_budget=32, step_hook=explode)
    with make_server(engine, tiny_tokenizer(128), port=0) as server:
        server.start()
        status, body = post(server, C, {"prompt": "w1 w2", "max_tokens": 4})
        assert status == 500 and body["error"]["type"] == "server_error" and "device lost" in body["error"]["message"]
        status, _, text = _request(server, "GET", "/health")
        assert status == 503 and json.loads(text)["status"] == "error"
        status, body = post(server, C, {"prompt": "w1 w2", "max_tokens": 4})
        assert status == 503 and "not running" in body["error"]["message"]
        # No chat template on this tokenizer: a clear 400, not a crash.
        status, body = post(server, CHAT, {"messages": [{"role": "user", "content": "w1"}]})
        assert status == 400 and "no chat template" in body["error"]["message"]
