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
- Issue 33, item 6: an update that lowers greedy acceptance on held-back requests is refused and kept
  aside (the reference pair, whose drafter accepts well: a shadow spoilt on purpose is refused, an honest
  small-lr update swapped in); a swap after which served tau falls is rolled back and the restored weights
  published (control: tau holds, no rollback); outputs stay plain greedy throughout.
"""

from __future__ import annotations

import dataclasses
import errno
import json
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
from generation_helpers import PAD_ID, make_drafter, make_target, ragged_prompts
from online_helpers import CollectRequests, real_requests, same, snapshot

from adaflash_hf import AdaFlashDrafter
from adaflash_hf.online import OnlineAdapter, OnlineConfig, VersionPublisher, VersionStore, latest_version, list_versions
from adaflash_hf.online.worker import copy_drafter


class Collect:
    def __init__(self):
        self.rounds = []

    def on_round(self, verified):
        self.rounds.append(verified)


@pytest.fixture(scope="module")
def setup():
    target = make_target(layers=3, seed=1)
    target.requires_grad_(False)
    drafter = make_drafter(target, block_size=8, num_layers=1, seed=0)
    sink = Collect()
    ids, mask, _ = ragged_prompts(2, [5, 9], 0)
    target.generate(ids, attention_mask=mask, assistant_model=drafter, round_sink=sink, do_sample=False,
                    max_new_tokens=24, pad_token_id=PAD_ID)
    assert len(sink.rounds) >= 6
    return target, sink.rounds


def _serves_exactly(adapter, target) -> bool:
    """The adapter's drafter (whatever its weights now) still gives exactly plain greedy output."""
    ids, mask, _ = ragged_prompts(2, [4, 7], 3)
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=PAD_ID)
    spec = target.generate(ids, assistant_model=adapter.drafter, **kw)
    return torch.equal(spec, target.generate(ids, **kw))


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


def _adapter(target, **kw):
    drafter = make_drafter(target, block_size=8, num_layers=1, seed=0)
    return OnlineAdapter(drafter, target, sample_unit="round", samples_per_update=2, epochs=1, lr=1e-3, **kw)


def _flush_after_release(adapter, release: threading.Event):
    """What ``flush`` returns when it is called while an update is held, and the update then released
    (None: it did not return within 30 s, i.e. it hung)."""
    result = {}
    flusher = threading.Thread(target=lambda: result.setdefault("ok", adapter.flush(20)), daemon=True)
    flusher.start()
    release.set()
    flusher.join(30)
    return result.get("ok")


def test_flush_returns_and_keeps_samples_that_arrive_during_an_update(setup):
    target, rounds = setup
    adapter = _adapter(target)
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
        assert _serves_exactly(adapter, target)
    finally:
        adapter.close(timeout=10)


@pytest.mark.parametrize("abandon", [True, False])
def test_close_abandon_discards_the_update_in_progress(setup, tmp_path, abandon):
    """A server's SIGTERM: close(abandon=True) stops the update at its next step, with no swap and no new
    version; the control (abandon=False) finishes the same update and publishes it."""
    target, rounds = setup
    adapter = _adapter(target, output_dir=str(tmp_path))
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


def test_leftovers_dropped_after_an_update_are_counted_and_flush_still_returns(setup):
    target, rounds = setup
    adapter = _adapter(target)  # clear_after_update=True (the default)
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
        assert _serves_exactly(adapter, target)
    finally:
        adapter.close(timeout=10)


def test_flush_with_everything_dropped_meanwhile_returns(setup):
    """A flush whose pending samples are all dropped by the update returns instead of waiting."""
    target, rounds = setup
    adapter = _adapter(target)
    try:
        training, release = _gated(adapter)
        with adapter.loop._cv:
            for r in rounds[:3]:
                adapter.on_round(r)
        assert training.wait(30)  # update 1 took two; one left over, nothing arrives later
        assert _flush_after_release(adapter, release) is True
        assert adapter.stats["updates"] == 1 and adapter.stats["samples_dropped"] == 1
        assert _serves_exactly(adapter, target)
    finally:
        adapter.close(timeout=10)


def _names(root) -> list[str]:
    return [p.name for _, p in list_versions(root)]


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


def test_pruning_keeps_the_version_uploading_and_the_last_uploaded(setup, tmp_path, slow_hub):
    target, rounds = setup
    out = tmp_path / "out"
    adapter = _adapter(target, output_dir=str(out), keep_versions=1, hub_repo="org/drafter", hub_max_retries=0)
    try:
        for k in range(3):  # three updates while the first upload is still running
            adapter.on_round(rounds[2 * k])
            adapter.on_round(rounds[2 * k + 1])
            assert adapter.wait_for_update(30)
            assert slow_hub["uploading"].wait(30)
        # v1 uploading and v2 pending (then superseded by v3) stay beyond the window of one.
        assert _names(out) == ["v00001", "v00002", "v00003"]
        slow_hub["release"].set()
        assert adapter.flush(30)
        assert [u[0] for u in slow_hub["uploads"]] == ["v00001", "v00003"]
        assert all("model.safetensors" in u[1] and "config.json" in u[1] for u in slow_hub["uploads"]), slow_hub["uploads"]
        assert adapter.stats["hub"]["last_pushed"] == 3 and adapter.stats["hub"]["gave_up"] == 0
        adapter.on_round(rounds[6])
        adapter.on_round(rounds[7])
        assert adapter.flush(30)  # v4 written: v3 (the last uploaded) is kept, v1 and v2 go
        assert _names(out) == ["v00003", "v00004"]
        assert _serves_exactly(adapter, target)
    finally:
        slow_hub["release"].set()
        adapter.close(timeout=10)


def test_a_failed_version_write_reaches_last_error_and_leaves_nothing(setup, tmp_path, monkeypatch):
    import adaflash_hf.online.publish as publish

    target, rounds = setup
    out = tmp_path / "out"
    save_version = publish.save_version

    def disk_full(drafter, path, layout="native"):
        (Path(path) / "config.json").write_text("{}")  # a partial write first
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(publish, "save_version", disk_full)
    adapter = _adapter(target, output_dir=str(out))
    try:
        adapter.on_round(rounds[0])
        adapter.on_round(rounds[1])
        assert adapter.flush(30)
        stats = adapter.stats
        assert stats["updates"] == 1 and stats["write_failures"] == 1
        assert "No space left on device" in stats["last_error"] and "online version" in stats["last_error"]
        assert sorted(p.name for p in out.iterdir()) == []  # no version, no temporary left behind
        assert _serves_exactly(adapter, target)
        monkeypatch.setattr(publish, "save_version", save_version)  # disk freed: the next update is written
        adapter.on_round(rounds[2])
        adapter.on_round(rounds[3])
        assert adapter.flush(30)
        assert _names(out) == ["v00001"] and adapter.stats["write_failures"] == 1
        AdaFlashDrafter.from_pretrained(out / "v00001")
    finally:
        adapter.close(timeout=10)


def test_close_with_an_offline_hub_returns_within_hub_timeout(setup, tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    target, rounds = setup
    out = tmp_path / "out"
    # The default retry schedule (5 retries from 2 s) would hold a draining close() for about a minute.
    adapter = _adapter(target, output_dir=str(out), hub_repo="org/drafter")
    adapter.on_round(rounds[0])
    adapter.on_round(rounds[1])
    assert adapter.wait_for_update(30)
    assert _serves_exactly(adapter, target)
    closer = threading.Thread(target=adapter.close, daemon=True)  # default hub_timeout
    closer.start()
    closer.join(8)
    assert not closer.is_alive(), "close() kept waiting for an offline Hub push"
    hub = adapter.stats["hub"]
    assert hub["pushes"] == 0 and hub["gave_up"] == 1 and "offline" in hub["last_error"].lower()
    assert _names(out) == ["v00001"]  # the local version stays


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


def _first_version(setup, tmp_path):
    """A tiny drafter, its output folder holding v00001, and the files a published version has."""
    drafter = make_drafter(setup[0], block_size=8, num_layers=1, seed=0)
    out = tmp_path / "out"
    first = VersionPublisher(str(out), keep_versions=1).publish(drafter, card=lambda n: {}, metadata={}, commit_message="")
    return drafter, out, set(os.listdir(first[1]))


def test_kills_mid_publish_never_leave_a_partial_version(setup, tmp_path):
    drafter, out, files = _first_version(setup, tmp_path)
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


def test_the_kill_check_catches_in_place_pruning(setup, tmp_path):
    """Negative control: the same kills against the old in-place delete leave a partial version."""
    drafter, out, files = _first_version(setup, tmp_path)
    rng = random.Random(34)
    for kill in range(20):
        _kill_publishing(out, drafter, rng, in_place=True)
        if _partial_versions(out, files):
            print(f"in-place pruning left a partial version after {kill + 1} kill(s): {_partial_versions(out, files)}")
            return
    pytest.fail("20 kills of in-place pruning left no partial version: the kill test may have no teeth")


# --------------------------------------------------------------------------- guard and rollback (issue 33, item 6)


@pytest.fixture(scope="module")
def reference():
    """The reference pair (its drafter accepts several tokens per block) and six finished requests of it."""
    from adaflash_hf import load_reference_pair

    target, drafter, tok = load_reference_pair()
    target.requires_grad_(False)
    sink = CollectRequests()
    for text in ("Question: Tom has 3 apples and buys 5 more. How many", "def add(a, b):", "The capital of France is",
                 "Once upon a time, there was a", "import numpy as np\n", "List three primary colors:"):
        ids = torch.tensor([tok(text)["input_ids"]])
        target.generate(ids, assistant_model=drafter, round_sink=sink, do_sample=False, max_new_tokens=40)
    assert len(sink.requests) == 6
    return target, drafter, sink.requests


def _online_metric(stats: dict, name: str) -> float:
    """What the server's GET /metrics says for ``adaflash_online_<name>`` given the adapter's stats."""
    from prometheus_client.parser import text_string_to_metric_families

    from adaflash_hf.serve.metrics import ServerMetrics

    text = ServerMetrics(block_size=8, online_stats=lambda: stats).render().decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == f"adaflash_online_{name}")


def _spoil_after_training(adapter):
    """The worker's train, then large noise on the shadow's weights (a finite, much worse drafter)."""
    train = adapter.worker.train

    def spoilt(samples, n, **kwargs):
        result = train(samples, n, **kwargs)
        gen = torch.Generator().manual_seed(n)
        with torch.no_grad():
            for p in adapter.worker.shadow.parameters():
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
        return result

    adapter.worker.train = spoilt


@pytest.mark.parametrize("spoilt", [True, False])
def test_an_update_that_lowers_held_back_acceptance_is_refused_and_kept_aside(reference, tmp_path, spoilt):
    target, drafter, requests = reference
    d = copy_drafter(drafter, target)
    start = snapshot(d)
    adapter = OnlineAdapter(d, target, samples_per_update=len(requests), guard_samples=2, epochs=1, lr=1e-6,
                            output_dir=str(tmp_path))
    try:
        if spoilt:
            _spoil_after_training(adapter)
        for r in requests:
            adapter.on_request(r)
        assert adapter.wait_for_update(120)
        stats, h = adapter.stats, adapter.stats["history"][-1]
        assert h["held_back"] == 2 and h["samples"] == len(requests) - 2 and stats["failures"] == 0
        assert h["guard_serving"] > 2.0, h  # the reference drafter accepts: a measure with teeth
        assert h["guard_candidate"] - h["guard_serving"] == pytest.approx(h["guard_gain"]) and h["guard_gain_se"] >= 0
        if spoilt:
            assert h["guard_candidate"] < h["guard_serving"] and not h["swapped"] and h["version"] is None
            assert same(start, snapshot(d)) and list_versions(tmp_path) == [] and latest_version(tmp_path) is None
            assert (stats["updates"], stats["swaps_refused"], stats["served_version"]) == (0, 1, 0)
            assert _online_metric(stats, "swaps_refused_total") == 1.0
            kept = tmp_path / "refused" / "update-0001"
            reason = json.loads((kept / "reason.json").read_text())
            assert reason["serving_accept_len"] == h["guard_serving"] and reason["candidate_accept_len"] == h["guard_candidate"]
            assert reason["update"] == 1 and reason["samples"] == 4 and reason["held_back"] == 2
            assert stats["last_refusal"]["path"] == h["path"] == str(kept)
            refused = snapshot(AdaFlashDrafter.from_pretrained(kept))
            assert not same(start, refused, "layers.")  # the spoilt weights, kept for inspection
            assert adapter.worker.shadow is None  # rebuilt from the serving weights for the next update
        else:
            assert h["guard_candidate"] >= h["guard_serving"] and h["swapped"] and h["version"] == 1
            assert not same(start, snapshot(d)) and not (tmp_path / "refused").exists()
            assert (stats["updates"], stats["swaps_refused"], stats["served_version"]) == (1, 0, 1)
        ids = requests[1].prompt_ids[None]
        plain = target.generate(ids, do_sample=False, max_new_tokens=24)
        assert torch.equal(target.generate(ids, assistant_model=d, do_sample=False, max_new_tokens=24), plain)
    finally:
        adapter.close(timeout=10)


@pytest.mark.parametrize("distinct,held", [
    (8, 2),  # the control: every request its own sequence, 2 of 8 held back, the other 6 trained on
    (4, 2),  # each sequence twice: the held-back ones' repeats leave training with them
    (1, 0),  # one sequence eight times: nothing else to train on, so nothing is held back
])
def test_a_held_back_requests_repeats_are_not_trained_on(distinct, held):
    from adaflash_hf.online.buffer import RequestSample
    from adaflash_hf.online.guard import UpdateGuard

    samples = [RequestSample(input_ids=torch.tensor([1, 2, i % distinct]), prompt_len=1) for i in range(8)]
    train, kept = UpdateGuard(OnlineConfig(samples_per_update=8, guard_samples=2)).split(samples, update_index=1)
    seq = lambda s: tuple(s.input_ids.tolist())  # noqa: E731
    kept_seqs = {seq(s) for s in kept}
    assert len(kept) == held and all(any(s is x for x in samples) for s in train + kept)
    assert train == [s for s in samples if not any(s is k for k in kept) and seq(s) not in kept_seqs]
    assert (len(train) < 8 - len(kept)) == (distinct == 4)  # repeats left training only where there were some


NOISY_GAIN = ([(4.0, 2), (2.0, 2), (3.0, 3)], [(6.0, 2), (2.0, 2), (2.0, 3)])  # +1/7 per block, standard error 0.39
STEADY_GAIN = ([(4.0, 2), (2.0, 2)], [(5.0, 2), (3.0, 2)])  # +0.5 per block on every request: standard error 0
LOSS = ([(4.0, 2), (2.0, 2)], [(3.0, 2), (1.0, 2)])  # -0.5 per block on every request


@pytest.mark.parametrize("rows, margin, confidence, swapped", [
    (NOISY_GAIN, 0.0, 0.0, True),  # the default: the gain itself decides
    (NOISY_GAIN, 0.0, 1.0, False),  # a gain within one standard error of nothing is refused
    (NOISY_GAIN, 0.3, 1.0, True),  # ... unless the margin lets it lose that much
    (STEADY_GAIN, 0.0, 2.0, True),  # the control: a gain every request shows clears any confidence
    (LOSS, 0.0, 0.0, False),
    (LOSS, 0.6, 0.0, True),  # a loss within the margin
])
def test_the_guard_judges_a_candidate_by_its_paired_gain(rows, margin, confidence, swapped):
    from adaflash_hf.online.guard import UpdateGuard

    serving, candidate = rows
    judged = UpdateGuard(OnlineConfig(guard_margin=margin, guard_confidence=confidence)).judge(serving, candidate)
    assert (judged.refusal is None) == swapped
    blocks = sum(n for _, n in serving)
    assert judged.gain == pytest.approx(sum(c for c, _ in candidate) / blocks - sum(s for s, _ in serving) / blocks)
    assert judged.candidate - judged.serving == pytest.approx(judged.gain)
    assert (judged.gain_se == 0.0) == (rows is not NOISY_GAIN)
    if not swapped:
        assert judged.refusal["gain_standard_error"] == judged.gain_se
        assert judged.refusal["guard_confidence"] == confidence
        assert ("fell from" in judged.refusal["reason"]) == (confidence == 0)  # a positive gain short of its bound


def test_the_guard_needs_both_measures_on_the_same_blocks():
    from adaflash_hf.online.guard import UpdateGuard

    guard = UpdateGuard(OnlineConfig(guard_confidence=1.0))
    assert guard.judge(None, None).refusal is None and guard.judge(None, None).serving is None  # off: nothing held back
    with pytest.raises(ValueError, match="same blocks"):
        guard.judge([(1.0, 2)], [(1.0, 3)])
    with pytest.raises(ValueError, match="guard_confidence"):
        OnlineConfig(guard_confidence=-1)


def _round(rounds, accepted: int):
    """A served round of the tiny pair that accepted ``accepted`` drafts (what the rollback watch counts)."""
    return dataclasses.replace(rounds[0], num_accepted=accepted)


@pytest.mark.parametrize("falls", [True, False])
def test_served_tau_falling_after_a_swap_rolls_it_back(setup, tmp_path, falls):
    target, rounds = setup
    d = make_drafter(target, block_size=8, num_layers=1, seed=0)
    requests = real_requests(target, d, seeds=(0,))
    out = tmp_path / "out"
    adapter = OnlineAdapter(d, target, samples_per_update=2, epochs=1, lr=1e-2, rollback_rounds=4, rollback_margin=0.05,
                            output_dir=str(out))
    try:
        for _ in range(4):  # the window before the swap: tau 6
            adapter.on_round(_round(rounds, 5))
        start = snapshot(d)
        for r in requests:
            adapter.on_request(r)
        assert adapter.wait_for_update(60) and adapter.stats["updates"] == 1
        swapped = snapshot(d)
        assert not same(start, swapped)
        for _ in range(3):
            adapter.on_round(_round(rounds, 0 if falls else 5))
        assert adapter.wait_for_update(60) and adapter.stats["rollbacks"] == 0  # not judged before 4 rounds
        adapter.on_round(_round(rounds, 0 if falls else 4))  # tau after: 1 (falls) or 5.75 (within 5%)
        assert adapter.wait_for_update(60)
        stats = adapter.stats
        if falls:
            assert same(start, snapshot(d)) and stats["rollbacks"] == 1 and stats["updates"] == 1
            assert stats["versions"] == [1, 2] and stats["served_version"] == 2
            assert _online_metric(stats, "rollbacks_total") == 1.0 and _online_metric(stats, "served_version") == 2.0
            assert latest_version(out) == out / "v00002" and same(start, snapshot(AdaFlashDrafter.from_pretrained(out / "v00002")))
            undone, rollback = stats["history"]
            assert (rollback["rollback_of"], rollback["swapped"], rollback["tau_before"]) == (1, True, 1.0)
            assert (undone["tau_before"], undone["tau_after"], undone["rounds_after"]) == (6.0, 1.0, 4)
            assert adapter.worker.shadow is None  # rebuilt from the restored weights
        else:
            assert same(swapped, snapshot(d)) and stats["rollbacks"] == 0 and stats["versions"] == [1]
            assert latest_version(out) == out / "v00001"
        assert stats["failures"] == 0 and _serves_exactly(adapter, target)
    finally:
        adapter.close(timeout=10)


@pytest.mark.parametrize("previous_better", [True, False])
def test_a_fall_of_served_tau_is_checked_paired_before_the_rollback(setup, previous_better):
    """With the guard on, served tau falling after a swap rolls it back only when the previous weights also accept
    more on the same recent requests (scores stubbed by which weights a model holds); otherwise the swap stays
    (served tau compares different traffic)."""
    target, rounds = setup
    d = make_drafter(target, block_size=8, num_layers=1, seed=0)
    requests = real_requests(target, d, seeds=(0, 1, 2, 3, 4))
    assert len(requests) >= 9
    adapter = OnlineAdapter(d, target, samples_per_update=8, epochs=1, lr=1e-2, rollback_rounds=4, rollback_margin=0.05)
    try:
        for _ in range(4):
            adapter.on_round(_round(rounds, 5))
        start = snapshot(d)
        for r in requests[:8]:
            adapter.on_request(r)
        assert adapter.wait_for_update(60) and adapter.stats["updates"] == 1 and not same(start, snapshot(d))
        swapped = snapshot(d)
        adapter.on_request(requests[8])  # a recent request, buffered, that neither version trained on
        scored = []

        def accept_len(model, samples, seed):
            is_previous = same(start, snapshot(model))
            scored.append((is_previous, len(samples)))
            return 3.0 if is_previous == previous_better else 2.0

        adapter.worker.accept_len = accept_len
        for _ in range(4):
            adapter.on_round(_round(rounds, 0))  # served tau falls from 6 to 1
        assert adapter.wait_for_update(60)
        assert sorted(scored) == [(False, 1), (True, 1)]  # both weights, on the same one request
        stats = adapter.stats
        assert stats["rollbacks"] == int(previous_better)
        assert same(start if previous_better else swapped, snapshot(d))
        assert stats["failures"] == 0 and _serves_exactly(adapter, target)
    finally:
        adapter.close(timeout=10)


@pytest.mark.parametrize("margin", [0.0, -1.0])
def test_guarded_updates_serve_exactly_the_targets_greedy_output(setup, margin):
    """With the guard on (request samples held back), a swapped update (margin 0) and a refused one (margin -1:
    a candidate must gain a whole token per block) alike leave the output plain greedy."""
    target, _ = setup
    d = make_drafter(target, block_size=8, num_layers=1, seed=0)
    requests = real_requests(target, d, seeds=(0, 1))
    adapter = OnlineAdapter(d, target, samples_per_update=4, guard_samples=1, guard_margin=margin, epochs=1, lr=1e-2)
    try:
        for r in requests:
            adapter.on_request(r)
        assert adapter.wait_for_update(60)
        stats = adapter.stats
        assert (stats["updates"], stats["swaps_refused"]) == ((1, 0) if margin == 0 else (0, 1))
        assert stats["history"][-1]["held_back"] == 1 and stats["failures"] == 0
        assert _serves_exactly(adapter, target)
    finally:
        adapter.close(timeout=10)
