"""The update loop built alone from its collaborators (no adapter, no thread): one update trains, swaps the weights
into the serving drafter between rounds, records it and publishes it; a failed one changes nothing but the counts."""

from __future__ import annotations

import torch

from adaflash_hf.online import OnlineConfig, OnlineCounters, ReplayBuffer, RoundLock, Sample, VersionPublisher, list_versions
from adaflash_hf.online.guard import RollbackWatch, UpdateGuard
from adaflash_hf.online.update_loop import UpdateLoop
from adaflash_hf.online.worker import ShadowTrainer
from online_helpers import fresh_drafter, pair, real_rounds, same, snapshot  # noqa: F401 (pair: a fixture)


def _loop(target, drafter, out):
    config = OnlineConfig(sample_unit="round", samples_per_update=2, epochs=1, lr=1e-2, output_dir=str(out))
    worker = ShadowTrainer(drafter, target, config)
    counters = OnlineCounters(RollbackWatch(config.rollback_rounds, config.rollback_margin))
    publisher = VersionPublisher(str(out), config.keep_versions, keep=counters.serving_on_disk)
    buffer = ReplayBuffer(max_samples=8)
    loop = UpdateLoop(config, drafter, worker, worker, buffer, UpdateGuard(config), publisher, counters, RoundLock(),
                      target_name="tiny")  # fmt: skip
    return loop, buffer


def test_one_update_of_a_loop_built_alone_swaps_records_and_publishes(pair, tmp_path):
    drafter = fresh_drafter(pair)
    samples = [Sample.from_round(r) for r in real_rounds(pair, drafter)[:2]]
    loop, buffer = _loop(pair, drafter, tmp_path)
    before = snapshot(drafter)
    loop.update(samples)
    assert not same(before, snapshot(drafter))  # the shadow's weights now serve
    assert same(snapshot(loop.worker.shadow), snapshot(drafter))
    c = loop.counters
    assert (c.updates, c.failures, c.served_version()) == (1, 0, 1)
    assert [(r.update, r.samples, r.version) for r in c.history] == [(1, 2, 1)]
    assert [n for n, _ in list_versions(tmp_path)] == [1]
    assert not loop.busy and not loop.stopped


def test_a_failed_update_of_a_loop_built_alone_leaves_the_serving_weights(pair, tmp_path):
    """The control: the same update with a trainer that spoils the shadow is counted as a failure, nothing swapped
    in and nothing written."""
    drafter = fresh_drafter(pair)
    samples = [Sample.from_round(r) for r in real_rounds(pair, drafter)[:2]]
    loop, _ = _loop(pair, drafter, tmp_path)
    train = loop.worker.train

    def spoilt(*args, **kwargs):
        result = train(*args, **kwargs)
        with torch.no_grad():
            next(loop.worker.shadow.parameters()).fill_(float("nan"))
        return result

    loop.trainer.train = spoilt
    before = snapshot(drafter)
    loop.update(samples)
    assert same(before, snapshot(drafter))
    c = loop.counters
    assert (c.updates, c.failures, c.history) == (0, 1, []) and "non-finite" in c.last_error
    assert list_versions(tmp_path) == [] and loop.worker.shadow is None  # rebuilt from the serving weights next time
