"""What an online adapter counts, under one lock: the rounds it serves (tau and the length head's error since the
newest swap, and per version), the updates' history, refusals, failures and rollbacks, and the version serving.

The serving side writes it once per round (:meth:`OnlineCounters.observe_round`), the update loop once per update;
:meth:`OnlineCounters.snapshot` reads it whole (the adapter's ``stats``).

Example:
    >>> from adaflash_hf.online.guard import RollbackWatch
    >>> counters = OnlineCounters(RollbackWatch(rounds=0, margin=0.1))
    >>> counters.observe_round(3, head_error=None)
    False
    >>> counters.tau_since_update, counters.snapshot()["rounds_seen"]
    (3.0, 1)
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import asdict, dataclass, field

from .guard import RollbackWatch

__all__ = ["OnlineCounters", "UpdateRecord"]


@dataclass
class UpdateRecord:
    """One finished update. ``tau_before``: mean tokens per round (accepted + 1) served since the
    previous swap; ``tau_after``: the same for the rounds served with this update's weights
    (running until the next update). ``head_mae_before`` / ``head_mae_after``: the length head's mean
    absolute error ``|ratio - (accepted + 1) / B|`` on the same served rounds (those whose block the
    verify length did not cut), i.e. on rounds no update had trained on yet. ``grad_norm``: the drafter's
    mean gradient norm per step before clipping.

    The guard (:mod:`~adaflash_hf.online.guard`): ``held_back`` requests judged the update,
    ``guard_serving`` / ``guard_candidate`` are the serving weights' and the trained shadow's ``accept_len`` on
    them (None when the guard is off), ``guard_gain`` / ``guard_gain_se`` the candidate's paired gain in accepted
    drafts per block and its standard error across those requests; ``swapped`` is False for a refused update (its
    ``version`` is None, ``path`` the folder it was kept aside in, ``tau_before`` the tau served so far with the
    weights it did not replace, ``update`` the number it would have had). A rollback is its own record:
    ``rollback_of`` names the update undone, ``version`` the restored weights' new version, ``tau_before`` the tau
    served with the undone weights. ``base_version``: the version serving when the update was trained, which it
    continues from (0: the weights the adapter started with)."""

    update: int
    samples: int
    loss_first: float | None
    loss_last: float | None
    head_loss_last: float | None
    tau_before: float | None
    rounds_before: int
    tau_after: float | None = None
    rounds_after: int = 0
    head_mae_before: float | None = None
    head_mae_after: float | None = None
    seconds: float = 0.0
    grad_norm: float | None = None
    version: int | None = None
    path: str | None = None
    domains: dict = field(default_factory=dict)
    swapped: bool = True
    held_back: int = 0
    guard_serving: float | None = None
    guard_candidate: float | None = None
    guard_gain: float | None = None
    guard_gain_se: float | None = None
    rollback_of: int | None = None
    base_version: int | None = None


class OnlineCounters:
    """The adapter's counters and served-tau bookkeeping (module doc); every method takes the one lock itself.

    Args:
        rollback: the :class:`~adaflash_hf.online.guard.RollbackWatch` that judges each swap from the served
            rounds (it is not locked itself: these counters call it under their lock).
        start_version: the version serving at the start (0: the weights the adapter was given).
    """

    def __init__(self, rollback: RollbackWatch, start_version: int = 0):
        self._lock = threading.Lock()
        self.rollback = rollback
        self.start_version = start_version
        self._version_serving = start_version  # the newest version written (start_version until then)
        self._tau_sum = 0
        self._tau_n = 0
        self._head_err = [0.0, 0]  # the length head's absolute error on served rounds since the last swap
        self._last_swap_tau: tuple[float | None, int] = (None, 0)
        self._last_swap_mae: float | None = None
        # verify rounds served and drafts they accepted, by the version serving them (the server's live acceptance)
        self._served_by_version: dict[int, list[int]] = {}
        self._rollback_due: dict | None = None  # set by a round, taken by the update loop
        self.rounds_seen = 0
        self.updates = 0
        self.failures = 0
        self.consecutive_failures = 0
        self.sample_errors = 0
        self.swaps_refused = 0
        self.rollbacks = 0
        self.last_loss: float | None = None
        self.last_error: str | None = None
        self.last_refusal: dict | None = None
        self.history: list[UpdateRecord] = []
        self.domains_seen: Counter = Counter()

    # ------------------------------------------------------------------ the serving side
    def observe_round(self, tokens: int, head_error: float | None) -> bool:
        """Count one served round of ``tokens`` (accepted + 1) and the length head's error on it (None: not
        measurable). True when this round decided a rollback (:meth:`take_rollback` hands it over)."""
        with self._lock:
            self._tau_sum += tokens
            self._tau_n += 1
            self.rounds_seen += 1
            if head_error is not None:
                self._head_err[0] += head_error
                self._head_err[1] += 1
            due = self.rollback.observe(tokens)
            if due is not None:
                self._rollback_due = due
            counts = self._served_by_version.setdefault(self._version_serving, [0, 0])
            counts[0] += 1
            counts[1] += tokens - 1
        return due is not None

    def sample_error(self) -> None:
        """Count a round or request that could not be buffered."""
        with self._lock:
            self.sample_errors += 1

    @property
    def tau_since_update(self) -> float | None:
        """Mean tokens per round served since the newest swap (None before any round)."""
        with self._lock:
            return self._tau_sum / self._tau_n if self._tau_n else None

    # ------------------------------------------------------------------ the update loop's side
    @property
    def rollback_due(self) -> bool:
        """Whether a rollback was decided and not yet taken."""
        return self._rollback_due is not None

    def take_rollback(self) -> dict | None:
        """The rollback decided (:meth:`~adaflash_hf.online.guard.RollbackWatch.observe`'s dict), once; else None."""
        with self._lock:
            due, self._rollback_due = self._rollback_due, None
        return due

    @property
    def can_judge(self) -> bool:
        """Whether a swap now would be judged by the rollback watch (so its replaced weights are worth keeping)."""
        return self.rollback.can_judge

    def swapped(self, judge: tuple[dict | None, int] | None) -> None:
        """New weights serve from now on: close the served-tau window of the weights they replaced and start a new
        one. ``judge``: (the replaced weights or None, update number) for the rollback watch; None for a rollback,
        after which the rounds served with the undone weights judge nothing more."""
        with self._lock:
            self._last_swap_tau = (self._tau_sum / self._tau_n if self._tau_n else None, self._tau_n)
            self._tau_sum, self._tau_n = 0, 0
            self._last_swap_mae = self._head_err[0] / self._head_err[1] if self._head_err[1] else None
            self._head_err = [0.0, 0]
            if judge is None:
                self.rollback.reset()
            else:
                self.rollback.arm(*judge)

    def served_version(self) -> int:
        """The version serving now (``start_version`` until one is written; a swap not yet written counts under the
        newest version written)."""
        with self._lock:
            return self._version_serving

    def _serving_record(self) -> UpdateRecord | None:
        return next((r for r in reversed(self.history) if r.swapped), None)

    def serving_on_disk(self) -> set[int]:
        """The version on disk whose weights serve now, which pruning keeps (none while a swap is being written)."""
        with self._lock:
            record = self._serving_record()
            return {self.start_version} if record is None else ({record.version} if record.version else set())

    def record_swapped(self, record: UpdateRecord) -> None:
        """Append the record of weights just swapped in (an update or a rollback): its tau_before is what served
        since the previous swap, which is that swap's record's tau_after."""
        with self._lock:
            record.tau_before, record.rounds_before = self._last_swap_tau
            record.head_mae_before = self._last_swap_mae
            previous = self._serving_record()
            if previous is not None:
                previous.tau_after, previous.rounds_after = record.tau_before, record.rounds_before
                previous.head_mae_after = self._last_swap_mae
            self.history.append(record)
            if record.rollback_of is not None:
                self.rollbacks += 1
                return
            self.updates += 1
            self.consecutive_failures = 0
            self.last_loss = record.loss_last
            self.domains_seen.update(record.domains)

    def refusing(self, record: UpdateRecord) -> int:
        """Fill a refused update's tau_before (what served so far with the weights it did not replace); returns the
        version serving."""
        with self._lock:
            record.tau_before = self._tau_sum / self._tau_n if self._tau_n else None
            record.rounds_before = self._tau_n
            return self._version_serving

    def record_refused(self, record: UpdateRecord, refusal: dict) -> None:
        """Append a refused update's record; ``refusal``: its reason, as ``last_refusal`` shows it."""
        with self._lock:
            self.history.append(record)
            self.swaps_refused += 1
            self.consecutive_failures = 0
            self.last_loss = record.loss_last
            self.last_refusal = refusal

    def record_failure(self, error: str, limit: int | None) -> bool:
        """Count a failed update (``error``: its redacted message); True when it is the ``limit``-th in a row."""
        with self._lock:
            self.failures += 1
            self.consecutive_failures += 1
            self.last_error = error
            return limit is not None and self.consecutive_failures >= limit

    def record_error(self, error: str) -> None:
        """Keep ``error`` as the last one without failing anything (a record that could not be written)."""
        with self._lock:
            self.last_error = error

    def record_published(self, record: UpdateRecord, done: tuple[int, object] | None, error: str | None) -> None:
        """A record's weights written as version ``done[0]`` in ``done[1]``, or not written (``done`` None, ``error``
        why: the swap stands, only its copy on disk failed)."""
        with self._lock:
            record.version, record.path = (done[0], str(done[1])) if done is not None else (None, None)
            if done is None:
                self.last_error = error
            else:
                self._version_serving = done[0]

    def card_history(self, writing: UpdateRecord | None = None, number: int | None = None) -> tuple[list, dict]:
        """``(history as dicts, domains seen)`` for a model card; ``writing``: the record of the version being
        written, numbered ``number`` there (its record takes the number once the version is on disk)."""
        with self._lock:
            history = [{**asdict(h), "version": number} if h is writing else asdict(h) for h in self.history]
            return history, dict(self.domains_seen)

    # ------------------------------------------------------------------ reading
    def snapshot(self) -> dict:
        """The counters as the adapter's ``stats`` shows them (the serving weights' ``tau_after`` live)."""
        with self._lock:
            tau = self._tau_sum / self._tau_n if self._tau_n else None
            rounds_since = self._tau_n
            mae = self._head_err[0] / self._head_err[1] if self._head_err[1] else None
            history = [asdict(h) for h in self.history]
            out = {
                "updates": self.updates,
                "failures": self.failures,
                "swaps_refused": self.swaps_refused,
                "rollbacks": self.rollbacks,
                "last_refusal": dict(self.last_refusal) if self.last_refusal is not None else None,
                "consecutive_failures": self.consecutive_failures,
                "last_loss": self.last_loss,
                "last_error": self.last_error,
                "rounds_seen": self.rounds_seen,
                "sample_errors": self.sample_errors,
                "served_version": self._version_serving,
                "served_by_version": {v: {"rounds": r, "accepted": a} for v, (r, a) in self._served_by_version.items()},
                "domains": dict(self.domains_seen),
            }
        serving = next((h for h in reversed(history) if h["swapped"]), None)
        if serving is not None:  # the serving weights' tau_after is live until the next swap
            serving["tau_after"], serving["rounds_after"], serving["head_mae_after"] = tau, rounds_since, mae
        return {**out, "tau_since_update": tau, "rounds_since_update": rounds_since, "head_error": mae,
                "versions": [r["version"] for r in history if r["version"] is not None], "history": history}
