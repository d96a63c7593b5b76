"""Issue 19, items 3 and 8: the online adapter under injected faults, and still serving exactly the
target's greedy output afterwards.

- `flush()` never hangs, and samples arriving during an update are kept for the next update (or,
  when dropped, counted). Deterministic: the worker's `train` is wrapped to block on an event, so
  samples arrive while an update is in progress; the worker thread is held off (by holding the
  adapter's condition) while the first batch is buffered, so the update takes exactly what the
  test expects.
- Pruning (`keep_versions=1`) never deletes the version being uploaded or the last one uploaded
  (the fake upload blocks until released, then reads the folder).
- A failed version write (disk full) reaches `last_error` and leaves nothing on disk.
- `close()` with an unreachable Hub (offline mode) returns within its short `hub_timeout`.
- Issue 34: SIGKILL at random points of a tight publish-and-prune loop never leaves a half-written
  or half-deleted `vNNNNN`; every listed version and `LATEST` load; a negative control (the old
  in-place delete) is caught by the same check.

The guard and the rollback (issue 33, item 6) are in `test_online_guard.py`.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import huggingface_hub
import pytest
import torch
import transformers
from generation_helpers import make_drafter
from online_helpers import pair, round_adapter, serves_exactly, tiny_rounds, version_names  # noqa: F401 (pair, tiny_rounds: fixtures)

from adaflash_hf import AdaFlashDrafter
from adaflash_hf.online import VersionPublisher, VersionStore, latest_version, list_versions


def _gated(adapter):
    """Make the worker's train wait for `release` after signalling `training`."""
    training, release = threading.Event(), threading.Event()
    train = adapter.worker.train

    def gated(samples, n, **kwargs):
        training.set()
        assert release.wait(30), "test never released the update"
        return train(samples, n, **kwargs)

    adapter.worker.train = gated
    return training, release


def _flush_after_release(adapter, release: threading.Event):
    """What ``flush`` returns when it is called while an update is held, and the update then released
    (None: it did not return within 30 s, i.e. it hung)."""
    result = {}
    flusher = threading.Thread(target=lambda: result.setdefault("ok", adapter.flush(20)), daemon=True)
    flusher.start()
    release.set()
    flusher.join(30)
    return result.get("ok")


def test_flush_returns_and_keeps_samples_that_arrive_during_an_update(tiny_rounds):
    target, rounds = tiny_rounds
    adapter = round_adapter(target)
    try:
        training, release = _gated(adapter)
        adapter.on_round(rounds[0])
        adapter.on_round(rounds[1])  # triggers update 1
        assert training.wait(30)
        adapter.on_round(rounds[2])  # arrives while update 1 trains
        result = {}
        flusher = threading.Thread(target=lambda: result.setdefault("ok", adapter.flush(20)), daemon=True)
        flusher.start()
        release.set()
        flusher.join(30)
        assert result.get("ok") is True, "flush() hung waiting for an update that never started"
        stats = adapter.stats
        assert stats["updates"] == 2 and [h["samples"] for h in stats["history"]] == [2, 1]
        assert stats["samples_buffered"] == 0 and stats["samples_dropped"] == 0
        assert serves_exactly(adapter.drafter, target)
    finally:
        adapter.close(timeout=10)


@pytest.mark.parametrize("abandon", [True, False])
def test_close_abandon_discards_the_update_in_progress(tiny_rounds, tmp_path, abandon):
    """A server's SIGTERM: close(abandon=True) stops the update at its next step, with no swap and no new
    version; the control (abandon=False) finishes the same update and publishes it."""
    target, rounds = tiny_rounds
    adapter = round_adapter(target, output_dir=str(tmp_path))
    before = {k: v.clone() for k, v in adapter.drafter.state_dict().items()}
    training, release = _gated(adapter)
    adapter.on_round(rounds[0])
    adapter.on_round(rounds[1])  # triggers update 1, held at the gate
    assert training.wait(30)
    closer = threading.Thread(target=adapter.close, kwargs={"timeout": 30, "abandon": abandon}, daemon=True)
    closer.start()
    time.sleep(0.2)  # close() is waiting on the worker
    release.set()
    closer.join(30)
    assert not closer.is_alive()
    unchanged = all(torch.equal(before[k], v) for k, v in adapter.drafter.state_dict().items())
    assert (adapter.counters.updates, unchanged, len(list_versions(tmp_path))) == ((0, True, 0) if abandon else (1, False, 1))
    assert adapter.counters.failures == 0


def test_leftovers_dropped_after_an_update_are_counted_and_flush_still_returns(tiny_rounds):
    target, rounds = tiny_rounds
    adapter = round_adapter(target)  # clear_after_update=True (the default)
    try:
        training, release = _gated(adapter)
        with adapter.loop._cv:  # the worker cannot take a batch until all four are buffered
            for r in rounds[:4]:
                adapter.on_round(r)
        assert training.wait(30)  # update 1 took two; two were left over
        adapter.on_round(rounds[4])  # arrives during the update: kept
        assert _flush_after_release(adapter, release) is True
        stats = adapter.stats
        assert stats["samples_dropped"] == 2  # the two leftovers, counted
        assert [h["samples"] for h in stats["history"]] == [2, 1]  # the late sample trained in update 2
        assert stats["samples_buffered"] == 0
        assert serves_exactly(adapter.drafter, target)
    finally:
        adapter.close(timeout=10)


def test_flush_with_everything_dropped_meanwhile_returns(tiny_rounds):
    """A flush whose pending samples are all dropped by the update returns instead of waiting."""
    target, rounds = tiny_rounds
    adapter = round_adapter(target)
    try:
        training, release = _gated(adapter)
        with adapter.loop._cv:
            for r in rounds[:3]:
                adapter.on_round(r)
        assert training.wait(30)  # update 1 took two; one left over, nothing arrives later
        assert _flush_after_release(adapter, release) is True
        assert adapter.stats["updates"] == 1 and adapter.stats["samples_dropped"] == 1
        assert serves_exactly(adapter.drafter, target)
    finally:
        adapter.close(timeout=10)


@pytest.fixture
def slow_hub(monkeypatch):
    """`HfApi.upload_folder` that blocks until `release` is set, then reads the folder (what a real
    upload does last); records (version folder, files read) per upload, or the error."""
    import huggingface_hub

    state = {"release": threading.Event(), "uploading": threading.Event(), "uploads": []}

    def upload_folder(self, *, repo_id, folder_path, commit_message=None, run_as_future=False, **kwargs):
        state["uploading"].set()
        assert state["release"].wait(30), "test never released the upload"
        fut = Future()
        try:
            files = sorted(p.name for p in Path(folder_path).iterdir())
            state["uploads"].append((folder_path.rsplit("/", 1)[-1], files))
            fut.set_result("commit")
        except OSError as e:
            state["uploads"].append((folder_path.rsplit("/", 1)[-1], type(e).__name__))
            fut.set_exception(e)
        return fut

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda self, repo_id, **kw: repo_id)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    return state


def test_pruning_keeps_the_version_uploading_and_the_last_uploaded(tiny_rounds, tmp_path, slow_hub):
    target, rounds = tiny_rounds
    out = tmp_path / "out"
    adapter = round_adapter(target, output_dir=str(out), keep_versions=1, hub_repo="org/drafter", hub_max_retries=0)
    try:
        for k in range(3):  # three updates while the first upload is still running
            adapter.on_round(rounds[2 * k])
            adapter.on_round(rounds[2 * k + 1])
            assert adapter.wait_for_update(30)
            assert slow_hub["uploading"].wait(30)
        # v1 uploading and v2 pending (then superseded by v3) stay beyond the window of one.
        assert version_names(out) == ["v00001", "v00002", "v00003"]
        slow_hub["release"].set()
        assert adapter.flush(30)
        assert [u[0] for u in slow_hub["uploads"]] == ["v00001", "v00003"]
        assert all("model.safetensors" in u[1] and "config.json" in u[1] for u in slow_hub["uploads"]), slow_hub["uploads"]
        assert adapter.stats["hub"]["last_pushed"] == 3 and adapter.stats["hub"]["gave_up"] == 0
        adapter.on_round(rounds[6])
        adapter.on_round(rounds[7])
        assert adapter.flush(30)  # v4 written: v3 (the last uploaded) is kept, v1 and v2 go
        assert version_names(out) == ["v00003", "v00004"]
        assert serves_exactly(adapter.drafter, target)
    finally:
        slow_hub["release"].set()
        adapter.close(timeout=10)


def test_a_failed_version_write_reaches_last_error_and_leaves_nothing(tiny_rounds, tmp_path, monkeypatch):
    import adaflash_hf.online.publish as publish

    target, rounds = tiny_rounds
    out = tmp_path / "out"
    save_version = publish.save_version

    def disk_full(drafter, path, layout="native"):
        (Path(path) / "config.json").write_text("{}")  # a partial write first
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(publish, "save_version", disk_full)
    adapter = round_adapter(target, output_dir=str(out))
    try:
        adapter.on_round(rounds[0])
        adapter.on_round(rounds[1])
        assert adapter.flush(30)
        stats = adapter.stats
        assert stats["updates"] == 1 and stats["write_failures"] == 1
        assert "No space left on device" in stats["last_error"] and "online version" in stats["last_error"]
        assert sorted(p.name for p in out.iterdir()) == []  # no version, no temporary left behind
        assert serves_exactly(adapter.drafter, target)
        monkeypatch.setattr(publish, "save_version", save_version)  # disk freed: the next update is written
        adapter.on_round(rounds[2])
        adapter.on_round(rounds[3])
        assert adapter.flush(30)
        assert version_names(out) == ["v00001"] and adapter.stats["write_failures"] == 1
        AdaFlashDrafter.from_pretrained(out / "v00001")
    finally:
        adapter.close(timeout=10)


def test_close_with_an_offline_hub_returns_within_hub_timeout(tiny_rounds, tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    target, rounds = tiny_rounds
    out = tmp_path / "out"
    # The default retry schedule (5 retries from 2 s) would hold a draining close() for about a minute.
    adapter = round_adapter(target, output_dir=str(out), hub_repo="org/drafter")
    adapter.on_round(rounds[0])
    adapter.on_round(rounds[1])
    assert adapter.wait_for_update(30)
    assert serves_exactly(adapter.drafter, target)
    closer = threading.Thread(target=adapter.close, daemon=True)  # default hub_timeout
    closer.start()
    closer.join(8)
    assert not closer.is_alive(), "close() kept waiting for an offline Hub push"
    hub = adapter.stats["hub"]
    assert hub["pushes"] == 0 and hub["gave_up"] == 1 and "offline" in hub["last_error"].lower()
    assert version_names(out) == ["v00001"]  # the local version stays


def _publish_until_killed(out: Path, drafter, in_place: bool) -> None:
    """The forked child: the adapter's publishing path (save_pretrained, card, VersionStore.write, prune
    with keep_versions=1) in a tight loop, on a disk whose unlinks take 10 ms (as on a network file
    system), so that deletes are a large share of the loop and random kills often land in them.
    ``in_place``: the negative control, pruning by an rmtree in place (the code before issue 34).

    Progress bars are off in the child: tqdm's write lock holds a semaphore shared across fork, so a child
    killed while its save_pretrained bar writes would leave it taken, and the parent's next bar (loading a
    version) would wait forever."""
    try:
        transformers.utils.logging.disable_progress_bar()
        huggingface_hub.utils.disable_progress_bars()
        unlink = os.unlink
        os.unlink = lambda *a, **k: (time.sleep(0.01), unlink(*a, **k))[1]
        if in_place:
            VersionStore._delete = lambda self, path: shutil.rmtree(path, ignore_errors=True)
        publisher = VersionPublisher(str(out), keep_versions=1)
        while True:
            publisher.publish(drafter, card=lambda n: {}, metadata={}, commit_message="")
    finally:
        os._exit(1)  # never back into pytest; only a SIGKILL ends the loop


def _kill_publishing(out: Path, drafter, rng: random.Random, in_place: bool = False) -> dict:
    """Fork a publishing child, SIGKILL it after a random delay; where the kill landed, read from the
    temporaries this child left (a version moved aside for deletion, or one being written)."""
    before = set(os.listdir(out))
    pid = os.fork()
    if pid == 0:
        _publish_until_killed(out, drafter, in_place)
    time.sleep(rng.uniform(0.02, 0.3))
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status), f"the publishing child ended by itself (status {status})"
    left = [n for n in set(os.listdir(out)) - before if n.startswith(".tmp-adaflash-v")]
    return {"mid_prune": any(f"-pruned-{pid}-" in n for n in left), "mid_write": any("-pruned-" not in n for n in left)}


def _partial_versions(out: Path, files: set[str]) -> list[str]:
    """Version folders on disk (listed or not) without every file a published version has."""
    return [p.name for p in out.iterdir() if p.name.startswith("v") and set(os.listdir(p)) != files]


def _first_version(tiny_rounds, tmp_path):
    """A tiny drafter, its output folder holding v00001, and the files a published version has."""
    drafter = make_drafter(tiny_rounds[0], block_size=8, num_layers=1, seed=0)
    out = tmp_path / "out"
    first = VersionPublisher(str(out), keep_versions=1).publish(drafter, card=lambda n: {}, metadata={}, commit_message="")
    return drafter, out, set(os.listdir(first[1]))


def test_kills_mid_publish_never_leave_a_partial_version(tiny_rounds, tmp_path):
    drafter, out, files = _first_version(tiny_rounds, tmp_path)
    rng, seen, start = random.Random(34), {"mid_prune": 0, "mid_write": 0}, time.monotonic()
    for kill in range(20):
        for kind, hit in _kill_publishing(out, drafter, rng).items():
            seen[kind] += hit
        assert _partial_versions(out, files) == [], f"kill {kill}"
        listed = list_versions(out)
        for _, path in listed:
            AdaFlashDrafter.from_pretrained(path)
        AdaFlashDrafter.from_pretrained(latest_version(out))
    print(f"20 kills in {time.monotonic() - start:.1f} s: {seen}; last version {listed[-1][1].name}")
    assert seen["mid_prune"] > 0, "no kill landed mid-delete: the test did not exercise pruning"


def test_the_kill_check_catches_in_place_pruning(tiny_rounds, tmp_path):
    """Negative control: the same kills against the old in-place delete leave a partial version."""
    drafter, out, files = _first_version(tiny_rounds, tmp_path)
    rng = random.Random(34)
    for kill in range(20):
        _kill_publishing(out, drafter, rng, in_place=True)
        if _partial_versions(out, files):
            print(f"in-place pruning left a partial version after {kill + 1} kill(s): {_partial_versions(out, files)}")
            return
    pytest.fail("20 kills of in-place pruning left no partial version: the kill test may have no teeth")
