"""Tool calls in the hermes format Qwen3's chat template teaches (``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>``), read back as OpenAI ``tool_calls`` the way vLLM's hermes parser reads them: the message's content is
the text before the first ``<tool_call>`` (``None`` when empty), each tag's JSON one call (an unclosed last tag too),
and a call whose JSON does not parse leaves the whole text as content with no calls. Streamed, the content goes out
as it comes, held back only while it could be the start of a tag; each call goes out whole when its tag closes.

``tool_choice``: ``"auto"`` (default with tools) lets the model choose; ``"none"`` leaves the tools out of the prompt;
``"required"`` or a named function forces one call through the request's grammar (:mod:`adaflash_hf.engine.grammar`):
the tags around a JSON object whose ``name`` is a given tool and whose ``arguments`` satisfy its parameters.

Example:
    >>> content, calls = parse_tool_calls('Sure.<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>')
    >>> content, calls[0]["function"]
    ('Sure.', {'name': 'f', 'arguments': '{"x": 1}'})
"""

from __future__ import annotations

import json
import re
import uuid

from .options import RequestFieldError, describe

__all__ = ["START", "END", "ToolStream", "forced_call", "parse_tool_calls", "read_tools", "tool_fields"]

START, END = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def read_tools(body: dict) -> tuple[list[dict] | None, str | dict | None]:
    """``tools`` (OpenAI's ``[{"type": "function", "function": {"name", "description", "parameters"}}]``) and
    ``tool_choice`` checked; ``(tools for the chat template or None, choice)``: choice ``None`` (no tools, or
    ``"none"``), ``"auto"``, ``"required"`` or a tool's name."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None:
        if not isinstance(tools, list) or not all(_is_tool(t) for t in tools):
            raise RequestFieldError('`tools` must be a list of {"type": "function", "function": {"name": ...}} objects, '
                                    f"got {describe(tools)}", "tools")
    names = [t["function"]["name"] for t in tools or []]
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise RequestFieldError('`tool_choice` must name one of `tools` as {"type": "function", "function": '
                                    '{"name": ...}}', "tool_choice")
        choice = name
    elif choice not in (None, "none", "auto", "required"):
        raise RequestFieldError(f'`tool_choice` must be "none", "auto", "required" or a function, got {describe(choice)}',
                                "tool_choice")
    if choice == "required" and not names:
        raise RequestFieldError('`tool_choice` "required" needs `tools`', "tool_choice")
    if not names or choice == "none":
        return None, None
    return tools, choice or "auto"


def tool_fields(message: dict, i: int) -> dict:
    """What the chat template reads of message ``i`` beside its role and content: an assistant turn's ``tool_calls``
    (each ``{"id", "type": "function", "function": {"name", "arguments"}}``), a tool turn's ``tool_call_id``."""
    out = {}
    calls = message.get("tool_calls")
    if calls is not None and message["role"] == "assistant":
        fns = [c.get("function") if isinstance(c, dict) else None for c in calls] if isinstance(calls, list) else [None]
        if not all(isinstance(f, dict) and isinstance(f.get("name"), str) for f in fns):
            raise RequestFieldError(f'`messages[{i}].tool_calls` must be a list of {{"function": {{"name", "arguments"}}}} '
                                    "objects", "messages")
        out["tool_calls"] = calls
    if message["role"] == "tool" and isinstance(message.get("tool_call_id"), str):
        out["tool_call_id"] = message["tool_call_id"]
    return out


def _is_tool(t) -> bool:
    fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
    return isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("parameters", {}), dict)


def forced_call(tools: list[dict], choice: str) -> dict | None:
    """The JSON schema of the one call ``choice`` forces (``"required"``: any of ``tools``; a name: that one), or
    ``None`` (``"auto"``: nothing forced)."""
    if choice == "auto":
        return None

    def call(t):
        fn = t["function"]
        return {"type": "object", "properties": {"name": {"const": fn["name"]},
                                                 "arguments": fn.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False}

    chosen = [call(t) for t in tools if choice == "required" or t["function"]["name"] == choice]
    return chosen[0] if len(chosen) == 1 else {"anyOf": chosen}


def _call(obj, index: int | None = None) -> dict:
    args = obj.get("arguments", {})
    out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
           "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}
    return out if index is None else {"index": index, **out}


def _parse(raw: str):
    """One tag's JSON as a call object, or ``None`` when it is not ``{"name": str, ...}``."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) and isinstance(obj.get("name"), str) else None


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of a whole answer (no ``<tool_call>``: the text itself, no calls)."""
    if START not in text:
        return text, []
    objs = [_parse(a if a else b) for a, b in _CALL.findall(text)]
    if any(o is None for o in objs):
        return text, []
    content = text[: text.index(START)]
    return content or None, [_call(o) for o in objs]


class ToolStream:
    """One streamed choice's text split into content deltas and tool-call deltas (:meth:`feed`, then :meth:`close`),
    equal in the end to :func:`parse_tool_calls` of the whole text."""

    def __init__(self):
        self.text, self.sent, self.calls = "", 0, 0  # all text, content sent, calls sent
        self.tagged = False  # a <tool_call> has begun: nothing more goes out as content until the end

    def feed(self, piece: str) -> tuple[str, list[dict]]:
        """``(content to send, tool calls to send)`` after ``piece``."""
        self.text += piece
        if not self.tagged:
            at = self.text.find(START)
            if at < 0:
                end = len(self.text) - _partial(self.text)
                out, self.sent = self.text[self.sent : end], max(self.sent, end)
                return out, []
            self.tagged = True
            out, self.sent = self.text[self.sent : at], at
            return out, self._closed()
        return "", self._closed()

    def _closed(self) -> list[dict]:
        """The calls whose tags closed since the last ones sent (all must parse, else none: see :meth:`close`)."""
        done = re.findall(r"<tool_call>(.*?)</tool_call>", self.text[self.sent :], re.DOTALL)
        objs = [_parse(raw) for raw in done[self.calls :]]
        if any(o is None for o in objs):
            return []
        calls = [_call(o, self.calls + k) for k, o in enumerate(objs)]
        self.calls += len(calls)
        return calls

    def close(self) -> tuple[str, list[dict]]:
        """The end: the last calls (an unclosed last tag too), or, when some tag's JSON does not parse and nothing was
        sent as a call yet, the held text as content."""
        content, calls = parse_tool_calls(self.text)
        if not calls:
            if self.calls:  # calls already went out: the rest cannot be content any more
                return "", []
            out, self.sent = self.text[self.sent :], len(self.text)
            return out, []
        new = calls[self.calls :]
        for k, c in enumerate(new):
            c["index"] = self.calls + k
        self.calls += len(new)
        return "", new

    @property
    def called(self) -> bool:
        return self.calls > 0


def _partial(text: str) -> int:
    """Characters at the end of ``text`` that may begin ``<tool_call>``."""
    for k in range(min(len(START) - 1, len(text)), 0, -1):
        if text.endswith(START[:k]):
            return k
    return 0
