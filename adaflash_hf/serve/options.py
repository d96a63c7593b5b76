"""Every field of OpenAI's two request bodies, and what this server does with each: the generation options beyond
sampling (``logprobs`` / ``top_logprobs``, ``echo``, ``presence_penalty`` / ``frequency_penalty``) read here, the
fields that change nothing about an answer accepted, and each field we cannot honour refused with a 400 that names
it, unless it carries the value that asks for nothing (clients send defaults). A field OpenAI does not define is
refused too, as OpenAI's API answers "Unrecognized request argument".

Example:
    >>> read_options({"logprobs": 2, "echo": True, "presence_penalty": 0.5}, "completion")
    Options(logprobs=2, echo=True, presence_penalty=0.5, frequency_penalty=0.0, json_schema=None)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from .logprobs import MAX_TOP_LOGPROBS

__all__ = ["FIELDS", "Options", "RequestFieldError", "check_fields", "describe", "read_options"]

_COMMON = ("model", "n", "stream", "stream_options", "stop", "seed", "temperature", "top_p", "max_tokens", "logprobs",
           "presence_penalty", "frequency_penalty", "logit_bias", "user")
# What each endpoint's fields do here: "used" (read and honoured), "inert" (no effect on an answer, accepted
# whatever its value), or a tuple of the values that ask for nothing (any other is a 400 naming the field).
FIELDS = {
    "completion": {
        **{f: "used" for f in _COMMON if f not in ("logit_bias", "user")},
        "prompt": "used", "echo": "used", "top_k": "used", "user": "inert",
        "best_of": (None, 1), "suffix": (None, ""), "logit_bias": (None, {}),
    },
    "chat": {
        **{f: "used" for f in _COMMON if f not in ("logit_bias", "user")},
        "messages": "used", "max_completion_tokens": "used", "top_logprobs": "used", "top_k": "used",
        "user": "inert", "metadata": "inert", "safety_identifier": "inert", "prompt_cache_key": "inert",
        "service_tier": (None, "auto", "default"), "store": (None, False), "logit_bias": (None, {}),
        "response_format": "used", "tools": "used", "tool_choice": "used",
        "parallel_tool_calls": (None, True, False), "functions": (None, []), "function_call": (None, "none", "auto"),
        "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,), "reasoning_effort": (None,),
        "web_search_options": (None,), "verbosity": (None,),
    },
}  # fmt: skip


class RequestFieldError(ValueError):
    """A field refused: ``param`` names it (the service answers a 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Options:
    """The generation options beyond sampling: ``logprobs`` (alternatives per token; ``None``: no logprobs), ``echo``
    (completions: the prompt and, with ``logprobs``, its logprobs come first), OpenAI's penalties, and the JSON schema
    ``response_format`` asks for (``None``: free text)."""

    logprobs: int | None = None
    echo: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    json_schema: dict | None = None  # `response_format`: the schema the answer must satisfy ({"type": "object"}: json_object)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _top(value, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise RequestFieldError(f"`{field}` must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {describe(value)}", field)
    return value


def describe(value) -> str:
    """What a wrongly typed value is, for an error message: numbers, booleans and null as themselves, text
    and containers by their type alone (never their content: it may be prompt text, and errors are logged)."""
    if value is None or isinstance(value, bool) or _number(value):
        return json.dumps(value)
    return {str: "a string", dict: "an object", list: "a list"}.get(type(value), f"a {type(value).__name__}")


def check_fields(body: dict, kind: str) -> None:
    """Refuse a field this endpoint does not define, or one we cannot honour that asks for something."""
    table = FIELDS[kind]
    for key, value in body.items():
        rule = table.get(key)
        if rule is None:
            where = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
            raise RequestFieldError(f"unrecognized request argument `{key}` for {where}", key)
        if isinstance(rule, tuple) and not any(value == v and type(value) is type(v) for v in rule):
            allowed = ", ".join(map(json.dumps, rule))
            raise RequestFieldError(f"`{key}` is not supported by this server (allowed: {allowed})", key)


def read_options(body: dict, kind: str) -> Options:
    """The options of a request ``body`` (``kind``: ``"completion"`` or ``"chat"``), after :func:`check_fields`."""
    check_fields(body, kind)
    logprobs, echo = None, False
    if kind == "chat":
        on = body.get("logprobs")
        if on is not None and not isinstance(on, bool):
            raise RequestFieldError(f"`logprobs` must be true or false, got {describe(on)}", "logprobs")
        top = body.get("top_logprobs")
        if top is not None:
            _top(top, "top_logprobs")
            if not on:
                raise RequestFieldError("`top_logprobs` needs `logprobs` set to true", "top_logprobs")
        logprobs = (top or 0) if on else None
    else:
        if body.get("logprobs") is not None:
            logprobs = _top(body["logprobs"], "logprobs")
        echo = body.get("echo")
        if echo is not None and not isinstance(echo, bool):
            raise RequestFieldError(f"`echo` must be true or false, got {describe(echo)}", "echo")
    penalties = {}
    for field in ("presence_penalty", "frequency_penalty"):
        v = body.get(field)
        if v is not None and (not _number(v) or not -2 <= v <= 2):
            raise RequestFieldError(f"`{field}` must be a number from -2 to 2, got {describe(v)}", field)
        penalties[field] = float(v or 0)
    return Options(logprobs, bool(echo), **penalties, json_schema=_json_schema(body.get("response_format")))


def _json_schema(fmt) -> dict | None:
    """``response_format`` as the JSON schema the answer must satisfy (``None``: text)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema", {}) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RequestFieldError('`response_format.json_schema` must be an object with a `schema` object', "response_format")
        return schema
    raise RequestFieldError('`response_format` must be {"type": "text"}, {"type": "json_object"} or '
                            f'{{"type": "json_schema", "json_schema": {{...}}}}, got {describe(kind if kind else fmt)}',
                            "response_format")
