"""The online adapter: on-policy distillation of the serving drafter from its own traffic (SPEC 4).

Flow::

    finished request ──on_request──> ReplayBuffer ──(samples_per_update)──> worker thread
    (or verified round ──on_round──>, sample_unit="round")                   │ shadow copy of the drafter
                                                                             │ (side CUDA stream on GPU):
                                                                             │ recompute target features
                                                                             │ and distributions, OPD / OSD
                                                                             │ loss on many blocks, AdamW
    serving drafter <──── swap under the round lock (between rounds) ───────┘
                                   └──> numbered version on disk ──> Hub push (background)

* **Never blocks generation.** ``on_request`` / ``on_round`` copy the sample into the buffer and return; all
  training runs on a worker thread (plus a side CUDA stream on GPU) on a *shadow* copy of the
  drafter. The only time generation waits is the swap itself: the generation loop holds
  ``drafter._weights_lock`` (this adapter's :class:`RoundLock`, shared by concurrent rounds)
  while it drafts, and the swap takes it exclusively, so a round drafts either entirely with the
  old weights or entirely with the new ones.
* **Lossless.** Verification is unchanged, so outputs stay exactly the target's whatever the
  drafter weights are; only the acceptance rate (tau) moves. (The drafter's per-request K/V cache
  of earlier context keeps the features computed with the old weights until the request ends.)
* **Faults.** An exception or a non-finite loss / weight in the worker discards the update: the
  serving weights stay the last good ones, the shadow is rebuilt from them, the failure is logged
  and counted, and after ``max_consecutive_failures`` in a row the adapter stops adapting (serving
  is unaffected).
* **Memory.** What a sample stores and costs: :mod:`adaflash_hf.online.buffer`.

Example:
    >>> adapter = OnlineAdapter(drafter, target, output_dir="runs/online", hub_repo=None)  # doctest: +SKIP
    >>> adapter.attach()  # every target.generate(..., assistant_model=drafter) now feeds it  # doctest: +SKIP
    >>> out = target.generate(ids, assistant_model=drafter, max_new_tokens=256)  # doctest: +SKIP
    >>> adapter.stats["updates"], adapter.stats["history"][-1]["tau_before"]  # doctest: +SKIP
    >>> adapter.close()  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import logging
import math
import random
import threading
import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..losses import default_gamma, forward_kl_loss, length_head_loss, opd_loss, position_weights
from ..modeling import AdaFlashDrafter
from .buffer import ReplayBuffer, RequestSample, Sample
from .hub import HubPublisher, redact, render_card
from .versions import VersionStore

__all__ = ["NonFiniteLossError", "OnlineAdapter", "RoundLock", "UpdateRecord", "copy_drafter"]

logger = logging.getLogger("adaflash_hf.online")

METHODS = ("opd", "osd", "off")
# Where a sample's per-slot labels come from. "verified": the verify forward, free, but only up to
# the first rejected draft. "rollout": the frozen target continues the bonus token greedily for
# B-1 tokens in the worker (B-1 extra small forwards per sample), labelling every slot.
LABEL_MODES = ("verified", "rollout")
# What one buffered sample is. "request" (default; the paper's and the released code's unit): a
# finished request, trained on like offline data (many blocks per sequence, target recomputed).
# "round": one verified round, a single block supervised by its verify forward.
SAMPLE_UNITS = ("request", "round")


class NonFiniteLossError(RuntimeError):
    """The worker produced a NaN / inf loss or weight; the update is discarded."""


def copy_drafter(drafter: AdaFlashDrafter, target: nn.Module) -> AdaFlashDrafter:
    """A deep copy of `drafter` bound to `target`, sharing (never copying) the target's embedding
    and LM head, and without the serving drafter's adapter hooks (round lock, round sink).

    Example:
        >>> shadow = copy_drafter(drafter, target)  # train it without touching the serving drafter  # doctest: +SKIP
    """
    memo: dict = {id(getattr(drafter, "_target_refs", {})): {}}
    for attr in ("_weights_lock", "_round_sink"):
        obj = drafter.__dict__.get(attr)
        if obj is not None:
            memo[id(obj)] = None
    clone = copy.deepcopy(drafter, memo)
    clone.__dict__.pop("_weights_lock", None)
    clone.__dict__.pop("_round_sink", None)
    return clone.bind_target(target)


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

    def __bool__(self) -> bool:  # `getattr(drafter, "_weights_lock", None) or nullcontext()`
        return True

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


@dataclass
class UpdateRecord:
    """One finished update. ``tau_before``: mean tokens per round (accepted + 1) served since the
    previous swap; ``tau_after``: the same for the rounds served with this update's weights
    (running until the next update)."""

    update: int
    samples: int
    loss_first: float | None
    loss_last: float | None
    head_loss_last: float | None
    tau_before: float | None
    rounds_before: int
    tau_after: float | None = None
    rounds_after: int = 0
    seconds: float = 0.0
    version: int | None = None
    path: str | None = None
    domains: dict = field(default_factory=dict)


class OnlineAdapter:
    """Distils ``drafter`` from the target's verification feedback while it serves (module doc).

    Args:
        drafter: the serving `AdaFlashDrafter` (bound to ``target``; bound here if not).
        target: the frozen target model (never trained; used in the worker to recompute features).
        method: ``"opd"`` (AdaFlash on-policy distillation + length head), ``"osd"`` (forward KL
            baseline, no length head) or ``"off"`` (collects tau statistics only).
        samples_per_update: buffered samples that trigger an update (paper: 128 requests).
        epochs / batch_size: passes over the update's samples / samples per optimizer step.
        lr / head_lr: AdamW learning rates of the drafter and of the length head.
        grad_clip: max gradient norm, applied to the drafter and to the head separately (so the
            head's loss cannot even rescale a drafter step).
        alpha / clip / temperature: OPD settings (``adaflash_hf.losses.opd_loss``).
        output_dir: write every update as a numbered version here (``versions.VersionStore``).
        keep_versions: rolling window of versions kept on disk.
        hub_repo: ``"org/name"``: also push each version to the Hub (``hub.HubPublisher``).
            Credentials come from ``HF_TOKEN`` or ``hf auth login`` only.
        max_consecutive_failures: stop adapting after this many failed updates in a row
            (``None`` or 0: never).
        device: where the shadow trains (default: the drafter's device).

    Keyword-only extras: ``sample_unit`` (``"request"``, default: a sample is a finished request,
    trained on with up to ``max_anchors`` blocks anchored in its response and the target's
    distributions recomputed for the whole sequence, as the released code does; ``"round"``: a
    sample is one verified round), ``clip_mode`` (``"token"``, default: the released code's per-token
    clip; ``"entry"``: the paper's per-vocabulary-entry clip, ``opd_loss``'s own default. Measured on
    the reference pair (BENCHMARKS.md section 3), the per-entry variant trails OSD, and its clipped
    reverse-KL term alone (``alpha=0``) drives tau from 1.78 to 1.15. With the per-token clip, OPD
    ends above OSD), ``position_gamma`` (``"auto"``, default:
    ``default_gamma(B)``, the offline recipe's decay; ``None``: plain mean over positions; or a
    number), ``head_weight``, ``weight_decay``,
    ``max_buffer_samples`` / ``max_buffer_bytes`` (buffer bounds), ``store_features``,
    ``store_target_logits``, ``logits_dtype`` (see ``online.buffer``), ``label_mode``
    (round samples only: ``"verified"``, the free labels up to the first rejection, or ``"rollout"``:
    every slot labelled along the target's own greedy continuation, computed in the worker), ``clear_after_update``
    (drop samples drafted with the old weights after a swap, as the paper does), ``train_dtype``
    (default fp32 master weights when the drafter is bf16 / fp16), ``version_layout``
    (``"native"`` or ``"dflash"`` for SGLang / vLLM), ``target_name`` (for the model card),
    ``domain`` (tag for incoming samples; see :meth:`set_domain`), ``hub_private``,
    ``hub_max_retries``, ``hub_backoff_s``, ``seed``.
    """

    def __init__(
        self,
        drafter: AdaFlashDrafter,
        target: nn.Module,
        method: str = "opd",
        samples_per_update: int = 128,
        epochs: int = 2,
        batch_size: int = 2,
        lr: float = 3e-4,
        head_lr: float = 2e-4,
        grad_clip: float | None = 1.0,
        alpha: float = 0.8,
        clip: float | None = 0.01,
        temperature: float = 1.0,
        output_dir: str | None = None,
        keep_versions: int = 3,
        hub_repo: str | None = None,
        max_consecutive_failures: int | None = 5,
        device: torch.device | str | None = None,
        *,
        sample_unit: str = "request",
        max_anchors: int = 512,
        clip_mode: str = "token",
        position_gamma: float | str | None = "auto",
        head_weight: float = 1.0,
        weight_decay: float = 0.0,
        max_buffer_samples: int | None = None,
        max_buffer_bytes: int = 2 << 30,
        store_features: bool = False,
        store_target_logits: bool = True,
        label_mode: str = "verified",
        logits_dtype: torch.dtype | None = torch.bfloat16,
        clear_after_update: bool = True,
        train_dtype: torch.dtype | None = None,
        version_layout: str = "native",
        target_name: str | None = None,
        domain: str | None = None,
        hub_private: bool | None = None,
        hub_max_retries: int = 5,
        hub_backoff_s: float = 2.0,
        seed: int = 0,
    ):
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if not isinstance(drafter, AdaFlashDrafter):
            raise TypeError(f"drafter must be an AdaFlashDrafter, got {type(drafter).__name__}")
        for name, value in (("samples_per_update", samples_per_update), ("epochs", epochs), ("batch_size", batch_size)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if version_layout not in ("native", "dflash"):
            raise ValueError(f"version_layout must be 'native' or 'dflash', got {version_layout!r}")
        if getattr(drafter, "_weights_lock", None) is not None:
            raise ValueError("this drafter already has an online adapter: close() it before creating another")
        if not drafter.has_target or not drafter.is_bound_to(target):
            drafter.bind_target(target)
        self.drafter = drafter
        self.target = target
        self.method = method
        self.samples_per_update = int(samples_per_update)
        self.epochs = int(epochs)
        self.batch_size = int(batch_size)
        self.lr, self.head_lr = float(lr), float(head_lr)
        self.grad_clip = grad_clip
        self.alpha, self.clip, self.temperature, self.clip_mode = alpha, clip, temperature, clip_mode
        self.head_weight = float(head_weight)
        self.weight_decay = float(weight_decay)
        self.max_consecutive_failures = max_consecutive_failures or None
        self.store_features = store_features
        self.store_target_logits = store_target_logits
        if sample_unit not in SAMPLE_UNITS:
            raise ValueError(f"sample_unit must be one of {SAMPLE_UNITS}, got {sample_unit!r}")
        self.sample_unit = sample_unit
        self.max_anchors = int(max_anchors)
        if label_mode not in LABEL_MODES:
            raise ValueError(f"label_mode must be one of {LABEL_MODES}, got {label_mode!r}")
        self.label_mode = label_mode
        self.logits_dtype = logits_dtype
        self.clear_after_update = clear_after_update
        self.version_layout = version_layout
        self.seed = int(seed)
        self.domain = domain

        param = next(drafter.parameters())
        self.device = torch.device(device) if device is not None else param.device
        self.serving_dtype = param.dtype
        if train_dtype is None:
            train_dtype = torch.float32 if param.dtype in (torch.float16, torch.bfloat16) else param.dtype
        self.train_dtype = train_dtype
        cfg = drafter.config
        self.block_size = int(cfg.block_size)
        self._feature_dim = len(cfg.target_layer_ids) * cfg.hidden_size
        if position_gamma == "auto":
            position_gamma = default_gamma(self.block_size)
        self._gamma = float(position_gamma) if position_gamma is not None else math.inf
        self._pos_weights = (
            position_weights(self.block_size - 1, float(position_gamma)) if position_gamma is not None else None
        )
        self.target_name = target_name or _model_name(target)

        self.buffer = ReplayBuffer(
            max_samples=max_buffer_samples or 4 * self.samples_per_update, max_bytes=max_buffer_bytes
        )
        self.versions = VersionStore(output_dir, keep_versions=keep_versions) if output_dir else None
        self.hub = (
            HubPublisher(hub_repo, private=hub_private, max_retries=hub_max_retries, backoff_s=hub_backoff_s)
            if hub_repo
            else None
        )
        self.hub_repo = hub_repo

        # Serving-side coordination.
        self.round_lock = RoundLock()
        drafter._weights_lock = self.round_lock
        self._swap_pending = threading.Event()  # set while a swap waits for the round lock

        # Statistics.
        self._stats_lock = threading.Lock()
        self._tau_sum = 0
        self._tau_n = 0
        self._last_swap_tau: tuple[float | None, int] = (None, 0)
        self.rounds_seen = 0
        self.updates = 0
        self.failures = 0
        self.consecutive_failures = 0
        self.write_failures = 0
        self.sample_errors = 0
        self.last_loss: float | None = None
        self.last_error: str | None = None
        self.history: list[UpdateRecord] = []
        self.domains_seen: Counter = Counter()

        # Worker.
        self._shadow: AdaFlashDrafter | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._cv = threading.Condition()
        self._busy = False
        self._force = 0
        self._started = 0
        self._finished = 0
        self._closing = False
        self.stopped = False
        self._stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        self._thread: threading.Thread | None = None
        if method != "off":
            self._thread = threading.Thread(target=self._run, name="adaflash-online-worker", daemon=True)
            self._thread.start()

    # ================================================================== serving side
    def attach(self) -> "OnlineAdapter":
        """Make every later ``target.generate(..., assistant_model=drafter)`` feed this adapter."""
        current = getattr(self.drafter, "_round_sink", None)
        if current is not None and current is not self:
            raise ValueError("another round sink is attached to this drafter; detach it first")
        self.drafter._round_sink = self
        return self

    def detach(self) -> None:
        """Stop receiving rounds automatically (an explicit ``round_sink=adapter`` still works)."""
        if getattr(self.drafter, "_round_sink", None) is self:
            self.drafter._round_sink = None

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
        if self.sample_unit != "request" or self.method == "off" or self.stopped or self._closing:
            return
        try:
            sample = RequestSample.from_request(finished, domain=self.domain)
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
        with self._stats_lock:
            self._tau_sum += int(verified.num_accepted) + 1
            self._tau_n += 1
            self.rounds_seen += 1
        if self.sample_unit != "round" or self.method == "off" or self.stopped or self._closing:
            return
        try:
            sample = Sample.from_round(
                verified,
                store_target_logits=self.store_target_logits,
                logits_dtype=self.logits_dtype,
                domain=self.domain,
                reserve_feature_dim=self._feature_dim if self.store_features else 0,
                features=features,
            )
        except Exception as e:  # noqa: BLE001 - a bad round must never break generation
            self.sample_errors += 1
            logger.warning("online adapter could not buffer a round: %s", redact(f"{type(e).__name__}: {e}"))
            return
        self._add(sample)

    def _add(self, sample: Sample) -> None:
        self.buffer.add(sample)
        if len(self.buffer) >= self.samples_per_update:
            with self._cv:
                self._cv.notify_all()

    # ================================================================== control
    def _ready_locked(self) -> bool:
        if self.stopped:
            return False
        n = len(self.buffer)
        return n >= self.samples_per_update or (bool(self._force) and n > 0)

    def wait_for_update(self, timeout: float | None = None) -> bool:
        """Block until the worker is idle: every update triggered so far has finished (succeeded or
        failed) and the buffer holds fewer than ``samples_per_update`` samples. False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._busy or self._ready_locked():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cv.wait(remaining)
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Train now on what is buffered (up to ``samples_per_update``, even fewer), wait for that
        update, its version on disk and its Hub push. False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left():
            return None if deadline is None else max(deadline - time.monotonic(), 0.0)

        if self._thread is not None:
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
                    while self._finished < ticket and not self.stopped and self._thread.is_alive():
                        remaining = left()
                        if remaining is not None and remaining <= 0:
                            return False
                        self._cv.wait(remaining)
                finally:
                    self._force -= 1
        if self.hub is not None:
            return self.hub.flush(left())
        return True

    def close(self, flush: bool = False, timeout: float | None = 120.0) -> None:
        """Drain cleanly: stop taking rounds, finish the updates already triggered (and, with
        ``flush=True``, one on a final partial buffer), stop the worker, detach from the drafter
        and finish pending Hub pushes (each wait up to ``timeout``)."""
        self._closing = True  # on_round ignores rounds from now on
        if flush:
            self.flush(timeout)
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self.detach()
        if getattr(self.drafter, "_weights_lock", None) is self.round_lock:
            self.drafter._weights_lock = None
        if self.hub is not None:
            self.hub.close(timeout)

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
        """Counters, buffer state, per-update history (tau before / after, losses), Hub state."""
        with self._stats_lock:
            tau = self._tau_sum / self._tau_n if self._tau_n else None
            rounds_since = self._tau_n
            history = [asdict(h) for h in self.history]
        if history:  # the newest version's tau_after is live until the next update
            history[-1]["tau_after"], history[-1]["rounds_after"] = tau, rounds_since
        return {
            "method": self.method,
            "updates": self.updates,
            "failures": self.failures,
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
            "write_failures": self.write_failures,
            "versions": [r["version"] for r in history if r["version"] is not None],
            "domains": dict(self.domains_seen),
            "history": history,
            "hub": self.hub.stats if self.hub is not None else None,
        }

    # ================================================================== worker
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._ready_locked():
                    if self._closing or self.stopped:
                        return
                    self._cv.wait()
                samples = self.buffer.take(self.samples_per_update)
                self._started += 1
                self._busy = True
            try:
                self._update(samples)
            except BaseException as e:  # noqa: BLE001 - the worker must survive anything
                logger.error("online adapter worker error: %s", redact(f"{type(e).__name__}: {e}"))
            finally:
                with self._cv:
                    self._busy = False
                    self._finished += 1
                    self._cv.notify_all()

    def _update(self, samples: list[Sample]) -> None:
        t0 = time.perf_counter()
        domains = Counter(s.domain for s in samples if s.domain is not None)
        try:
            stream_ctx = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
            with stream_ctx:
                if self._stream is not None:
                    self._stream.wait_stream(torch.cuda.default_stream(self.device))
                result = self._train(samples)
            self._swap()
        except Exception as e:  # noqa: BLE001
            self._on_failure(e)
            return
        with self._stats_lock:
            tau_before, rounds_before = self._last_swap_tau
            if self.history:
                self.history[-1].tau_after, self.history[-1].rounds_after = tau_before, rounds_before
            record = UpdateRecord(
                update=self.updates + 1,
                samples=len(samples),
                loss_first=result["loss_first"],
                loss_last=result["loss_last"],
                head_loss_last=result["head_loss_last"],
                tau_before=tau_before,
                rounds_before=rounds_before,
                seconds=time.perf_counter() - t0,
                domains=dict(domains),
            )
            self.history.append(record)
            self.updates += 1
            self.consecutive_failures = 0
            self.last_loss = result["loss_last"]
            self.domains_seen.update(domains)
        if self.clear_after_update:
            self.buffer.clear()
        logger.info(
            "online update %d (%s): %d samples, loss %.4f -> %.4f, tau before %s, %.1fs",
            record.update, self.method, len(samples), result["loss_first"] or 0.0, result["loss_last"] or 0.0,
            "n/a" if tau_before is None else f"{tau_before:.3f}", record.seconds,
        )  # fmt: skip
        self._publish(record)

    def _on_failure(self, e: BaseException) -> None:
        self._shadow = None  # rebuilt from the (unchanged, last good) serving weights next time
        self._optimizer = None
        with self._stats_lock:
            self.failures += 1
            self.consecutive_failures += 1
            self.last_error = redact(f"{type(e).__name__}: {e}")
            stop = self.max_consecutive_failures is not None and self.consecutive_failures >= self.max_consecutive_failures
        logger.warning("online update failed, serving weights unchanged: %s", self.last_error)
        if stop:
            self.stopped = True
            self.buffer.clear()
            logger.error(
                "online adapter stopped after %d consecutive failed updates; the drafter keeps serving its last good weights",
                self.consecutive_failures,
            )

    # ------------------------------------------------------------------ shadow / optimizer
    def _make_shadow(self) -> AdaFlashDrafter:
        shadow = copy_drafter(self.drafter, self.target)
        impl = str(getattr(shadow.config, "_attn_implementation", "") or "")
        if self.sample_unit == "request" and (impl.startswith("flash") or "paged" in impl):
            # Many blocks per request train in one pass under a block attention mask, which flash
            # kernels cannot take; only the shadow changes, the serving drafter keeps its kernel.
            shadow.set_attn_implementation("sdpa")
        shadow.to(device=self.device, dtype=self.train_dtype)
        shadow.train()
        for p in shadow.parameters():
            p.requires_grad_(True)
        return shadow

    def _param_groups(self, shadow: AdaFlashDrafter):
        drafter_params = [p for n, p in shadow.named_parameters() if not n.startswith("length_head.")]
        head_params = []
        if self.method == "opd" and shadow.length_head is not None:
            head_params = list(shadow.length_head.parameters())
        return drafter_params, head_params

    def _ensure_shadow(self):
        if self._shadow is None:
            self._shadow = self._make_shadow()
            dp, hp = self._param_groups(self._shadow)
            groups = [{"params": dp, "lr": self.lr}]
            if hp:
                groups.append({"params": hp, "lr": self.head_lr})
            self._optimizer = torch.optim.AdamW(groups, weight_decay=self.weight_decay)
        return self._shadow, self._optimizer

    # ------------------------------------------------------------------ losses
    @torch.no_grad()
    def _target_pass(self, s: Sample) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Target features of ``s.context_ids`` (``[1, T, K*H]``) and, when not stored, the target
        logits at the bonus + draft positions (``[verify_len, V]``), from the frozen target."""
        tparam = next(self.target.parameters())
        ctx = s.context_ids.to(tparam.device)
        T = ctx.numel()
        if s.target_logits is None:
            ids = torch.cat([ctx, torch.tensor([s.bonus_token], device=ctx.device), s.draft_tokens.to(ctx.device)])
            out = self.target(input_ids=ids[None], output_hidden_states=True, use_cache=False, logits_to_keep=s.verify_len)
            logits = out.logits[0, -s.verify_len :]
            feats = self.drafter.select_context(out.hidden_states)[:, :T] if T else None
            return feats, logits
        if T == 0:
            return None, None
        decoder = self.target.get_decoder() if hasattr(self.target, "get_decoder") else None
        model = decoder if decoder is not None else self.target
        out = model(input_ids=ctx[None], output_hidden_states=True, use_cache=False)
        return self.drafter.select_context(out.hidden_states), None

    @torch.no_grad()
    def _rollout(self, s: Sample) -> torch.Tensor:
        """The frozen target's distributions along its own greedy continuation of the bonus token:
        ``[B-1, V]``, row ``j`` predicting draft slot ``j + 1`` (the labels of ``label_mode="rollout"``)."""
        from transformers import DynamicCache

        device = next(self.target.parameters()).device
        ids = torch.cat([s.context_ids.to(device), torch.tensor([s.bonus_token], device=device)])[None]
        cache, rows = DynamicCache(config=self.target.config), []
        for _ in range(self.block_size - 1):
            logits = self.target(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
            rows.append(logits[0].float())
            ids = logits.argmax(dim=-1, keepdim=True)
        return torch.stack(rows)

    @staticmethod
    def _logits(model: AdaFlashDrafter, hidden: torch.Tensor) -> torch.Tensor:
        lm = model._target_ref("lm_head")
        if isinstance(lm, nn.Linear):  # detached weights: no gradient can reach the target
            w = lm.weight.detach()
            b = lm.bias.detach() if lm.bias is not None else None
            return F.linear(hidden.to(device=w.device, dtype=w.dtype), w, b)
        return model.compute_logits(hidden)

    def _sample_loss(self, model: AdaFlashDrafter, s: Sample, cache_features: bool = True):
        """``(main_loss, head_loss)`` of one sample for ``model`` (the shadow, or the serving drafter
        for :meth:`evaluate`). ``main``: OPD (or forward KL) of draft slots ``1..n`` against
        ``target_logits[0..n-1]``, ``n = min(num_accepted + 1, verify_len - 1)`` (``label_mode="rollout"``:
        all ``B - 1`` slots against the target's greedy rollout); ``head``: MSE of the length head on detached
        features against ``(num_accepted + 1) / B`` (OPD only)."""
        param = next(model.parameters())
        dev, dtype = param.device, param.dtype
        B = self.block_size
        feats, tlogits = s.features, s.target_logits
        T = s.context_ids.numel()
        if (feats is None and T > 0) or tlogits is None:
            new_feats, new_logits = self._target_pass(s)
            if feats is None:
                feats = new_feats
                if cache_features and self.store_features and feats is not None:
                    s.features = feats.to(torch.bfloat16 if feats.is_floating_point() else feats.dtype)
            if tlogits is None:
                tlogits = new_logits
        ids = torch.full((1, B), model.config.mask_token_id, dtype=torch.long)
        ids[0, 0] = s.bonus_token
        with torch.no_grad():
            emb_dev = model._target_ref("embed").weight.device
            noise = model.embed(ids.to(emb_dev)).to(device=dev, dtype=dtype)
        if noise.is_inference():
            noise = noise.clone()
        ctx = None
        if T > 0:
            ctx = feats.to(device=dev, dtype=dtype)
            if ctx.is_inference():
                ctx = ctx.clone()
        pos = torch.arange(T + B, device=dev)[None]
        hidden = model(noise_embeds=noise, context_hidden_states=ctx, position_ids=pos).last_hidden_state
        if self.label_mode == "rollout":
            if s.rollout_logits is None:
                s.rollout_logits = self._rollout(s).to(torch.bfloat16)
            tlogits, n = s.rollout_logits.float(), B - 1
        else:
            # Only slots up to the first rejected draft carry usable labels: the verify forward
            # conditions later target distributions on a wrong draft prefix, while the block drafter
            # predicts every slot from the verified context alone.
            n = min(s.num_accepted + 1, s.verify_len - 1, B - 1)
        main = hidden.sum() * 0.0
        if n > 0 and self.method in ("opd", "osd"):
            draft_logits = self._logits(model, hidden[:, 1 : 1 + n])
            target_logits = tlogits[:n].to(draft_logits.device)
            if target_logits.is_inference():
                target_logits = target_logits.clone()
            target_logits = target_logits[None]
            w = self._pos_weights[:n].to(draft_logits.device) if self._pos_weights is not None else None
            if self.method == "opd":
                main = opd_loss(
                    draft_logits, target_logits, alpha=self.alpha, clip=self.clip, temperature=self.temperature,
                    position_weights=w, clip_mode=self.clip_mode,
                )  # fmt: skip
            else:
                main = forward_kl_loss(draft_logits, target_logits, temperature=self.temperature, position_weights=w)
        head = main.new_zeros(())
        if self.method == "opd" and model.length_head is not None:
            pred = model.predict_accept_ratio(hidden)  # detached input: no gradient into the drafter
            head = length_head_loss(
                pred, torch.tensor([s.num_accepted], device=pred.device), B, verify_len=torch.tensor([s.verify_len], device=pred.device)
            )
        return main, head

    def _request_model(self, model: AdaFlashDrafter):
        """The offline training wrapper around ``model`` with this adapter's objective: OPD (or
        OSD's forward KL) against the target's distributions on blocks anchored in responses."""
        from ..training.trainer import DrafterTrainingModel

        return DrafterTrainingModel(
            self.target, model, max_anchors=self.max_anchors, gamma=self._gamma,
            length_head_weight=self.head_weight if self.method == "opd" else 0.0,
            objective="opd" if self.method == "opd" else "forward_kl", alpha=self.alpha, clip=self.clip,
            temperature=self.temperature, clip_mode=self.clip_mode, move_target=False,
        )  # fmt: skip

    def _request_batch(self, batch: list[RequestSample], device) -> dict[str, torch.Tensor]:
        from ..training.trainer import DrafterDataCollator

        pad = getattr(self.target.config, "pad_token_id", None)
        collate = DrafterDataCollator(max_length=None, pad_token_id=pad if isinstance(pad, int) else 0)
        rows = [{"input_ids": s.input_ids.tolist(), "loss_mask": [0] * s.prompt_len + [1] * s.response_len} for s in batch]
        return {k: v.to(device) for k, v in collate(rows).items()}

    def _train(self, samples: list[Sample]) -> dict:
        shadow, opt = self._ensure_shadow()
        drafter_params, head_params = self._param_groups(shadow)
        params = drafter_params + head_params
        rng = random.Random(self.seed * 1_000_003 + self._started)
        n = len(samples)
        epoch_losses: list[float] = []
        head_last = None
        wrapper = self._request_model(shadow) if self.sample_unit == "request" else None
        with torch.enable_grad():
            for _ in range(self.epochs):
                order = list(range(n))
                rng.shuffle(order)
                main_sum, head_sum, count = 0.0, 0.0, 0
                for start in range(0, n, self.batch_size):
                    batch = [samples[i] for i in order[start : start + self.batch_size]]
                    if wrapper is not None:  # the whole batch of requests in one forward
                        out = wrapper(**self._request_batch(batch, self.device))
                        losses = [(out["loss"], out["ce_loss"], out["length_loss"], len(batch))]
                    else:
                        losses = []
                        for s in batch:
                            main, head = self._sample_loss(shadow, s)
                            loss = (main.float() + self.head_weight * head.float()) / len(batch)
                            losses.append((loss, main.detach(), head.detach(), 1))
                    grads: list[torch.Tensor | None] = [None] * len(params)
                    step_loss = 0.0
                    for loss, main, head, k in losses:
                        step_loss += float(loss.detach())
                        main_sum, head_sum, count = main_sum + float(main) * k, head_sum + float(head) * k, count + k
                        if loss.requires_grad:
                            gs = torch.autograd.grad(loss, params, allow_unused=True)
                            grads = [g if a is None else (a if g is None else a + g) for a, g in zip(grads, gs)]
                    if not math.isfinite(step_loss):
                        raise NonFiniteLossError(f"non-finite loss {step_loss} in an online update")
                    for p, g in zip(params, grads):
                        p.grad = g
                    if self.grad_clip is not None:
                        for group in (drafter_params, head_params):
                            if group:
                                torch.nn.utils.clip_grad_norm_(group, self.grad_clip)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                epoch_losses.append(main_sum / max(count, 1))
                head_last = head_sum / max(count, 1)
        for name, p in shadow.named_parameters():
            if not bool(torch.isfinite(p).all()):
                raise NonFiniteLossError(f"non-finite weights in {name} after an online update")
        return {
            "loss_first": epoch_losses[0] if epoch_losses else None,
            "loss_last": epoch_losses[-1] if epoch_losses else None,
            "head_loss_last": head_last if (self.method == "opd" and shadow.length_head is not None) else None,
        }

    # ------------------------------------------------------------------ swap
    def _swap(self) -> None:
        """Copy the shadow's weights into the serving drafter while no round is drafting."""
        new_state = self._shadow.state_dict()
        serving = self.drafter.state_dict()
        if new_state.keys() != serving.keys():
            raise RuntimeError("shadow and serving drafter disagree on their tensors; not swapping")
        self._swap_pending.set()
        try:
            with self.round_lock.exclusive():
                self._swap_pending.clear()
                cuda_devices = {t.device for t in serving.values() if t.device.type == "cuda"}
                if self._stream is not None:
                    cuda_devices.add(self.device)
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
        finally:
            self._swap_pending.clear()

    # ------------------------------------------------------------------ publishing
    def _card_context(self) -> dict:
        with self._stats_lock:
            history = [asdict(h) for h in self.history]
            domains = dict(self.domains_seen)
        latest = history[-1] if history else {}
        return {
            "repo_id": self.hub_repo or "adaflash-drafter",
            "title": (self.hub_repo or "AdaFlash drafter") + " (online)",
            "target_name": self.target_name,
            "method": self.method.upper(),
            "latest_version": latest.get("version"),
            "latest_tau_before": latest.get("tau_before"),
            "block_size": self.block_size,
            "samples_per_update": f"{self.samples_per_update} {'finished requests' if self.sample_unit == 'request' else 'verified rounds'}",
            "epochs": self.epochs,
            "domains": domains,
            "history": history,
            "method_description": _METHOD_DESCRIPTIONS[self.method],
            "hyperparameters": (
                f"alpha {self.alpha}, clip {self.clip} ({self.clip_mode}), temperature {self.temperature}, "
                f"AdamW lr {self.lr} / head {self.head_lr}, batch {self.batch_size}, grad clip {self.grad_clip}"
            ),
        }

    def _save_weights(self, path: str) -> None:
        if self.version_layout == "dflash":
            from ..export import export_dflash

            export_dflash(self.drafter, path)
        else:
            self.drafter.save_pretrained(path)

    def _publish(self, record: UpdateRecord) -> None:
        if self.versions is None:
            return
        try:
            number = self.versions.next_number()
            with self._stats_lock:
                record.version = number
            context = self._card_context()
            meta = {
                "update": record.update,
                "method": self.method,
                "target": self.target_name,
                "samples": record.samples,
                "loss_first": record.loss_first,
                "loss_last": record.loss_last,
                "tau_before": record.tau_before,
                "domains": record.domains,
                "layout": self.version_layout,
            }
            path = self.versions.write(self._save_weights, metadata=meta, files={"README.md": render_card(context)})
            with self._stats_lock:
                record.path = str(path)
        except Exception as e:  # noqa: BLE001 - serving continues with the new weights
            with self._stats_lock:
                record.version = None
                self.write_failures += 1
            logger.warning("could not write online version: %s", redact(f"{type(e).__name__}: {e}"))
            return
        if self.hub is not None:
            self.hub.submit(path, number, commit_message=f"AdaFlash online update {record.update} (version {number})")

    # ================================================================== evaluation
    def evaluate(self, samples) -> dict:
        """Mean main / length-head loss of the *serving* drafter on ``samples`` without training:
        `VerifiedRound`s / `Sample`s (one block each), or `FinishedRequest`s / `RequestSample`s
        (every response block, as an update trains on them; anchors drawn from torch's RNG). For
        tests and benchmarks."""
        from ..spec.rounds import FinishedRequest

        samples = list(samples)
        if samples and all(isinstance(x, (FinishedRequest, RequestSample)) for x in samples):
            reqs = [x if isinstance(x, RequestSample) else RequestSample.from_request(x) for x in samples]
            with torch.no_grad(), self.round_lock:
                out = self._request_model(self.drafter)(**self._request_batch(reqs, self.device))
            return {"loss": float(out["ce_loss"]), "head_loss": float(out["length_loss"])}
        rounds = [r if isinstance(r, Sample) else Sample.from_round(r, store_target_logits=self.store_target_logits, logits_dtype=None) for r in samples]
        main_sum, head_sum = 0.0, 0.0
        with torch.no_grad(), self.round_lock:
            for s in rounds:
                main, head = self._sample_loss(self.drafter, s, cache_features=False)
                main_sum += float(main)
                head_sum += float(head)
        n = max(len(rounds), 1)
        return {"loss": main_sum / n, "head_loss": head_sum / n}


_METHOD_DESCRIPTIONS = {
    "opd": (
        "On-policy distillation (AdaFlash): `l = alpha * CE(q, argmax p) + (1 - alpha) * sum_y min(q log(q/p), delta)` "
        "over the verified draft positions of live traffic (q: drafter, p: target, from the verify forward); the "
        "length head is trained by MSE against `(accepted + 1) / B` on detached drafter features."
    ),
    "osd": "Online speculative distillation baseline: forward KL `T^2 * KL(p || q)` over the verified draft positions.",
    "off": "No adaptation (statistics only).",
}


def _model_name(model: nn.Module) -> str:
    name = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    return str(name) if name else type(model).__name__
