"""Files and folders written so that a reader never sees half of one: temporary beside it, fsync, rename.

Shared by everything that publishes what another process may read while it is written (the online version
store's versions and ``LATEST`` marker, the online guard's refused updates, ``train_drafter``'s regeneration
cache). Standard library only.

Example:
    >>> write_text_atomic("out/LATEST", "v00002\n")  # doctest: +SKIP
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["TMP_PREFIX", "fsync_path", "publishable", "remove_temporaries", "write_dir_atomic", "write_text_atomic"]

TMP_PREFIX = ".tmp-adaflash-"  # temporary names start so; a folder's owner may sweep leftovers by it


def _umask() -> int:
    """The process umask, read without changing it (``os.umask`` would race with other threads)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def publishable(path: Path, directory: bool) -> None:
    """Temporary files / directories are created private (0600 / 0700); give the published ones
    the permissions a plain ``mkdir`` / ``open`` would have, so an engine under another user can
    read them."""
    try:
        os.chmod(path, (0o777 if directory else 0o666) & ~_umask())
    except OSError:
        pass


def fsync_path(path: Path, directory: bool = False) -> None:
    """Flush a file, or a folder's entries (a rename), to disk; best effort: errors are ignored."""
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write a small text file atomically: temporary file in the same directory, fsync, rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        publishable(Path(tmp), directory=False)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_path(path.parent, directory=True)


def write_dir_atomic(final: str | os.PathLike, fill: Callable[[Path], object]) -> Path:
    """Write the folder ``final`` atomically: ``fill(tmp)`` writes its files into a temporary folder beside
    it (raising to abandon it), then permissions, fsync and one rename into place. On error nothing of it
    remains; ``final`` must not exist yet."""
    final = Path(final)
    tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX + final.name + "-", dir=final.parent))
    try:
        fill(tmp)
        for p in tmp.rglob("*"):
            if p.is_file() and not p.is_symlink():
                publishable(p, directory=False)
                fsync_path(p)
            elif p.is_dir() and not p.is_symlink():
                publishable(p, directory=True)
        publishable(tmp, directory=True)
        fsync_path(tmp, directory=True)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(final.parent, directory=True)
    return final


def remove_temporaries(folder: str | os.PathLike) -> None:
    """Remove what writes cut short left in ``folder`` (names starting with :data:`TMP_PREFIX`)."""
    for p in Path(folder).iterdir():
        if p.name.startswith(TMP_PREFIX):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                try:
                    p.unlink()
                except OSError:
                    pass
