"""An OpenAI-compatible HTTP server over the continuous-batching engine, standard library only.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the tokenizer's chat template),
``GET /v1/models``, ``GET /health``. Every request is a request of one :class:`AsyncEngine`, so
concurrent HTTP requests are decoded together (continuous batching). Supported fields: ``prompt``
(a string or a list of token ids) / ``messages``, ``max_tokens`` (``max_completion_tokens``),
``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop`` (a string or a list: the text is cut before
the first stop string and the request is cancelled right there, ``finish_reason="stop"``),
``stream`` (server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``;
``stream_options.include_usage`` adds a usage chunk) and ``usage`` counts in every response.
A bad request gets a 400 with an OpenAI-style ``{"error": {"message", "type", "param", "code"}}``.

Example::

    from adaflash_hf import load_reference_pair
    from adaflash_hf.engine import Engine
    from adaflash_hf.engine.serve.server import make_server

    target, drafter, tok = load_reference_pair()
    server = make_server(Engine(target, drafter, max_slots=8, max_len=1024), tok, port=8000)
    server.serve_forever()   # or server.start() for a background thread; server.close() stops both

    # curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
    #      -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32, "temperature": 0}'

The server logs one line per request to the ``adaflash_hf.server`` logger (status, token counts,
finish reason, time; never prompt or completion text).
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from .async_engine import AsyncEngine, EngineClosed, EngineFailed
from ..engine import Engine, RequestRejected
from ..sampling import SamplingParams

__all__ = ["APIError", "CompletionService", "OpenAIServer", "make_server"]

log = logging.getLogger("adaflash_hf.server")

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_STOP_STRINGS = 16
_END = object()
_FINISH = {"eos": "stop", "length": "length", "cancelled": "cancelled"}
# Fields we do not implement: the value a request may carry anyway (OpenAI clients send defaults).
_UNSUPPORTED = {
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "logprobs": (None, False),
    "top_logprobs": (None, 0), "suffix": (None, ""), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "tools": (None, []), "functions": (None, []),
}  # fmt: skip


class APIError(Exception):
    """An error answered as OpenAI's error JSON with HTTP ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's chat roles


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class _Parsed:
    __slots__ = ("kind", "prompt_ids", "max_tokens", "params", "stops", "stream", "include_usage")


class _Generation:
    """One request in flight: submits it, turns committed tokens into text deltas, applies stop strings."""

    def __init__(self, service: "CompletionService", req: _Parsed):
        self.service, self.req = service, req
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        try:
            self.future = service.engine.submit(req.prompt_ids, req.max_tokens, req.params, on_token=self._q.put)
            self.future.add_done_callback(lambda f: self._q.put(_END))
            self.future.wait_submitted()
        except ValueError as e:  # RequestRejected: a request the engine can never fit
            msg = str(e).replace("max_new_tokens", "max_tokens")
            raise _bad(msg, "max_tokens" if "max_tokens" in msg else "prompt") from None
        except (EngineClosed, EngineFailed) as e:
            raise APIError(503, f"the engine is not running: {e}") from None

    def cancel(self) -> None:
        self.service.engine.cancel(self.future)

    def deltas(self):
        """Yield text pieces as they become final; sets ``finish_reason`` / ``completion_tokens``."""
        stops, decode = self.req.stops, self.service.decode
        longest = max((len(s) for s in stops), default=0)
        tokens: list[int] = []
        emitted = ""
        while True:
            item = self._q.get()
            if item is _END:
                break
            if self.finish_reason is not None:  # stopped: drain what the round still committed
                continue
            tokens.append(item)
            text = decode(tokens)
            if not text.startswith(emitted):  # the tokenizer revised earlier text: wait for it to settle
                continue
            if stops:
                start = max(0, len(emitted) - longest)
                hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
                if hits:
                    cut = min(hits)
                    self.finish_reason, self.completion_tokens = "stop", len(tokens)
                    self.cancel()
                    if cut > len(emitted):
                        yield text[len(emitted):cut]
                    emitted = text[:cut]
                    continue
            end = len(text) - _holdback(text, stops)
            if end > len(emitted):
                yield text[len(emitted):end]
                emitted = text[:end]
        if self.future.cancelled():
            raise APIError(503, "the request was cancelled")
        exc = self.future.exception()
        if exc is not None:
            raise APIError(500, f"generation failed: {type(exc).__name__}: {exc}")
        out = self.future.result()
        if out.finish_reason == "error" and self.finish_reason is None:  # it failed (alone or with its round)
            raise APIError(500, f"generation failed: {out.error}")
        if self.finish_reason is None:
            self.finish_reason = _FINISH.get(out.finish_reason, out.finish_reason)
            self.completion_tokens = len(out.token_ids)
            text = decode(out.token_ids)
            if text.startswith(emitted) and len(text) > len(emitted):
                yield text[len(emitted):]


def _holdback(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` not yet safe to send: a partial UTF-8 character, or a prefix of a stop string."""
    n = len(text) - len(text.rstrip("\ufffd"))
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                n = max(n, k)
                break
    return n


class CompletionService:
    """The server's logic without HTTP: parses OpenAI requests, runs them on an :class:`AsyncEngine`.

    Args:
        engine: an :class:`Engine` (wrapped in an :class:`AsyncEngine` owned by the service) or an :class:`AsyncEngine`.
        tokenizer: the target's tokenizer (chat template for ``/v1/chat/completions``).
        model_name: the id ``/v1/models`` lists; a request naming another model gets a 404.
        default_max_tokens: ``max_tokens`` when a request gives none (capped at what still fits the KV slot).
        eos_token_id: ids that end a completion (default: the tokenizer's and the target's generation config's).
    """

    def __init__(self, engine, tokenizer, model_name: str = "adaflash", default_max_tokens: int = 256,
                 eos_token_id=None):
        self.engine = engine if isinstance(engine, AsyncEngine) else AsyncEngine(engine)
        self.tokenizer, self.model_name, self.default_max_tokens = tokenizer, model_name, default_max_tokens
        if eos_token_id is None:
            ids = set()
            gen_cfg = getattr(getattr(self.engine.engine, "target", None), "generation_config", None)
            for e in (getattr(tokenizer, "eos_token_id", None), getattr(gen_cfg, "eos_token_id", None)):
                ids.update([e] if _is_int(e) else (e or []))
            eos_token_id = tuple(sorted(ids)) or None
        self.eos_token_id = eos_token_id
        self._tok_lock = threading.Lock()  # HF fast tokenizers are not guaranteed thread-safe
        self.created = int(time.time())

    # ------------------------------------------------------------------ tokenizer
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self._tok_lock:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids) -> str:
        with self._tok_lock:
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def close(self, cancel: bool = True) -> None:
        self.engine.close(cancel=cancel)

    # ------------------------------------------------------------------ endpoints
    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "adaflash-hf", "max_model_len": self.engine.max_len}]}

    def health(self) -> tuple[int, dict]:
        if self.engine.error is not None:
            return 503, {"status": "error", "error": f"engine thread failed: {type(self.engine.error).__name__}"}
        if self.engine.closed:
            return 503, {"status": "closed"}
        core = getattr(self.engine, "engine", None)  # the Engine: a failed round marks it unhealthy
        if core is not None and not getattr(core, "healthy", True):
            return 503, {"status": "error", "error": f"engine round failed: {core.last_error}"}
        return 200, {"status": "ok", "model": self.model_name, "pending": self.engine.num_pending}

    def parse(self, body, kind: str) -> _Parsed:
        """Validate an OpenAI request body (``kind``: ``"completion"`` or ``"chat"``); raises :class:`APIError`."""
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        model = body.get("model")
        if model is not None:
            if not isinstance(model, str):
                raise _bad("`model` must be a string", "model")
            if model != self.model_name:
                raise APIError(404, f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                               "model", code="model_not_found")
        for key, allowed in _UNSUPPORTED.items():
            if key in body and body[key] not in allowed:
                raise _bad(f"`{key}` is not supported by this server (allowed: {', '.join(map(json.dumps, allowed))})", key)
        r = _Parsed()
        r.kind = kind
        r.prompt_ids = self._prompt_ids(body, kind)
        r.max_tokens = self._max_tokens(body, kind, len(r.prompt_ids))
        r.params = self._sampling(body)
        r.stops = self._stops(body.get("stop"))
        stream = body.get("stream", False)
        if stream is not None and not isinstance(stream, bool):
            raise _bad("`stream` must be true or false", "stream")
        r.stream = bool(stream)
        opts = body.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            raise _bad("`stream_options` must be an object", "stream_options")
        r.include_usage = bool((opts or {}).get("include_usage", False))
        return r

    def _prompt_ids(self, body: dict, kind: str) -> list[int]:
        if kind == "chat":
            if "messages" not in body:
                raise _bad("missing required field `messages`", "messages")
            messages = body["messages"]
            if not isinstance(messages, list) or not messages:
                raise _bad("`messages` must be a non-empty list of {\"role\", \"content\"} objects", "messages")
            clean = []
            for i, m in enumerate(messages):
                if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                    raise _bad(f"`messages[{i}]` must be an object with a string `role`", "messages")
                if m["role"] not in _CHAT_ROLES:
                    raise _bad(f"`messages[{i}].role` {m['role']!r} is not one of {', '.join(_CHAT_ROLES)}", "messages")
                if "content" not in m:
                    raise _bad(f"`messages[{i}]` has no `content`", "messages")
                content = m["content"]
                if content is None and m["role"] != "assistant":  # OpenAI allows null only for an assistant turn
                    raise _bad(f"`messages[{i}].content` is null; only an assistant message may have null content", "messages")
                if isinstance(content, list):  # content parts: text only
                    parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
                    if len(parts) != len(content) or not all(isinstance(t, str) for t in parts):
                        raise _bad(f"`messages[{i}].content`: only text parts are supported", "messages")
                    content = "".join(parts)
                if content is None:
                    content = ""
                if not isinstance(content, str):
                    raise _bad(f"`messages[{i}].content` must be a string or a list of text parts", "messages")
                clean.append({"role": m["role"], "content": content})
            if not getattr(self.tokenizer, "chat_template", None):
                raise _bad("this model's tokenizer has no chat template; use /v1/completions with a text prompt", "messages")
            try:
                with self._tok_lock:
                    text = self.tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # noqa: BLE001 - a template refusing the conversation (roles, order, ...)
                raise _bad(f"the chat template rejected `messages`: {type(e).__name__}: {e}", "messages") from None
            ids = self.encode(text, add_special_tokens=False)
        else:
            if "prompt" not in body:
                raise _bad("missing required field `prompt`", "prompt")
            prompt = body["prompt"]
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch of one
            if isinstance(prompt, str):
                ids = self.encode(prompt) if prompt else []
            elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
                ids = list(prompt)
            else:
                raise _bad("`prompt` must be a string or a list of token ids (one prompt per request)", "prompt")
        if not ids:
            raise _bad("the prompt is empty (zero tokens)", "messages" if kind == "chat" else "prompt")
        return ids

    def _max_tokens(self, body: dict, kind: str, prompt_len: int) -> int:
        key = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None else "max_tokens"
        value = body.get(key)
        room = self.engine.max_len - prompt_len
        if value is None:
            if room < 1:
                raise _bad(f"the prompt is {prompt_len} tokens; this server fits at most {self.engine.max_len - 1} prompt "
                           f"tokens (max_len {self.engine.max_len} per request, prompt + completion)", "prompt")
            return min(self.default_max_tokens, room)
        if not _is_int(value) or value < 1:
            raise _bad(f"`{key}` must be a positive integer, got {json.dumps(value)}", key)
        return value  # prompt + max_tokens > max_len: the engine rejects it with the numbers (a 400)

    def _sampling(self, body: dict) -> SamplingParams:
        temperature = body.get("temperature")
        temperature = 1.0 if temperature is None else temperature
        if not _is_number(temperature) or temperature < 0:
            raise _bad(f"`temperature` must be a number >= 0, got {json.dumps(temperature)}", "temperature")
        top_p = body.get("top_p")
        if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
            raise _bad(f"`top_p` must be a number in (0, 1], got {json.dumps(top_p)}", "top_p")
        top_k = body.get("top_k")
        if top_k is not None and (not _is_int(top_k) or top_k < -1):
            raise _bad(f"`top_k` must be an integer >= 1 (0 or -1: off), got {json.dumps(top_k)}", "top_k")
        seed = body.get("seed")
        if seed is not None and not _is_int(seed):
            raise _bad(f"`seed` must be an integer, got {json.dumps(seed)}", "seed")
        return SamplingParams(temperature=float(temperature), top_k=top_k if top_k and top_k > 0 else None,
                              top_p=None if top_p is None or top_p == 1 else float(top_p), seed=seed,
                              eos_token_id=self.eos_token_id)

    @staticmethod
    def _stops(stop) -> list[str]:
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise _bad("`stop` must be a non-empty string or a list of non-empty strings", "stop")
        if len(stops) > MAX_STOP_STRINGS:
            raise _bad(f"`stop` holds {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
        return stops

    # ------------------------------------------------------------------ responses
    def start(self, req: _Parsed) -> _Generation:
        """Submit a parsed request (a 400 if the engine can never fit it); iterate ``.deltas()`` for the text."""
        return _Generation(self, req)

    def usage(self, req: _Parsed, gen: _Generation) -> dict:
        n = len(req.prompt_ids)
        return {"prompt_tokens": n, "completion_tokens": gen.completion_tokens, "total_tokens": n + gen.completion_tokens}

    def response(self, req: _Parsed, gen: _Generation, text: str, rid: str) -> dict:
        base = {"id": rid, "created": int(time.time()), "model": self.model_name}
        if req.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": gen.finish_reason}
            return {**base, "object": "chat.completion", "choices": [choice], "usage": self.usage(req, gen)}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": gen.finish_reason}
        return {**base, "object": "text_completion", "choices": [choice], "usage": self.usage(req, gen)}

    def chunk(self, req: _Parsed, rid: str, text: str | None = None, finish: str | None = None,
              role: bool = False, usage: dict | None = None) -> dict:
        obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
        out = {"id": rid, "object": obj, "created": int(time.time()), "model": self.model_name}
        if usage is not None:
            return {**out, "choices": [], "usage": usage}
        if req.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**out, "choices": [choice]}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "adaflash-hf"

    def log_message(self, format, *args):  # noqa: A002 - replaced by one line per request (see _dispatch)
        pass

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    # ------------------------------------------------------------------ plumbing
    def _dispatch(self, method: str) -> None:
        t0 = time.perf_counter()
        self._status, self._headers_sent, self._stats = 0, False, {}
        path = urlsplit(self.path).path.rstrip("/") or "/"
        try:
            routes = {"/health": ("GET", self._health), "/v1/models": ("GET", self._models),
                      "/v1/completions": ("POST", lambda: self._complete("completion")),
                      "/v1/chat/completions": ("POST", lambda: self._complete("chat"))}
            if path not in routes:
                raise APIError(404, f"no such endpoint: {method} {path}", type_="not_found_error")
            want, fn = routes[path]
            if method != want:
                raise APIError(405, f"{path} takes {want}, not {method}")
            if self.server.service is None:
                raise APIError(503, "the model is still loading")
            fn()
        except APIError as e:
            self._stats["error"] = e.message
            self._send_json(e.status, e.body())
        except (BrokenPipeError, ConnectionResetError):
            self._stats["error"] = "client disconnected"
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 - a bug: answer 500, keep serving
            log.exception("internal error on %s %s", method, path)
            self._stats["error"] = f"{type(e).__name__}"
            self._send_json(500, APIError(500, f"internal error: {type(e).__name__}: {e}").body())
        finally:
            s = self._stats
            extra = "".join(f" {k}={s[k]}" for k in ("prompt_tokens", "completion_tokens", "finish_reason", "stream") if k in s)
            if "error" in s:
                extra += f" error={json.dumps(s['error'])[:200]}"
            log.info("%s %s %s %d%s %.1fms", self.client_address[0], method, path, self._status, extra,
                     1000 * (time.perf_counter() - t0))

    def _send_json(self, status: int, payload: dict) -> None:
        if self._headers_sent:  # mid-stream: report in-band, then end the stream
            try:
                self._event(payload)
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except OSError:
                pass
            self.close_connection = True
            return
        data = json.dumps(payload).encode()
        self._status = status
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _read_json(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            raise _bad("chunked request bodies are not supported; send Content-Length")
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise _bad("missing or invalid Content-Length header") from None
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            raise APIError(413, f"request body too large ({length} bytes > {MAX_BODY_BYTES})")
        raw = self.rfile.read(length)
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _bad(f"the request body is not valid JSON: {e}") from None

    def _event(self, payload) -> None:
        self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        self.wfile.flush()

    # ------------------------------------------------------------------ endpoints
    def _health(self) -> None:
        status, body = self.server.service.health()
        self._send_json(status, body)

    def _models(self) -> None:
        self._send_json(200, self.server.service.models())

    def _complete(self, kind: str) -> None:
        svc: CompletionService = self.server.service
        body = self._read_json()
        req = svc.parse(body, kind)
        self._stats.update(prompt_tokens=len(req.prompt_ids), stream=req.stream)
        gen = svc.start(req)  # a 400 here if the engine can never fit the request
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        try:
            if not req.stream:
                text = "".join(gen.deltas())
                self._stats.update(completion_tokens=gen.completion_tokens, finish_reason=gen.finish_reason)
                self._send_json(200, svc.response(req, gen, text, rid))
                return
            self._status, self._headers_sent = 200, True
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            if kind == "chat":
                self._event(svc.chunk(req, rid, role=True))
            for piece in gen.deltas():
                self._event(svc.chunk(req, rid, text=piece))
            self._stats.update(completion_tokens=gen.completion_tokens, finish_reason=gen.finish_reason)
            self._event(svc.chunk(req, rid, finish=gen.finish_reason, text="" if kind != "chat" else None))
            if req.include_usage:
                self._event(svc.chunk(req, rid, usage=svc.usage(req, gen)))
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        finally:
            if not gen.future.done():  # the client went away (or an error): free the engine slot
                gen.cancel()


class OpenAIServer(ThreadingHTTPServer):
    """A :class:`ThreadingHTTPServer` answering the OpenAI endpoints with a :class:`CompletionService`.

    ``service`` may be set after binding (requests get a 503 until then). ``start()`` serves on a
    background thread; ``close()`` stops serving, cancels requests in flight and stops the engine thread.
    """

    daemon_threads = True

    def __init__(self, address: tuple[str, int], service: CompletionService | None = None):
        super().__init__(address, _Handler)
        self.service = service
        self._thread: threading.Thread | None = None
        self._serving = threading.Event()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self._serving.set()
        try:
            super().serve_forever(poll_interval)
        finally:
            self._serving.clear()

    def start(self) -> "OpenAIServer":
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="adaflash-http", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._serving.is_set():
            self.shutdown()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.service is not None:
            self.service.close(cancel=True)
        self.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def make_server(engine, tokenizer, host: str = "127.0.0.1", port: int = 8000, model_name: str = "adaflash",
                default_max_tokens: int = 256) -> OpenAIServer:
    """Bind an :class:`OpenAIServer` (``port=0``: any free port, see ``server.url``) over ``engine``
    (an :class:`Engine` or :class:`AsyncEngine`); call ``serve_forever()`` or ``start()``."""
    if not isinstance(engine, (Engine, AsyncEngine)):
        raise TypeError(f"engine must be an Engine or AsyncEngine, got {type(engine).__name__}")
    return OpenAIServer((host, port), CompletionService(engine, tokenizer, model_name, default_max_tokens))
