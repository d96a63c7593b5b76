"""Publishing drafter versions: a numbered version on disk, its model card, its Hub push.

One implementation for the online adapter (every update) and for ``OnlineAdapterCallback`` (a
``transformers.Trainer`` run): :class:`VersionPublisher` writes the drafter atomically as the next
version (:class:`~adaflash_hf.online.versions.VersionStore`) with a rendered card and metadata, then
queues the push (:class:`~adaflash_hf.online.hub.HubPublisher`, background, retried); pruning keeps
the versions the push still needs. It never raises: a failed write is logged (redacted), counted
and kept in ``last_error``, nothing of it stays on disk, and serving or training goes on.

Example:
    >>> pub = VersionPublisher("runs/versions", hub_repo="org/drafter")  # doctest: +SKIP
    >>> pub.publish(drafter, card=lambda n: {"latest_version": n}, metadata={"step": 10},
    ...             commit_message="step 10 (version {version})")  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from pathlib import Path

from .hub import HubPublisher, redact, render_card
from .versions import VersionStore

__all__ = ["VersionPublisher", "card_context", "save_version"]

logger = logging.getLogger("adaflash_hf.online")

LAYOUTS = ("native", "dflash")


def save_version(drafter, path: str, layout: str = "native") -> None:
    """Write ``drafter`` (plain or PEFT) to ``path``: the native layout (LoRA merged) or, with
    ``layout="dflash"``, the layout SGLang and vLLM read (plain drafters only), in the drafter's dtype."""
    from ..training.checkpoint import is_peft, save_drafter, unwrap_drafter

    if layout == "dflash":
        if is_peft(drafter):
            raise ValueError("the dflash layout needs a plain drafter; merge the LoRA adapters first")
        from ..export import export_dflash

        base = unwrap_drafter(drafter)
        export_dflash(base, path, dtype=next(base.parameters()).dtype)
    else:
        save_drafter(drafter, path)


class VersionPublisher:
    """Numbered versions in ``output_dir`` (rolling window ``keep_versions``), optionally pushed to
    ``hub_repo`` (credentials from ``HF_TOKEN`` or ``hf auth login`` only), in ``layout``; ``keep()`` names
    versions pruning must keep beyond the window (the one serving)."""

    def __init__(
        self,
        output_dir: str,
        keep_versions: int = 3,
        hub_repo: str | None = None,
        layout: str = "native",
        hub_private: bool | None = None,
        hub_max_retries: int = 5,
        hub_backoff_s: float = 2.0,
        keep: Callable[[], Collection[int]] | None = None,
    ):
        if layout not in LAYOUTS:
            raise ValueError(f"version_layout must be 'native' or 'dflash', got {layout!r}")
        self.hub_repo = hub_repo
        self.hub = (
            HubPublisher(hub_repo, private=hub_private, max_retries=hub_max_retries, backoff_s=hub_backoff_s)
            if hub_repo
            else None
        )
        # Pruning keeps what a push still reads (the version uploading, pending, last pushed).
        hub = self.hub

        def in_use() -> set[int]:
            return set(hub.in_use() if hub is not None else ()) | set(keep() if keep is not None else ())

        self.store = VersionStore(output_dir, keep_versions=keep_versions, in_use=in_use)
        self.layout = layout
        self.failures = 0
        self.last_error: str | None = None

    def publish(
        self,
        drafter,
        card: Callable[[int], dict],
        metadata: dict,
        commit_message: str,
        what: str = "a drafter version",
    ) -> tuple[int, Path] | None:
        """Write ``drafter`` as the next version and queue its push; ``(number, path)`` or None.

        ``card(number)`` gives the model card's context; ``commit_message`` may use ``{version}``.
        """
        try:
            number = self.store.next_number()
            files = {"README.md": render_card(card(number))}
            path = self.store.write(lambda p: save_version(drafter, p, self.layout), metadata=metadata, files=files)
        except Exception as e:  # noqa: BLE001 - publishing must never stop serving or training
            self.failures += 1
            self.last_error = redact(f"could not write {what}: {type(e).__name__}: {e}")
            logger.warning("%s", self.last_error)
            return None
        if self.hub is not None:
            self.hub.submit(path, number, commit_message=commit_message.format(version=number))
        return number, path

    @property
    def hub_stats(self) -> dict | None:
        return self.hub.stats if self.hub is not None else None

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the queued pushes (True without a Hub repo)."""
        return self.hub.flush(timeout) if self.hub is not None else True

    def close(self, timeout: float | None = 10.0) -> bool:
        """Stop the Hub pushes, waiting up to ``timeout`` for the one in flight (:meth:`HubPublisher.close`)."""
        return self.hub.close(timeout) if self.hub is not None else True


def card_context(config, history: list[dict], domains: dict, target_name: str, block_size: int) -> dict:
    """What an online version's model card says (``hub_cards``' online template): the adapter's settings
    (an :class:`~.config.OnlineConfig`), its update ``history`` and the ``domains`` it has served."""
    c = config
    latest = history[-1] if history else {}
    return {
        "repo_id": c.hub_repo or "adaflash-drafter",
        "title": (c.hub_repo or "AdaFlash drafter") + " (online)",
        "target_name": target_name,
        "method": c.method.upper(),
        "latest_version": latest.get("version"),
        "latest_tau_before": latest.get("tau_before"),
        "block_size": block_size,
        "samples_per_update": f"{c.samples_per_update} " + ("finished requests" if c.sample_unit == "request" else "verified rounds"),
        "epochs": c.epochs,
        "domains": domains,
        "history": history,
        "method_description": _METHOD_DESCRIPTIONS[c.method],
        "hyperparameters": (
            f"alpha {c.alpha}, clip {c.clip} ({c.clip_mode}), temperature {c.temperature}, "
            f"AdamW lr {c.lr} / head {c.head_lr}, batch {c.batch_size}, grad clip {c.grad_clip}"
        ),
    }


_METHOD_DESCRIPTIONS = {
    "opd": (
        "On-policy distillation (AdaFlash): `l = alpha * CE(q, argmax p) + (1 - alpha) * sum_y min(q log(q/p), delta)` "
        "over the verified draft positions of live traffic (q: drafter, p: target, from the verify forward); the "
        "length head is trained by MSE against `(accepted + 1) / B` on detached drafter features."
    ),
    "osd": "Online speculative distillation baseline: forward KL `T^2 * KL(p || q)` over the verified draft positions.",
    "off": "No adaptation (statistics only).",
}
