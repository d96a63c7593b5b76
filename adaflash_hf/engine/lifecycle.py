"""How a request starts and ends inside the engine: admit it to a slot, commit its tokens, finish, fail (one
request, or every request of a failed round), cancel; and the engine's health.

Fault isolation: a failure that belongs to one request (its ``on_token`` callback raised, its logits or
processed distribution were not finite) finishes that request with ``finish_reason="error"`` and
:attr:`EngineOutput.error`, frees its KV slots and leaves every other request running. A failure of the
round itself (the batched target forward, a kernel, out of memory) fails the requests in flight the same
way and marks the engine unhealthy (:attr:`Lifecycle.healthy` false, :attr:`last_error` set): the
engine keeps accepting ``step()`` calls, but a server should report itself down so a supervisor restarts it.

:class:`Lifecycle` owns the engine's queue and running list; it is handed the caches whose slots it frees and the sink
that hears of finished requests, and it is built and tested without an engine.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque

import torch

from ..speculation.rounds import FinishedRequest
from .requests import EngineOutput, Request

__all__ = ["Lifecycle", "NON_FINITE"]

logger = logging.getLogger(__name__)

NON_FINITE = "non-finite logits or probabilities for this request (not a valid distribution)"


class Lifecycle:
    """Where requests wait (:attr:`queue`), start (:meth:`admit`), run (:attr:`running`) and end: commit, finish,
    fail, cancel, reap.

    ``cache`` / ``dcache``: the target's and the drafter's slotted caches (``dcache`` may be ``None``); a request that
    starts takes a slot in both, one that ends frees it. ``on_request``: called with a
    :class:`~adaflash_hf.speculation.rounds.FinishedRequest` for each request that ends by EOS or length (settable).

    Example:
        >>> from types import SimpleNamespace
        >>> from adaflash_hf.engine.sampling import SamplingParams
        >>> cache = SimpleNamespace(free=lambda slot: None)
        >>> life = Lifecycle(cache, None)
        >>> r = Request(0, [1, 2], 3, SamplingParams(eos_token_id=9), None)
        >>> r.state, r.slot = "running", 0; life.running.append(r)
        >>> life.commit(r, [5, 9, 7])  # stops at EOS: 7 is never committed
        2
        >>> r.output.token_ids, r.output.finish_reason, life.running
        ([5, 9], 'eos', [])
    """

    def __init__(self, cache, dcache=None, on_request=None):
        self.cache, self.dcache, self.on_request = cache, dcache, on_request
        self.queue: deque[Request] = deque()
        self.running: list[Request] = []
        self.in_step = False  # set by the engine around a round: a cancellation then waits for the round's end
        self.healthy = True  # False after a round failed as a whole (sticky: restart the engine)
        self.last_error: str | None = None  # that failure, "ExceptionType: message"
        self.failure: Exception | None = None  # that failure's exception (an AsyncEngine re-raises it: its thread stops)

    def admit(self, running: int, limit: int, budget: int) -> list[Request]:
        """Queued requests, in order, that may join ``running`` others: while a slot is free, fewer than ``limit`` run
        and the next prompt fits what is left of ``budget`` tokens. Each gets its slot (the same id in both caches) and
        joins :attr:`running` (in flight from here: a failed round fails it too)."""
        queue, cache, dcache = self.queue, self.cache, self.dcache
        admitted: list[Request] = []
        while queue and cache.num_free > 0 and running + len(admitted) < limit and len(queue[0].prompt) <= budget:
            req = queue.popleft()
            req.slot = cache.alloc()
            if dcache is not None:
                dcache.alloc(req.slot)
            req.state = "running"
            self.running.append(req)
            admitted.append(req)
            budget -= len(req.prompt)
        return admitted

    def commit(self, r: Request, new: list[int], verify_len: int | None = None, logprobs=None) -> int:
        """Append tokens one by one; stop at EOS, ``max_new_tokens`` or a cancellation exactly where plain
        decoding would. ``verify_len``: ``new`` ends a verify round of that length, recorded (before the
        request can finish) with the tokens it emitted: fewer than accepted + 1 when it stopped inside.
        ``logprobs``: a :class:`~.processed_rows.LoggedToken` per token of ``new`` (a request that asked for them),
        kept in ``r.logprobs`` and handed to ``on_token`` in the token's place.
        A raising ``on_token`` callback fails this request only. Returns how many tokens it emitted (0: it failed)."""
        eos, emitted, reason = r.params.eos_ids, 0, None
        for k, tok in enumerate(new):
            r.tokens.append(tok)
            if logprobs is not None:
                tok = logprobs[k]
                r.logprobs.append(tok)
            if r.grammar is not None and not r.grammar.accept_token(int(tok)):  # masked rows never commit one
                self.fail(r, f"token {int(tok)} is outside the request's grammar")
                return 0
            emitted += 1
            if r.on_token is not None:
                try:
                    r.on_token(tok)
                except Exception as e:  # noqa: BLE001 - the caller's bug ends its own request only
                    self.fail(r, f"on_token callback raised {type(e).__name__}: {e}")
                    return 0
            ended = tok in eos or (r.grammar is not None and r.grammar.is_terminated())  # a grammar's stop token too
            reason = ("eos" if ended else "length" if len(r.tokens) >= r.max_new
                      else "cancelled" if r.cancel_requested else None)
            if reason is not None:
                break
        if verify_len is not None:
            r.accepted.append(emitted - 1)
            r.verify_lengths.append(verify_len)
        if reason is not None:
            self.finish(r, reason)
        return emitted

    def finish(self, r: Request, reason: str, error: str | None = None) -> None:
        """End ``r`` (once): out of the queue or the running list, its slots freed, its output made."""
        if r.output is not None:
            return
        if r.state == "running":
            self.running.remove(r)
            self.cache.free(r.slot)
            if self.dcache is not None:
                self.dcache.free(r.slot)
        elif r.state == "queued":
            self.queue.remove(r)
        r.state, r.pending_ctx = "done", None
        r.output = EngineOutput(r.id, list(r.prompt), list(r.tokens), reason, list(r.accepted),
                                list(r.verify_lengths), error=error,
                                logprobs=list(r.logprobs) if r.params.logprobs is not None else None)
        if self.on_request is not None and reason not in ("cancelled", "error"):
            self.on_request(FinishedRequest(r.id, torch.tensor(r.prompt), torch.tensor(r.tokens)))

    def fail(self, r: Request, error: str) -> None:
        """Finish ``r`` alone with ``finish_reason="error"``; its slots are freed."""
        logger.warning("request %d failed: %s", r.id, error)
        self.finish(r, "error", error)

    def fail_round(self, exc: Exception) -> None:
        """The round failed as a whole: fail every request in flight, mark the engine unhealthy."""
        logger.error("engine round failed; failing %d request(s) in flight", len(self.running), exc_info=exc)
        self.healthy, self.last_error, self.failure = False, f"{type(exc).__name__}: {exc}", exc
        for r in list(self.running):
            self.fail(r, f"engine failure: {self.last_error}")

    def cancel(self, r: Request) -> None:
        """Cancel ``r``: at once outside a round, else where the round's commit or its end (:meth:`reap`) sees it."""
        if r.output is not None:
            return
        r.cancel_requested = True
        if not self.in_step:
            self.finish(r, "cancelled")

    def reap(self) -> None:
        """Finish every request whose cancellation is pending."""
        for r in [r for r in itertools.chain(self.running, self.queue) if r.cancel_requested]:
            self.finish(r, "cancelled")
