"""Numbered, atomically written drafter versions with a rolling window, for hot reload.

Layout of an output directory::

    out/
      v00001/            complete versions (config.json, model.safetensors, README.md,
      v00002/            adaflash_version.json, ...)
      LATEST             "v00002": the version marker, written last
      latest -> v00002   convenience symlink for engines that reload from a fixed path

Each version is written into a hidden temporary directory inside ``out/``, renamed into place
with ``os.replace`` (atomic on POSIX), and only then is ``LATEST`` replaced (itself written into
a temporary file and renamed). A crash at any point therefore leaves ``LATEST`` naming a
complete, loadable version: before the rename the new version does not exist; between the rename
and the marker the old marker still names the previous version. Only the newest ``keep_versions``
versions are kept; the one ``LATEST`` names never goes, nor do those ``in_use()`` returns (e.g. a
version being uploaded and the last one uploaded: :meth:`~adaflash_hf.online.hub.HubPublisher.in_use`),
which go at the first write after they are released. A pruned version is first renamed to a
temporary name, then deleted, so a crash mid-delete never leaves a half-deleted ``vNNNNN``.
Leftover temporary directories (a write or a delete cut short) are removed by the next write.

A version is *complete* when it holds ``config.json``, its weights (``model.safetensors`` or a
sharded index) and ``adaflash_version.json``: :meth:`VersionStore.write` publishes nothing else,
and :func:`list_versions` / :func:`latest_version` report nothing else (a ``vNNNNN`` folder that
an older release left half-deleted, or one copied in by hand, is skipped; the next prune removes it).

``adaflash_version.json`` records the SHA-256 of every other file of the version (``sha256``), computed
before the rename and so before ``LATEST`` moves; :func:`verify_version` checks them, so a version damaged
after it was written (a truncated or overwritten weights file) is found before anything loads it
(:mod:`.resume` then falls back to the newest version that checks out).

Example:
    >>> store = VersionStore("out/drafter", keep_versions=3)  # doctest: +SKIP
    >>> path = store.write(drafter.save_pretrained, metadata={"tau_before": 3.1})  # doctest: +SKIP
    >>> AdaFlashDrafter.from_pretrained(latest_version("out/drafter"))  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Collection
from pathlib import Path

from ..atomic_io import TMP_PREFIX, fsync_path, remove_temporaries, write_dir_atomic, write_text_atomic

__all__ = [
    "LATEST_MARKER",
    "METADATA_FILE",
    "VersionStore",
    "file_checksums",
    "is_complete",
    "latest_version",
    "list_versions",
    "verify_version",
    "version_name",
    "write_text_atomic",
]

logger = logging.getLogger("adaflash_hf.online")

LATEST_MARKER = "LATEST"
LATEST_LINK = "latest"
METADATA_FILE = "adaflash_version.json"
_VERSION_RE = re.compile(r"^v(\d{5,})$")
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")  # what checkpoint_layouts.weight_files reads


def version_name(n: int) -> str:
    """``v00007`` for 7."""
    return f"v{n:05d}"


def is_complete(path: Path) -> bool:
    """Whether a version directory holds what loading it needs (config, weights) and the metadata file
    :meth:`VersionStore.write` adds last: the one definition of a complete version (module docstring)."""
    return (
        (path / METADATA_FILE).is_file()
        and (path / "config.json").is_file()
        and any((path / name).is_file() for name in _WEIGHTS)
    )


def file_checksums(folder: Path) -> dict[str, str]:
    """SHA-256 (hex) of every file under ``folder`` but the metadata file, by path relative to it."""
    sums = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and not p.is_symlink() and p.name != METADATA_FILE:
            with open(p, "rb") as f:
                sums[p.relative_to(folder).as_posix()] = hashlib.file_digest(f, "sha256").hexdigest()
    return sums


def verify_version(path: str | os.PathLike) -> str | None:
    """Why the version folder ``path`` cannot be trusted (incomplete, unreadable metadata, a file missing or
    not matching the checksum written with it), or None when it checks out. A version written before
    checksums were recorded checks out when complete (loading it is then the only check).

    Example:
        >>> verify_version("out/v00003")  # doctest: +SKIP
        'model.safetensors does not match its checksum'
    """
    path = Path(path)
    if not is_complete(path):
        return "incomplete (config.json, weights or metadata missing)"
    try:
        recorded = json.loads((path / METADATA_FILE).read_text(encoding="utf-8")).get("sha256")
    except (OSError, ValueError, AttributeError) as e:
        return f"unreadable {METADATA_FILE}: {type(e).__name__}"
    if recorded is None:
        return None
    try:
        actual = file_checksums(path)
    except OSError as e:
        return f"unreadable: {type(e).__name__}: {e.strerror or e}"
    for name in sorted(set(recorded) | set(actual)):
        if name not in actual:
            return f"{name} is missing"
        if recorded.get(name) != actual[name]:
            return f"{name} does not match its checksum" if name in recorded else f"{name} has no checksum"
    return None


def _numbered_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every ``vNNNNN`` directory under ``root``, complete or not, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _VERSION_RE.match(p.name)
        if m and p.is_dir() and not p.is_symlink():
            found.append((int(m.group(1)), p))
    return sorted(found)


def list_versions(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete version directories under ``root``, oldest first."""
    return [(n, p) for n, p in _numbered_dirs(Path(root)) if is_complete(p)]


def latest_version(root: str | os.PathLike) -> Path | None:
    """The directory of the newest complete version: the one ``LATEST`` names.

    Without a (valid) marker, falls back to the highest-numbered complete version; ``None`` when
    there is none.
    """
    root = Path(root)
    marker = root / LATEST_MARKER
    try:
        name = marker.read_text(encoding="utf-8").strip()
    except OSError:
        name = ""
    if _VERSION_RE.match(name) and (root / name).is_dir() and is_complete(root / name):
        return root / name
    versions = list_versions(root)
    return versions[-1][1] if versions else None


class VersionStore:
    """Writes numbered versions into ``root`` (module docstring); keeps the newest ``keep_versions``.

    Args:
        root: the output directory (created when missing).
        keep_versions: rolling window size (>= 1).
        link_latest: also maintain a ``latest`` symlink to the newest version (best effort).
        in_use: returns the version numbers pruning must keep beyond the window (default: none).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        keep_versions: int = 3,
        link_latest: bool = True,
        in_use: Callable[[], Collection[int]] | None = None,
    ):
        if keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1, got {keep_versions}")
        self.root = Path(root)
        self.keep_versions = int(keep_versions)
        self.link_latest = link_latest
        self.in_use = in_use
        self.root.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ reading
    def latest(self) -> Path | None:
        return latest_version(self.root)

    def versions(self) -> list[tuple[int, Path]]:
        return list_versions(self.root)

    def next_number(self) -> int:
        # Past every numbered folder, complete or not: the rename into place needs a free name.
        numbered = _numbered_dirs(self.root)
        return numbered[-1][0] + 1 if numbered else 1

    # ------------------------------------------------------------------ writing
    def write(
        self,
        save_fn: Callable[[str], object],
        metadata: dict | None = None,
        files: dict[str, str] | None = None,
    ) -> Path:
        """Write one version: ``save_fn(tmp_dir)`` writes the weights, then ``files`` (name -> text)
        and ``adaflash_version.json`` are added; the directory is renamed to ``vNNNNN`` and the
        ``LATEST`` marker written last. Returns the version directory. On error nothing of the
        new version remains and the previous one stays the latest.
        """
        remove_temporaries(self.root)
        n = self.next_number()
        name = version_name(n)

        def fill(tmp: Path) -> None:
            save_fn(str(tmp))
            for fname, text in (files or {}).items():
                if os.path.basename(fname) != fname or fname in ("", ".", ".."):
                    raise ValueError(f"version file names must be plain names, got {fname!r}")
                (tmp / fname).write_text(text, encoding="utf-8")
            meta = {"version": n, "name": name, "created_unix": time.time(), **(metadata or {}),
                    "sha256": file_checksums(tmp)}
            (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True, default=str), encoding="utf-8")
            if not is_complete(tmp):
                raise ValueError(f"save_fn wrote no config.json or no weights ({', '.join(_WEIGHTS)})")

        final = write_dir_atomic(self.root / name, fill)
        write_text_atomic(self.root / LATEST_MARKER, name + "\n")
        if self.link_latest:
            self._update_link(name)
        self.prune()
        return final

    def _update_link(self, name: str) -> None:
        link = self.root / LATEST_LINK
        if link.exists() and not link.is_symlink():
            return  # a user's own file or directory: leave it alone
        tmp = self.root / f"{TMP_PREFIX}link-{os.getpid()}-{time.monotonic_ns()}"
        try:
            os.symlink(name, tmp, target_is_directory=True)
            os.replace(tmp, link)
        except OSError as e:  # e.g. no symlink permission (Windows): the marker is the authority anyway
            logger.debug("could not update the latest symlink: %s", type(e).__name__)
            try:
                os.unlink(tmp)
            except OSError:
                pass

    def prune(self) -> list[Path]:
        """Remove versions beyond the rolling window (never the one ``LATEST`` names nor those in use:
        ``in_use`` names the one serving, which after a fallback (:mod:`.resume`) is not ``LATEST``'s),
        and incomplete ``vNNNNN`` folders (module docstring), which :meth:`versions` never counts."""
        latest = self.latest()
        keep = set(self.in_use()) if self.in_use is not None else set()
        versions = self.versions()
        going = versions[: max(len(versions) - self.keep_versions, 0)]
        going += [(n, p) for n, p in _numbered_dirs(self.root) if not is_complete(p)]
        removed = []
        for number, path in going:
            if number in keep or (latest is not None and path.resolve() == latest.resolve()):
                continue
            self._delete(path)
            removed.append(path)
        return removed

    def _delete(self, path: Path) -> None:
        """Rename ``path`` to a temporary name (atomic), then delete it there: a crash mid-delete leaves
        a temporary that the next write sweeps, never a half-deleted version under its name."""
        aside = self.root / f"{TMP_PREFIX}{path.name}-pruned-{os.getpid()}-{time.monotonic_ns()}"
        try:
            os.replace(path, aside)
        except OSError as e:  # gone already, or it stays whole under its name: never half-deleted
            logger.debug("could not move %s aside: %s", path.name, type(e).__name__)
            return
        fsync_path(self.root, directory=True)  # the rename reaches the disk before any of the unlinks
        shutil.rmtree(aside, ignore_errors=True)
