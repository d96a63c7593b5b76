"""Issue 19, item 3: `OnlineAdapter.flush()` never hangs, and samples arriving during an update are
kept for the next update (or, when dropped, counted).

Deterministic: the worker's `train` is wrapped to block on an event, so samples arrive while an
update is in progress; the worker thread is held off (by holding the adapter's condition) while
the first batch is buffered, so the update takes exactly what the test expects.
"""

from __future__ import annotations

import threading

import pytest
import torch
from generation_helpers import PAD_ID, make_drafter, make_target, ragged_prompts

from adaflash_hf.online import OnlineAdapter


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


def _gated(adapter):
    """Make the worker's train wait for `release` after signalling `training`."""
    training, release = threading.Event(), threading.Event()
    train = adapter.worker.train

    def gated(samples, n):
        training.set()
        assert release.wait(30), "test never released the update"
        return train(samples, n)

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
    finally:
        adapter.close(timeout=10)


def test_leftovers_dropped_after_an_update_are_counted_and_flush_still_returns(setup):
    target, rounds = setup
    adapter = _adapter(target)  # clear_after_update=True (the default)
    try:
        training, release = _gated(adapter)
        with adapter._cv:  # the worker cannot take a batch until all four are buffered
            for r in rounds[:4]:
                adapter.on_round(r)
        assert training.wait(30)  # update 1 took two; two were left over
        adapter.on_round(rounds[4])  # arrives during the update: kept
        assert _flush_after_release(adapter, release) is True
        stats = adapter.stats
        assert stats["samples_dropped"] == 2  # the two leftovers, counted
        assert [h["samples"] for h in stats["history"]] == [2, 1]  # the late sample trained in update 2
        assert stats["samples_buffered"] == 0
    finally:
        adapter.close(timeout=10)


def test_flush_with_everything_dropped_meanwhile_returns(setup):
    """A flush whose pending samples are all dropped by the update returns instead of waiting."""
    target, rounds = setup
    adapter = _adapter(target)
    try:
        training, release = _gated(adapter)
        with adapter._cv:
            for r in rounds[:3]:
                adapter.on_round(r)
        assert training.wait(30)  # update 1 took two; one left over, nothing arrives later
        assert _flush_after_release(adapter, release) is True
        assert adapter.stats["updates"] == 1 and adapter.stats["samples_dropped"] == 1
    finally:
        adapter.close(timeout=10)
