"""Publish drafter versions from a ``transformers.Trainer`` run, the way the online adapter does.

``OnlineAdapterCallback`` writes an atomic numbered version (``versions.VersionStore``) of the
drafter on every ``on_save`` (and/or every ``every_n_steps`` steps) and, with ``hub_repo``, pushes
it in the background (``hub.HubPublisher``: retries, never raises into training, no tokens in
logs or cards). Works with ``DrafterTrainer`` / ``DrafterTrainingModel`` (the drafter is found on
the model; LoRA deltas are merged into the written version) or with any Trainer when the drafter
is passed explicitly.

Example:
    >>> cb = OnlineAdapterCallback("runs/drafter-versions", hub_repo="my-org/my-drafter", every_n_steps=500)  # doctest: +SKIP
    >>> trainer = DrafterTrainer(model=model, args=args, train_dataset=ds, callbacks=[cb])  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from pathlib import Path

from transformers import TrainerCallback

from ..modeling import AdaFlashDrafter
from .hub import redact
from .publish import VersionPublisher

__all__ = ["OnlineAdapterCallback"]

logger = logging.getLogger("adaflash_hf.online")

_OFFLINE_DESCRIPTION = (
    "Offline DFlash training: position-weighted cross-entropy of the drafter's block slots "
    "at random anchors of target-generated responses (frozen target)."
)


def _unwrap(model):
    model = getattr(model, "module", model)  # DDP / DataParallel
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _last_loss(state):
    for entry in reversed(getattr(state, "log_history", None) or []):
        if "loss" in entry:
            return entry["loss"]
    return None


class OnlineAdapterCallback(TrainerCallback):
    """Writes (and optionally pushes) drafter versions during ``Trainer`` training.

    Args:
        output_dir: where versions go (``vNNNNN`` + ``LATEST``).
        drafter: the drafter to publish; default: found on the Trainer's model (an
            ``AdaFlashDrafter``, or a wrapper with a ``drafter`` attribute, PEFT allowed).
        keep_versions: rolling window on disk.
        hub_repo: ``"org/name"`` to push each version to (credentials from env / login only).
        every_n_steps: also publish every N optimizer steps (``None``: only on save).
        on_save_publish: publish on every ``on_save`` (default True).
        target_name: for the model card.
        version_layout: ``"native"`` or ``"dflash"`` (SGLang / vLLM layout; plain drafters only).
        hub_wait_on_train_end: seconds to wait for pending pushes when training ends (each gets its
            attempt, without retries then; an unfinished one is counted in the Hub stats).
    """

    def __init__(
        self,
        output_dir: str,
        drafter=None,
        keep_versions: int = 3,
        hub_repo: str | None = None,
        every_n_steps: int | None = None,
        on_save_publish: bool = True,
        target_name: str | None = None,
        version_layout: str = "native",
        hub_private: bool | None = None,
        hub_max_retries: int = 5,
        hub_backoff_s: float = 2.0,
        hub_wait_on_train_end: float = 300.0,
    ):
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.publisher = VersionPublisher(output_dir, keep_versions, hub_repo, version_layout, hub_private,
                                          hub_max_retries, hub_backoff_s)  # fmt: skip
        self.drafter = drafter
        self.hub_repo = hub_repo
        self.every_n_steps = every_n_steps
        self.on_save_publish = on_save_publish
        self.target_name = target_name
        self.version_layout = version_layout
        self.hub_wait_on_train_end = hub_wait_on_train_end
        self.history: list[dict] = []
        self.failures = 0
        self._last_step: int | None = None

    @property
    def store(self):
        return self.publisher.store

    @property
    def hub(self):
        return self.publisher.hub

    # ------------------------------------------------------------------ Trainer events
    def on_save(self, args, state, control, model=None, **kwargs):
        if self.on_save_publish:
            self.publish(model, state)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.every_n_steps and state.global_step > 0 and state.global_step % self.every_n_steps == 0:
            self.publish(model, state)

    def on_train_end(self, args, state, control, **kwargs):
        self.publisher.close(self.hub_wait_on_train_end)

    # ------------------------------------------------------------------ publishing
    def _find_drafter(self, model):
        if self.drafter is not None:
            return self.drafter
        m = getattr(model, "module", model)
        if isinstance(_unwrap(m), AdaFlashDrafter):
            return m
        d = getattr(m, "drafter", None)
        if d is not None and isinstance(_unwrap(d), AdaFlashDrafter):
            return d
        raise ValueError(
            f"no AdaFlash drafter found on the Trainer model ({type(m).__name__}); pass drafter=... to the callback"
        )

    def _card(self, drafter, record: dict) -> dict:
        config = getattr(_unwrap(drafter), "config", None)
        return {
            "repo_id": self.hub_repo or "adaflash-drafter",
            "target_name": self.target_name or getattr(config, "_name_or_path", None) or "n/a",
            "method": "offline training (transformers.Trainer)",
            "latest_version": record["version"],
            "block_size": getattr(config, "block_size", None),
            "domains": "see the training data",
            "method_description": _OFFLINE_DESCRIPTION,
            "history": self.history + [record],
        }

    def publish(self, model, state) -> Path | None:
        """Write one version now (main process only) and queue its Hub push; never raises."""
        if state is not None and not getattr(state, "is_world_process_zero", True):
            return None
        step = int(getattr(state, "global_step", 0) or 0)
        if step == self._last_step:
            return None  # on_save and every_n_steps on the same step
        try:
            drafter = self._find_drafter(model)
        except Exception as e:  # noqa: BLE001 - publishing must never stop training
            self.failures += 1
            logger.warning("could not publish a drafter version at step %d: %s", step, redact(f"{type(e).__name__}: {e}"))
            return None
        loss = _last_loss(state)
        record = {"version": None, "step": step, "loss_last": loss, "epoch": getattr(state, "epoch", None)}

        def card(number: int) -> dict:
            record["version"] = number
            return self._card(drafter, record)

        done = self.publisher.publish(
            drafter, card, metadata={"step": step, "loss": loss},
            commit_message=f"AdaFlash drafter, training step {step} (version {{version}})",
            what=f"a drafter version at step {step}",
        )  # fmt: skip
        if done is None:
            self.failures += 1
            return None
        self._last_step = step
        self.history.append(record)
        return done[1]
