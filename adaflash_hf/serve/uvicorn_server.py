"""uvicorn's server, stopped also by a check of ours (an engine failure, a drain finished) on its own 0.1 s tick,
its first SIGTERM / SIGINT handed to us (to drain before stopping), and its
h11 protocol with the connection guards uvicorn lacks: a connection that sends nothing is closed after
the keep-alive timeout, one that has not finished a request's headers ``header_timeout_s`` after their
first byte gets a 408 and is closed, and past ``max_connections`` a new connection gets a 503 and is
closed at once.

uvicorn's own ``limit_concurrency`` is not enough here: it answers 503 only once a request's headers are
in, so connections that never finish theirs are not counted out. The one place that reaches into
uvicorn (``H11Protocol``'s ``conn``, ``connections``, ``transport``, ``client``, ``timeout_keep_alive_task``,
``timeout_keep_alive_handler``, ``data_received`` and ``on_response_complete``): tests/test_server_http.py
checks each behaviour, so a change there fails loudly.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Callable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .service import APIError
from .settings import ServeSettings

__all__ = ["GuardedH11", "TickServer", "guarded_h11"]

log = logging.getLogger("adaflash_hf.server")


class TickServer(uvicorn.Server):
    """A :class:`uvicorn.Server` that also stops (gracefully) once ``should_stop()`` returns True. With
    ``on_signal``, the first two SIGTERM / SIGINT call it instead of stopping (the server keeps serving until
    ``should_stop()``: a drain, then a drain cut short); a third stops as uvicorn does. Either way the signal is
    raised again once the server has stopped, as uvicorn does.

    Example::

        TickServer(uvicorn.Config(app), should_stop=lambda: False).run(sockets=[sock])
    """

    def __init__(self, config: uvicorn.Config, should_stop: Callable[[], bool],
                 on_signal: Callable[[], None] | None = None):
        super().__init__(config)
        self.should_stop, self.on_signal = should_stop, on_signal

    def handle_exit(self, sig, frame) -> None:
        if self.on_signal is None or len(self._captured_signals) >= 2:
            return super().handle_exit(sig, frame)
        self._captured_signals.append(sig)
        self.on_signal()

    async def on_tick(self, counter: int) -> bool:
        return await super().on_tick(counter) or self.should_stop()


class GuardedH11(H11Protocol):
    """h11 with a header deadline and a connection cap (the class attributes; :func:`guarded_h11` sets them).
    The deadline runs from a request's first byte to the end of its headers; a connection silent since it
    opened (or since its last answer) is uvicorn's keep-alive timer's.

    Example::

        uvicorn.Config(app, http=guarded_h11(ServeSettings(header_timeout_s=5)), timeout_keep_alive=5)
    """

    header_timeout_s: float = 10.0
    max_connections: int = 1024
    on_refuse: Callable[[int], None] | None = None  # counts each refusal by status (the server's metrics)
    _header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:  # this one included
            n = self.max_connections
            self._refuse(503, f"the server is at its limit of {n} open connections; retry shortly", b"retry-after: 1\r\n")
            return
        # uvicorn arms the keep-alive timer only after a response: arm it now, so a silent client is closed too
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may parse a pipelined request's first bytes
        self._watch_headers()

    def connection_lost(self, exc) -> None:
        self._stop_header_deadline()
        super().connection_lost(exc)

    def _watch_headers(self) -> None:
        """Arm the deadline when a request's first bytes are in and its headers are not; disarm it once they are."""
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            if self._header_deadline is None:
                self._header_deadline = self.loop.call_later(self.header_timeout_s, self._header_deadline_passed)
        else:
            self._stop_header_deadline()

    def _stop_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _header_deadline_passed(self) -> None:
        self._header_deadline = None
        if not self.transport.is_closing():
            self._refuse(408, f"the request headers did not arrive within {self.header_timeout_s:g} s")

    def _refuse(self, status: int, message: str, extra_headers: bytes = b"") -> None:
        """Answer ``status`` with OpenAI's error JSON and close, outside h11 (no request was parsed)."""
        body = json.dumps(APIError(status, message).body()).encode()
        reason = {408: b"Request Timeout", 503: b"Service Unavailable"}[status]
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n%s\r\n%s" % (status, reason, len(body), extra_headers, body))
        self.transport.close()
        client = (self.client or ("-",))[0]
        log.info("%s - - %d error=%s", client, status, json.dumps(message))
        if self.on_refuse is not None:
            self.on_refuse(status)


def guarded_h11(settings: ServeSettings, on_refuse: Callable[[int], None] | None = None) -> type[GuardedH11]:
    """The protocol class for ``uvicorn.Config(http=...)`` with ``settings``' header deadline and connection cap
    and ``on_refuse(status)`` (uvicorn builds the protocol from the class alone, so they travel as class
    attributes)."""
    return type("GuardedH11", (GuardedH11,), {"header_timeout_s": settings.header_timeout_s,
                                              "max_connections": settings.max_connections,
                                              "on_refuse": staticmethod(on_refuse) if on_refuse else None})
