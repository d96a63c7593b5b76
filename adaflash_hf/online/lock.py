"""The round lock: decoding rounds share it while they draft; a weight swap takes it exclusively.

An online adapter registers it for its drafter (``adaflash_hf.speculation.hooks.DrafterHooks.weights_lock``);
every decoding loop holds it around a round's drafting, so new weights land only between rounds.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

__all__ = ["RoundLock"]


class RoundLock:
    """Reader-writer lock: rounds share it (``with lock:``), the weight swap takes it exclusively.

    Writer-preferring (a waiting swap holds off new rounds, so it cannot starve under load) and
    re-entrant for readers on the same thread.

    Example:
        >>> lock = RoundLock()
        >>> with lock:          # a round drafting
        ...     pass
        >>> with lock.exclusive():  # the swap
        ...     pass
    """

    def __init__(self):
        self._cv = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0
        self._local = threading.local()

    def __enter__(self):
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            with self._cv:
                while self._writer or self._writers_waiting:
                    self._cv.wait()
                self._readers += 1
        self._local.depth = depth + 1
        return self

    def __exit__(self, *exc):
        self._local.depth -= 1
        if self._local.depth == 0:
            with self._cv:
                self._readers -= 1
                if self._readers == 0:
                    self._cv.notify_all()
        return False

    @contextmanager
    def exclusive(self):
        if getattr(self._local, "depth", 0):
            raise RuntimeError("cannot swap weights from inside a round (this thread holds the round lock)")
        with self._cv:
            self._writers_waiting += 1
            try:
                while self._writer or self._readers:
                    self._cv.wait()
            finally:
                self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cv:
                self._writer = False
                self._cv.notify_all()

    @property
    def readers(self) -> int:
        return self._readers
