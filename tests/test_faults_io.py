"""Issue 19, item 8: saves are all or nothing. Every writer of a checkpoint (the drafter's
`save_pretrained`, training's `save_drafter`, `export_dflash`, the online `VersionStore`) is run on a
"full disk": the safetensors write puts a partial file down and raises `OSError(ENOSPC)`. Afterwards
the destination holds nothing new (an earlier save there is untouched and loads to the same
weights) and no temporary folder is left beside it.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers.modeling_utils as modeling_utils
from generation_helpers import make_drafter, make_target

from adaflash_hf import AdaFlashDrafter
from adaflash_hf.export import export_dflash
from adaflash_hf.online import VersionStore, latest_version
from adaflash_hf.training.checkpoint import save_drafter


@pytest.fixture(scope="module")
def drafter():
    return make_drafter(make_target(layers=3, seed=1), block_size=8, num_layers=1, seed=0)


@pytest.fixture
def disk_full(monkeypatch):
    """Every safetensors write (transformers' and ours) writes a few bytes, then fails with ENOSPC."""

    def save_file(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 16)
        raise OSError(errno.ENOSPC, "No space left on device", str(filename))

    def fill():
        monkeypatch.setattr(modeling_utils, "safe_save_file", save_file)
        monkeypatch.setattr(safetensors.torch, "save_file", save_file)

    return fill


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _save_pretrained(d, path):
    d.save_pretrained(path)


def _save_drafter(d, path):
    save_drafter(d, path)


def _export(d, path):
    export_dflash(d, str(path), dtype=None)


WRITERS = {"save_pretrained": _save_pretrained, "save_drafter": _save_drafter, "export_dflash": _export}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_full_disk_leaves_nothing_at_a_new_path(drafter, tmp_path, disk_full, writer):
    disk_full()
    with pytest.raises(OSError, match="No space left"):
        WRITERS[writer](drafter, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no folder, no temporary


@pytest.mark.parametrize("writer", ["save_pretrained", "save_drafter"])
def test_a_full_disk_keeps_an_earlier_save_loadable(drafter, tmp_path, disk_full, writer):
    out = tmp_path / "out"
    WRITERS[writer](drafter, out)
    (out / "tokenizer.json").write_text("{}")  # a file of the user's beside the checkpoint
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    disk_full()
    with pytest.raises(OSError, match="No space left"):
        WRITERS[writer](drafter, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert _same(_weights(AdaFlashDrafter.from_pretrained(out)), _weights(drafter))


def test_saving_onto_a_file_names_it_and_leaves_it(drafter, tmp_path):
    (tmp_path / "out").write_text("mine")
    with pytest.raises(NotADirectoryError, match="out is a file"):
        drafter.save_pretrained(tmp_path / "out")
    assert (tmp_path / "out").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_save_over_an_earlier_sharded_one_replaces_its_weights(drafter, tmp_path):
    out = tmp_path / "out"
    drafter.save_pretrained(out, max_shard_size="20KB")
    assert len(list(out.glob("model-*.safetensors"))) > 1
    (out / "tokenizer.json").write_text("{}")
    other = make_drafter(make_target(layers=3, seed=1), block_size=8, num_layers=1, seed=5)
    other.save_pretrained(out)
    names = sorted(p.name for p in out.iterdir() if "safetensors" in p.name)
    assert names == ["model.safetensors"] and (out / "tokenizer.json").exists()  # stale shards gone, user file kept
    assert _same(_weights(AdaFlashDrafter.from_pretrained(out)), _weights(other))


def test_push_to_hub_names_the_repository_after_the_folder(drafter, tmp_path, monkeypatch):
    """The save goes through a temporary folder; the Hub repository still takes the real folder's name."""
    pushed = {}

    class Api:
        def create_repo(self, repo_id, **kwargs):
            pushed["repo"] = repo_id
            return type("Repo", (), {"repo_id": repo_id})()

    def upload(self, working_dir, repo_id, files_timestamps, **kwargs):
        pushed["files"] = sorted(p.name for p in Path(working_dir).iterdir())

    monkeypatch.setattr(modeling_utils, "hf_api", lambda: Api())
    monkeypatch.setattr(modeling_utils, "create_and_tag_model_card", lambda *a, **k: type("Card", (), {"save": lambda s, p: None})())
    monkeypatch.setattr(AdaFlashDrafter, "_upload_modified_files", upload)
    drafter.save_pretrained(tmp_path / "my-drafter", push_to_hub=True)
    assert pushed["repo"] == "my-drafter" and {"config.json", "model.safetensors"} <= set(pushed["files"])
    assert (tmp_path / "my-drafter" / "model.safetensors").is_file()


def test_a_full_disk_during_a_version_write_keeps_the_previous_version(drafter, tmp_path, disk_full):
    store = VersionStore(tmp_path / "versions", keep_versions=2)
    first = store.write(drafter.save_pretrained)
    disk_full()
    with pytest.raises(OSError, match="No space left"):
        store.write(drafter.save_pretrained)
    assert latest_version(store.root) == first
    assert sorted(p.name for p in store.root.iterdir() if not p.name.startswith(("LATEST", "latest"))) == ["v00001"]
