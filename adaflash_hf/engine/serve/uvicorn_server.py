"""uvicorn's server, stopped also by a check of ours (an engine failure) on its own 0.1 s tick, and its
h11 protocol, which also closes a connection that sends nothing (uvicorn times out only idle keep-alive
connections, after a response). The one place that reaches into uvicorn: tests/test_server_http.py
checks both behaviours."""

from __future__ import annotations

from typing import Callable

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["QuietConnectionTimeout", "TickServer"]


class TickServer(uvicorn.Server):
    """A :class:`uvicorn.Server` that also stops (gracefully) once ``should_stop()`` returns True.

    Example::

        TickServer(uvicorn.Config(app), should_stop=lambda: False).run(sockets=[sock])
    """

    def __init__(self, config: uvicorn.Config, should_stop: Callable[[], bool]):
        super().__init__(config)
        self.should_stop = should_stop

    async def on_tick(self, counter: int) -> bool:
        return await super().on_tick(counter) or self.should_stop()


class QuietConnectionTimeout(H11Protocol):
    """h11 that arms the keep-alive timer when a connection opens, so a client that connects and sends
    nothing is closed after ``timeout_keep_alive`` (the first bytes disarm it, as uvicorn does).

    Example::

        uvicorn.Config(app, http=QuietConnectionTimeout, timeout_keep_alive=5)
    """

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)
