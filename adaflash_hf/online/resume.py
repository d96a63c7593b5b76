"""Resuming from an online output folder: the newest version that checks out serves again.

A restarted server (``adaflash serve --online`` with the same ``--output-dir``) serves what it had learned:
:func:`resume_drafter` copies the newest good version's weights (drafter and length head) into the serving
drafter before anything serves or trains, and updates continue from them, numbered after every version on disk.
The version ``LATEST`` names is tried first, then the older ones, newest first; one is *good* when its files
match the checksums written with it (:func:`~.versions.verify_version`), it loads, its tensors fit the serving
drafter and every one is finite. Each version skipped is returned with its reason (the adapter logs a warning
and counts it); a folder with no good version leaves the drafter as it was. The optimizer's state is not kept
in a version: the first update after a restart starts a fresh AdamW.

Example:
    >>> resumed = resume_drafter(drafter, "runs/online")  # doctest: +SKIP
    >>> resumed.version, resumed.skipped  # doctest: +SKIP
    (6, [('v00007', 'model.safetensors does not match its checksum')])
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..modeling import AdaFlashDrafter
from .versions import LATEST_MARKER, _VERSION_RE, list_versions, verify_version

__all__ = ["Resumed", "first_nonfinite", "newest_number", "resume_drafter"]


@dataclass
class Resumed:
    """What :func:`resume_drafter` found: the version now serving (0 and ``path`` None: none, the drafter is
    unchanged), the versions skipped as ``(name, reason)``, and the newest version number on disk."""

    version: int = 0
    path: Path | None = None
    skipped: list[tuple[str, str]] = field(default_factory=list)
    newest: int = 0


def first_nonfinite(named_tensors) -> str | None:
    """The name of the first tensor holding a NaN or an infinity among ``(name, tensor)`` pairs, else None."""
    for name, t in named_tensors:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def newest_number(root: str | os.PathLike) -> int:
    """The highest number of a complete version under ``root`` (0: none)."""
    return max((n for n, _ in list_versions(root)), default=0)


def _candidates(root: Path) -> list[tuple[int, Path]]:
    """Complete versions to try, newest first, from the one ``LATEST`` names down (one above it was never
    marked: a write cut short between its rename and the marker)."""
    versions = list_versions(root)
    try:
        marked = (root / LATEST_MARKER).read_text(encoding="utf-8").strip()
    except OSError:
        marked = ""
    m = _VERSION_RE.match(marked)
    top = int(m.group(1)) if m else max((n for n, _ in versions), default=0)
    return [(n, p) for n, p in reversed(versions) if n <= top]


def _load(path: Path, drafter: AdaFlashDrafter) -> dict[str, torch.Tensor]:
    """The version's tensors, checked to fit ``drafter`` and to be finite; ``ValueError`` saying why not."""
    reason = verify_version(path)
    if reason is not None:
        raise ValueError(reason)
    try:
        loaded = AdaFlashDrafter.from_pretrained(str(path), dtype=next(drafter.parameters()).dtype)
    except Exception as e:  # noqa: BLE001 - any failure to read a version only skips it
        raise ValueError(f"does not load: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    state, serving = loaded.state_dict(), drafter.state_dict()
    wrong = [k for k, v in state.items() if k not in serving or serving[k].shape != v.shape]
    if wrong:
        raise ValueError(f"does not fit the serving drafter ({len(wrong)} tensors differ, e.g. {wrong[0]})")
    bad = first_nonfinite(state.items())
    if bad is not None:
        raise ValueError(f"holds non-finite values (in {bad})")
    return state


def resume_drafter(drafter: AdaFlashDrafter, root: str | os.PathLike) -> Resumed:
    """Copy the newest good version under ``root`` into ``drafter`` (module docstring); what was found."""
    root = Path(root)
    candidates = _candidates(root)
    found = Resumed(newest=newest_number(root))
    for number, path in candidates:
        try:
            state = _load(path, drafter)
        except ValueError as e:
            found.skipped.append((path.name, str(e)))
            continue
        serving = drafter.state_dict()
        with torch.no_grad():
            for name, t in state.items():
                serving[name].copy_(t)
        found.version, found.path = number, path
        break
    return found
