"""Issue 33, item 6: the online adapter's guard and rollback, under updates made bad on purpose, and still serving
exactly the target's greedy output.

- An update that lowers greedy acceptance on held-back requests is refused and kept aside (the reference pair, whose
  drafter accepts well: a shadow spoilt on purpose is refused, an honest small-lr update swapped in); the guard judges
  a candidate by its paired gain on the same blocks, and a held-back request's repeats are not trained on.
- A swap after which served tau falls is rolled back and the restored weights published (control: tau holds, no
  rollback); with the guard on, only when the previous weights also accept more on the same recent requests.
- Outputs stay plain greedy throughout.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from generation_helpers import make_drafter
from online_helpers import CollectRequests, pair, real_requests, same, serves_exactly, snapshot, tiny_rounds  # noqa: F401 (pair, tiny_rounds: fixtures)

from adaflash_hf import AdaFlashDrafter
from adaflash_hf.online import OnlineAdapter, OnlineConfig, latest_version, list_versions
from adaflash_hf.online.worker import copy_drafter


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
def test_served_tau_falling_after_a_swap_rolls_it_back(tiny_rounds, tmp_path, falls):
    target, rounds = tiny_rounds
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
        assert stats["failures"] == 0 and serves_exactly(adapter.drafter, target)
    finally:
        adapter.close(timeout=10)


@pytest.mark.parametrize("previous_better", [True, False])
def test_a_fall_of_served_tau_is_checked_paired_before_the_rollback(tiny_rounds, previous_better):
    """With the guard on, served tau falling after a swap rolls it back only when the previous weights also accept
    more on the same recent requests (scores stubbed by which weights a model holds); otherwise the swap stays
    (served tau compares different traffic)."""
    target, rounds = tiny_rounds
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
        assert stats["failures"] == 0 and serves_exactly(adapter.drafter, target)
    finally:
        adapter.close(timeout=10)


@pytest.mark.parametrize("margin", [0.0, -1.0])
def test_guarded_updates_serve_exactly_the_targets_greedy_output(tiny_rounds, margin):
    """With the guard on (request samples held back), a swapped update (margin 0) and a refused one (margin -1:
    a candidate must gain a whole token per block) alike leave the output plain greedy."""
    target, _ = tiny_rounds
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
        assert serves_exactly(adapter.drafter, target)
    finally:
        adapter.close(timeout=10)
