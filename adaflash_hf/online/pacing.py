"""How much of the wall clock an online update may take from the engine beside it.

An update trains in a thread of the serving process: its Python (autograd, optimizer, kernel launches) takes
the GIL from the engine's host loop, and its kernels share the GPU, so an update training flat out beside the
engine slows serving. :class:`Pacer` bounds that: after each optimizer step it sleeps (holding neither the GIL nor the GPU)
so that steps take at most ``share`` of the wall time; the update then lasts ``1 / share`` times longer.
"""

from __future__ import annotations

import math
import time

__all__ = ["Pacer"]


class Pacer:
    """Keeps a worker's busy share of wall time at or below ``share`` (1.0: never sleeps).

    Call :meth:`start` before a step and :meth:`done` after it; ``done`` sleeps ``busy * (1 / share - 1)``,
    where ``busy`` is the step's wall time (the step ends with a host read of its loss, so on CUDA this is
    its device time too).

    Example:
        >>> slept = []
        >>> pacer = Pacer(0.25, clock=iter([0.0, 1.0]).__next__, sleep=slept.append)
        >>> pacer.start(); pacer.done(); slept
        [3.0]
    """

    def __init__(self, share: float = 1.0, clock=None, sleep=None):
        if not (math.isfinite(share) and 0 < share <= 1):
            raise ValueError(f"train_share must be in (0, 1], got {share}")
        self.share, self._clock, self._sleep = float(share), clock or time.perf_counter, sleep or time.sleep
        self._t0: float | None = None
        self.slept = 0.0

    def start(self) -> None:
        self._t0 = self._clock() if self.share < 1 else None

    def done(self) -> None:
        if self._t0 is None:
            return
        pause = (self._clock() - self._t0) * (1.0 / self.share - 1.0)
        self._t0 = None
        if pause > 0:
            self._sleep(pause)
            self.slept += pause
