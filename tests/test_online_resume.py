"""Resuming an online adapter from its output folder: the newest version whose checksums, loading and finiteness
check out serves (damaged newer ones skipped, each with its reason), updates train on from it and are numbered after
every version on disk, pruning keeps the version serving; non-finite weights are never swapped in. Answers stay
plain greedy decoding's throughout. (The same as real server processes: tests/test_serve_faults.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from generation_helpers import make_drafter
from online_helpers import pair, round_adapter, same, serves_exactly, snapshot, tiny_rounds, version_names  # noqa: F401 (pair, tiny_rounds: fixtures)

from adaflash_hf.online import VersionPublisher, list_versions


def _spoil_weights(path: Path, how: str) -> None:
    """Damage a version on disk: truncate its weights, or fill one tensor with NaN and record matching checksums
    (so that only the finite check can tell)."""
    from safetensors.torch import load_file, save_file

    from adaflash_hf.online.versions import METADATA_FILE, file_checksums

    weights = path / "model.safetensors"
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[:512])
        return
    state = load_file(weights)
    name = sorted(state)[0]
    state[name] = torch.full_like(state[name], float("nan"))
    save_file(state, weights, metadata={"format": "pt"})
    meta = json.loads((path / METADATA_FILE).read_text())
    (path / METADATA_FILE).write_text(json.dumps({**meta, "sha256": file_checksums(path)}))


def _three_versions(target, out: Path) -> list:
    """Drafters of seeds 1, 2, 3 published as v00001..v00003 (as their snapshots)."""
    pub = VersionPublisher(str(out), keep_versions=5)
    snaps = []
    for seed in (1, 2, 3):
        d = make_drafter(target, block_size=8, num_layers=1, seed=seed)
        pub.publish(d, card=lambda n: {}, metadata={}, commit_message="")
        snaps.append(snapshot(d))
    return snaps


@pytest.mark.parametrize("damage,expect", [
    ({}, 3),  # the control: LATEST checks out and serves
    ({3: "truncated"}, 2),
    ({3: "nan"}, 2),
    ({3: "truncated", 2: "nan"}, 1),
    ({3: "nan", 2: "truncated", 1: "truncated"}, 0),  # nothing good: the given weights stay
])  # fmt: skip
def test_resume_serves_the_newest_version_that_checks_out(tiny_rounds, tmp_path, damage, expect):
    from adaflash_hf.online.resume import resume_drafter
    from adaflash_hf.online.versions import verify_version

    target = tiny_rounds[0]
    snaps = _three_versions(target, tmp_path)
    assert all(verify_version(p) is None for _, p in list_versions(tmp_path))
    for n, how in damage.items():
        _spoil_weights(tmp_path / f"v{n:05d}", how)
    d = make_drafter(target, block_size=8, num_layers=1, seed=0)
    start = snapshot(d)
    resumed = resume_drafter(d, tmp_path)
    assert resumed.version == expect and resumed.newest == 3
    assert [name for name, _ in resumed.skipped] == [f"v{n:05d}" for n in sorted(damage, reverse=True) if n > expect]
    for (name, reason), n in zip(resumed.skipped, sorted(damage, reverse=True)):
        assert ("checksum" in reason) if damage[n] == "truncated" else ("non-finite" in reason), reason
    assert same(snaps[expect - 1] if expect else start, snapshot(d))


def test_an_adapter_resumes_numbers_on_and_keeps_the_version_it_serves(tiny_rounds, tmp_path):
    """resume=True: the newest good version serves (v00003 damaged: v00002), stats and the next version say so,
    and pruning to one version keeps the one serving until a newer one serves; answers stay plain greedy."""
    target, rounds = tiny_rounds
    snaps = _three_versions(target, tmp_path)
    _spoil_weights(tmp_path / "v00003", "truncated")
    adapter = round_adapter(target, output_dir=str(tmp_path), keep_versions=1, resume=True)
    try:
        stats = adapter.stats
        assert (stats["served_version"], stats["resumed_from"], stats["versions_rejected"]) == (2, 2, 1)
        assert same(snaps[1], snapshot(adapter.drafter)) and serves_exactly(adapter.drafter, target)
        adapter.publisher.store.prune()  # the window of one keeps LATEST (v00003) and the version serving
        assert version_names(tmp_path) == ["v00002", "v00003"]
        adapter.on_round(rounds[0])
        adapter.on_round(rounds[1])
        assert adapter.flush(30)
        meta = json.loads((tmp_path / "v00004" / "adaflash_version.json").read_text())
        assert meta["base_version"] == 2 and adapter.stats["served_version"] == 4
        assert version_names(tmp_path) == ["v00004"] and serves_exactly(adapter.drafter, target)  # v00002 serves no more
    finally:
        adapter.close(timeout=10)
    fresh = round_adapter(target, output_dir=str(tmp_path))  # resume off (the default): the given weights serve
    try:
        assert fresh.stats["served_version"] == 0 and fresh.stats["resumed_from"] == 0
    finally:
        fresh.close(timeout=10)


def test_non_finite_weights_are_never_swapped_in(tiny_rounds):
    from adaflash_hf.online import NonFiniteLossError

    target, _ = tiny_rounds
    adapter = round_adapter(target)
    try:
        before = snapshot(adapter.drafter)
        state = {k: v.clone() for k, v in adapter.drafter.state_dict().items()}
        name = sorted(state)[-1]
        state[name].fill_(float("inf"))
        with pytest.raises(NonFiniteLossError, match=name):
            adapter.loop.install(state)
        assert same(before, snapshot(adapter.drafter))
        adapter.loop.install({k: v.clone() for k, v in adapter.drafter.state_dict().items()})  # the control: finite swaps
    finally:
        adapter.close(timeout=10)
