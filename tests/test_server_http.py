"""The HTTP stack (issues 19, 34) through the official `openai` client and raw sockets, on 127.0.0.1: completions,
chat and streaming answered exactly; the concurrency limit answers 429 (never a reset); a client that leaves
cancels its request, streaming or not (slots freed); a stalled body gets a 408, stalled headers a 408 and an
idle connection is closed; past max_connections a 503 at once; a slow tokenization leaves /health answering;
the API key; 64 concurrent clients x 3 rounds all answered, each equal to the request run alone. After every
case the engine holds nothing and the server still answers correctly."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import socket
import threading
import time

import httpx
import openai
import pytest
from conftest import build_word_tokenizer

from adaflash_hf.engine import Engine
from adaflash_hf.serve.server import ServeSettings, make_server

from generation_helpers import make_drafter, make_target, plain_greedy_ids

MAX_LEN, BUDGET, SLOTS = 64, 192, 32
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w1{% endif %}"


def _serve(settings: ServeSettings, slots: int = SLOTS):
    target = make_target("qwen3", seed=3)
    tok = build_word_tokenizer(128)
    tok.chat_template = TEMPLATE
    state = {"rounds": 0, "delay": 0.0}

    def hook(info):
        state["rounds"] += 1
        if state["delay"]:
            time.sleep(state["delay"])

    engine = Engine(target, make_drafter(target, block_size=4), length_policy="adaptive", max_slots=slots,
                    max_len=MAX_LEN, token_budget=BUDGET, step_hook=hook)
    server = make_server(engine, tok, port=0, model_name="tiny", default_max_tokens=8, settings=settings).start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    return dict(server=server, target=target, tok=tok, engine=engine, state=state, client=client)


@pytest.fixture(scope="module")
def srv():
    s = _serve(ServeSettings(max_concurrent_requests=128))
    yield s
    s["server"].close()


@pytest.fixture(scope="module")
def tight():
    """Short timeouts (a loaded machine would trip them under the load test, so on a server of their own)."""
    s = _serve(ServeSettings(body_timeout_s=0.5, timeout_keep_alive_s=0.3, header_timeout_s=0.5), slots=2)
    yield s
    s["server"].close()


def _greedy_text(s, prompt: str, n: int) -> str:
    ids = s["tok"](prompt)["input_ids"]
    return s["tok"].decode(plain_greedy_ids(s["target"], ids, n), skip_special_tokens=True)


def _idle(s, timeout: float = 5.0) -> bool:
    """Nothing pending in the engine and every KV slot free: no request or slot was lost."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if s["server"].service.engine.num_pending == 0 and s["engine"].cache.num_free == s["engine"].cache.num_slots:
            return True
        time.sleep(0.005)
    return False


def _still_answers(s) -> None:
    assert _idle(s)
    out = s["client"].completions.create(model="tiny", prompt="w7 w8 w9", max_tokens=6, temperature=0)
    assert out.choices[0].text == _greedy_text(s, "w7 w8 w9", 6)


def _raw(s, data: bytes) -> socket.socket:
    sock = socket.create_connection(s["server"].server_address, timeout=10)
    sock.sendall(data)
    return sock


def _post_head(body: bytes, length: int | None = None) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (len(body) if length is None else length))


# ---------------------------------------------------------------- the openai client
@pytest.mark.parametrize("kind,stream", [("completion", False), ("completion", True), ("chat", False), ("chat", True)])
def test_openai_client_gets_plain_greedy(srv, kind, stream):
    client, tok = srv["client"], srv["tok"]
    if kind == "chat":
        expected = _greedy_text(srv, "w4 w9 w1", 10)  # what the template renders: "w4 w9 w1"
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w4 w9"}],
                                             max_tokens=10, temperature=0, stream=stream)
        text = ("".join(c.choices[0].delta.content or "" for c in out if c.choices) if stream
                else out.choices[0].message.content)
    else:
        expected = _greedy_text(srv, "w4 w9 w30", 10)
        out = client.completions.create(model="tiny", prompt="w4 w9 w30", max_tokens=10, temperature=0, stream=stream)
        text = "".join(c.choices[0].text for c in out) if stream else out.choices[0].text
        if not stream:
            assert out.usage.completion_tokens == 10 and out.usage.prompt_tokens == len(tok("w4 w9 w30")["input_ids"])
    assert text == expected
    assert _idle(srv)


@pytest.mark.parametrize("kwargs,param,words", [
    ({"max_tokens": 0}, "max_tokens", "positive integer"),
    ({"extra_body": {"max_tokens": "8"}}, "max_tokens", "must be a positive integer, got a string"),
    ({"extra_body": {"temperature": "hot"}}, "temperature", "must be a number >= 0"),
    ({"extra_body": {"stream": 1}}, "stream", "true or false"),
    ({"max_tokens": 10_000}, "max_tokens", "can never fit"),
])  # fmt: skip
def test_openai_client_gets_a_400_naming_the_field(srv, kwargs, param, words):
    """Type errors are pydantic's, answered as today's 400 (not FastAPI's 422 shape)."""
    with pytest.raises(openai.BadRequestError) as e:
        srv["client"].completions.create(model="tiny", prompt="w1 w2", **kwargs)
    assert e.value.status_code == 400
    err = e.value.body
    assert err["param"] == param and words in err["message"] and err["type"] == "invalid_request_error", err
    _still_answers(srv)


# ---------------------------------------------------------------- limits and timeouts
def test_past_the_concurrency_limit_a_429_with_retry_after():
    s = _serve(ServeSettings(max_concurrent_requests=2))
    try:
        # issue 34: bodies still arriving hold no place: two stalled ones, and a request is still answered
        stalled = [_raw(s, _post_head(b"", length=60) + b'{"prompt": ') for _ in range(2)]
        time.sleep(0.1)
        assert s["client"].completions.create(model="tiny", prompt="w1 w2", max_tokens=2, temperature=0).choices
        for sock in stalled:
            sock.close()
        s["state"]["delay"] = 0.03
        bodies = [json.dumps({"prompt": f"w{i} w3", "max_tokens": 12, "temperature": 0}).encode() for i in (5, 6)]
        socks = [_raw(s, _post_head(body) + body) for body in bodies]
        end = time.monotonic() + 5
        while s["server"].service.engine.num_pending < 2 and time.monotonic() < end:
            time.sleep(0.005)
        with pytest.raises(openai.RateLimitError) as e:
            s["client"].completions.create(model="tiny", prompt="w1 w2", max_tokens=4, temperature=0)
        assert e.value.status_code == 429 and e.value.response.headers["retry-after"] == "1"
        assert e.value.body["code"] == "rate_limit_exceeded" and "limit of 2 concurrent" in e.value.body["message"]
        assert s["client"].models.list().data[0].id == "tiny"  # /v1/models and /health are never limited
        for sock in socks:  # both held requests are answered in full
            got = b""
            while b'"finish_reason"' not in got:
                got += sock.recv(65536)
            assert got.startswith(b"HTTP/1.1 200") and b'"completion_tokens":12' in got.replace(b" ", b"")
            sock.close()
        s["state"]["delay"] = 0.0
        _still_answers(s)
    finally:
        s["server"].close()


@pytest.mark.parametrize("stream", [False, True])
def test_client_that_leaves_cancels_its_request(srv, stream):
    """Non-streaming included: the request stops generating and its slot is freed (not run to max_tokens)."""
    srv["state"]["delay"], srv["state"]["rounds"] = 0.02, 0
    try:
        body = json.dumps({"prompt": "w5 w6", "max_tokens": 50, "temperature": 0, "stream": stream}).encode()
        sock = _raw(srv, _post_head(body) + body)
        end = time.monotonic() + 5
        while srv["state"]["rounds"] < 2 and time.monotonic() < end:  # it is generating
            time.sleep(0.005)
        sock.close()
        assert _idle(srv)
    finally:
        srv["state"]["delay"] = 0.0
    assert srv["state"]["rounds"] < 40  # 50 tokens take far more rounds
    _still_answers(srv)


@pytest.mark.parametrize("head,sent,status,words", [
    (_post_head(b"", length=40), b'{"prompt": ', 408, b"did not arrive within 0.5 s"),  # 11 of 40 bytes, then nothing
    (_post_head(b"", length=9 * 2**20), b"", 413, b"request body too large (9437184 bytes > 8388608)"),
])  # fmt: skip
def test_a_stalled_or_oversized_body_is_answered_at_once(tight, head, sent, status, words):
    sock = _raw(tight, head + sent)
    t0, got = time.monotonic(), b""
    while not got.endswith(b"}"):
        got += sock.recv(65536)
    assert got.startswith(b"HTTP/1.1 %d" % status) and time.monotonic() - t0 < 5 and words in got, got
    sock.close()
    _still_answers(tight)


def test_an_idle_keep_alive_connection_is_closed(tight):
    """An answered connection left idle, or one that never sends a byte, is closed by the server (recv sees
    the end), not held open."""
    body = b'{"prompt": "w1 w2", "max_tokens": 2, "temperature": 0}'
    sock = _raw(tight, _post_head(body) + body)
    got = b""
    while b'"usage"' not in got:
        got += sock.recv(65536)
    t0 = time.monotonic()
    while sock.recv(65536):
        pass
    assert time.monotonic() - t0 < 5
    sock.close()
    sock = _raw(tight, b"")  # a connection that never sends a byte is closed too
    t0 = time.monotonic()
    assert sock.recv(65536) == b"" and time.monotonic() - t0 < 5
    sock.close()
    _still_answers(tight)


@pytest.mark.parametrize("answered_first", [False, True])
def test_headers_that_stall_get_a_408_and_the_connection_closes(tight, answered_first):
    """issue 34: part of a request's headers, then nothing: a 408 once header_timeout_s (0.5 s) has passed since
    their first byte, on a new connection or a keep-alive one after an answer (uvicorn alone waits for ever)."""
    sock = _raw(tight, b"")
    sock.settimeout(4)
    if answered_first:
        body = b'{"prompt": "w1 w2", "max_tokens": 2, "temperature": 0}'
        sock.sendall(_post_head(body) + body)
        got = b""
        while b'"usage"' not in got:
            got += sock.recv(65536)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
    t0, got = time.monotonic(), b""
    while chunk := sock.recv(65536):
        got += chunk
    sock.close()
    assert got.startswith(b"HTTP/1.1 408") and b"headers did not arrive within 0.5 s" in got, got
    assert 0.4 < time.monotonic() - t0 < 3
    _still_answers(tight)


def test_past_max_connections_a_new_connection_gets_a_503_at_once():
    """issue 34: three connections held open (part of their headers sent), a fourth is answered 503 and closed
    at once; once one of the three is closed, requests are answered again."""
    s = _serve(ServeSettings(max_connections=3), slots=2)
    try:
        held = [_raw(s, b"GET /health HTTP/1.1\r\n") for _ in range(3)]
        time.sleep(0.2)  # let the server take all three
        sock = _raw(s, b"")
        sock.settimeout(3)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
        sock.close()
        assert got.startswith(b"HTTP/1.1 503") and b"limit of 3 open connections" in got and b"retry-after: 1" in got, got
        held.pop().close()
        time.sleep(0.2)
        _still_answers(s)
        for h in held:
            h.close()
    finally:
        s["server"].close()


def test_the_uvicorn_internals_the_guards_use_exist():
    """The guards override these (uvicorn_server.py); a rename in uvicorn would make them dead code silently."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    for name in ("connection_made", "connection_lost", "data_received", "on_response_complete", "timeout_keep_alive_handler"):
        assert callable(getattr(H11Protocol, name, None)), name
    src = inspect.getsource(H11Protocol.__init__)
    for attr in ("self.conn =", "self.connections =", "self.timeout_keep_alive_task", "self.client"):
        assert attr in src, attr


def test_a_slow_tokenization_leaves_health_answering(srv, monkeypatch):
    """issue 34: the prompt is tokenized off the event loop: while one request's tokenizer call is held, /health
    answers at once and a request given as token ids is answered in full (its decoding does not wait on the held
    tokenizer); then the held request is answered. A prompt over the character cap never reaches the tokenizer."""
    entered, release, calls = threading.Event(), threading.Event(), []
    svc = srv["server"].service

    class HeldTokenizer:
        def __init__(self, tok):
            self.tok = tok

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def __call__(self, text, **kw):
            calls.append(len(text))
            entered.set()
            release.wait(4)  # a bound, so that the unfixed server (tokenizing on its loop) fails instead of hanging
            return self.tok(text, **kw)

    monkeypatch.setattr(svc, "prompt_tokenizer", HeldTokenizer(svc.prompt_tokenizer))
    pool = concurrent.futures.ThreadPoolExecutor(1)
    answer = pool.submit(srv["client"].completions.create, model="tiny", prompt="w7 w8 w9", max_tokens=6, temperature=0)
    try:
        assert entered.wait(5)
        t0 = time.monotonic()
        health = httpx.get(srv["server"].url + "/health", timeout=10)
        assert health.status_code == 200 and time.monotonic() - t0 < 1.0
        ids = srv["tok"]("w4 w5 w6")["input_ids"]
        out = srv["client"].completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
        assert out.choices[0].text == _greedy_text(srv, "w4 w5 w6", 6) and time.monotonic() - t0 < 3.0
    finally:
        release.set()
    assert answer.result(10).choices[0].text == _greedy_text(srv, "w7 w8 w9", 6)
    pool.shutdown()
    with pytest.raises(openai.BadRequestError) as e:  # over the cap: refused by its length, never tokenized
        srv["client"].completions.create(model="tiny", prompt="w5 " * 2000, max_tokens=2)
    assert e.value.body["param"] == "prompt" and f"at most {MAX_LEN - 1} prompt tokens" in e.value.body["message"]
    assert "6000 characters" in e.value.body["message"] and calls == [len("w7 w8 w9")]


# ---------------------------------------------------------------- the API key
@pytest.fixture(scope="module")
def keyed():
    s = _serve(ServeSettings(api_key="sk-right-key"), slots=2)
    yield s
    s["server"].close()


def test_the_api_key_is_checked_through_the_openai_client(keyed):
    """issue 34: the right key is answered; a wrong one is openai.AuthenticationError (401, OpenAI's body)."""
    url = keyed["server"].url + "/v1"
    right = openai.OpenAI(base_url=url, api_key="sk-right-key", max_retries=0, timeout=30)
    out = right.completions.create(model="tiny", prompt="w7 w8 w9", max_tokens=6, temperature=0)
    assert out.choices[0].text == _greedy_text(keyed, "w7 w8 w9", 6)
    assert right.models.list().data[0].id == "tiny"
    wrong = openai.OpenAI(base_url=url, api_key="sk-right-kez", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.completions.create(model="tiny", prompt="w7 w8 w9", max_tokens=6, temperature=0)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    assert "sk-right" not in e.value.response.text
    assert "sk-right" not in repr(ServeSettings(api_key="sk-right-key"))  # never printed with the settings


@pytest.mark.parametrize("method,path,auth,status", [
    ("POST", "/v1/completions", None, 401),
    ("POST", "/v1/chat/completions", "Basic c2stcmlnaHQta2V5", 401),
    ("GET", "/v1/models", None, 401),
    ("GET", "/v1/models", "Bearer sk-right-key-and-more", 401),
    ("GET", "/v1/nothing", None, 401),  # no route is listed to a client without the key
    ("GET", "/v1/models", "bearer sk-right-key", 200),
    ("GET", "/health", None, 200),  # liveness probes carry no key
])  # fmt: skip
def test_every_route_but_health_needs_the_key(keyed, method, path, auth, status):
    headers = {} if auth is None else {"Authorization": auth}
    r = httpx.request(method, keyed["server"].url + path, headers=headers, json={"prompt": "w1"}, timeout=10)
    assert r.status_code == status, r.text
    if status == 401:
        assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"


# ---------------------------------------------------------------- load
def test_64_concurrent_openai_clients_3_rounds_each_answer_equals_its_request_alone(srv):
    """Every response equals plain greedy for its prompt (what the engine gives the request alone); half stream."""
    prompts = [f"w{3 + i % 32} w{(7 * i) % 120 + 2 if i % 32 else 9}" for i in range(32)] * 2  # each streamed once
    refs = {p: _greedy_text(srv, p, 4) for p in set(prompts)}
    assert len(refs) == 32
    aclient = openai.AsyncOpenAI(base_url=srv["server"].url + "/v1", api_key="unused", max_retries=0, timeout=60)

    async def one(i: int) -> str:
        if i < 32:
            out = await aclient.completions.create(model="tiny", prompt=prompts[i], max_tokens=4, temperature=0)
            return out.choices[0].text
        chunks = await aclient.completions.create(model="tiny", prompt=prompts[i], max_tokens=4, temperature=0,
                                                  stream=True)
        return "".join([c.choices[0].text async for c in chunks])

    async def rounds():
        try:
            return [await asyncio.gather(*(one(i) for i in range(64)), return_exceptions=True) for _ in range(3)]
        finally:
            await aclient.close()

    for texts in asyncio.run(rounds()):
        errors = [t for t in texts if isinstance(t, BaseException)]
        assert not errors, errors[:3]
        assert [t == refs[p] for t, p in zip(texts, prompts)] == [True] * 64
    _still_answers(srv)
