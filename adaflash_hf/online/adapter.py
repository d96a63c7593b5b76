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
* **Parts.** The adapter is the serving side (ingest, control, statistics); it composes, from its one
  :class:`OnlineConfig`, the :class:`~adaflash_hf.online.update_loop.UpdateLoop` (train + guard + swap + publish, on
  its worker thread) with the buffer, the trainer, the guard, the publisher, the
  :class:`~adaflash_hf.online.counters.OnlineCounters` and the round lock it hands that loop.

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
from contextlib import nullcontext

import torch
from torch import nn

from ..modeling import AdaFlashDrafter
from ..speculation.hooks import DrafterHooks, hooks_for, register_hooks, replace_hooks, unregister_hooks
from .buffer import ReplayBuffer, RequestSample, Sample
from .config import LABEL_MODES, METHODS, SAMPLE_UNITS, OnlineConfig
from .counters import OnlineCounters, UpdateRecord
from .guard import RollbackWatch, UpdateGuard
from .hub import redact
from .lock import RoundLock
from .publish import VersionPublisher
from .resume import Resumed, newest_number, resume_drafter
from .trainer_process import ProcessTrainer
from .update_loop import UpdateLoop
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


class OnlineAdapter:
    """Distils ``drafter`` from the target's verification feedback while it serves (module doc).

    Args:
        drafter: the serving `AdaFlashDrafter` (bound to ``target``; bound here if not).
        target: the frozen target model (never trained; used in the worker to recompute features).
        config: an :class:`~adaflash_hf.online.config.OnlineConfig` (default settings if None).
        **settings: ``OnlineConfig`` fields, applied over ``config`` (``OnlineAdapter(d, t,
            method="osd", samples_per_update=64)``).

    The settings are read from ``adapter.config`` (``adapter.config.lr``). Its parts, each an attribute:
    ``buffer`` (:class:`ReplayBuffer`), ``worker`` (the :class:`ShadowTrainer` holding the shadow), ``trainer``
    (``worker``, or a :class:`ProcessTrainer` around it), ``guard``, ``publisher`` (None without ``output_dir``),
    ``counters`` (:class:`OnlineCounters`, read whole through :attr:`stats`), ``round_lock`` and ``loop``
    (:class:`UpdateLoop`).
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
        self._feature_dim = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
        self.buffer = ReplayBuffer(
            max_samples=config.max_buffer_samples or 4 * config.samples_per_update, max_bytes=config.max_buffer_bytes
        )
        self.resumed = _resume(drafter, config) if config.output_dir else Resumed()
        self.counters = OnlineCounters(RollbackWatch(config.rollback_rounds, config.rollback_margin),
                                       start_version=self.resumed.version)  # fmt: skip
        self.publisher = (
            VersionPublisher(config.output_dir, config.keep_versions, config.hub_repo, config.version_layout,
                             config.hub_private, config.hub_max_retries, config.hub_backoff_s,
                             keep=self.counters.serving_on_disk)
            if config.output_dir else None
        )  # fmt: skip
        self.worker = ShadowTrainer(drafter, target, config)
        self.trainer = ProcessTrainer(self.worker) if config.trainer == "process" else self.worker
        self.guard = UpdateGuard(config)

        # Serving-side coordination: the loops find the lock (and, once attached, this sink) here.
        self.round_lock = RoundLock()
        self._hooks = DrafterHooks(weights_lock=self.round_lock)
        register_hooks(drafter, self._hooks)
        # served rounds of requests in flight, per (loop thread, row): (anchor, accepted, verify length)
        self._served: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        self._served_lock = threading.Lock()
        self._drops_lock = threading.Lock()
        self._drops_unlogged, self._drops_logged_at = 0, None  # buffer evictions not yet in a log line; its clock
        self.loop = UpdateLoop(config, drafter, self.worker, self.trainer, self.buffer, self.guard, self.publisher,
                               self.counters, self.round_lock, config.target_name or _model_name(target))  # fmt: skip
        if config.method != "off":
            self.loop.start()

    @property
    def busy(self) -> bool:
        """Whether an update is training (or swapping / publishing) right now."""
        return self.loop.busy

    @property
    def stopped(self) -> bool:
        """Whether the adapter stopped adapting after ``max_consecutive_failures`` failed updates in a row (serving
        is unaffected)."""
        return self.loop.stopped

    @property
    def write_failures(self) -> int:
        """Versions that could not be written (their weights serve all the same)."""
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
        if self.config.sample_unit != "request" or self.config.method == "off" or not self.loop.accepting:
            return
        with self._served_lock:
            served = self._served.pop((threading.get_ident(), int(finished.row)), None)
        try:
            sample = RequestSample.from_request(finished, domain=self.domain, served=served)
        except Exception as e:  # noqa: BLE001 - a bad request must never break generation
            self.counters.sample_error()
            logger.warning("online adapter could not buffer a request: %s", redact(f"{type(e).__name__}: {e}"))
            return
        if sample.prompt_len >= 1 and sample.response_len >= 2:  # a block needs an anchor and a label
            self._add(sample)

    def add_round(self, verified, features: torch.Tensor | None = None) -> None:
        """Like :meth:`on_round`, optionally with the context's target features (``[1, T, K*H]``)
        already at hand (then the worker does not recompute them; they count against the buffer's
        byte bound)."""
        tokens = int(verified.num_accepted) + 1
        if self.counters.observe_round(tokens, verified.head_error(self.drafter.config.block_size)):
            self.loop.wake()  # the worker thread restores the weights; this round returns at once
        if self.config.sample_unit == "request" and self.config.anchors_at_served_rounds:
            self._keep_served(verified)
        if self.config.sample_unit != "round" or self.config.method == "off" or not self.loop.accepting:
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
            self.counters.sample_error()
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
            self.loop.wake()

    def _log_drops(self, dropped: int) -> None:
        """Say that the full buffer dropped its oldest samples: at once the first time, then at most once every
        ``DROP_LOG_INTERVAL_S`` with the count since the last line (a slow worker drops on every request)."""
        now = time.monotonic()
        with self._drops_lock:
            self._drops_unlogged += dropped
            if self._drops_logged_at is not None and now - self._drops_logged_at < DROP_LOG_INTERVAL_S:
                return
            n, self._drops_unlogged, self._drops_logged_at = self._drops_unlogged, 0, now
        logger.warning("online buffer full (%d samples, %d bytes at most): its %d oldest sample%s dropped unseen since "
                       "the last such line (%d dropped in all); updates train slower than traffic arrives: raise "
                       "--samples-per-update or --train-share, or lower --epochs", self.buffer.max_samples,
                       self.buffer.max_bytes, n, "" if n == 1 else "s", self.buffer.dropped)  # fmt: skip

    # ================================================================== control
    def wait_for_update(self, timeout: float | None = None) -> bool:
        """Block until the worker is idle: every update triggered so far has finished (succeeded,
        refused or failed), a rollback decided has been made, and the buffer holds fewer than
        ``samples_per_update`` samples. False on timeout."""
        return self.loop.wait_idle(timeout)

    def flush(self, timeout: float | None = None) -> bool:
        """Train now on what is buffered (up to ``samples_per_update``, even fewer), wait for that
        update, its version on disk and its Hub push. Returns as soon as nothing more can train (the
        worker idle with an empty buffer, or stopped), never waits for an update that cannot start.
        False on timeout (``None``: no limit; an update in progress always finishes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.loop.train_buffered(deadline):
            return False
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        return self.publisher.flush(left) if self.publisher is not None else True

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
        done = self.loop.stop(flush=flush, timeout=timeout, abandon=abandon)
        self.trainer.close()
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
        """Mean tokens per round served since the newest swap (None before any round)."""
        return self.counters.tau_since_update

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
        c = self.counters.snapshot()
        return {
            "method": self.config.method,
            **{k: c[k] for k in ("updates", "failures", "swaps_refused", "rollbacks", "last_refusal",
                                 "consecutive_failures")},
            "stopped": self.stopped,
            **{k: c[k] for k in ("last_loss", "last_error", "rounds_seen")},
            "samples_seen": self.buffer.added,
            "samples_buffered": len(self.buffer),
            "buffer_bytes": self.buffer.nbytes,
            "samples_dropped": self.buffer.dropped,
            **{k: c[k] for k in ("sample_errors", "tau_since_update", "rounds_since_update", "head_error",
                                 "served_version", "served_by_version")},
            "write_failures": self.write_failures,
            "versions_rejected": len(self.resumed.skipped),
            "resumed_from": self.resumed.version,
            **{k: c[k] for k in ("versions", "domains", "history")},
            "hub": self.publisher.hub_stats if self.publisher is not None else None,
        }  # fmt: skip

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


def _resume(drafter: AdaFlashDrafter, config: OnlineConfig) -> Resumed:
    """With ``config.resume``, serve the newest good version in the output folder (:mod:`.resume`); one log
    line says which weights serve, a warning names each version skipped."""
    root = config.output_dir
    resumed = resume_drafter(drafter, root) if config.resume else Resumed(newest=newest_number(root))
    for name, reason in resumed.skipped:
        logger.warning("online: version %s in %s skipped: %s", name, root, reason)
    nxt = version_name(resumed.newest + 1)
    if resumed.version:
        logger.info("online: resuming from %s: its drafter and length head serve and train on (new versions "
                    "from %s)", resumed.path, nxt)
    elif config.resume:
        logger.info("online: no %sversion to resume in %s: starting from the given drafter (new versions from %s)",
                    "good " if resumed.skipped else "", root, nxt)
    elif resumed.newest:
        logger.info("online: starting fresh from the given drafter, not from the versions in %s (new versions "
                    "from %s)", root, nxt)
    return resumed


def _model_name(model: nn.Module) -> str:
    name = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    return str(name) if name else type(model).__name__
