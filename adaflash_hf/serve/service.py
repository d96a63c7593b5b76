"""The OpenAI API's logic without HTTP: request parsing and validation, generation, response shapes.

:class:`CompletionService` turns an OpenAI request body into an engine request on one
:class:`AsyncEngine` (so concurrent requests are decoded together) and shapes the answers; the HTTP
transport (``app.py``, ``server.py``) only moves bytes. Supported fields: ``prompt`` (a string, a list of token
ids, or a list of either: each prompt its own choices) / ``messages``, ``max_tokens`` (``max_completion_tokens``;
0 with ``echo``), ``temperature``, ``top_p``, ``top_k``, ``seed``, ``n`` (choices, one engine request each), ``stop``
(a string or a list: the text is cut before the first stop string and the request is cancelled right there,
``finish_reason="stop"``), ``stream`` (chunks in OpenAI's format; ``stream_options.include_usage`` adds a usage
chunk), ``logprobs`` / ``top_logprobs`` and ``echo`` (:mod:`.logprobs`), the penalties, ``response_format`` and
``tools`` / ``tool_choice`` (:mod:`.tools`); every other field of OpenAI's request bodies is accepted or refused
as :mod:`.options` says. A bad request raises :class:`APIError` (a 400 with an OpenAI-style ``{"error": {...}}``
body); answers are shaped by its :class:`~.responses.ResponseShapes` (``svc.shapes``).

Example::

    svc = CompletionService(Engine(target, drafter, EngineConfig(max_slots=8, max_len=1024)), tok)
    req = svc.parse({"prompt": "Hi", "max_tokens": 8, "temperature": 0}, "completion")
    gens = svc.start(req)                    # inside a running event loop: one per choice
    answers = [await gen.text() for gen in gens]   # (text, logprob entries) each
    print(svc.shapes.response(req, gens, answers, "cmpl-1"))
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import math
import threading
import time
from functools import partial

from .async_engine import AsyncEngine, EngineClosed, EngineFailed
from .logprobs import prompt_entries
from .metrics import ServerMetrics, online_health
from .options import RequestFieldError, describe, read_options
from .responses import ResponseShapes
from .tools import END, START, forced_call, read_tools, tool_fields
from ..engine.grammar import Grammars
from ..engine.processed_rows import LoggedToken
from ..engine import SamplingParams

__all__ = ["APIError", "CompletionService"]

MAX_STOP_STRINGS = 16
MAX_CHOICES = 16  # the most choices (`n`) one request may ask for: each is an engine request of its own
MAX_TEMPERATURE = 2.0  # OpenAI's bound; far beyond it the logits' scaling overflows to inf
MAX_PROMPTS = 64  # the most prompts one completion request may list (prompts x n engine requests)
_END = object()
_FINISH = {"eos": "stop", "length": "length", "cancelled": "cancelled"}


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


def _text(value: str, field: str, param: str) -> str:
    """``value`` if it can be encoded (JSON's ``\\ud800`` escapes decode to lone surrogates, which no tokenizer
    and no UTF-8 answer takes), else a 400 naming ``field``."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(f"`{field}` is not valid Unicode text (it holds a lone UTF-16 surrogate)", param) from None
    return value


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class _Parsed:
    __slots__ = ("kind", "prompts", "max_tokens", "params", "stops", "stream", "include_usage", "n", "options", "echoes",
                 "tools", "tool_choice")


class _Generation:
    """One request in flight, read on an event loop: submits it, turns committed tokens into text deltas,
    applies stop strings. Create it inside a running loop (the engine thread hands tokens to that loop)."""

    def __init__(self, service: "CompletionService", req: _Parsed, params: SamplingParams, prompt: int = 0):
        self.service, self.req = service, req
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.shutdown = False  # cancelled because the server is stopping: answered with a 503
        self.echo = req.echoes[prompt] if req.echoes else None  # (prompt text, its logprob entries): `echo`
        self._q: asyncio.Queue = asyncio.Queue()
        self._head = None  # the first item, read by admitted()
        self.started, self.token_times = time.perf_counter(), []  # the latency histograms' clock
        put = partial(_to_loop, asyncio.get_running_loop(), self._q.put_nowait)
        if req.max_tokens == 0:  # `echo` alone: nothing to generate, no engine request
            self.future = concurrent.futures.Future()
            self.future.set_result(None)
            self._head, self.finish_reason = _END, "length"
            return

        def on_token(tok) -> None:  # on the engine thread
            self.token_times.append(time.perf_counter())
            put(tok)

        try:
            self.future = service.engine.submit(req.prompts[prompt], req.max_tokens, params, on_token=on_token)
        except (EngineClosed, EngineFailed) as e:
            raise APIError(503, f"the engine is not running: {e}") from None
        service._track(self)
        self.future.add_done_callback(lambda f: _quietly(put, _END))
        self.future.add_done_callback(lambda f: service.observe(f, self))

    def cancel(self, shutdown: bool = False) -> None:
        self.shutdown = self.shutdown or shutdown
        self.service.engine.cancel(self.future)

    def _shutdown_error(self) -> APIError:
        return APIError(503, "the server is shutting down and cancelled this request before it finished; retry it",
                        code="server_shutting_down")

    async def admitted(self) -> None:
        """Wait for the first token, or for a refusal: a request the engine can never fit is a 400, one
        submitted to a stopped engine a 503 (checked before a stream commits to its headers)."""
        if self._head is None:
            self._head = await self._q.get()
        if self._head is _END and self.shutdown:
            raise self._shutdown_error()
        if self._head is not _END or self.future.cancelled() or not self.req.max_tokens:
            return
        exc = self.future.exception()
        if isinstance(exc, ValueError):  # RequestRejected: a request the engine can never fit
            msg = str(exc).replace("max_new_tokens", "max_tokens")
            raise _bad(msg, "max_tokens" if "max_tokens" in msg else "prompt")
        if isinstance(exc, (EngineClosed, EngineFailed)) and self.future.request_id is None:
            raise APIError(503, f"the engine is not running: {exc}")

    async def text(self) -> tuple[str, list[tuple]]:
        """The whole answer: its text and its logprob entries (``logprobs``; else empty)."""
        pieces = [piece async for piece in self.deltas()]
        return "".join(t for t, _ in pieces), [e for _, entries in pieces for e in entries]

    async def _items(self):
        item = self._head if self._head is not None else await self._q.get()
        while item is not _END:
            yield item
            item = await self._q.get()

    async def deltas(self):
        """Yield ``(text piece, logprob entries of the tokens it completes)`` as pieces become final (the echoed
        prompt first, with ``echo``); sets ``finish_reason`` / ``completion_tokens``."""
        base = ""
        if self.echo is not None:
            base = self.echo[0]
            yield self.echo
        if not self.req.max_tokens:
            return
        stops, decode = self.req.stops, self.service.decode
        longest = max((len(s) for s in stops), default=0)
        tokens: list[int] = []
        entries: list[tuple] = []  # (token, logprob, top, text offset) of each token read, for `logprobs`
        sent = 0  # entries already yielded
        emitted, prev = "", 0
        async for item in self._items():
            if self.finish_reason is not None:  # stopped: drain what the round still committed
                continue
            tokens.append(item)
            text = decode(tokens)
            if isinstance(item, LoggedToken):
                entries.append((int(item), item.logprob, item.top_logprobs, len(base) + prev))
            prev = len(text)
            if not text.startswith(emitted):  # the tokenizer revised earlier text: wait for it to settle
                continue
            if stops:
                start = max(0, len(emitted) - longest)
                hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
                if hits:
                    cut = min(hits)
                    self.finish_reason, self.completion_tokens = "stop", len(tokens)
                    self.cancel()
                    yield text[len(emitted):cut] if cut > len(emitted) else "", entries[sent:]
                    sent, emitted = len(entries), text[:cut]
                    continue
            end = len(text) - _holdback(text, stops)
            if end > len(emitted):
                yield text[len(emitted):end], entries[sent:]
                sent, emitted = len(entries), text[:end]
        if self.future.cancelled():
            raise APIError(503, "the request was cancelled")
        exc = self.future.exception()
        if exc is not None:
            raise APIError(500, f"generation failed: {type(exc).__name__}: {exc}")
        out = self.future.result()
        if out.finish_reason == "error" and self.finish_reason is None:  # it failed (alone or with its round)
            raise APIError(500, f"generation failed: {out.error}")
        if out.finish_reason == "cancelled" and self.shutdown and self.finish_reason is None:
            raise self._shutdown_error()
        if self.finish_reason is None:
            self.finish_reason = _FINISH.get(out.finish_reason, out.finish_reason)
            self.completion_tokens = len(out.token_ids)
            text = decode(out.token_ids)
            rest = text[len(emitted):] if text.startswith(emitted) else ""
            if rest or sent < len(entries):
                yield rest, entries[sent:]


def _to_loop(loop: asyncio.AbstractEventLoop, fn, item) -> None:
    """Hand ``item`` to ``fn`` on ``loop`` (called on the engine thread); raises once the loop is closed,
    which cancels the request (nobody is left to read it)."""
    loop.call_soon_threadsafe(fn, item)


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except RuntimeError:  # the loop is closed: the reader is gone
        pass


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
        self.shapes = ResponseShapes(model_name, self.token_text)  # the answers' bodies and chunks
        if eos_token_id is None:
            ids = set()
            gen_cfg = getattr(getattr(self.engine.engine, "target", None), "generation_config", None)
            for e in (getattr(tokenizer, "eos_token_id", None), getattr(gen_cfg, "eos_token_id", None)):
                ids.update([e] if _is_int(e) else (e or []))
            eos_token_id = tuple(sorted(ids)) or None
        self.eos_token_id = eos_token_id
        # HF fast tokenizers are not guaranteed thread-safe: each use holds a lock. Prompts (worker threads) use
        # a copy of their own, so a long tokenization never holds the lock that decoding (the event loop) takes.
        self.prompt_tokenizer = copy.deepcopy(tokenizer)
        self._prompt_lock, self._tok_lock = threading.Lock(), threading.Lock()
        self.max_prompt_tokens = self.engine.max_len - 1  # one position is left for the completion
        # No text longer than this tokenizes into max_prompt_tokens or fewer: each token covers at most its
        # longest vocabulary entry (byte-level entries are never shorter than the text they cover) plus a
        # separator a pre-tokenizer may drop. Longer prompts are refused before tokenizing.
        longest = max(map(len, tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = self.max_prompt_tokens * (longest + 1)
        self.created = int(time.time())
        self._grammars = None  # compiles `response_format` schemas, made on the first (engine.grammar)
        core = getattr(self.engine, "engine", None)
        self.metrics = ServerMetrics(block_size=getattr(core, "block_size", 1) if getattr(core, "drafter", None) else 1)
        self.draining = False  # stopping: no new completion requests (a 503), /health answers 503
        self._live: set[_Generation] = set()
        self._live_lock = threading.Lock()

    def observe(self, future, gen: _Generation | None = None) -> None:
        """Count a finished request in :attr:`metrics` (a done-callback of its future; cancelled futures are not
        counted): its finish reason as the client sees it (a stop string's ``stop``, not the cancellation that
        ended it) and, with ``gen``, its latencies."""
        if gen is not None:
            with self._live_lock:
                self._live.discard(gen)
        if future.cancelled() or future.exception() is not None:
            return
        out = future.result()
        reason = _FINISH.get(out.finish_reason, out.finish_reason)
        if gen is not None and gen.req.stops and (gen.finish_reason == "stop" or any(
                s in self.decode(out.token_ids) for s in gen.req.stops)):  # its reader may not have seen it yet
            reason = "stop"
        timing = None if gen is None else (gen.started, gen.token_times, time.perf_counter())
        self.metrics.observe(out, finish_reason=reason, timing=timing)

    def _track(self, gen: _Generation) -> None:
        with self._live_lock:
            self._live.add(gen)

    def begin_drain(self) -> None:
        """Stop admitting completion requests (they get a 503); those in flight go on."""
        self.draining = True

    def in_flight(self) -> int:
        """Engine requests submitted and not finished."""
        with self._live_lock:
            return len(self._live)

    def cancel_all(self) -> int:
        """Cancel every request in flight as the server stops: each client gets a 503 (a streaming one, in band).
        Returns how many were cancelled."""
        with self._live_lock:
            live = list(self._live)
        for gen in live:
            gen.cancel(shutdown=True)
        return len(live)

    # ------------------------------------------------------------------ tokenizer
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self._prompt_lock:
            return list(self.prompt_tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids) -> str:
        with self._tok_lock:
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def close(self, cancel: bool = True) -> None:
        self.engine.close(cancel=cancel)

    # ------------------------------------------------------------------ endpoints
    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "adaflash-hf", "max_model_len": self.engine.max_len}]}

    def failure(self) -> str | None:
        """Why the engine can no longer serve (its thread died, or a round failed as a whole), else None."""
        if self.engine.error is not None:
            return f"engine thread failed: {type(self.engine.error).__name__}: {self.engine.error}"
        core = getattr(self.engine, "engine", None)  # the Engine: a failed round marks it unhealthy
        if core is not None and not getattr(core, "healthy", True):
            return f"engine round failed: {core.last_error}"
        return None

    def health(self) -> tuple[int, dict]:
        failure = self.failure()
        if failure is not None:
            return 503, {"status": "error", "error": failure}
        if self.engine.closed:
            return 503, {"status": "closed"}
        if self.draining:
            return 503, {"status": "draining", "pending": self.engine.num_pending}
        body = {"status": "ok", "model": self.model_name, "pending": self.engine.num_pending}
        online = self.metrics.online_stats() if self.metrics.online_stats is not None else None
        if online:
            body["online"] = online_health(online)
        return 200, body

    def parse(self, body, kind: str) -> _Parsed:
        """Validate an OpenAI request body (``kind``: ``"completion"`` or ``"chat"``); raises :class:`APIError`."""
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        model = body.get("model")
        if model is not None:
            if not isinstance(model, str):
                raise _bad(f"`model` must be a string, got {describe(model)}", "model")
            if _text(model, "model", "model") != self.model_name:
                named = f"`{model}`" if len(model) <= 100 else f"named in `model` ({len(model)} characters)"
                raise APIError(404, f"the model {named} does not exist; this server serves `{self.model_name}`",
                               "model", code="model_not_found")
        try:
            r = _Parsed()  # the cheap checks first: a bad field is refused before the prompt is tokenized
            r.options = read_options(body, kind)
            r.tools, r.tool_choice = read_tools(body) if kind == "chat" else (None, None)
        except RequestFieldError as e:
            raise _bad(str(e), e.param) from None
        r.kind = kind
        max_tokens = self._max_tokens(body, kind, r.options.echo)
        r.params = self._sampling(body, r.options)
        forced = forced_call(r.tools, r.tool_choice) if r.tools is not None else None
        if forced is not None and r.options.json_schema is not None:
            raise _bad("`response_format` cannot be combined with a forced tool call (`tool_choice`)", "tool_choice")
        if forced is not None:  # `tool_choice` "required" or a named function: one call, enforced by its grammar
            r.params = dataclasses.replace(r.params, grammar=self._grammar(forced, START + "\n", "\n" + END, "tool_choice"))
        elif r.options.json_schema is not None:
            r.params = dataclasses.replace(r.params, grammar=self._grammar(r.options.json_schema))
        r.n = 1 if body.get("n") is None else body["n"]
        if not _is_int(r.n) or not 1 <= r.n <= MAX_CHOICES:
            raise _bad(f"`n` must be an integer from 1 to {MAX_CHOICES}, got {describe(r.n)}", "n")
        r.stops = self._stops(body.get("stop"))
        stream = body.get("stream", False)
        if stream is not None and not isinstance(stream, bool):
            raise _bad(f"`stream` must be true or false, got {describe(stream)}", "stream")
        r.stream = bool(stream)
        opts = body.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            raise _bad(f"`stream_options` must be an object, got {describe(opts)}", "stream_options")
        r.include_usage = bool((opts or {}).get("include_usage", False))
        r.prompts = self._prompts(body, kind, r.tools)
        # no max_tokens: the default, capped at what fits after the longest prompt (at least 1: _prompts checked)
        longest = max(map(len, r.prompts))
        r.max_tokens = max_tokens if max_tokens is not None else min(self.default_max_tokens, self.engine.max_len - longest)
        r.echoes = None
        return r

    def _grammar(self, schema: dict, before: str = "", after: str = "", field: str = "response_format"):
        """``schema`` (between ``before`` and ``after``) compiled for this tokenizer (xgrammar: the ``grammar`` extra),
        else a 400 naming ``field``."""
        with self._prompt_lock:
            if self._grammars is None:
                vocab = self.engine.engine.target.get_output_embeddings().weight.shape[0]
                try:
                    self._grammars = Grammars(self.prompt_tokenizer, vocab, self.eos_token_id or ())
                except ImportError:  # no xgrammar: the 400 below
                    pass
        if self._grammars is None:
            raise _bad(f"`{field}` needs xgrammar on the server: pip install 'adaflash-hf[grammar]'", field)
        try:
            return self._grammars.json_schema(schema, before, after, any_whitespace=not before)
        except ValueError as e:
            raise _bad(f"`{field}`: the JSON schema cannot be compiled: {e}", field) from None

    def score_prompts(self, req: _Parsed) -> None:
        """With ``echo``: each prompt's text and, with ``logprobs``, its logprob entries (one plain forward of the
        target per prompt); call it off the event loop, after :meth:`parse`."""
        if not req.options.echo:
            return
        echoes = []
        for ids in req.prompts:
            text = self.decode(ids)
            if req.options.logprobs is None:
                echoes.append((text, []))
                continue
            offsets = [len(self.decode(ids[:i])) for i in range(len(ids))]
            target = self.engine.engine.target
            echoes.append((text, prompt_entries(target, ids, req.options.logprobs, offsets)))
        req.echoes = echoes

    def token_text(self, token: int) -> str:
        """One token's text, as logprobs name it (special tokens included)."""
        with self._tok_lock:
            return self.tokenizer.decode([int(token)])

    def _prompts(self, body: dict, kind: str, tools: list | None = None) -> list[list[int]]:
        """The prompts' token ids (completions take a list of prompts: each its own choices), after every check that
        costs less than tokenizing (types, Unicode, length)."""
        field = "messages" if kind == "chat" else "prompt"
        if field not in body:
            raise _bad(f"missing required field `{field}`", field)
        prompt = body[field]
        if kind != "chat" and isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            if len(prompt) > MAX_PROMPTS:
                raise _bad(f"`prompt` holds {len(prompt)} prompts; at most {MAX_PROMPTS} are allowed", field)
            self._check_chars(sum(len(p) for p in prompt if isinstance(p, str)), field)
            return [self._prompt_ids(p, kind) for p in prompt]
        return [self._prompt_ids(prompt, kind, tools)]

    def _prompt_ids(self, prompt, kind: str, tools: list | None = None) -> list[int]:
        """One prompt's token ids (``prompt``: ``messages``, with ``tools`` for the chat template; a text or token ids)."""
        field = "messages" if kind == "chat" else "prompt"
        if kind == "chat":
            messages = self._chat_messages(prompt)
            self._check_chars(sum(len(m["content"]) for m in messages), field)
            if not getattr(self.prompt_tokenizer, "chat_template", None):
                raise _bad("this model's tokenizer has no chat template; use /v1/completions with a text prompt", field)
            try:
                with self._prompt_lock:
                    text = self.prompt_tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                                     tokenize=False)
            except Exception as e:  # noqa: BLE001 - a template refusing the conversation (roles, order, ...)
                raise _bad(f"the chat template rejected `messages`: {type(e).__name__}: {e}", field) from None
            ids = self.encode(text, add_special_tokens=False)
        else:
            if isinstance(prompt, str):
                self._check_chars(len(_text(prompt, "prompt", field)), field)
                ids = self.encode(prompt) if prompt else []
            elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
                ids = list(prompt)
            else:
                raise _bad("`prompt` must be a string, a list of token ids, or a list of either (one prompt each), "
                           f"got {describe(prompt)}", field)
        if not ids:
            raise _bad("the prompt is empty (zero tokens)", field)
        if len(ids) > self.max_prompt_tokens:
            raise _bad(f"the prompt is {len(ids)} tokens; this server fits at most {self.max_prompt_tokens} prompt "
                       f"tokens (max_len {self.engine.max_len} per request, prompt + completion)", field)
        return ids

    def _check_chars(self, n: int, field: str) -> None:
        """Refuse a text no tokenization could fit, before tokenizing it (a huge prompt would hold the tokenizer)."""
        if n > self.max_prompt_chars:
            raise _bad(f"the prompt is {n} characters; this server fits at most {self.max_prompt_tokens} prompt tokens, "
                       f"and no text over {self.max_prompt_chars} characters tokenizes into that few", field)

    @staticmethod
    def _chat_messages(messages) -> list[dict]:
        """``messages`` checked and reduced to ``{"role", "content"}`` with text content (parts joined), and an assistant
        turn's ``tool_calls`` / a tool turn's ``tool_call_id`` kept for the chat template."""
        if not isinstance(messages, list) or not messages:
            raise _bad(f"`messages` must be a non-empty list of {{\"role\", \"content\"}} objects, got {describe(messages)}",
                       "messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _bad(f"`messages[{i}]` must be an object with a string `role`", "messages")
            if m["role"] not in _CHAT_ROLES:
                raise _bad(f"`messages[{i}].role` must be one of {', '.join(_CHAT_ROLES)}", "messages")
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
                raise _bad(f"`messages[{i}].content` must be a string or a list of text parts, got {describe(content)}",
                           "messages")
            try:
                extra = tool_fields(m, i)
            except RequestFieldError as e:
                raise _bad(str(e), e.param) from None
            clean.append({"role": m["role"], "content": _text(content, f"messages[{i}].content", "messages"), **extra})
        return clean

    @staticmethod
    def _max_tokens(body: dict, kind: str, echo: bool) -> int | None:
        key = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None else "max_tokens"
        value = body.get(key)
        if value is None:
            return None
        if not _is_int(value) or value < (0 if echo else 1):  # 0 with `echo`: the prompt (and its logprobs) alone
            raise _bad(f"`{key}` must be a positive integer (0 only with `echo`), got {describe(value)}", key)
        return value  # prompt + max_tokens > max_len: the engine rejects it with the numbers (a 400)

    def _sampling(self, body: dict, options) -> SamplingParams:
        temperature = body.get("temperature")
        temperature = 1.0 if temperature is None else temperature
        if not _is_number(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
            raise _bad(f"`temperature` must be a number >= 0 and <= {MAX_TEMPERATURE:g}, got {describe(temperature)}",
                       "temperature")
        top_p = body.get("top_p")
        if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
            raise _bad(f"`top_p` must be a number in (0, 1], got {describe(top_p)}", "top_p")
        top_k = body.get("top_k")
        if top_k is not None and (not _is_int(top_k) or top_k < -1):
            raise _bad(f"`top_k` must be an integer >= 1 (0 or -1: off), got {describe(top_k)}", "top_k")
        seed = body.get("seed")
        if seed is not None and not _is_int(seed):
            raise _bad(f"`seed` must be an integer, got {describe(seed)}", "seed")
        return SamplingParams(temperature=float(temperature), top_k=top_k if top_k and top_k > 0 else None,
                              top_p=None if top_p is None or top_p == 1 else float(top_p), seed=seed,
                              eos_token_id=self.eos_token_id, presence_penalty=options.presence_penalty,
                              frequency_penalty=options.frequency_penalty, logprobs=options.logprobs)

    @staticmethod
    def _stops(stop) -> list[str]:
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise _bad(f"`stop` must be a non-empty string or a list of non-empty strings, got {describe(stop)}", "stop")
        if len(stops) > MAX_STOP_STRINGS:
            raise _bad(f"`stop` holds {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
        return [_text(s, "stop", "stop") for s in stops]

    # ------------------------------------------------------------------ responses
    def start(self, req: _Parsed) -> list[_Generation]:
        """Submit a parsed request's choices inside a running event loop, one engine request each: ``n`` per prompt,
        prompt ``p``'s choice ``j`` at index ``p * n + j`` (as OpenAI numbers them); for each, ``await gen.admitted()``
        (a 400 if the engine can never fit it), then ``await gen.text()`` or ``async for piece in gen.deltas()``. A
        seeded request's choice ``j`` samples with ``seed + j`` (the same seed would give the same tokens)."""
        gens: list[_Generation] = []
        seed = req.params.seed
        try:
            for p in range(len(req.prompts)):
                for j in range(req.n):
                    params = req.params if seed is None else dataclasses.replace(req.params, seed=seed + j)
                    gens.append(_Generation(self, req, params, p))
        except APIError:
            for gen in gens:  # the engine stopped part way: free what was submitted
                gen.cancel()
            raise
        return gens
