"""Online updates trained in a child process (`OnlineConfig(trainer="process")`, online/trainer_process.py): the same
weights as the thread, identity with plain greedy after the swap, a close mid-update, a child that dies. CPU, the
tiny seeded pair of online_helpers."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
import torch

from adaflash_hf.online import OnlineAdapter, OnlineConfig
from generation_helpers import make_target
from online_helpers import fresh_drafter, greedy, pair, prompts, real_requests, real_rounds, same, snapshot  # noqa: F401 (pair: a fixture)


@pytest.fixture(params=["forkserver"])
def start_method(request, monkeypatch):
    """How the trainer's child starts. The product spawns it (a fresh interpreter that imports torch, transformers and
    adaflash_hf: about 5 s of each test on two cores). ``forkserver`` forks it from one server process of this session
    that imported adaflash_hf.online.trainer_process once: the same ``Process`` object, pickled the same way (the models
    as shared-memory handles, the config, the pipe), the same ``_child_main``, the same exit codes; only the imports are
    not paid again. One case of ``test_a_child_process_trains_the_weights_a_thread_does`` runs on the product's spawn
    itself (and tests/test_serve_online.py's real server spawns its child)."""
    import adaflash_hf.online.trainer_process as tp

    assert request.param in ("forkserver", "spawn")
    if request.param == "forkserver":
        ctx = tp.mp.get_context("forkserver")
        ctx.set_forkserver_preload(["adaflash_hf.online.trainer_process"])
        real = tp.mp.get_context
        monkeypatch.setattr(tp.mp, "get_context", lambda method=None: ctx if method == "spawn" else real(method))
    return request.param


def _wait(condition, timeout=60.0):
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def _trained(target, trainer: str, samples, **settings):
    d = fresh_drafter(target)
    adapter = OnlineAdapter(d, target, trainer=trainer, samples_per_update=1000, epochs=2, lr=1e-2, head_lr=1e-2,
                            **settings)  # fmt: skip
    try:
        for x in samples:
            adapter.on_round(x) if settings.get("sample_unit") == "round" else adapter.on_request(x)
        assert adapter.flush(120)
        return d, adapter.stats
    finally:
        adapter.close()


@pytest.mark.parametrize("method,unit,start_method", [("opd", "request", "spawn"), ("osd", "request", "forkserver"),
                                                     ("opd", "round", "forkserver")], indirect=["start_method"])
def test_a_child_process_trains_the_weights_a_thread_does(pair, method, unit, start_method):
    samples = real_requests(pair, fresh_drafter(pair)) if unit == "request" else real_rounds(pair, fresh_drafter(pair))
    settings = dict(method=method, sample_unit=unit) | ({"served_anchors": True} if unit == "request" else {})
    by_thread, stats_t = _trained(pair, "thread", samples, **settings)
    by_child, stats_p = _trained(pair, "process", samples, **settings)
    assert stats_t["updates"] == stats_p["updates"] == 1 and stats_p["failures"] == 0
    start = snapshot(fresh_drafter(pair))
    assert not same(start, snapshot(by_child))  # the control: the update moved the weights
    for name, t in snapshot(by_thread).items():
        torch.testing.assert_close(snapshot(by_child)[name], t, rtol=1e-5, atol=1e-6, msg=name)
    ids, mask, _ = prompts(7)
    assert torch.equal(greedy(pair, ids, mask, assistant_model=by_child), greedy(pair, ids, mask))


def test_closing_mid_update_stops_the_child_and_keeps_the_serving_weights(pair, start_method):
    d = fresh_drafter(pair)
    reqs = real_requests(pair, d)
    good = snapshot(d)
    adapter = OnlineAdapter(d, pair, trainer="process", samples_per_update=len(reqs), epochs=10_000, lr=1e-2)
    for r in reqs:
        adapter.on_request(r)
    _wait(lambda: adapter.trainer.process is not None and adapter.trainer.process.is_alive())
    child = adapter.trainer.process
    t0 = time.monotonic()
    assert adapter.close(abandon=True, timeout=60)
    assert time.monotonic() - t0 < 30 and not child.is_alive() and adapter.trainer.process is None
    assert adapter.stats["updates"] == 0 and adapter.stats["failures"] == 0 and same(good, snapshot(d))


def test_a_child_that_dies_fails_its_update_and_the_next_update_starts_another(pair, start_method):
    d = fresh_drafter(pair)
    reqs = real_requests(pair, d)
    good = snapshot(d)
    adapter = OnlineAdapter(d, pair, trainer="process", samples_per_update=len(reqs), epochs=10_000, lr=1e-2)
    try:
        for r in reqs:
            adapter.on_request(r)
        _wait(lambda: adapter.trainer.process is not None and adapter.trainer.process.is_alive())
        first = adapter.trainer.process
        time.sleep(1.0)  # inside the update
        os.kill(first.pid, signal.SIGKILL)
        _wait(lambda: adapter.stats["failures"] == 1)
        assert adapter.stats["updates"] == 0 and same(good, snapshot(d)) and "died during the update (exit code -9)" in adapter.counters.last_error
        adapter.config.epochs = 1  # read by the next child when it starts
        for r in reqs:
            adapter.on_request(r)
        assert adapter.flush(120) and adapter.stats["updates"] == 1 and not same(good, snapshot(d))
        assert adapter.trainer.process is not first and adapter.trainer.process.is_alive()
    finally:
        adapter.close()
    assert adapter.trainer.process is None


def test_a_child_that_cannot_start_fails_the_update_and_the_next_one_retries(pair, monkeypatch, start_method):
    import adaflash_hf.online.trainer_process as tp

    d = fresh_drafter(pair)
    reqs = real_requests(pair, d)
    adapter = OnlineAdapter(d, pair, trainer="process", samples_per_update=len(reqs), epochs=1, lr=1e-2)
    real = tp.portable
    try:
        monkeypatch.setattr(tp, "portable", lambda model: (_ for _ in ()).throw(RuntimeError("no shared memory")))
        for r in reqs:
            adapter.on_request(r)
        _wait(lambda: adapter.stats["failures"] == 1)
        assert adapter.trainer.process is None and "no shared memory" in adapter.counters.last_error
        monkeypatch.setattr(tp, "portable", real)
        for r in reqs:
            adapter.on_request(r)
        assert adapter.flush(120) and adapter.stats["updates"] == 1
    finally:
        adapter.close()
    assert adapter.trainer.process is None


def _after_a_rollback(target, trainer: str) -> tuple[dict, dict]:
    """Update 1 swapped in, rolled back when served tau falls after it, then update 2 on other requests: (the weights
    before update 1, the serving weights after update 2)."""
    d = fresh_drafter(target)
    rounds = real_rounds(target, d)
    first, second = real_requests(target, d, seeds=(0,)), real_requests(target, d, seeds=(1,))
    served = lambda accepted: dataclasses.replace(rounds[0], num_accepted=accepted)  # noqa: E731
    adapter = OnlineAdapter(d, target, trainer=trainer, samples_per_update=len(first), epochs=1, lr=1e-2,
                            guard_samples=0, rollback_rounds=4, rollback_margin=0.05)  # fmt: skip
    try:
        for _ in range(4):
            adapter.on_round(served(5))  # served tau 6 before the swap
        start = snapshot(d)
        for r in first:
            adapter.on_request(r)
        assert adapter.wait_for_update(120) and adapter.stats["updates"] == 1 and not same(start, snapshot(d))
        for _ in range(4):
            adapter.on_round(served(0))  # ... and 1 after it
        assert adapter.wait_for_update(120) and adapter.stats["rollbacks"] == 1 and same(start, snapshot(d))
        for r in second[: len(first)]:
            adapter.on_request(r)
        assert adapter.wait_for_update(120) and adapter.stats["updates"] == 2 and adapter.stats["failures"] == 0
        return start, snapshot(d)
    finally:
        adapter.close()


@pytest.mark.parametrize("child_rebuilds", [True, False])
def test_after_a_rollback_the_child_trains_from_the_restored_weights(pair, monkeypatch, child_rebuilds, start_method):
    """A rollback resets the shadow: the child must rebuild its own from the restored serving weights, not go on from
    the undone ones. The control keeps the child's stale shadow and must come out different from the thread."""
    import adaflash_hf.online.trainer_process as tp

    start, by_thread = _after_a_rollback(pair, "thread")
    if not child_rebuilds:
        monkeypatch.setattr(tp.ProcessTrainer, "reset", lambda self: self.local.reset())  # the child keeps its shadow
    _, by_child = _after_a_rollback(pair, "process")
    assert not same(start, by_child)  # update 2 moved the weights
    close = all(torch.allclose(by_child[k], t, rtol=1e-5, atol=1e-6) for k, t in by_thread.items())
    assert close == child_rebuilds


def _pointers(model) -> dict[str, int]:
    return {n: t.data_ptr() for n, t in [*model.named_parameters(), *model.named_buffers()]}


def test_memory_a_serving_forward_may_read_is_never_moved():
    """Pickling a CPU tensor moves its storage into shared memory in place and frees the old memory, under whatever
    forward another thread runs on it. So the trainer moves its models when it is made, before anything serves, an
    engine built afterwards keeps its fused weights there, and `portable` sends a copy of anything still outside."""
    from multiprocessing.reduction import ForkingPickler

    from adaflash_hf.engine import Engine
    from adaflash_hf.online.trainer_process import portable

    target = make_target(layers=2, seed=3).requires_grad_(False)
    d = fresh_drafter(target)
    loose = torch.randn(4, 4)
    before = loose.data_ptr()
    ForkingPickler.dumps(loose)
    assert loose.is_shared() and loose.data_ptr() != before  # the control: what a plain pickle does
    before = _pointers(d)
    ForkingPickler.dumps(portable(d))
    assert _pointers(d) == before and not any(t.is_shared() for t in d.parameters())
    adapter = OnlineAdapter(d, target, trainer="process")
    try:
        for model in (target, d):
            assert all(t.is_shared() for t in [*model.parameters(), *model.buffers()])
        before = _pointers(target)
        Engine(target, d, max_slots=2, max_len=64, round_sink=adapter)
        assert _pointers(target) != before  # the engine fused the target's projections into new storage
        assert all(t.is_shared() for t in target.parameters())
    finally:
        adapter.close()


@pytest.mark.parametrize("free_bytes", [4096, 1 << 40])
def test_too_little_shared_memory_is_refused_before_anything_moves(monkeypatch, free_bytes):
    import adaflash_hf.online.trainer_process as tp

    target = make_target(layers=2, seed=3).requires_grad_(False)
    d = fresh_drafter(target)
    monkeypatch.setattr(tp, "_SHM", "/tmp")  # a directory that exists on every machine, reporting the space below
    monkeypatch.setattr(tp.os, "statvfs", lambda path: os.statvfs_result((4096, 1, 0, 0, free_bytes, 0, 0, 0, 0, 255)))
    if free_bytes < 1 << 20:
        with pytest.raises(RuntimeError, match=r"needs 0\.\d\d GiB of shared memory .* /tmp has 0\.00 GiB free: use trainer='thread'"):
            OnlineAdapter(d, target, trainer="process")
        assert not any(t.is_shared() for t in [*target.parameters(), *d.parameters()])
    else:  # the control: room enough, both models moved
        OnlineAdapter(d, target, trainer="process").close()
        assert all(t.is_shared() for t in [*target.parameters(), *d.parameters()])


def test_the_trainer_setting_is_checked():
    assert OnlineConfig(trainer="process").trainer == "process"
    with pytest.raises(ValueError, match="trainer must be one of"):
        OnlineConfig(trainer="fork")
