"""The worker-thread half of :class:`~adaflash_hf.online.adapter.OnlineAdapter`: one update from the samples it
takes to the swap, the guard's refusal, a rollback, and the version published (the adapter's module docstring has
the flow). The serving half (ingest, control, statistics) is in :mod:`.adapter`; both halves share the adapter's
state (its locks, counters and history) as one object.

Example:
    >>> adapter = OnlineAdapter(drafter, target)  # an UpdateLoop: its worker thread runs ``_run``  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from ..speculation.capture import CAPTURE_LOCK
from .buffer import RequestSample, Sample
from .hub import redact
from .publish import card_context
from .resume import first_nonfinite
from .worker import NonFiniteLossError, UpdateAbandoned

__all__ = ["UpdateLoop", "UpdateRecord"]

logger = logging.getLogger("adaflash_hf.online")


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


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def guard_verdict(record: UpdateRecord) -> str:
    """The guard's verdict on a swapped update as its log line says it: off (nothing held back), or passed with the
    held-back requests' tau (accept_len) before and after training.

    Example:
        >>> guard_verdict(UpdateRecord(1, 8, None, None, None, None, 0, held_back=2, guard_serving=2.0, guard_candidate=2.5))
        'passed, held-back tau 2.000 -> 2.500 on 2 requests'
    """
    if record.guard_serving is None:
        return "off (no request held back)"
    return f"passed, held-back tau {_fmt(record.guard_serving)} -> {_fmt(record.guard_candidate)} on {record.held_back} requests"


class UpdateLoop:
    """The worker thread's side of an online adapter (module docstring); mixed into ``OnlineAdapter``."""

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._ready_locked() and self._rollback_due is None:
                    if self._closing or self.stopped:
                        return
                    self._cv.wait()
                ready = self._ready_locked()
                if ready:
                    samples = self.buffer.take(self.config.samples_per_update)
                    leftover = self.buffer.mark()  # samples arriving from now on are kept for the next update
                    self._started += 1
                self._busy = True
            try:
                self._roll_back_if_due(samples if ready else None)
                if ready:
                    self._update(samples, leftover)
            except BaseException as e:  # noqa: BLE001 - the worker must survive anything
                logger.error("online adapter worker error: %s", redact(f"{type(e).__name__}: {e}"))
            finally:
                with self._cv:
                    self._busy = False
                    self._finished += int(ready)
                    self._cv.notify_all()

    def _update(self, samples: list[Sample], leftover: int | None = None) -> None:
        t0 = time.perf_counter()
        domains = Counter(s.domain for s in samples if s.domain is not None)
        worker, index = self.worker, self._started
        samples, held = self.guard.split(samples, index)
        with self._stats_lock:
            base = self._served_version()
        try:
            with self._side_stream(after_serving=True):
                serving = self.guard.measure(worker, held, index)  # before training: the shadow holds the serving weights
                result = worker.train(samples, index, should_stop=self._abandon.is_set)
                candidate = self.guard.measure(worker, held, index)
            if self._roll_back_if_due(held):  # the shadow trained on the weights just undone: the update goes too
                logger.info("online update discarded: it was trained from weights that were just rolled back")
                return
            judged = self.guard.judge(serving, candidate)
            if judged.refusal is None:
                self._swap()
        except UpdateAbandoned:
            worker.reset()  # the shadow stopped mid-update: rebuilt from the serving weights if ever needed
            logger.info("online update abandoned (the adapter is closing); serving weights unchanged")
            return
        except Exception as e:  # noqa: BLE001
            self._on_failure(e)
            return
        record = UpdateRecord(
            update=self.updates + 1, samples=len(samples), loss_first=result["loss_first"], loss_last=result["loss_last"],
            head_loss_last=result["head_loss_last"], grad_norm=result.get("grad_norm"), tau_before=None, rounds_before=0,
            seconds=time.perf_counter() - t0,
            domains=dict(domains), held_back=len(held), guard_serving=judged.serving, guard_candidate=judged.candidate,
            guard_gain=judged.gain, guard_gain_se=judged.gain_se, base_version=base,
        )  # fmt: skip
        if judged.refusal is not None:
            self._refuse(record, judged.refusal, index)
            return
        self._record_swapped(record)
        superseded = 0
        if self.config.clear_after_update and leftover is not None:
            # What the update trained on left the buffer when it was taken; the samples that were left
            # over then (already superseded) go, counted in samples_dropped; those that arrived while it
            # trained stay for the next update.
            superseded = self.buffer.drop_before(leftover)
        logger.info(
            "online update %d (%s): %d samples, loss %.4f -> %.4f, guard: %s, %.1fs%s",
            record.update, self.config.method, len(samples), result["loss_first"] or 0.0, result["loss_last"] or 0.0,
            guard_verdict(record), record.seconds,
            f"; {superseded} older buffered samples dropped (superseded by this update)" if superseded else "",
        )  # fmt: skip
        logger.info("online swap: update %d's weights serve from now on (served tau before %s over %d rounds)",
                    record.update, _fmt(record.tau_before), record.rounds_before)  # fmt: skip
        self._publish(record)

    @contextmanager
    def _side_stream(self, after_serving: bool = False):
        """The worker's side CUDA stream as the current stream (a no-op off CUDA); ``after_serving``: it first waits
        for the work queued on the legacy stream (the serving weights' last writes)."""
        if self.worker.stream is None:
            yield
            return
        with torch.cuda.stream(self.worker.stream):
            if after_serving:
                with CAPTURE_LOCK:  # an event recorded on the legacy stream (speculation/capture.py)
                    self.worker.stream.wait_stream(torch.cuda.default_stream(self.worker.device))
            yield

    def _served_version(self) -> int:
        """The version serving now (``start_version``: the starting weights, until one is written); under the stats
        lock. Kept as the newest version written (:meth:`_publish`), since every served round reads it."""
        return self._version_serving

    def _serving_record(self) -> UpdateRecord | None:
        """The newest record whose weights were swapped in (an update or a rollback); under the stats lock."""
        return next((r for r in reversed(self.history) if r.swapped), None)

    def _record_swapped(self, record: UpdateRecord) -> None:
        """Append the record of weights just swapped in: its tau_before is what served since the previous
        swap, which is that swap's record's tau_after."""
        with self._stats_lock:
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

    def _refuse(self, record: UpdateRecord, refusal: dict, index: int) -> None:
        """Keep a candidate that lowered held-back acceptance aside (:mod:`.guard`): no swap, no version, the
        shadow rebuilt from the serving weights. Not a failure: the worker ran without fault."""
        record.swapped = False
        with self._stats_lock:
            record.tau_before = self._tau_sum / self._tau_n if self._tau_n else None
            record.rounds_before = self._tau_n
            served = self._served_version()
        reason = {**refusal, "update": record.update, "worker_update_index": index, "samples": record.samples,
                  "serving_version": served, "loss_first": record.loss_first, "loss_last": record.loss_last}  # fmt: skip
        if self.worker.stream is not None:
            self.worker.stream.synchronize()  # the side stream's last writes to the shadow, before it is saved
        if self.config.output_dir:
            try:
                with self._side_stream():
                    record.path = str(self.guard.keep_aside(self.worker.shadow, next(self.drafter.parameters()).dtype, reason))
            except Exception as e:  # noqa: BLE001 - keeping it aside is a record, never a reason to stop
                self.last_error = redact(f"could not keep a refused update aside: {type(e).__name__}: {e}")
                logger.warning("%s", self.last_error)
        self.worker.reset()
        with self._stats_lock:
            self.history.append(record)
            self.swaps_refused += 1
            self.consecutive_failures = 0
            self.last_loss = record.loss_last
            self.last_refusal = {**reason, "path": record.path}
        logger.warning("online update %d (%s): %d samples, loss %.4f -> %.4f, guard: refused, serving weights "
                       "unchanged: %s%s", record.update, self.config.method, record.samples, record.loss_first or 0.0,
                       record.loss_last or 0.0, refusal["reason"],
                       f"; kept aside in {record.path}" if record.path else "")  # fmt: skip

    def _on_failure(self, e: BaseException) -> None:
        self.worker.reset()  # rebuilt from the (unchanged, last good) serving weights next time
        limit = self.config.max_consecutive_failures
        with self._stats_lock:
            self.failures += 1
            self.consecutive_failures += 1
            self.last_error = redact(f"{type(e).__name__}: {e}")
            stop = limit is not None and self.consecutive_failures >= limit
        logger.warning("online update failed, serving weights unchanged: %s", self.last_error)
        if stop:
            self.stopped = True
            self.buffer.clear()
            logger.error(
                "online adapter stopped after %d consecutive failed updates; the drafter keeps serving its last good weights",
                self.consecutive_failures,
            )

    # ------------------------------------------------------------------ swap / rollback
    def _swap(self) -> None:
        """Copy the shadow's weights into the serving drafter while no round is drafting; keep the weights
        they replace (on the CPU) while the rollback watch judges the swap."""
        previous = None
        if self.rollback.can_judge:
            previous = {k: v.detach().to("cpu", copy=True) for k, v in self.drafter.state_dict().items()}
        self._install(self.worker.shadow.state_dict(), judge=(previous, self.updates + 1))

    def _roll_back_if_due(self, recent: list | None = None) -> bool:
        """Restore the weights the newest swap replaced when served tau fell after it (:mod:`.guard`) and a paired
        check does not clear it (:meth:`_paired_check`, on ``recent`` requests or the newest buffered), and
        publish them as a new version so that ``LATEST`` names what serves. Whether it did."""
        with self._stats_lock:
            due, self._rollback_due = self._rollback_due, None
        if due is None:
            return False
        paired = self._paired_check(due, recent)
        if paired is not None and paired["serving"] >= paired["previous"] - self.config.guard_margin:
            logger.warning("online rollback of update %d not made: served tau fell from %.3f to %.3f, but on %d recent "
                           "requests the swapped weights accept %.4f against the previous weights' %.4f (served tau "
                           "compares different traffic)", due["update"], due["tau_before"], due["tau_after"],
                           paired["requests"], paired["serving"], paired["previous"])  # fmt: skip
            return False
        self._install(due["previous"])
        self.worker.reset()  # the shadow holds the undone weights: rebuilt from the restored ones
        logger.warning("online rollback of update %d: served tau fell from %.3f to %.3f over %d rounds after its swap; "
                       "its previous weights serve again", due["update"], due["tau_before"], due["tau_after"],
                       due["rounds"])  # fmt: skip
        record = UpdateRecord(update=due["update"], samples=0, loss_first=None, loss_last=None, head_loss_last=None,
                              tau_before=None, rounds_before=0, rollback_of=due["update"])  # fmt: skip
        self._record_swapped(record)
        self._publish(record)
        return True

    def _paired_check(self, due: dict, recent: list | None) -> dict | None:
        """Served tau before and after a swap compares different requests: a change in the mix of prompts can read as a
        fall. With the guard on, both weights are scored on the same requests
        that neither trained on (``recent``, else the newest buffered; at most the guard's count): ``{"serving",
        "previous", "requests"}``, or None without the guard or such requests (served tau then decides alone).
        Costs two temporary copies of the drafter on the worker's device."""
        k = self.config.held_back
        samples = [s for s in (recent if recent else self.buffer.newest(k)) if isinstance(s, RequestSample)][:k]
        if not k or not samples:
            return None
        worker = self.worker
        with self._side_stream(after_serving=True):
            serving, previous = worker.make_shadow(), worker.make_shadow()
            previous.load_state_dict(due["previous"])
            scores = [worker.accept_len(m, samples, seed=self._started) for m in (serving, previous)]
        return {"serving": scores[0], "previous": scores[1], "requests": len(samples)}

    def _install(self, new_state: dict, judge: tuple[dict | None, int] | None = None) -> None:
        """Copy ``new_state`` into the serving drafter under the round lock (exclusive: between rounds).
        ``judge``: (the replaced weights or None, update number) for the rollback watch; None for a
        rollback, after which the rounds served with the undone weights judge nothing more."""
        serving = self.drafter.state_dict()
        if new_state.keys() != serving.keys():
            raise RuntimeError("new and serving drafter weights disagree on their tensors; not swapping")
        bad = first_nonfinite(new_state.items())
        if bad is not None:  # never served: the update fails, the serving weights stay
            raise NonFiniteLossError(f"non-finite values in {bad}; not swapping")
        self._swap_pending.set()
        try:
            with self.round_lock.exclusive(), CAPTURE_LOCK:  # device syncs and copies on the legacy stream
                self._swap_pending.clear()
                cuda_devices = {t.device for t in serving.values() if t.device.type == "cuda"}
                if self.worker.stream is not None:
                    cuda_devices.add(self.worker.device)
                for dev in cuda_devices:  # in-flight drafts and the side stream's last writes
                    torch.cuda.synchronize(dev)
                with torch.no_grad():
                    for name, t in serving.items():
                        t.copy_(new_state[name])
                for dev in cuda_devices:
                    torch.cuda.synchronize(dev)
                with self._stats_lock:
                    self._last_swap_tau = (self._tau_sum / self._tau_n if self._tau_n else None, self._tau_n)
                    self._tau_sum, self._tau_n = 0, 0
                    self._last_swap_mae = self._head_err[0] / self._head_err[1] if self._head_err[1] else None
                    self._head_err = [0.0, 0]
                    if judge is None:
                        self.rollback.reset()
                    else:
                        self.rollback.arm(*judge)
        finally:
            self._swap_pending.clear()

    # ------------------------------------------------------------------ publishing
    def _card_context(self, writing: UpdateRecord | None = None, number: int | None = None) -> dict:
        """The model card's context; ``writing``: the record of the version being written, numbered ``number`` in
        the card only (its record takes the number once the version is on disk)."""
        with self._stats_lock:
            history = [{**asdict(h), "version": number} if h is writing else asdict(h) for h in self.history]
            domains = dict(self.domains_seen)
        return card_context(self.config, history, domains, self.target_name, self.worker.block_size)

    def _publish(self, record: UpdateRecord) -> None:
        if self.publisher is None:
            return
        meta = {
            "update": record.update,
            "method": self.config.method,
            "target": self.target_name,
            "samples": record.samples,
            "loss_first": record.loss_first,
            "loss_last": record.loss_last,
            "tau_before": record.tau_before,
            "domains": record.domains,
            "layout": self.config.version_layout,
            "guard_serving": record.guard_serving,
            "guard_candidate": record.guard_candidate,
            "guard_gain_se": record.guard_gain_se,
            "rollback_of": record.rollback_of,
            "base_version": record.base_version,
        }

        def card(number: int) -> dict:
            return self._card_context(record, number)

        what = f"rollback of update {record.update}" if record.rollback_of is not None else f"update {record.update}"
        with self._side_stream():  # the weights are read off the legacy stream (speculation/capture.py)
            done = self.publisher.publish(self.drafter, card, meta, f"AdaFlash online {what} (version {{version}})",
                                          what="online version")  # fmt: skip
        with self._stats_lock:
            record.version, record.path = (done[0], str(done[1])) if done is not None else (None, None)
            if done is None:  # the swap stands (serving uses the new weights); only its copy on disk failed
                self.last_error = self.publisher.last_error
            else:
                self._version_serving = done[0]
        if done is not None:
            held = ("no held-back check" if record.guard_serving is None
                    else f"held-back tau {_fmt(record.guard_serving)} -> {_fmt(record.guard_candidate)}")
            logger.info("online version %d published (%s) in %s: %s", done[0], what, done[1], held)
