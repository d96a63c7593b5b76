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
from .hub import HubPublisher, redact, render_card
from .versions import VersionStore

__all__ = ["OnlineAdapterCallback"]

logger = logging.getLogger("adaflash_hf.online")


def _unwrap(model):
    model = getattr(model, "module", model)  # DDP / DataParallel
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _is_peft(model) -> bool:
    return callable(getattr(model, "get_base_model", None))


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
        hub_wait_on_train_end: seconds to wait for pending pushes when training ends.
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
        if version_layout not in ("native", "dflash"):
            raise ValueError(f"version_layout must be 'native' or 'dflash', got {version_layout!r}")
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.store = VersionStore(output_dir, keep_versions=keep_versions)
        self.drafter = drafter
        self.hub_repo = hub_repo
        self.hub = (
            HubPublisher(hub_repo, private=hub_private, max_retries=hub_max_retries, backoff_s=hub_backoff_s)
            if hub_repo
            else None
        )
        self.every_n_steps = every_n_steps
        self.on_save_publish = on_save_publish
        self.target_name = target_name
        self.version_layout = version_layout
        self.hub_wait_on_train_end = hub_wait_on_train_end
        self.history: list[dict] = []
        self.failures = 0
        self._last_step: int | None = None

    # ------------------------------------------------------------------ Trainer events
    def on_save(self, args, state, control, model=None, **kwargs):
        if self.on_save_publish:
            self.publish(model, state)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.every_n_steps and state.global_step > 0 and state.global_step % self.every_n_steps == 0:
            self.publish(model, state)

    def on_train_end(self, args, state, control, **kwargs):
        if self.hub is not None:
            self.hub.close(self.hub_wait_on_train_end)

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

    def _save_fn(self, drafter):
        base = _unwrap(drafter)

        def save(path: str) -> None:
            if self.version_layout == "dflash":
                if _is_peft(drafter):
                    raise ValueError("the dflash layout needs a plain drafter; merge the LoRA adapters first")
                from ..export import export_dflash

                export_dflash(base, path)
                return
            try:
                from ..training.trainer import save_drafter  # merges LoRA deltas, never touches the live model
            except ImportError:
                save_drafter = None
            if save_drafter is not None:
                save_drafter(drafter, path)
            elif _is_peft(drafter):
                raise ValueError("cannot save a PEFT drafter without adaflash_hf.training")
            else:
                base.save_pretrained(path)

        return save

    def publish(self, model, state) -> Path | None:
        """Write one version now (main process only) and queue its Hub push; never raises."""
        if state is not None and not getattr(state, "is_world_process_zero", True):
            return None
        step = int(getattr(state, "global_step", 0) or 0)
        if step == self._last_step:
            return None  # on_save and every_n_steps on the same step
        try:
            drafter = self._find_drafter(model)
            loss = None
            for entry in reversed(getattr(state, "log_history", None) or []):
                if "loss" in entry:
                    loss = entry["loss"]
                    break
            number = self.store.next_number()
            record = {"version": number, "step": step, "loss_last": loss, "epoch": getattr(state, "epoch", None)}
            history = self.history + [record]
            target = self.target_name or getattr(getattr(_unwrap(drafter), "config", None), "_name_or_path", None)
            card = render_card(
                {
                    "repo_id": self.hub_repo or "adaflash-drafter",
                    "target_name": target or "n/a",
                    "method": "offline training (transformers.Trainer)",
                    "latest_version": number,
                    "block_size": getattr(_unwrap(drafter).config, "block_size", None),
                    "domains": "see the training data",
                    "method_description": (
                        "Offline DFlash training: position-weighted cross-entropy of the drafter's block slots "
                        "at random anchors of target-generated responses (frozen target)."
                    ),
                    "history": history,
                }
            )
            path = self.store.write(self._save_fn(drafter), metadata={"step": step, "loss": loss}, files={"README.md": card})
        except Exception as e:  # noqa: BLE001 - publishing must never stop training
            self.failures += 1
            logger.warning("could not publish a drafter version at step %d: %s", step, redact(f"{type(e).__name__}: {e}"))
            return None
        self._last_step = step
        self.history.append(record)
        if self.hub is not None:
            self.hub.submit(path, number, commit_message=f"AdaFlash drafter, training step {step} (version {number})")
        return path
