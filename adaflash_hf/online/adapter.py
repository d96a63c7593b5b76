"""The online adapter: on-policy distillation of the serving drafter from its own traffic (SPEC 4).

Flow::

    finished request ──on_request──> ReplayBuffer ──(samples_per_update)──> worker thread
    (or verified round ──on_round──>, sample_unit="round")                   │ ShadowTrainer (worker.py):
                                                                             │ shadow copy of the drafter,
                                                                             │ side CUDA stream on GPU,
                                                                             │ training's objective
                                                                             │ guard (guard.py): accept_len on
                                                                             │ held-back requests, before and
                                                                             │ after training ── lower? ──> kept
                                                                             │ aside (refused/), no swap
    serving drafter <──── swap under the round lock (between rounds) ───────┘
          │                        └──> VersionPublisher (publish.py): numbered version ──> Hub push
          └── served tau falls after a swap (rollback_rounds) ──> previous weights restored, published

* **Never blocks generation.** ``on_request`` / ``on_round`` copy the sample into the buffer and return; all
  training runs on a worker thread (plus a side CUDA stream on GPU) on a *shadow* copy of the
  drafter. The only time generation waits is the swap itself: the adapter registers its
  :class:`RoundLock` for the drafter (``adaflash_hf.speculation.hooks``), every decoding loop holds it
  (shared by concurrent rounds) while it drafts, and the swap takes it exclusively, so a round
  drafts either entirely with the old weights or entirely with the new ones.
* **Lossless.** Verification is unchanged, so outputs stay exactly the target's whatever the
  drafter weights are; only the acceptance rate (tau) moves. (The drafter's per-request K/V cache
  of earlier context keeps the features computed with the old weights until the request ends.)
* **Faults.** An exception or a non-finite loss / weight in the worker discards the update: the
  serving weights stay the last good ones, the shadow is rebuilt from them, the failure is logged
  and counted, and after ``max_consecutive_failures`` in a row the adapter stops adapting (serving
  is unaffected).
* **Guard and rollback** (:mod:`adaflash_hf.online.guard`). An update that lowers greedy acceptance on
  requests held back from its training is refused (no swap, no version; kept aside with its reason,
  counted in ``stats["swaps_refused"]``, not a failure). A swap after which served tau falls is undone:
  the previous weights serve again and are published as a new version (``stats["rollbacks"]``).
* **Memory.** What a sample stores and costs: :mod:`adaflash_hf.online.buffer`.

Example:
    >>> adapter = OnlineAdapter(drafter, target, OnlineConfig(output_dir="runs/online"))  # doctest: +SKIP
    >>> adapter.attach()  # every target.generate(..., assistant_model=drafter) now feeds it  # doctest: +SKIP
    >>> out = target.generate(ids, assistant_model=drafter, max_new_tokens=256)  # doctest: +SKIP
    >>> adapter.stats["updates"], adapter.stats["history"][-1]["tau_before"]  # doctest: +SKIP
    >>> adapter.close()  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import asdict

import torch
from torch import nn

from ..modeling import AdaFlashDrafter
from ..speculation.hooks import DrafterHooks, hooks_for, register_hooks, replace_hooks, unregister_hooks
from .buffer import ReplayBuffer, RequestSample, Sample
from .config import LABEL_MODES, METHODS, SAMPLE_UNITS, OnlineConfig
from .guard import RollbackWatch, UpdateGuard
from .hub import redact
from .lock import RoundLock
from .publish import VersionPublisher
from .resume import Resumed, newest_number, resume_drafter
from .trainer_process import ProcessTrainer
from .update_loop import UpdateLoop, UpdateRecord
from .versions import version_name
from .worker import NonFiniteLossError, ShadowTrainer, copy_drafter

_MAX_OPEN_ROWS = 4096  # requests in flight whose served rounds are kept
DROP_LOG_INTERVAL_S = 60.0  # at most one "buffer full" line per minute

__all__ = [
    "LABEL_MODES",
    "METHODS",
    "SAMPLE_UNITS",
    "NonFiniteLossError",
    "OnlineAdapter",
    "OnlineConfig",
    "RoundLock",
    "UpdateRecord",
    "copy_drafter",
]

logger = logging.getLogger("adaflash_hf.online")


class OnlineAdapter(UpdateLoop):
    """Distils ``drafter`` from the target's verification feedback while it serves (module doc).

    Args:
        drafter: the serving `AdaFlashDrafter` (bound to ``target``; bound here if not).
        target: the frozen target model (never trained; used in the worker to recompute features).
        config: an :class:`~adaflash_hf.online.config.OnlineConfig` (default settings if None).
        **settings: ``OnlineConfig`` fields, applied over ``config`` (``OnlineAdapter(d, t,
            method="osd", samples_per_update=64)``).

    The settings are readable as attributes (``adapter.method``, ``adapter.lr``, ...).
    """

    def __init__(self, drafter: AdaFlashDrafter, target: nn.Module, config: OnlineConfig | None = None, **settings):
        config = config or OnlineConfig()
        if settings:
            config = config.replace(**settings)
        if not isinstance(drafter, AdaFlashDrafter):
            raise TypeError(f"drafter must be an AdaFlashDrafter, got {type(drafter).__name__}")
        current = hooks_for(drafter)
        if current.round_sink is not None or not isinstance(current.weights_lock, nullcontext):
            raise ValueError("this drafter already has an online adapter: close() it before creating another")
        if not drafter.has_target or not drafter.is_bound_to(target):
            drafter.bind_target(target)
        self.drafter, self.target, self.config = drafter, target, config
        self.domain = config.domain
        self.target_name = config.target_name or _model_name(target)
        self._feature_dim = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
        self.buffer = ReplayBuffer(
            max_samples=config.max_buffer_samples or 4 * config.samples_per_update, max_bytes=config.max_buffer_bytes
        )
        self._init_stats()
        self.resumed = self._resume() if config.output_dir else Resumed()
        self.publisher = (
            VersionPublisher(config.output_dir, config.keep_versions, config.hub_repo, config.version_layout,
                             config.hub_private, config.hub_max_retries, config.hub_backoff_s,
                             keep=self._serving_on_disk)
            if config.output_dir else None
        )  # fmt: skip
        self.hub = self.publisher.hub if self.publisher is not None else None
        self.worker = (ProcessTrainer if config.trainer == "process" else ShadowTrainer)(drafter, target, config)
        self.guard = UpdateGuard(config)
        self.device = self.worker.device

        # Serving-side coordination: the loops find the lock (and, once attached, this sink) here.
        self.round_lock = RoundLock()
        self._hooks = DrafterHooks(weights_lock=self.round_lock)
        register_hooks(drafter, self._hooks)
        self._swap_pending = threading.Event()  # set while a swap waits for the round lock
        # served rounds of requests in flight, per (loop thread, row): (anchor, accepted, verify length)
        self._served: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        self._served_lock = threading.Lock()
        self._init_worker_thread()

    def _init_stats(self) -> None:
        self._stats_lock = threading.Lock()
        self._tau_sum = 0
        self._tau_n = 0
        self._last_swap_tau: tuple[float | None, int] = (None, 0)
        self._head_err = [0.0, 0]  # the length head's absolute error on served rounds since the last swap
        self._last_swap_mae: float | None = None
        self.rounds_seen = 0
        self.updates = 0
        self.failures = 0
        self.consecutive_failures = 0
        self.sample_errors = 0
        self.last_loss: float | None = None
        self.last_error: str | None = None
        self.history: list[UpdateRecord] = []
        self.domains_seen: Counter = Counter()
        self.swaps_refused = 0
        self.rollbacks = 0
        self.last_refusal: dict | None = None
        self.rollback = RollbackWatch(self.config.rollback_rounds, self.config.rollback_margin)
        self.start_version = 0  # the version the server started with (0: the given drafter's weights)
        self._version_serving = 0  # the newest version written (start_version until then)
        # verify rounds served and drafts they accepted, by the version serving them (the server's live acceptance)
        self._served_by_version: dict[int, list[int]] = {}
        self._drops_unlogged, self._drops_logged_at = 0, None  # buffer evictions not yet in a log line; its clock
        self._rollback_due: dict | None = None  # set by a round, taken by the worker thread

    def _resume(self) -> Resumed:
        """With ``config.resume``, serve the newest good version in the output folder (:mod:`.resume`); one log
        line says which weights serve, a warning names each version skipped."""
        root, c = self.config.output_dir, self.config
        resumed = resume_drafter(self.drafter, root) if c.resume else Resumed(newest=newest_number(root))
        for name, reason in resumed.skipped:
            logger.warning("online: version %s in %s skipped: %s", name, root, reason)
        nxt = version_name(resumed.newest + 1)
        if resumed.version:
            logger.info("online: resuming from %s: its drafter and length head serve and train on (new versions "
                        "from %s)", resumed.path, nxt)
        elif c.resume:
            logger.info("online: no %sversion to resume in %s: starting from the given drafter (new versions from %s)",
                        "good " if resumed.skipped else "", root, nxt)
        elif resumed.newest:
            logger.info("online: starting fresh from the given drafter, not from the versions in %s (new versions "
                        "from %s)", root, nxt)
        self.start_version = self._version_serving = resumed.version
        return resumed

    def _init_worker_thread(self) -> None:
        self._cv = threading.Condition()
        self._busy = False
        self._force = 0
        self._started = 0
        self._finished = 0
        self._closing = False
        self._abandon = threading.Event()  # close(abandon=True): the update in progress stops at its next step
        self.stopped = False
        self._thread: threading.Thread | None = None
        if self.config.method != "off":
            self._thread = threading.Thread(target=self._run, name="adaflash-online-worker", daemon=True)
            self._thread.start()

    def __getattr__(self, name: str):  # settings read as attributes: adapter.method, adapter.lr, ...
        config = self.__dict__.get("config")
        if config is not None and name in OnlineConfig.__dataclass_fields__:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def busy(self) -> bool:
        """Whether an update is training (or swapping / publishing) right now."""
        return self._busy

    def _serving_on_disk(self) -> set[int]:
        """The version on disk whose weights serve now, which pruning keeps (none while a swap is being written)."""
        with self._stats_lock:
            record = self._serving_record()
            return {self.start_version} if record is None else ({record.version} if record.version else set())

    @property
    def write_failures(self) -> int:
        return self.publisher.failures if self.publisher is not None else 0

    # ================================================================== serving side
    def _set_hooks(self, hooks: DrafterHooks) -> None:
        """Replace this adapter's registered hooks (the lock stays the same object)."""
        replace_hooks(self.drafter, self._hooks, hooks)
        self._hooks = hooks

    def attach(self) -> "OnlineAdapter":
        """Make every later ``target.generate(..., assistant_model=drafter)`` feed this adapter."""
        if self._hooks.round_sink is not self:
            self._set_hooks(DrafterHooks(round_sink=self, weights_lock=self.round_lock))
        return self

    def detach(self) -> None:
        """Stop receiving rounds automatically (an explicit ``round_sink=adapter`` still works)."""
        if self._hooks.round_sink is self and hooks_for(self.drafter) is self._hooks:
            self._set_hooks(DrafterHooks(weights_lock=self.round_lock))

    def set_domain(self, domain: str | None) -> None:
        """Tag the samples added from now on (for the model card's "domains seen")."""
        self.domain = domain

    def on_round(self, verified) -> None:
        """`RoundSink` hook: record tau and, with ``sample_unit="round"``, buffer the round as a
        sample. Never blocks on training."""
        self.add_round(verified)

    def on_request(self, finished) -> None:
        """`RoundSink` hook at the end of each sequence (a `FinishedRequest`): with
        ``sample_unit="request"``, buffer it as a sample. Never blocks on training."""
        if self.config.sample_unit != "request" or self.config.method == "off" or self.stopped or self._closing:
            return
        with self._served_lock:
            served = self._served.pop((threading.get_ident(), int(finished.row)), None)
        try:
            sample = RequestSample.from_request(finished, domain=self.domain, served=served)
        except Exception as e:  # noqa: BLE001 - a bad request must never break generation
            self.sample_errors += 1
            logger.warning("online adapter could not buffer a request: %s", redact(f"{type(e).__name__}: {e}"))
            return
        if sample.prompt_len >= 1 and sample.response_len >= 2:  # a block needs an anchor and a label
            self._add(sample)

    def add_round(self, verified, features: torch.Tensor | None = None) -> None:
        """Like :meth:`on_round`, optionally with the context's target features (``[1, T, K*H]``)
        already at hand (then the worker does not recompute them; they count against the buffer's
        byte bound)."""
        tokens = int(verified.num_accepted) + 1
        with self._stats_lock:
            self._tau_sum += tokens
            self._tau_n += 1
            self.rounds_seen += 1
            err = verified.head_error(self.drafter.config.block_size)
            if err is not None:
                self._head_err[0] += err
                self._head_err[1] += 1
            due = self.rollback.observe(tokens)
            if due is not None:
                self._rollback_due = due
            counts = self._served_by_version.setdefault(self._version_serving, [0, 0])
            counts[0] += 1
            counts[1] += tokens - 1
        if due is not None:  # the worker thread restores the weights; this round returns at once
            with self._cv:
                self._cv.notify_all()
        if self.config.sample_unit == "request" and self.config.anchors_at_served_rounds:
            self._keep_served(verified)
        if self.config.sample_unit != "round" or self.config.method == "off" or self.stopped or self._closing:
            return
        try:
            sample = Sample.from_round(
                verified,
                store_target_logits=self.config.store_target_logits,
                logits_dtype=self.config.logits_dtype,
                domain=self.domain,
                reserve_feature_dim=self._feature_dim if self.config.store_features else 0,
                features=features,
            )
        except Exception as e:  # noqa: BLE001 - a bad round must never break generation
            self.sample_errors += 1
            logger.warning("online adapter could not buffer a round: %s", redact(f"{type(e).__name__}: {e}"))
            return
        self._add(sample)

    def _keep_served(self, verified) -> None:
        """Remember a served round's real acceptance for its request's sample (the length head's label).
        Rows are keyed by the loop's thread (each loop numbers its own rows); an anchor that does not move
        forward starts a new request on that row (one that ended without ``on_request``)."""
        key = (threading.get_ident(), int(verified.row))
        entry = (int(verified.context_ids.numel()), int(verified.num_accepted), int(verified.verify_len))
        with self._served_lock:
            rounds = self._served.setdefault(key, [])
            if rounds and rounds[-1][0] >= entry[0]:
                rounds.clear()
            rounds.append(entry)
            while len(self._served) > _MAX_OPEN_ROWS:  # rows whose request never finished (cancelled, failed)
                self._served.pop(next(iter(self._served)))

    def _add(self, sample: Sample) -> None:
        dropped = self.buffer.add(sample)
        if dropped:
            self._log_drops(dropped)
        if len(self.buffer) >= self.config.samples_per_update:
            with self._cv:
                self._cv.notify_all()

    def _log_drops(self, dropped: int) -> None:
        """Say that the full buffer dropped its oldest samples: at once the first time, then at most once every
        ``DROP_LOG_INTERVAL_S`` with the count since the last line (a slow worker drops on every request)."""
        now = time.monotonic()
        with self._stats_lock:
            self._drops_unlogged += dropped
            if self._drops_logged_at is not None and now - self._drops_logged_at < DROP_LOG_INTERVAL_S:
                return
            n, self._drops_unlogged, self._drops_logged_at = self._drops_unlogged, 0, now
        logger.warning("online buffer full (%d samples, %d bytes at most): its %d oldest sample%s dropped unseen since "
                       "the last such line (%d dropped in all); updates train slower than traffic arrives: raise "
                       "--samples-per-update or --train-share, or lower --epochs", self.buffer.max_samples,
                       self.buffer.max_bytes, n, "" if n == 1 else "s", self.buffer.dropped)  # fmt: skip

    # ================================================================== control
    def _ready_locked(self) -> bool:
        if self.stopped:
            return False
        n = len(self.buffer)
        return n >= self.config.samples_per_update or (bool(self._force) and n > 0)

    def _rollback_pending(self) -> bool:
        """A rollback decided that the worker thread (alive to make it) has not made yet."""
        return self._rollback_due is not None and self._thread is not None and self._thread.is_alive()

    def wait_for_update(self, timeout: float | None = None) -> bool:
        """Block until the worker is idle: every update triggered so far has finished (succeeded,
        refused or failed), a rollback decided has been made, and the buffer holds fewer than
        ``samples_per_update`` samples. False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._busy or self._ready_locked() or self._rollback_pending():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cv.wait(remaining)
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Train now on what is buffered (up to ``samples_per_update``, even fewer), wait for that
        update, its version on disk and its Hub push. Returns as soon as nothing more can train (the
        worker idle with an empty buffer, or stopped), never waits for an update that cannot start.
        False on timeout (``None``: no limit; an update in progress always finishes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._train_buffered(deadline):
            return False
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        return self.publisher.flush(left) if self.publisher is not None else True

    def _train_buffered(self, deadline: float | None) -> bool:
        """The training half of :meth:`flush` (its version written too); False at ``deadline``."""
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
                while (self._finished < ticket and not self.stopped and self._thread.is_alive()
                       and (self._busy or len(self.buffer) > 0)):  # fmt: skip
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    self._cv.wait(remaining)
            finally:
                self._force -= 1
        return True

    def close(self, flush: bool = False, timeout: float | None = 120.0, hub_timeout: float | None = 10.0,
              abandon: bool = False) -> bool:
        """Drain cleanly: stop taking rounds, finish the updates already triggered (and, with
        ``flush=True``, one on a final partial buffer), stop the worker and unregister from the
        drafter (each wait up to ``timeout``), then give pending Hub pushes up to ``hub_timeout``
        seconds without retrying (``None``: no limit). An unfinished push is counted in
        ``stats["hub"]`` (``gave_up``, ``last_error``); its version stays on disk. Returns False
        when something was left unfinished. ``abandon=True`` (a server's SIGTERM): the update in
        progress stops at its next optimizer step and is discarded (no swap, no new version); a
        version being written is finished, so the newest one on disk stays loadable.

        Example:
            >>> adapter.close(flush=True, hub_timeout=300)  # wait longer for a large upload  # doctest: +SKIP
        """
        self._closing = True  # on_round ignores rounds from now on
        if abandon:
            self._abandon.set()
        done = self._train_buffered(None if timeout is None else time.monotonic() + timeout) if flush and not abandon else True
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            done = done and not self._thread.is_alive()
        self.worker.close()
        unregister_hooks(self.drafter, self._hooks)
        if self.publisher is not None:
            done = self.publisher.close(hub_timeout) and done
        return done

    def __enter__(self) -> "OnlineAdapter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ================================================================== statistics
    @property
    def tau_since_update(self) -> float | None:
        with self._stats_lock:
            return self._tau_sum / self._tau_n if self._tau_n else None

    @property
    def stats(self) -> dict:
        """Counters, buffer state, per-update history (tau before / after, losses, the guard's
        measurements, rollbacks: :class:`UpdateRecord`), Hub state. ``swaps_refused`` / ``last_refusal``:
        updates the guard kept aside and the newest one's reason; ``rollbacks``: swaps undone;
        ``served_version``: the version serving now (0: the starting weights); ``served_by_version``: ``{version:
        {"rounds", "accepted"}}``, the verify rounds served and the drafts they accepted while each version served
        (the start weights and unwritten swaps count under the newest version written); ``write_failures``: versions that
        could not be written (their weights serve all the same); ``versions_rejected``: damaged versions skipped at
        the start (``resumed_from``: the version the adapter resumed from, 0: none)."""
        with self._stats_lock:
            tau = self._tau_sum / self._tau_n if self._tau_n else None
            rounds_since = self._tau_n
            mae = self._head_err[0] / self._head_err[1] if self._head_err[1] else None
            history = [asdict(h) for h in self.history]
            last_refusal = dict(self.last_refusal) if self.last_refusal is not None else None
            served_version = self._served_version()
            served_by_version = {v: {"rounds": r, "accepted": a} for v, (r, a) in self._served_by_version.items()}
        serving = next((h for h in reversed(history) if h["swapped"]), None)
        if serving is not None:  # the serving weights' tau_after is live until the next swap
            serving["tau_after"], serving["rounds_after"], serving["head_mae_after"] = tau, rounds_since, mae
        return {
            "method": self.config.method,
            "updates": self.updates,
            "failures": self.failures,
            "swaps_refused": self.swaps_refused,
            "rollbacks": self.rollbacks,
            "last_refusal": last_refusal,
            "consecutive_failures": self.consecutive_failures,
            "stopped": self.stopped,
            "last_loss": self.last_loss,
            "last_error": self.last_error,
            "rounds_seen": self.rounds_seen,
            "samples_seen": self.buffer.added,
            "samples_buffered": len(self.buffer),
            "buffer_bytes": self.buffer.nbytes,
            "samples_dropped": self.buffer.dropped,
            "sample_errors": self.sample_errors,
            "tau_since_update": tau,
            "rounds_since_update": rounds_since,
            "head_error": mae,
            "served_version": served_version,
            "served_by_version": served_by_version,
            "write_failures": self.write_failures,
            "versions_rejected": len(self.resumed.skipped),
            "resumed_from": self.resumed.version,
            "versions": [r["version"] for r in history if r["version"] is not None],
            "domains": dict(self.domains_seen),
            "history": history,
            "hub": self.publisher.hub_stats if self.publisher is not None else None,
        }

    # ================================================================== evaluation
    def evaluate(self, samples) -> dict:
        """Mean main / length-head loss of the *serving* drafter on ``samples`` without training:
        `VerifiedRound`s / `Sample`s (one block each), or `FinishedRequest`s / `RequestSample`s
        (every response block, as an update trains on them; anchors drawn from torch's RNG). For
        tests and benchmarks."""
        from ..speculation.rounds import FinishedRequest

        samples = list(samples)
        if samples and all(isinstance(x, (FinishedRequest, RequestSample)) for x in samples):
            samples = [x if isinstance(x, RequestSample) else RequestSample.from_request(x) for x in samples]
        else:
            samples = [r if isinstance(r, Sample) else Sample.from_round(r, store_target_logits=self.config.store_target_logits,
                                                                         logits_dtype=None) for r in samples]  # fmt: skip
        with self.round_lock:
            return self.worker.evaluate(self.drafter, samples)


def _model_name(model: nn.Module) -> str:
    name = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    return str(name) if name else type(model).__name__
