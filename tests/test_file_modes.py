"""Saved checkpoints get the file modes of a plain save (the umask's), not the 0600 of a temporary file:
a model folder shared by a team, or read by an engine under another user, must be readable."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from safetensors.torch import save_file

from adaflash_hf import export_dflash
from conftest import distinct_pair


@pytest.fixture
def umask():
    """Set the process umask for one test, then restore it."""
    before = os.umask(0o022)
    os.umask(before)
    yield lambda mask: os.umask(mask)
    os.umask(before)


def _modes(folder) -> dict[str, int]:
    out = {}
    for root, dirs, files in os.walk(folder):
        out[os.path.relpath(root, folder) + "/"] = stat.S_IMODE(os.stat(root).st_mode)
        for f in files:
            out[os.path.relpath(os.path.join(root, f), folder)] = stat.S_IMODE(os.stat(os.path.join(root, f)).st_mode)
    return out


def test_safetensors_alone_writes_private_files(tmp_path, umask):
    """The control: the writer underneath creates 0600 whatever the umask, which is what the save must undo."""
    umask(0o022)
    save_file({"w": torch.zeros(2)}, str(tmp_path / "w.safetensors"))
    assert stat.S_IMODE(os.stat(tmp_path / "w.safetensors").st_mode) == 0o600


@pytest.mark.parametrize("mask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)])
def test_drafter_save_and_export_follow_the_umask(tmp_path, umask, mask, file_mode, dir_mode):
    _, drafter = distinct_pair(use_length_head=True)
    umask(mask)
    drafter.save_pretrained(tmp_path / "native")
    export_dflash(drafter, str(tmp_path / "dflash"))
    for folder in ("native", "dflash"):
        modes = _modes(tmp_path / folder)
        assert any(name.endswith(".safetensors") for name in modes), modes
        for name, mode in modes.items():
            assert mode == (dir_mode if name.endswith("/") else file_mode), (folder, name, oct(mode))


def test_a_second_save_into_the_folder_keeps_the_modes(tmp_path, umask):
    """Saving over an earlier save moves the files in one by one: they get the same modes."""
    _, drafter = distinct_pair(use_length_head=False)
    umask(0o022)
    drafter.save_pretrained(tmp_path / "d")
    drafter.save_pretrained(tmp_path / "d")
    assert set(_modes(tmp_path / "d").values()) == {0o644, 0o755}
