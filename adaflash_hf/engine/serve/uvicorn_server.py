"""uvicorn's server, stopped also by a check of ours (an engine failure) on its own 0.1 s tick."""

from __future__ import annotations

from typing import Callable

import uvicorn

__all__ = ["TickServer"]


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
