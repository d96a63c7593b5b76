"""What an engine counts as it runs (:class:`EngineStats`) and the phase timer profiling attaches (:class:`PhaseTimer`).

Both are plain objects the engine's parts are handed when built and update in place: the round's code neither asks
whether profiling is on nor where a counter lives.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

__all__ = ["EngineStats", "PhaseTimer"]


@dataclass
class EngineStats:
    """An engine's running counts (benchmarks, tests; the engine shows each as its own attribute too).

    Example:
        >>> s = EngineStats()
        >>> s.num_steps += 2; s.forward_tokens += [3, 1]
        >>> s.num_steps, s.forward_tokens
        (2, [3, 1])
    """

    num_steps: int = 0  # target forwards (a queued plain stretch counts each step)
    forward_tokens: list[int] = field(default_factory=list)  # tokens per target forward
    skipped_drafts: int = 0  # rounds whose drafter forward was skipped (nothing could be verified)
    host_syncs: int = 0  # device -> host reads the round logic makes (1 per fixed round, 2 with the length head)
    whole_rounds: int = 0  # drafting rounds that verified whole blocks chosen before their ratios
    wide_rounds: int = 0  # rounds that verified past the block (the prompt n-gram rule's `max_width`)
    ngram_used: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.long))  # on the device


class PhaseTimer:
    """Where a round's time goes: :meth:`mark` charges the time since the last mark to a phase (``None``: none) after a
    device synchronisation. Off (the default), :meth:`mark` is a function that does nothing, so the round calls it
    unconditionally; :attr:`enabled` switches it.

    Example:
        >>> timer = PhaseTimer(torch.device("cpu"), enabled=True)
        >>> timer.mark(None); timer.mark("draft"); sorted(timer.seconds)
        ['draft']
    """

    def __init__(self, device: torch.device, enabled: bool = False):
        self.device = device
        self.seconds: Counter = Counter()  # phase -> seconds (draft / target / accept / host)
        self.steps = 0  # rounds timed
        self._last = 0.0
        self.enabled = enabled

    @property
    def enabled(self) -> bool:
        return self.mark == self._mark

    @enabled.setter
    def enabled(self, on: bool) -> None:
        self.mark = self._mark if on else _unmarked
        self.end_step = self._end_step if on else _unmarked

    def _mark(self, phase: str | None) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        if phase is not None:
            self.seconds[phase] += now - self._last
        self._last = now

    def _end_step(self, did: bool) -> None:
        """The round's last mark (``host``); ``did``: it ran a round."""
        self._mark("host")
        self.steps += int(did)


def _unmarked(_) -> None:
    """What :meth:`PhaseTimer.mark` is while profiling is off."""
