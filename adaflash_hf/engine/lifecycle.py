"""How a request ends inside the engine: commit its tokens, finish, fail (one request, or every request of a
failed round), cancel; and the engine's health.

Fault isolation: a failure that belongs to one request (its ``on_token`` callback raised, its logits or
processed distribution were not finite) finishes that request with ``finish_reason="error"`` and
:attr:`EngineOutput.error`, frees its KV slots and leaves every other request running. A failure of the
round itself (the batched target forward, a kernel, out of memory) fails the requests in flight the same
way and marks the engine unhealthy (:attr:`RequestLifecycle.healthy` false, :attr:`last_error` set): the
engine keeps accepting ``step()`` calls, but a server should report itself down so a supervisor restarts it.
"""

from __future__ import annotations

import itertools
import logging

import torch

from ..speculation.rounds import FinishedRequest
from .requests import EngineOutput, Request

__all__ = ["NON_FINITE", "RequestLifecycle"]

logger = logging.getLogger(__name__)

NON_FINITE = "non-finite logits or probabilities for this request (not a valid distribution)"


class RequestLifecycle:
    """Mixin of :class:`~.engine.Engine` (it owns ``_running``, ``_queue``, ``cache``, ``dcache``,
    ``on_request`` and ``_in_step``)."""

    healthy: bool = True  # False after a round failed as a whole (sticky: restart the engine)
    last_error: str | None = None  # that failure, "ExceptionType: message"
    failure: Exception | None = None  # that failure's exception (an AsyncEngine re-raises it: its thread stops)

    def _commit(self, r: Request, new: list[int], verify_len: int | None = None, logprobs=None) -> None:
        """Append tokens one by one; stop at EOS, ``max_new_tokens`` or a cancellation exactly where plain
        decoding would. ``verify_len``: ``new`` ends a verify round of that length, recorded (before the
        request can finish) with the tokens it emitted: fewer than accepted + 1 when it stopped inside.
        ``logprobs``: a :class:`~.processed_rows.LoggedToken` per token of ``new`` (a request that asked for them),
        kept in ``r.logprobs`` and handed to ``on_token`` in the token's place.
        A raising ``on_token`` callback fails this request only."""
        eos, emitted, reason = r.params.eos_ids, 0, None
        for k, tok in enumerate(new):
            r.tokens.append(tok)
            if logprobs is not None:
                tok = logprobs[k]
                r.logprobs.append(tok)
            if r.grammar is not None and not r.grammar.accept_token(int(tok)):  # masked rows never commit one
                self._fail(r, f"token {int(tok)} is outside the request's grammar")
                return
            emitted += 1
            if r.on_token is not None:
                try:
                    r.on_token(tok)
                except Exception as e:  # noqa: BLE001 - the caller's bug ends its own request only
                    self._fail(r, f"on_token callback raised {type(e).__name__}: {e}")
                    return
            ended = tok in eos or (r.grammar is not None and r.grammar.is_terminated())  # a grammar's stop token too
            reason = ("eos" if ended else "length" if len(r.tokens) >= r.max_new
                      else "cancelled" if r.cancel_requested else None)
            if reason is not None:
                break
        if verify_len is not None:
            r.accepted.append(emitted - 1)
            r.verify_lengths.append(verify_len)
            self.planner.observe(r, emitted - 1, verify_len)
        if reason is not None:
            self._finish(r, reason)

    def _finish(self, r: Request, reason: str, error: str | None = None) -> None:
        if r.output is not None:
            return
        if r.state == "running":
            self._running.remove(r)
            self.cache.free(r.slot)
            if self.dcache is not None:
                self.dcache.free(r.slot)
        elif r.state == "queued":
            self._queue.remove(r)
        r.state, r.pending_ctx = "done", None
        r.output = EngineOutput(r.id, list(r.prompt), list(r.tokens), reason, list(r.accepted),
                                list(r.verify_lengths), error=error,
                                logprobs=list(r.logprobs) if r.params.logprobs is not None else None)
        if self.on_request is not None and reason not in ("cancelled", "error"):
            self.on_request(FinishedRequest(r.id, torch.tensor(r.prompt), torch.tensor(r.tokens)))

    def _fail(self, r: Request, error: str) -> None:
        """Finish ``r`` alone with ``finish_reason="error"``; its slots are freed."""
        logger.warning("request %d failed: %s", r.id, error)
        self._finish(r, "error", error)

    def _fail_round(self, exc: Exception) -> None:
        """The round failed as a whole: fail every request in flight, mark the engine unhealthy."""
        logger.error("engine round failed; failing %d request(s) in flight", len(self._running), exc_info=exc)
        self.healthy, self.last_error, self.failure = False, f"{type(exc).__name__}: {exc}", exc
        for r in list(self._running):
            self._fail(r, f"engine failure: {self.last_error}")

    def _cancel(self, r: Request) -> None:
        if r.output is not None:
            return
        r.cancel_requested = True
        if not self._in_step:
            self._finish(r, "cancelled")

    def _reap_cancelled(self) -> None:
        for r in [r for r in itertools.chain(self._running, self._queue) if r.cancel_requested]:
            self._finish(r, "cancelled")
