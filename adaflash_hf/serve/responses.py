"""OpenAI's response shapes for :class:`~.service.CompletionService`: whole answers, stream chunks, usage, logprobs,
and a chat answer's tool calls (:mod:`.tools`), streamed or not.

Example::

    answers = [await gen.text() for gen in gens]          # (text, logprob entries) per choice
    shapes = ResponseShapes("adaflash", svc.token_text)     # a service's own: svc.shapes
    body = shapes.response(req, gens, answers, "chatcmpl-1")  # {"choices": [{"message": ..., "logprobs": ...}], ...}
"""

from __future__ import annotations

import time

from .logprobs import chat_logprobs, completion_logprobs
from .tools import ToolStream, parse_tool_calls

__all__ = ["ResponseShapes"]


class ResponseShapes:
    """The bodies and chunks a service answers with (module doc).

    Args:
        model_name: the ``model`` every answer names.
        token_text: one token id's text, as logprobs name it (the service's
            :meth:`~.service.CompletionService.token_text`).
    """

    def __init__(self, model_name: str, token_text):
        self.model_name, self.token_text = model_name, token_text

    def usage(self, req, gens) -> dict:
        n, done = sum(map(len, req.prompts)), sum(gen.completion_tokens for gen in gens)
        return {"prompt_tokens": n, "completion_tokens": done, "total_tokens": n + done}

    def logprobs(self, req, entries: list[tuple] | None) -> dict | None:
        """A choice's (or a chunk's) ``logprobs`` object, in the endpoint's shape; ``None`` when not asked for."""
        if req.options.logprobs is None or entries is None:
            return None
        shape = chat_logprobs if req.kind == "chat" else completion_logprobs
        return shape(entries, self.token_text)

    def response(self, req, gens, answers: list[tuple[str, list]], rid: str) -> dict:
        """The whole answer; ``answers``: each choice's ``await gen.text()``."""
        base = {"id": rid, "created": int(time.time()), "model": self.model_name}
        if req.kind == "chat":
            choices = []
            for i, (gen, (text, entries)) in enumerate(zip(gens, answers)):
                message, finish = {"role": "assistant", "content": text}, gen.finish_reason
                if req.tools is not None:
                    content, calls = parse_tool_calls(text)
                    if calls:  # as vLLM: the content before the first call, finish_reason "tool_calls"
                        message, finish = {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
                choices.append({"index": i, "message": message, "logprobs": self.logprobs(req, entries),
                                "finish_reason": finish})
            return {**base, "object": "chat.completion", "choices": choices, "usage": self.usage(req, gens)}
        choices = [{"index": i, "text": text, "logprobs": self.logprobs(req, entries), "finish_reason": gen.finish_reason}
                   for i, (gen, (text, entries)) in enumerate(zip(gens, answers))]
        return {**base, "object": "text_completion", "choices": choices, "usage": self.usage(req, gens)}

    def tool_streams(self, req, gens) -> list[ToolStream | None]:
        """One :class:`ToolStream` per streamed chat choice when the request has tools (else ``None`` each)."""
        return [ToolStream() if req.tools is not None else None for _ in gens]

    def piece_chunks(self, req, rid: str, index: int, piece: tuple[str, list], tools: ToolStream | None) -> list[dict]:
        """The chunks of one streamed piece ``(text, logprob entries)`` of choice ``index``."""
        text, entries = piece
        if tools is None:
            return [self.chunk(req, rid, text=text, index=index, entries=entries)]
        content, calls = tools.feed(text)
        return self._tool_chunks(req, rid, index, content, calls, entries)

    def finish_chunks(self, req, rid: str, index: int, gen, tools: ToolStream | None) -> list[dict]:
        """Choice ``index``'s last chunks: what its tool stream still held, then the finish reason."""
        out = []
        finish = gen.finish_reason
        if tools is not None:
            content, calls = tools.close()
            out = self._tool_chunks(req, rid, index, content, calls, None) if content or calls else []
            finish = "tool_calls" if tools.called else finish
        return out + [self.chunk(req, rid, finish=finish, text="" if req.kind != "chat" else None, index=index)]

    def _tool_chunks(self, req, rid, index, content: str, calls: list[dict], entries) -> list[dict]:
        out = [self.chunk(req, rid, text=content, index=index, entries=entries)] if content or entries else []
        if calls:
            chunk = self.chunk(req, rid, index=index)
            chunk["choices"][0]["delta"] = {"tool_calls": calls}
            out.append(chunk)
        return out

    def chunk(self, req, rid: str, text: str | None = None, finish: str | None = None,
              role: bool = False, usage: dict | None = None, index: int = 0, entries: list | None = None) -> dict:
        obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
        out = {"id": rid, "object": obj, "created": int(time.time()), "model": self.model_name}
        if usage is not None:
            return {**out, "choices": [], "usage": usage}
        logprobs = self.logprobs(req, entries)
        if req.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        return {**out, "choices": [choice]}
