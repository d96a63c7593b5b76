"""Saving a checkpoint folder so that nothing is ever half-written: write beside, then move in.

`save_atomically(save, path)` runs a save into a temporary folder next to `path` and publishes it
(renamed, or moved in file by file with `config.json` last); a failing save (a full disk) leaves
`path` as it was. Part of the remote code uploaded with a checkpoint: imports no library code.

Example:
    >>> save_atomically(lambda tmp: model.save_pretrained(tmp), "out/drafter")  # doctest: +SKIP
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable

__all__ = ["chmod_tree", "move_into_place", "save_atomically"]


def chmod_tree(root: str) -> None:
    """Give every folder and file under `root` the mode a plain ``mkdir`` / ``open`` would (0755 / 0644
    under the usual umask 022). Writers that go through a temporary file (safetensors' `save_file`,
    `tempfile`) create files 0600, which another user (a teammate, an engine in its own account) cannot
    read. `root` must be a folder made with a plain ``os.mkdir``: its mode is the umask's, read without
    calling ``os.umask`` (which would race with other threads)."""
    dir_mode = os.stat(root).st_mode & 0o777
    file_mode = dir_mode & 0o666
    for dirpath, dirnames, filenames in os.walk(root):
        os.chmod(dirpath, dir_mode)
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, file_mode)


def move_into_place(tmp, dest) -> None:
    """Move every entry of folder `tmp` into folder `dest` with `os.replace`, `config.json` last; weight
    shards of an earlier save that the new one does not have are removed just before the config moves,
    so `dest` never pairs a config with weights of another save."""
    names = sorted(os.listdir(tmp))
    names.sort(key=lambda n: n == "config.json")
    stale = [n for n in os.listdir(dest) if n.startswith("model") and ".safetensors" in n and n not in names
             and os.path.isfile(os.path.join(dest, n))]  # fmt: skip
    for name in names:
        if name == "config.json":
            for n in stale:
                os.remove(os.path.join(dest, n))
        target = os.path.join(dest, name)
        if os.path.isdir(target) and not os.path.isdir(os.path.join(tmp, name)):
            shutil.rmtree(target)
        os.replace(os.path.join(tmp, name), target)


def save_atomically(save: Callable[[str], object], path) -> None:
    """Run `save(folder)` into a fresh folder beside `path`, then publish it: renamed into place when
    `path` is missing or empty, else moved in file by file ([`move_into_place`]). On any error (a full
    disk) the temporary folder is removed: nothing new appears at `path` and an earlier save there is
    untouched, so a config never ends up without its weights."""
    path = os.path.abspath(path)
    if os.path.isfile(path):
        raise NotADirectoryError(f"{path} is a file: save into a folder")
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp-save-{os.getpid()}-{uuid.uuid4().hex}")
    os.mkdir(tmp)  # not mkdtemp: the published folder gets the permissions a plain save gives it
    try:
        save(tmp)
        chmod_tree(tmp)
        if os.path.isdir(path) and os.listdir(path):
            move_into_place(tmp, path)
        else:
            if os.path.isdir(path):
                os.rmdir(path)
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
