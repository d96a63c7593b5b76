"""The settings of an online adapter, in one validated dataclass.

Example:
    >>> cfg = OnlineConfig(method="osd", samples_per_update=64, output_dir="runs/online")
    >>> cfg.objective
    'forward_kl'
    >>> OnlineConfig(sample_unit="token")
    Traceback (most recent call last):
    ...
    ValueError: sample_unit must be one of ('request', 'round'), got 'token'
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch

__all__ = ["LABEL_MODES", "METHODS", "SAMPLE_UNITS", "TRAINERS", "OnlineConfig", "resolve_trainer_device"]

METHODS = ("opd", "osd", "off")
# Where a round sample's per-slot labels come from. "verified": the verify forward, free, but only
# up to the first rejected draft. "rollout": the frozen target continues the bonus token greedily
# for B-1 tokens in the worker (B-1 extra small forwards per sample), labelling every slot.
LABEL_MODES = ("verified", "rollout")
# What one buffered sample is. "request" (default; the paper's and the released code's unit): a
# finished request, trained on like offline data (many blocks per sequence, target recomputed).
# "round": one verified round, a single block supervised by its verify forward.
SAMPLE_UNITS = ("request", "round")
LAYOUTS = ("native", "dflash")
# Where an update trains: a thread of the serving process, or a child process (online/trainer_process.py).
TRAINERS = ("thread", "process")


def resolve_trainer_device(name: torch.device | str) -> torch.device:
    """The device ``name`` (``cpu``, ``cuda`` (index 0) or ``cuda:N``) the online trainer can run on, or a
    ``ValueError`` saying why not; CUDA indices count the devices this process sees (``CUDA_VISIBLE_DEVICES``).

    Example:
        >>> resolve_trainer_device("cpu")
        device(type='cpu')
    """
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"{name!r} is not a device: use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"the online trainer runs on cpu or cuda:N, not {device.type}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r}; indices count the devices it shows)"
    index = 0 if device.index is None else device.index
    if index >= count:
        sees = "no CUDA device" if count == 0 else f"{count} CUDA device{'s' if count > 1 else ''} (cuda:0..cuda:{count - 1})"
        raise ValueError(f"{name} is not available: this process sees {sees}{shown}")
    return torch.device("cuda", index)


@dataclass
class OnlineConfig:
    """How an :class:`~adaflash_hf.online.adapter.OnlineAdapter` learns, keeps and publishes.

    Learning:
        method: ``"opd"`` (AdaFlash on-policy distillation + length head), ``"osd"`` (forward-KL
            baseline, no length head) or ``"off"`` (collects tau statistics only).
        samples_per_update: buffered samples that trigger an update (paper: 128 requests).
        epochs / batch_size: passes over the update's samples / samples per optimizer step.
        lr / head_lr: AdamW learning rates of the drafter and of the length head. ``lr`` is a tenth of the
            paper's 3e-4: it starts from an already trained drafter, which the paper's rate can make worse
            within one update.
        grad_clip: max gradient norm, applied to the drafter and to the head separately (so the
            head's loss cannot even rescale a drafter step).
        warmup_steps: the learning rates ramp up linearly over the shadow's first steps (0: off).
        train_share: the most of the wall clock an update's optimizer steps may take (``(0, 1]``; 1.0: train
            flat out). Below 1 the worker sleeps after each step (:class:`~adaflash_hf.online.pacing.Pacer`), so
            an engine serving beside it loses less and the update lasts ``1 / train_share`` times longer;
            ``adaflash serve --online`` defaults to 0.25.
        alpha / clip / temperature / clip_mode: OPD settings (``adaflash_hf.training.losses.opd_loss``);
            ``clip_mode="token"`` (default) is the released code's per-token clip, ``"entry"`` the
            paper's per-vocabulary-entry clip.
        position_gamma: slot-weight decay; ``"auto"``: ``default_gamma(B)`` as offline; ``None``:
            equal weights; or a number.
        head_weight / weight_decay: the length head's loss weight; AdamW weight decay.
        sample_unit: ``"request"`` (a finished request, up to ``max_anchors`` blocks anchored in its
            response, target recomputed) or ``"round"`` (one verified round).
        served_anchors: request samples: anchor the blocks at the rounds really served (the length head
            learns their real acceptance) instead of at random response positions, as offline; ``None``
            (default): for OPD only, as the paper. Set it to compare objectives on the same blocks.
        label_mode: round samples only: ``"verified"`` (labels up to the first rejection) or
            ``"rollout"`` (every slot, along the target's own greedy continuation).
        trainer: ``"thread"`` (default) trains in a thread of the serving process; ``"process"`` in a child
            process that shares the target's and the drafter's memory (:mod:`~adaflash_hf.online.trainer_process`),
            so that the update's Python never holds the serving loop's interpreter lock; the guard, swap and
            publishing stay in the serving process either way.
        train_dtype: the shadow's dtype (default: fp32 master weights for a bf16 / fp16 drafter).
        trainer_device: where updates train and the guard measures (``"cpu"``, ``"cuda:1"``...; default: the
            drafter's device). Another device than the target's holds a frozen copy of the target (its memory once
            more), so that no forward of an update runs on the serving device; the weights cross to it only at a
            swap, as one copy of the state dict. CUDA indices count the devices ``CUDA_VISIBLE_DEVICES`` shows.
        seed: shuffling seed.
    Buffer:
        max_buffer_samples (default ``4 * samples_per_update``) / max_buffer_bytes; store_features,
        store_target_logits, logits_dtype (see :mod:`adaflash_hf.online.buffer`);
        clear_after_update: after a swap, drop the samples left over in the buffer when the update took
            its batch (counted in ``samples_dropped``); the trained ones are gone already and those
            arriving during the update stay for the next one.
    Publishing:
        output_dir: write every update as a numbered version here; keep_versions: rolling window (the
            version serving is kept beyond it).
        resume: start from the newest good version in ``output_dir`` (:mod:`~adaflash_hf.online.resume`): its
            weights serve and train on, and a damaged newer one is skipped with a warning. Off (default), the
            given drafter's weights serve; either way new versions are numbered after those on disk.
        version_layout: ``"native"`` or ``"dflash"`` (SGLang / vLLM).
        hub_repo: ``"org/name"`` to push each version to (credentials from ``HF_TOKEN`` or
            ``hf auth login`` only); hub_private, hub_max_retries, hub_backoff_s.
        target_name: for the model card; domain: tag of incoming samples.
    Faults:
        max_consecutive_failures: stop adapting after this many failed updates in a row (``None``
            or 0: never). A refused update (Guard) is not a failure.
    Guard (:mod:`adaflash_hf.online.guard`):
        guard_samples: request samples of each update held back from its training to check it: the
            update replaces the serving weights only when the trained shadow's greedy acceptance
            (``accept_len``) on them, at the same blocks, is at least the serving weights' minus
            ``guard_margin``; otherwise it is kept aside (``output_dir/refused/``) with the reason.
            ``None`` (default): ``samples_per_update // 8`` (16 of 128; 0, i.e. off, below 8); 0: off;
            otherwise fewer than ``samples_per_update``. An update on fewer samples (``flush``) holds
            back the same share, rounded down. Requests identical to a held-back one are not trained on
            either (greedy decoding answers a repeated prompt the same way). ``sample_unit="round"``:
            always off (a round sample is labelled only up to the serving drafter's first rejected draft,
            so acceptance measured on it is censored by the serving weights and cannot judge a candidate
            fairly); a positive value is refused. Cost: the held-back requests are not trained on, and each
            update runs the target and the shadow over them twice (no gradient), one request per forward.
        guard_margin: acceptance (tokens per block) a candidate may lose and still be swapped in
            (negative: how much it must gain).
        guard_confidence: standard errors of the candidate's paired gain (across the held-back requests,
            each measured alone with both weights) it must clear: swapped in only when ``gain - guard_confidence
            x standard error >= -guard_margin``. 0 (default): the gain itself decides. A few held-back
            requests rarely tell the sign of a change of a few percent: 1 or 2 swap in only gains the sample can tell, at the price of refusing small real ones.
        rollback_rounds: served rounds that judge a swap (0: never roll back). Once this many rounds
            have been served with new weights, if their tau is below the tau of the last
            ``rollback_rounds`` rounds before the swap by more than ``rollback_margin`` (relative),
            the previous weights are restored and published as a new version, unless (guard on) the swapped
            weights accept at least as much as the previous ones, less ``guard_margin``, on the same recent
            requests (served tau compares different traffic). Judged once per swap, and only for a swap made
            after at least this many rounds were served.
        rollback_margin: the relative fall of served tau that triggers a rollback. The defaults (2048
            rounds, 10%) are an estimate, not a measurement: a request of ~256 tokens at tau ~3.8 is ~70
            rounds, so each side spans ~30 requests, over which the spread of tau between prompts makes
            a 10% fall unlikely by chance (about two standard errors), while a harmful update's
            fall (a quarter of tau, say) is well beyond it; the rounds cost little next to the
            thousands served between updates of 128 requests.
    """

    method: str = "opd"
    samples_per_update: int = 128
    epochs: int = 2
    batch_size: int = 2
    lr: float = 3e-5
    head_lr: float = 2e-4
    grad_clip: float | None = 1.0
    warmup_steps: int = 0
    train_share: float = 1.0
    alpha: float = 0.8
    clip: float | None = 0.01
    temperature: float = 1.0
    clip_mode: str = "token"
    position_gamma: float | str | None = "auto"
    head_weight: float = 1.0
    weight_decay: float = 0.0
    sample_unit: str = "request"
    served_anchors: bool | None = None
    max_anchors: int = 512
    label_mode: str = "verified"
    trainer: str = "thread"
    train_dtype: torch.dtype | None = None
    trainer_device: torch.device | str | None = None
    seed: int = 0
    max_buffer_samples: int | None = None
    max_buffer_bytes: int = 2 << 30
    store_features: bool = False
    store_target_logits: bool = True
    logits_dtype: torch.dtype | None = torch.bfloat16
    clear_after_update: bool = True
    output_dir: str | None = None
    keep_versions: int = 3
    resume: bool = False
    version_layout: str = "native"
    hub_repo: str | None = None
    hub_private: bool | None = None
    hub_max_retries: int = 5
    hub_backoff_s: float = 2.0
    target_name: str | None = None
    domain: str | None = None
    max_consecutive_failures: int | None = 5
    guard_samples: int | None = None
    guard_margin: float = 0.0
    guard_confidence: float = 0.0
    rollback_rounds: int = 2048
    rollback_margin: float = 0.1

    def __post_init__(self):
        for name, allowed in (("method", METHODS), ("sample_unit", SAMPLE_UNITS), ("label_mode", LABEL_MODES),
                              ("trainer", TRAINERS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if int(self.warmup_steps) < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        self.warmup_steps = int(self.warmup_steps)
        if not (math.isfinite(float(self.train_share)) and 0 < float(self.train_share) <= 1):
            raise ValueError(f"train_share must be in (0, 1], got {self.train_share}")
        self.train_share = float(self.train_share)
        for name in ("samples_per_update", "epochs", "batch_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
            setattr(self, name, int(getattr(self, name)))
        if self.version_layout not in LAYOUTS:
            raise ValueError(f"version_layout must be 'native' or 'dflash', got {self.version_layout!r}")
        self.lr, self.head_lr = float(self.lr), float(self.head_lr)
        self.head_weight, self.weight_decay = float(self.head_weight), float(self.weight_decay)
        self.max_anchors, self.seed = int(self.max_anchors), int(self.seed)
        self.max_consecutive_failures = self.max_consecutive_failures or None
        if self.trainer_device is not None:
            self.trainer_device = resolve_trainer_device(self.trainer_device)
        self._check_guard()

    def _check_guard(self) -> None:
        if self.guard_samples is not None:
            self.guard_samples = int(self.guard_samples)
            if not 0 <= self.guard_samples < self.samples_per_update:
                raise ValueError(f"guard_samples must be >= 0 and < samples_per_update ({self.samples_per_update}), "
                                 f"got {self.guard_samples}")
            if self.guard_samples and self.sample_unit == "round":
                raise ValueError("guard_samples needs sample_unit='request' (round samples cannot judge a candidate): "
                                 "pass 0 or leave it unset")
        self.rollback_rounds = int(self.rollback_rounds)
        self.guard_margin, self.rollback_margin = float(self.guard_margin), float(self.rollback_margin)
        self.guard_confidence = float(self.guard_confidence)
        for name in ("rollback_rounds", "rollback_margin", "guard_confidence"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def held_back(self) -> int:
        """Request samples a full update holds back for its guard (``guard_samples`` resolved)."""
        if self.sample_unit != "request":
            return 0
        return self.samples_per_update // 8 if self.guard_samples is None else self.guard_samples

    @property
    def anchors_at_served_rounds(self) -> bool:
        """Whether request samples are anchored at their served rounds (``served_anchors``, default: OPD)."""
        return self.method == "opd" if self.served_anchors is None else bool(self.served_anchors)

    @property
    def objective(self) -> str:
        """The training objective (``adaflash_hf.training.objective``) of this method."""
        return "opd" if self.method == "opd" else "forward_kl"

    def replace(self, **changes) -> "OnlineConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)
