"""Online adaptation (SPEC section 4) with finished requests as samples (the default unit), the experiment
script, the head-error and stream-order helpers. CPU, tiny seeded models."""

from __future__ import annotations

import json

import pytest
import torch
from generation_helpers import PAD_ID, ragged_prompts

from adaflash_hf.speculation.rounds import FinishedRequest, VerifiedRound
from adaflash_hf.online import (
    OnlineAdapter,
    RequestSample,
)
from online_helpers import CollectRequests, pair, fresh_drafter, prompts, real_rounds, real_requests, snapshot, same, greedy  # noqa: F401 (pair: a fixture)


def test_generation_reports_each_finished_request(pair):
    d = fresh_drafter(pair)
    ids, mask, rows = prompts(5, n=3, lengths=(4, 9, 6))
    sink = CollectRequests()
    out = pair.generate(ids, attention_mask=mask, assistant_model=d, round_sink=sink, do_sample=False,
                        max_new_tokens=12, pad_token_id=PAD_ID)  # fmt: skip
    assert sorted(r.row for r in sink.requests) == [0, 1, 2] and len(sink.rounds) > 0
    for r in sink.requests:
        assert torch.equal(r.prompt_ids, rows[r.row])  # left padding removed
        assert torch.equal(r.output_ids, out[r.row, ids.shape[1] : ids.shape[1] + r.output_ids.numel()])
        assert r.output_ids.numel() == 12


def test_request_samples_cost_ids_only_and_skip_empty_responses(pair):
    d = fresh_drafter(pair)
    req = real_requests(pair, d, seeds=(0,))[0]
    s = RequestSample.from_request(req, domain="math")
    assert s.prompt_len == req.prompt_ids.numel() and s.response_len == req.output_ids.numel()
    assert s.nbytes == 8 * s.input_ids.numel() and s.domain == "math"
    adapter = OnlineAdapter(d, pair, samples_per_update=1000)
    try:
        adapter.on_round(real_rounds(pair, d)[0])  # rounds only feed tau statistics in request mode
        assert len(adapter.buffer) == 0 and adapter.counters.rounds_seen == 1
        adapter.on_request(req)
        adapter.on_request(FinishedRequest(0, req.prompt_ids, req.output_ids[:1]))  # nothing to predict
        assert len(adapter.buffer) == 1
    finally:
        adapter.close()
    with pytest.raises(ValueError, match="sample_unit"):
        OnlineAdapter(fresh_drafter(pair), pair, sample_unit="token")


@pytest.mark.parametrize("method", ["opd", "osd"])
def test_request_update_lowers_distillation_loss_and_head_only_trains_for_opd(pair, method):
    d = fresh_drafter(pair)
    reqs = real_requests(pair, d)
    adapter = OnlineAdapter(d, pair, method=method, samples_per_update=1000, epochs=5, lr=1e-2, head_lr=1e-2)
    try:
        torch.manual_seed(0)
        before = adapter.evaluate(reqs)["loss"]
        start = snapshot(d)
        for r in reqs:
            adapter.on_request(r)
        assert adapter.flush(60) and adapter.stats["updates"] == 1
        torch.manual_seed(0)  # the same anchors
        after = adapter.evaluate([RequestSample.from_request(r) for r in reqs])["loss"]
        assert after < 0.97 * before, (before, after)
        assert not same(start, snapshot(d))
        assert same(start, snapshot(d), "length_head.") == (method == "osd")
        ids, mask, _ = prompts(7)
        assert torch.equal(greedy(pair, ids, mask, assistant_model=d), greedy(pair, ids, mask))
    finally:
        adapter.close()


def test_request_update_failure_keeps_serving_weights(pair):
    d = fresh_drafter(pair)
    reqs = real_requests(pair, d)
    adapter = OnlineAdapter(d, pair, samples_per_update=1000, epochs=1, max_consecutive_failures=3)
    real = adapter.worker.request_batch
    good = snapshot(d)
    try:
        def nan_batch(batch, device):
            out = real(batch, device)
            adapter.worker.shadow.fc.weight.data.fill_(float("nan"))  # the step's loss becomes NaN
            return out

        adapter.worker.request_batch = nan_batch
        for r in reqs:
            adapter.on_request(r)
        assert adapter.flush(30)
        assert adapter.stats["failures"] == 1 and adapter.stats["updates"] == 0 and same(good, snapshot(d))
        adapter.worker.request_batch = real
        for r in reqs:
            adapter.on_request(r)
        assert adapter.flush(30) and adapter.stats["updates"] == 1 and not same(good, snapshot(d))
    finally:
        adapter.close()


def test_online_experiment_curve_on_the_reference_pair(tmp_path):
    """The experiment's JSON: one tau per update per method, every output checked; measuring in
    batches gives the same tau as one prompt at a time (rows verify their own blocks)."""
    import os

    import online_experiment as experiment
    from adaflash_hf.reference import REFERENCE_DIR

    def run(out, *extra):
        args = ["--target", os.path.join(REFERENCE_DIR, "target"), "--drafter", os.path.join(REFERENCE_DIR, "drafter"),
                "--dataset", "gsm8k", "--held-out", "3", "--stream", "4", "--samples-per-update", "2",
                "--stream-batch", "2", "--max-new-tokens", "10", "--device", "cpu", "--out", str(out), *extra]
        assert experiment.main(args) == 0
        return json.loads((out / "online.json").read_text())

    r = run(tmp_path / "a", "--methods", "opd,osd", "--updates", "1", "--measure-batch", "3")
    assert r["sample_unit"] == "request" and r["dataset"] == "gsm8k" and "--updates 1" in r["command"]
    for m in ("opd", "osd"):
        curve = r["methods"][m]["curve"]
        assert [c["update"] for c in curve] == [0, 1] and all(c["identical"] for c in curve)
        assert r["methods"][m]["complete"] and curve[1]["served_prompts"] == 2 and curve[1]["loss"] > 0
        assert all(c["head_mae"] is not None and c["head_rounds"] > 0 and 1 <= c["mean_verify_length"] <= 16 for c in curve)
        (record,) = r["methods"][m]["updates"]  # the adapter's record of its one update
        assert record["update"] == 1 and record["head_mae_before"] is not None
    assert (tmp_path / "a" / "online_tau.png").is_file()
    one_by_one = run(tmp_path / "b", "--methods", "opd", "--updates", "0", "--measure-batch", "1")
    assert one_by_one["methods"]["opd"]["curve"][0]["tau"] == pytest.approx(r["methods"]["opd"]["curve"][0]["tau"])
    both = run(tmp_path / "c", "--methods", "osd", "--updates", "0", "--measure-batch", "3", "--policy", "adaptive", "--measure-fixed")
    (start,) = both["methods"]["osd"]["curve"]  # the adaptive measurement, and the fixed one beside it
    assert start["fixed_tau"] == pytest.approx(r["methods"]["osd"]["curve"][0]["tau"]) and start["mean_verify_length"] < 16


def test_engine_requests_feed_an_attached_adapter(pair):
    """The serving engine reports finished requests: an attached adapter (request samples) updates."""
    from adaflash_hf.engine import Engine

    d = fresh_drafter(pair)
    adapter = OnlineAdapter(d, pair, samples_per_update=2, epochs=1, lr=1e-2).attach()
    try:
        start = snapshot(d)
        engine = Engine(pair, d, length_policy="adaptive", max_slots=2, max_len=48, token_budget=48)
        prompts = [row.tolist() for row in ragged_prompts(4, [5, 7, 6, 4], 3)[2]]
        outs = engine.generate(prompts, max_new_tokens=8)
        assert adapter.wait_for_update(30) and adapter.stats["updates"] >= 1
        assert not same(start, snapshot(d)) and adapter.counters.rounds_seen == sum(o.rounds for o in outs)
        for p, o in zip(prompts, outs):  # lossless while the weights change under it
            ref = pair.generate(torch.tensor([p]), do_sample=False, max_new_tokens=8, pad_token_id=PAD_ID)
            assert o.token_ids == ref[0, len(p):].tolist()
    finally:
        adapter.close()


def test_request_training_shadow_leaves_a_flash_serving_drafter_alone(pair):
    """Request samples train under a block mask (SDPA); a flash-attention serving drafter keeps flash."""
    d = fresh_drafter(pair)
    d.config._attn_implementation = "flash_attention_2"  # as a GPU deployment would set it (not runnable on CPU)
    adapter = OnlineAdapter(d, pair, samples_per_update=1000, epochs=1)
    try:
        shadow = adapter.worker.make_shadow()
        assert shadow.config._attn_implementation == "sdpa" and d.config._attn_implementation == "flash_attention_2"
        adapter.worker.request_model(shadow)  # the training wrapper accepts it (it refuses flash kernels)
        with pytest.raises(ValueError, match="block attention mask"):
            adapter.worker.request_model(d)
    finally:
        adapter.close()


@pytest.mark.parametrize("kwargs,expected", [({}, "token"), ({"clip_mode": "entry"}, "entry")])
def test_request_updates_use_the_configured_opd_clip(pair, monkeypatch, kwargs, expected):
    """The adapter trains with the released code's per-token clip unless told otherwise (opd_loss itself keeps
    the paper's per-entry default); the setting reaches the loss the worker calls."""
    import adaflash_hf.training.objective as trainer_mod

    seen = []
    real = trainer_mod.opd_loss
    monkeypatch.setattr(trainer_mod, "opd_loss", lambda *a, **kw: seen.append(kw["clip_mode"]) or real(*a, **kw))
    d = fresh_drafter(pair)
    adapter = OnlineAdapter(d, pair, method="opd", samples_per_update=1000, epochs=1, **kwargs)
    try:
        for r in real_requests(pair, d):
            adapter.on_request(r)
        assert adapter.flush(60) and adapter.stats["updates"] == 1
    finally:
        adapter.close()
    assert seen and set(seen) == {expected}


@pytest.mark.parametrize(
    "verify_len, accepted, ratio, expected",
    [
        (4, 1, 0.5, 0.25),  # a draft rejected inside the verified part: |0.5 - 2/8|
        (4, 3, 0.5, None),  # every verified draft accepted but the block cut (4 of 8): acceptance unknown
        (8, 7, 0.5, 0.5),  # the whole block verified and accepted: |0.5 - 8/8|
        (4, 1, None, None),  # no length head
    ],
)
def test_head_error_counts_only_rounds_with_known_acceptance(verify_len, accepted, ratio, expected):
    """`VerifiedRound.head_error`: |ratio - (accepted + 1) / B| where the real acceptance is known."""
    k = verify_len - 1
    r = VerifiedRound.from_block(0, torch.tensor([1]), 2, torch.arange(k), torch.zeros(k, 8), torch.zeros(k + 1, 8),
                                 draft_len=k, num_accepted=accepted, ratio=ratio)
    assert r.head_error(block_size=8) == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_stream_order_is_file_order_at_seed_0_and_a_seeded_permutation_otherwise(seed):
    from online_experiment import stream_order

    prompts = list(range(50))
    order = stream_order(prompts, seed)
    assert sorted(order) == prompts and order == stream_order(prompts, seed) and prompts == list(range(50))
    assert (order == prompts) == (seed == 0)
