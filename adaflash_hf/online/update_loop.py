"""The update loop of an online adapter: from the samples an update takes to the swap, the guard's refusal, a
rollback, and the version published (:mod:`.adapter`'s docstring has the flow), on a worker thread of its own.

:class:`UpdateLoop` is built from explicit collaborators (the buffer it takes samples from, the trainer, the guard,
the publisher, the counters it records into, the round lock a swap takes) and the one :class:`OnlineConfig`; the
adapter composes it with the serving side (ingest, control, statistics).

Example:
    >>> loop = UpdateLoop(config, drafter, worker, worker, buffer, UpdateGuard(config), None,  # doctest: +SKIP
    ...                   OnlineCounters(RollbackWatch(0, 0.1)), RoundLock(), target_name="tiny")
    >>> loop.update(buffer.take(config.samples_per_update))  # one update, here: trained, judged, swapped in  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from contextlib import contextmanager

import torch

from ..modeling import AdaFlashDrafter
from ..speculation.capture import CAPTURE_LOCK
from .buffer import ReplayBuffer, RequestSample, Sample
from .config import OnlineConfig
from .counters import OnlineCounters, UpdateRecord
from .guard import UpdateGuard
from .hub import redact
from .lock import RoundLock
from .publish import VersionPublisher, card_context
from .resume import first_nonfinite
from .worker import NonFiniteLossError, ShadowTrainer, UpdateAbandoned

__all__ = ["UpdateLoop", "guard_verdict"]

logger = logging.getLogger("adaflash_hf.online")


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
    """Trains, judges, swaps in and publishes updates of a serving drafter (module doc), one at a time.

    Args:
        config: the settings it reads: ``samples_per_update``, ``clear_after_update``, ``max_consecutive_failures``,
            ``held_back``, ``guard_margin``, ``method``, ``version_layout``, ``output_dir`` (and, through
            :func:`~.publish.card_context`, what a model card states).
        drafter: the serving drafter; a swap copies new weights into it in place.
        worker: the :class:`~.worker.ShadowTrainer` holding the shadow that is judged, swapped in or kept aside, and
            measuring acceptance for the guard and the rollback check.
        trainer: what trains the shadow (``train``, ``reset``): ``worker`` itself, or a
            :class:`~.trainer_process.ProcessTrainer` around it.
        buffer: the :class:`~.buffer.ReplayBuffer` updates take their samples from.
        guard: the :class:`~.guard.UpdateGuard` that holds samples back and judges each candidate.
        publisher: the :class:`~.publish.VersionPublisher` that writes each swap as a version (None: nothing written).
        counters: the :class:`~.counters.OnlineCounters` every update, refusal, failure and rollback is recorded in,
            and the rollback decisions come from.
        round_lock: the :class:`~.lock.RoundLock` every round drafts under; a swap takes it exclusively.
        target_name: the target's name in the versions' metadata and model cards.

    :meth:`update` runs one update on the calling thread; :meth:`start` runs updates on a worker thread whenever
    the buffer holds ``samples_per_update`` samples (:meth:`wake` after adding some), until :meth:`stop`.

    Example:
        >>> loop.start(); buffer.add(sample); loop.wake()  # the thread trains once the buffer is full  # doctest: +SKIP
        >>> loop.stop(flush=True)  # doctest: +SKIP
    """

    def __init__(self, config: OnlineConfig, drafter: AdaFlashDrafter, worker: ShadowTrainer, trainer,
                 buffer: ReplayBuffer, guard: UpdateGuard, publisher: VersionPublisher | None,
                 counters: OnlineCounters, round_lock: RoundLock, target_name: str):
        self.config, self.drafter, self.worker, self.trainer = config, drafter, worker, trainer
        self.buffer, self.guard, self.publisher, self.counters = buffer, guard, publisher, counters
        self.round_lock, self.target_name = round_lock, target_name
        self.swap_pending = threading.Event()  # set while a swap waits for the round lock
        self._cv = threading.Condition()  # guards the fields below; the worker thread waits on it
        self._busy = False
        self._force = 0  # flushes waiting: an update may start on fewer than samples_per_update samples
        self._started = 0  # batches taken (the update's index: the guard's seed)
        self._finished = 0
        self._closing = False
        self._stopped = False
        self._abandon = threading.Event()  # stop(abandon=True): the update in progress stops at its next step
        self._thread: threading.Thread | None = None

    # ================================================================== control
    def start(self) -> None:
        """Run updates on a worker thread from now on (daemon; :meth:`stop` ends it)."""
        self._thread = threading.Thread(target=self._run, name="adaflash-online-worker", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Tell the worker thread to look again (samples were added, or a rollback was decided)."""
        with self._cv:
            self._cv.notify_all()

    @property
    def busy(self) -> bool:
        """Whether an update is training (or swapping / publishing) right now."""
        return self._busy

    @property
    def stopped(self) -> bool:
        """Whether the loop stopped after ``max_consecutive_failures`` failed updates in a row."""
        return self._stopped

    @property
    def accepting(self) -> bool:
        """Whether new samples are wanted: neither stopped nor closing."""
        return not (self._stopped or self._closing)

    def _ready_locked(self) -> bool:
        if self._stopped:
            return False
        n = len(self.buffer)
        return n >= self.config.samples_per_update or (bool(self._force) and n > 0)

    def _rollback_pending(self) -> bool:
        """A rollback decided that the worker thread (alive to make it) has not made yet."""
        return self.counters.rollback_due and self._thread is not None and self._thread.is_alive()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every update triggered so far has finished (succeeded, refused or failed), a rollback
        decided has been made, and the buffer holds fewer than ``samples_per_update`` samples. False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._busy or self._ready_locked() or self._rollback_pending():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cv.wait(remaining)
        return True

    def train_buffered(self, deadline: float | None) -> bool:
        """Train now on what is buffered (up to ``samples_per_update``, even fewer) and wait for that update (its
        version written too); returns as soon as nothing more can train. False at ``deadline`` (monotonic)."""
        if self._thread is None:
            return True
        with self._cv:
            if len(self.buffer) > 0:
                ticket = self._started + 1
            elif self._busy:
                ticket = self._started
            else:
                ticket = self._finished
            self._force += 1
            self._cv.notify_all()
            try:
                # Done at the ticket's update, or as soon as nothing more can train (worker idle and
                # nothing buffered): samples of a pending ticket may have been dropped meanwhile.
                while (self._finished < ticket and not self._stopped and self._thread.is_alive()
                       and (self._busy or len(self.buffer) > 0)):  # fmt: skip
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    self._cv.wait(remaining)
            finally:
                self._force -= 1
        return True

    def stop(self, flush: bool = False, timeout: float | None = 120.0, abandon: bool = False) -> bool:
        """Take no more samples, finish the updates already triggered (with ``flush``, one on a partial buffer too)
        and end the worker thread, each wait up to ``timeout``; ``abandon``: the update in progress stops at its
        next optimizer step and is discarded. False when something was left unfinished."""
        self._closing = True  # the adapter ignores rounds from now on
        if abandon:
            self._abandon.set()
        done = True
        if flush and not abandon:
            done = self.train_buffered(None if timeout is None else time.monotonic() + timeout)
        with self._cv:
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            done = done and not self._thread.is_alive()
        return done

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._ready_locked() and not self.counters.rollback_due:
                    if self._closing or self._stopped:
                        return
                    self._cv.wait()
                ready = self._ready_locked()
                if ready:
                    samples = self.buffer.take(self.config.samples_per_update)
                    leftover = self.buffer.mark()  # samples arriving from now on are kept for the next update
                    self._started += 1
                self._busy = True
            try:
                self.roll_back_if_due(samples if ready else None)
                if ready:
                    self.update(samples, leftover)
            except BaseException as e:  # noqa: BLE001 - the worker must survive anything
                logger.error("online adapter worker error: %s", redact(f"{type(e).__name__}: {e}"))
            finally:
                with self._cv:
                    self._busy = False
                    self._finished += int(ready)
                    self._cv.notify_all()

    # ================================================================== one update
    def update(self, samples: list[Sample], leftover: int | None = None) -> None:
        """Train on ``samples``, judge the candidate, then swap it in and publish it, or keep it aside; a failure is
        counted and leaves the serving weights as they are. ``leftover``: the buffer's mark when the samples were
        taken (with ``clear_after_update``, the samples older than it go once the update is swapped in)."""
        t0 = time.perf_counter()
        domains = Counter(s.domain for s in samples if s.domain is not None)
        index = self._started
        samples, held = self.guard.split(samples, index)
        base = self.counters.served_version()
        try:
            with self._side_stream(after_serving=True):
                serving = self.guard.measure(self.worker, held, index)  # before training: the shadow holds the serving weights
                result = self.trainer.train(samples, index, should_stop=self._abandon.is_set)
                candidate = self.guard.measure(self.worker, held, index)
            if self.roll_back_if_due(held):  # the shadow trained on the weights just undone: the update goes too
                logger.info("online update discarded: it was trained from weights that were just rolled back")
                return
            judged = self.guard.judge(serving, candidate)
            if judged.refusal is None:
                self._swap()
        except UpdateAbandoned:
            self.trainer.reset()  # the shadow stopped mid-update: rebuilt from the serving weights if ever needed
            logger.info("online update abandoned (the adapter is closing); serving weights unchanged")
            return
        except Exception as e:  # noqa: BLE001
            self._on_failure(e)
            return
        record = UpdateRecord(
            update=self.counters.updates + 1, samples=len(samples), loss_first=result["loss_first"],
            loss_last=result["loss_last"], head_loss_last=result["head_loss_last"], grad_norm=result.get("grad_norm"),
            tau_before=None, rounds_before=0, seconds=time.perf_counter() - t0,
            domains=dict(domains), held_back=len(held), guard_serving=judged.serving, guard_candidate=judged.candidate,
            guard_gain=judged.gain, guard_gain_se=judged.gain_se, base_version=base,
        )  # fmt: skip
        if judged.refusal is not None:
            self._refuse(record, judged.refusal, index)
            return
        self.counters.record_swapped(record)
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

    def _refuse(self, record: UpdateRecord, refusal: dict, index: int) -> None:
        """Keep a candidate that lowered held-back acceptance aside (:mod:`.guard`): no swap, no version, the
        shadow rebuilt from the serving weights. Not a failure: the worker ran without fault."""
        record.swapped = False
        served = self.counters.refusing(record)
        reason = {**refusal, "update": record.update, "worker_update_index": index, "samples": record.samples,
                  "serving_version": served, "loss_first": record.loss_first, "loss_last": record.loss_last}  # fmt: skip
        if self.worker.stream is not None:
            self.worker.stream.synchronize()  # the side stream's last writes to the shadow, before it is saved
        if self.config.output_dir:
            try:
                with self._side_stream():
                    record.path = str(self.guard.keep_aside(self.worker.shadow, next(self.drafter.parameters()).dtype, reason))
            except Exception as e:  # noqa: BLE001 - keeping it aside is a record, never a reason to stop
                error = redact(f"could not keep a refused update aside: {type(e).__name__}: {e}")
                self.counters.record_error(error)
                logger.warning("%s", error)
        self.trainer.reset()
        self.counters.record_refused(record, {**reason, "path": record.path})
        logger.warning("online update %d (%s): %d samples, loss %.4f -> %.4f, guard: refused, serving weights "
                       "unchanged: %s%s", record.update, self.config.method, record.samples, record.loss_first or 0.0,
                       record.loss_last or 0.0, refusal["reason"],
                       f"; kept aside in {record.path}" if record.path else "")  # fmt: skip

    def _on_failure(self, e: BaseException) -> None:
        self.trainer.reset()  # rebuilt from the (unchanged, last good) serving weights next time
        error = redact(f"{type(e).__name__}: {e}")
        stop = self.counters.record_failure(error, self.config.max_consecutive_failures)
        logger.warning("online update failed, serving weights unchanged: %s", error)
        if stop:
            self._stopped = True
            self.buffer.clear()
            logger.error(
                "online adapter stopped after %d consecutive failed updates; the drafter keeps serving its last good weights",
                self.counters.consecutive_failures,
            )

    # ------------------------------------------------------------------ swap / rollback
    def _swap(self) -> None:
        """Copy the shadow's weights into the serving drafter while no round is drafting; keep the weights
        they replace (on the CPU) while the rollback watch judges the swap."""
        previous = None
        if self.counters.can_judge:
            previous = {k: v.detach().to("cpu", copy=True) for k, v in self.drafter.state_dict().items()}
        self.install(self.worker.shadow.state_dict(), judge=(previous, self.counters.updates + 1))

    def roll_back_if_due(self, recent: list | None = None) -> bool:
        """Restore the weights the newest swap replaced when served tau fell after it (:mod:`.guard`) and a paired
        check does not clear it (:meth:`_paired_check`, on ``recent`` requests or the newest buffered), and
        publish them as a new version so that ``LATEST`` names what serves. Whether it did."""
        due = self.counters.take_rollback()
        if due is None:
            return False
        paired = self._paired_check(due, recent)
        if paired is not None and paired["serving"] >= paired["previous"] - self.config.guard_margin:
            logger.warning("online rollback of update %d not made: served tau fell from %.3f to %.3f, but on %d recent "
                           "requests the swapped weights accept %.4f against the previous weights' %.4f (served tau "
                           "compares different traffic)", due["update"], due["tau_before"], due["tau_after"],
                           paired["requests"], paired["serving"], paired["previous"])  # fmt: skip
            return False
        self.install(due["previous"])
        self.trainer.reset()  # the shadow holds the undone weights: rebuilt from the restored ones
        logger.warning("online rollback of update %d: served tau fell from %.3f to %.3f over %d rounds after its swap; "
                       "its previous weights serve again", due["update"], due["tau_before"], due["tau_after"],
                       due["rounds"])  # fmt: skip
        record = UpdateRecord(update=due["update"], samples=0, loss_first=None, loss_last=None, head_loss_last=None,
                              tau_before=None, rounds_before=0, rollback_of=due["update"])  # fmt: skip
        self.counters.record_swapped(record)
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

    def install(self, new_state: dict, judge: tuple[dict | None, int] | None = None) -> None:
        """Copy ``new_state`` into the serving drafter under the round lock (exclusive: between rounds), swap and
        rollback alike. ``judge``: (the replaced weights or None, update number) for the rollback watch; None for a
        rollback. Raises (nothing copied) when the tensors differ from the serving ones or are not finite."""
        serving = self.drafter.state_dict()
        if new_state.keys() != serving.keys():
            raise RuntimeError("new and serving drafter weights disagree on their tensors; not swapping")
        bad = first_nonfinite(new_state.items())
        if bad is not None:  # never served: the update fails, the serving weights stay
            raise NonFiniteLossError(f"non-finite values in {bad}; not swapping")
        self.swap_pending.set()
        try:
            with self.round_lock.exclusive(), CAPTURE_LOCK:  # device syncs and copies on the legacy stream
                self.swap_pending.clear()
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
                self.counters.swapped(judge)
        finally:
            self.swap_pending.clear()

    # ------------------------------------------------------------------ publishing
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
            history, domains = self.counters.card_history(record, number)
            return card_context(self.config, history, domains, self.target_name, self.worker.block_size)

        what = f"rollback of update {record.update}" if record.rollback_of is not None else f"update {record.update}"
        with self._side_stream():  # the weights are read off the legacy stream (speculation/capture.py)
            done = self.publisher.publish(self.drafter, card, meta, f"AdaFlash online {what} (version {{version}})",
                                          what="online version")  # fmt: skip
        self.counters.record_published(record, done, self.publisher.last_error)
        if done is not None:
            held = ("no held-back check" if record.guard_serving is None
                    else f"held-back tau {_fmt(record.guard_serving)} -> {_fmt(record.guard_candidate)}")
            logger.info("online version %d published (%s) in %s: %s", done[0], what, done[1], held)
