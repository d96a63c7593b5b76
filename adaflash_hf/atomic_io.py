"""Small files written so that a reader never sees half of one: temporary file beside it, fsync, rename.

Shared by everything that publishes a file another process may read while it is written (the online version
store's ``LATEST`` marker, ``train_drafter``'s regeneration cache). Standard library only.

Example:
    >>> write_text_atomic("out/LATEST", "v00002\n")  # doctest: +SKIP
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["TMP_PREFIX", "fsync_path", "publishable", "write_text_atomic"]

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
