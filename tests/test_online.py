"""Online adaptation (SPEC section 4): buffer, worker, hot swap, learning, faults.

Everything runs on CPU with tiny seeded models; the worker is a real background thread.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from contextlib import nullcontext

import pytest
import torch
from generation_helpers import PAD_ID

from adaflash_hf.online import (
    OnlineAdapter,
    ReplayBuffer,
    RoundLock,
    Sample,
    estimate_sample_bytes,
)
from adaflash_hf.speculation.hooks import hooks_for
from online_helpers import BLOCK, pair, fresh_drafter, prompts, real_rounds, snapshot, same, greedy  # noqa: F401 (pair: a fixture)


# --------------------------------------------------------------------------- buffer


def test_buffer_bounds_by_samples_and_bytes():
    def s(nbytes):
        return Sample(torch.zeros(1, dtype=torch.long), 0, torch.zeros(0, dtype=torch.long), None, 1, 0, nbytes=nbytes)

    buf = ReplayBuffer(max_samples=3, max_bytes=100)
    for _ in range(5):
        buf.add(s(10))
    assert len(buf) == 3 and buf.dropped == 2 and buf.nbytes == 30
    buf.add(s(85))  # bytes bound evicts the oldest until it fits: 10 + 85 <= 100
    assert buf.nbytes == 95 and len(buf) == 2
    assert buf.add(s(1000)) == 1 and len(buf) == 2  # alone too big: refused
    assert [x.nbytes for x in buf.take(5)] == [10, 85] and len(buf) == 0 and buf.nbytes == 0


def test_sample_costs_are_documented_and_counted(pair):
    d = fresh_drafter(pair)
    r = real_rounds(pair, d)[0]
    s = Sample.from_round(r, logits_dtype=torch.bfloat16)
    assert s.target_logits.dtype == torch.bfloat16 and s.target_logits.shape == (r.verify_len, 128)
    assert s.nbytes >= estimate_sample_bytes(r.context_ids.numel(), r.verify_len, 128)
    ids_only = Sample.from_round(r, store_target_logits=False)
    assert ids_only.target_logits is None and ids_only.nbytes < 1000
    k_h = len(d.config.target_layer_ids) * d.config.hidden_size
    reserved = Sample.from_round(r, reserve_feature_dim=k_h)
    assert reserved.nbytes - s.nbytes == r.context_ids.numel() * k_h * 2
    assert estimate_sample_bytes(1024, 16, 151936) == 8 * 1040 + 16 * 151936 * 2


# --------------------------------------------------------------------------- round lock / swap


def test_round_lock_is_shared_by_rounds_and_exclusive_for_swaps():
    lock = RoundLock()
    order = []
    with lock:
        with lock:  # re-entrant for a round's own thread
            pass
        t = threading.Thread(target=lambda: (lock.exclusive().__enter__(), order.append("swap")))
        t.start()
        time.sleep(0.1)
        assert order == []  # the swap waits for the round
        order.append("round done")
    t.join(5)
    assert order == ["round done", "swap"]


def test_update_swaps_weights_only_between_rounds(pair):
    d = fresh_drafter(pair)
    rounds = real_rounds(pair, d)
    adapter = OnlineAdapter(d, pair, sample_unit="round", samples_per_update=1000, epochs=1, lr=1e-2)
    try:
        for r in rounds[:6]:
            adapter.on_round(r)
        before = snapshot(d)
        done = threading.Event()
        with adapter.round_lock:  # a round in progress
            threading.Thread(target=lambda: (adapter.flush(30), done.set()), daemon=True).start()
            assert adapter.loop.swap_pending.wait(30), "the worker never reached the swap"
            time.sleep(0.2)
            assert same(before, snapshot(d)), "weights changed while a round held the lock"
            assert not done.is_set()
        assert done.wait(30)
        assert adapter.stats["updates"] == 1
        assert not same(before, snapshot(d)), "the update did not reach the serving drafter"
    finally:
        adapter.close()


@pytest.mark.parametrize("unit,per_update", [("round", 3), ("request", 2)])
def test_generation_stays_greedy_and_rounds_see_consistent_weights_during_updates(pair, unit, per_update):
    d = fresh_drafter(pair)
    adapter = OnlineAdapter(d, pair, sample_unit=unit, samples_per_update=per_update, epochs=1, lr=1e-2).attach()
    inconsistent = []

    def checksum():
        return sum(float(p.detach().double().sum()) for p in d.parameters())

    def pre(module, args, kwargs):
        module._probe = checksum()

    def post(module, args, kwargs, out):
        if module is d and module._probe != checksum():
            inconsistent.append(1)

    h1 = d.register_forward_pre_hook(pre, with_kwargs=True)
    h2 = d.register_forward_hook(post, with_kwargs=True)
    try:
        start = snapshot(d)
        for seed in range(4):
            ids, mask, _ = prompts(seed)
            assert torch.equal(greedy(pair, ids, mask, assistant_model=d), greedy(pair, ids, mask))
            adapter.wait_for_update(30)
        assert adapter.stats["updates"] >= 2, adapter.stats
        assert not same(start, snapshot(d))
        assert inconsistent == []
        st = adapter.stats
        assert st["rounds_seen"] > 0 and st["history"][0]["tau_before"] >= 1.0
        assert st["history"][0]["tau_after"] is not None
    finally:
        h1.remove()
        h2.remove()
        adapter.close()
    assert hooks_for(d).round_sink is None and isinstance(hooks_for(d).weights_lock, nullcontext)


def test_attach_detach_and_explicit_sink(pair):
    d = fresh_drafter(pair)
    adapter = OnlineAdapter(d, pair, method="off")
    ids, mask, _ = prompts(0)
    greedy(pair, ids, mask, assistant_model=d)
    assert adapter.counters.rounds_seen == 0
    adapter.attach()
    greedy(pair, ids, mask, assistant_model=d)
    seen = adapter.counters.rounds_seen
    assert seen > 0 and len(adapter.buffer) == 0  # "off" collects statistics only
    adapter.detach()
    greedy(pair, ids, mask, assistant_model=d)
    assert adapter.counters.rounds_seen == seen
    greedy(pair, ids, mask, assistant_model=d, round_sink=adapter)
    assert adapter.counters.rounds_seen > seen
    with pytest.raises(ValueError, match="already has an online adapter"):
        OnlineAdapter(d, pair)
    adapter.close()
    OnlineAdapter(d, pair, method="off").close()  # closing released the drafter


# --------------------------------------------------------------------------- learning


def test_opd_update_on_a_repeated_sample_lowers_its_loss(pair):
    d = fresh_drafter(pair)
    r = max(real_rounds(pair, d), key=lambda x: x.verify_len)
    assert r.verify_len >= 3
    adapter = OnlineAdapter(d, pair, sample_unit="round", samples_per_update=1000, epochs=2, lr=1e-3)
    try:
        before = adapter.evaluate([r])
        for _ in range(16):
            adapter.on_round(r)
        assert adapter.flush(60)
        after = adapter.evaluate([r])
        assert adapter.stats["updates"] == 1
        assert after["loss"] < before["loss"] - 0.05, (before, after)
        h = adapter.stats["history"][0]
        assert h["loss_last"] < h["loss_first"]
    finally:
        adapter.close()


@pytest.mark.parametrize("warmup, expected", [(0, 1.0), (10, 0.4)])
def test_warmup_ramps_the_learning_rate_over_the_first_steps(pair, warmup, expected):
    """4 steps (4 samples, batch 1, one epoch): with a 10-step warm-up the next step's rate is 5/10 of lr and the
    first step's was 1/10; the control (no warm-up) steps at lr throughout. The update reports its gradient norm."""
    d = fresh_drafter(pair)
    rounds = real_rounds(pair, d)[:4]
    adapter = OnlineAdapter(d, pair, sample_unit="round", samples_per_update=4, epochs=1, batch_size=1, lr=1e-3,
                            warmup_steps=warmup)
    try:
        for r in rounds:
            adapter.on_round(r)
        assert adapter.flush(60) and adapter.stats["updates"] == 1
        opt = adapter.worker.optimizer
        assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * (1.0 if not warmup else 5 / warmup))
        assert opt.state_dict()["state"] and adapter.stats["history"][0]["grad_norm"] > 0
        assert (adapter.worker.scheduler is None) == (warmup == 0) and expected
    finally:
        adapter.close()


def test_length_head_loss_never_reaches_drafter_params(pair):
    d = fresh_drafter(pair)
    rounds = real_rounds(pair, d)
    adapter = OnlineAdapter(d, pair, sample_unit="round", samples_per_update=1000, epochs=1, lr=1e-2, head_lr=1e-2)
    try:
        shadow, _ = adapter.worker.ensure_shadow()
        sample = Sample.from_round(rounds[0])
        main, head = adapter.worker.sample_loss(shadow, sample)
        drafter_params, head_params = adapter.worker.param_groups(shadow)
        g_drafter = torch.autograd.grad(head, drafter_params, allow_unused=True, retain_graph=True)
        assert all(g is None or not g.any() for g in g_drafter)
        assert any(g is not None and g.any() for g in torch.autograd.grad(head, head_params, allow_unused=True))

        # End to end: an update driven by the head loss alone moves only the head.
        real = adapter.worker.sample_loss
        adapter.worker.sample_loss = lambda model, s, cache_features=True: (lambda m, h: (m * 0.0, h))(*real(model, s, cache_features))
        for r in rounds[:6]:
            adapter.on_round(r)
        before = snapshot(d)
        assert adapter.flush(30) and adapter.stats["updates"] == 1
        after = snapshot(d)
        assert all(torch.equal(before[k], after[k]) for k in before if not k.startswith("length_head."))
        assert not same(before, after, "length_head.")
    finally:
        adapter.close()


def test_osd_trains_drafter_not_head_and_recomputed_logits_match(pair):
    d = fresh_drafter(pair)
    rounds = real_rounds(pair, d)
    adapter = OnlineAdapter(d, pair, sample_unit="round", method="osd", samples_per_update=1000, epochs=1, lr=1e-2, store_target_logits=False)
    try:
        # Ids-only samples: the worker recomputes the target logits; they match the verify forward's.
        s = Sample.from_round(rounds[3], store_target_logits=False)
        _, logits = adapter.worker.target_pass(s)
        torch.testing.assert_close(logits.float(), rounds[3].target_logits.float(), atol=1e-4, rtol=1e-4)
        for r in rounds[:6]:
            adapter.on_round(r)
        before = snapshot(d)
        assert adapter.flush(30) and adapter.stats["updates"] == 1
        after = snapshot(d)
        assert same(before, after, "length_head.") and not same(before, after)
    finally:
        adapter.close()


# --------------------------------------------------------------------------- faults


def test_failing_worker_keeps_last_good_weights_and_generation(pair):
    d = fresh_drafter(pair)
    rounds = real_rounds(pair, d)
    adapter = OnlineAdapter(d, pair, sample_unit="round", samples_per_update=1000, epochs=1, lr=1e-2, max_consecutive_failures=3)
    real = adapter.worker.sample_loss
    try:
        for r in rounds[:4]:
            adapter.on_round(r)
        good = snapshot(d)

        def boom(*a, **k):
            raise RuntimeError("injected failure")

        adapter.worker.sample_loss = boom
        assert adapter.flush(30)
        assert adapter.stats["failures"] == 1 and adapter.stats["updates"] == 0
        assert "injected failure" in adapter.stats["last_error"]
        assert same(good, snapshot(d))

        def nan_loss(model, s, cache_features=True):
            main, head = real(model, s, cache_features)
            return main * float("nan"), head

        adapter.worker.sample_loss = nan_loss
        for r in rounds[:4]:
            adapter.on_round(r)
        assert adapter.flush(30)
        assert adapter.stats["failures"] == 2 and same(good, snapshot(d))
        assert all(torch.isfinite(v).all() for v in snapshot(d).values())

        ids, mask, _ = prompts(3)
        assert torch.equal(greedy(pair, ids, mask, assistant_model=d, round_sink=adapter), greedy(pair, ids, mask))

        adapter.worker.sample_loss = real  # it keeps going: the next update succeeds
        assert adapter.flush(30)
        assert adapter.stats["updates"] == 1 and adapter.stats["consecutive_failures"] == 0
        assert not same(good, snapshot(d))
    finally:
        adapter.close()


def test_adapter_stops_after_consecutive_failures(pair):
    d = fresh_drafter(pair)
    rounds = real_rounds(pair, d)
    adapter = OnlineAdapter(d, pair, sample_unit="round", samples_per_update=2, epochs=1, max_consecutive_failures=2)
    adapter.worker.sample_loss = lambda *a, **k: (_ for _ in ()).throw(ValueError("always"))
    good = snapshot(d)
    try:
        for r in rounds[:2]:
            adapter.on_round(r)
        adapter.wait_for_update(30)
        for r in rounds[2:4]:
            adapter.on_round(r)
        adapter.wait_for_update(30)
        st = adapter.stats
        assert st["failures"] == 2 and st["stopped"]
        n = len(adapter.buffer)
        adapter.on_round(rounds[5])
        assert len(adapter.buffer) == n  # a stopped adapter buffers nothing
        ids, mask, _ = prompts(1)
        assert torch.equal(greedy(pair, ids, mask, assistant_model=d, round_sink=adapter), greedy(pair, ids, mask))
        assert same(good, snapshot(d))
    finally:
        adapter.close()


def test_close_drains_a_running_update(pair):
    d = fresh_drafter(pair)
    rounds = real_rounds(pair, d)
    adapter = OnlineAdapter(d, pair, sample_unit="round", samples_per_update=4, epochs=2)
    for r in rounds[:4]:
        adapter.on_round(r)
    adapter.close()  # waits for the update already triggered, then stops the worker
    assert adapter.loop._thread is not None and not adapter.loop._thread.is_alive()
    assert adapter.stats["updates"] + adapter.stats["failures"] == 1
    adapter.on_round(rounds[5])
    assert len(adapter.buffer) == 0


def test_store_features_computes_target_features_once_per_sample(pair):
    d = fresh_drafter(pair)
    rounds = real_rounds(pair, d)[:3]
    calls = {}
    for store in (False, True):
        adapter = OnlineAdapter(d, pair, sample_unit="round", samples_per_update=1000, epochs=2, store_features=store)
        real = adapter.worker.target_pass
        calls[store] = 0

        def counting(s, real=real, store=store):
            calls[store] += 1
            return real(s)

        adapter.worker.target_pass = counting
        try:
            for r in rounds:
                adapter.on_round(r)
            if store:  # the feature bytes are reserved against the buffer bound up front
                k_h = len(d.config.target_layer_ids) * d.config.hidden_size
                assert adapter.buffer.nbytes >= sum(r.context_ids.numel() for r in rounds) * k_h * 2
            assert adapter.flush(30) and adapter.stats["updates"] == 1
        finally:
            adapter.close()
    assert calls == {False: 6, True: 3}  # recomputed every epoch by default, once when stored


def test_on_round_never_waits_for_training(pair):
    d = fresh_drafter(pair)
    rounds = real_rounds(pair, d)
    adapter = OnlineAdapter(d, pair, sample_unit="round", samples_per_update=2, epochs=1)
    real = adapter.worker.sample_loss
    entered = threading.Event()

    def slow(*a, **k):
        entered.set()
        time.sleep(1.0)
        return real(*a, **k)

    adapter.worker.sample_loss = slow
    try:
        adapter.on_round(rounds[0])
        adapter.on_round(rounds[1])  # triggers an update that takes >= 2 s
        assert entered.wait(10)
        t0 = time.perf_counter()
        for r in rounds[2:8]:
            adapter.on_round(r)
        assert time.perf_counter() - t0 < 0.5
        assert adapter.busy  # the update was still running all along
        ids, mask, _ = prompts(4)
        assert torch.equal(greedy(pair, ids, mask, assistant_model=d, round_sink=adapter), greedy(pair, ids, mask))
    finally:
        adapter.close()


@pytest.mark.parametrize("method", ["opd", "osd"])
def test_slots_after_the_first_rejection_carry_no_label(pair, method):
    """Target distributions after a rejected draft are conditioned on a wrong prefix: never labels."""
    d = fresh_drafter(pair)
    r = next(x for x in real_rounds(pair, d) if x.num_accepted + 2 < x.verify_len)
    garbage = r.target_logits.clone()
    garbage[r.num_accepted + 1 :] = torch.randn_like(garbage[r.num_accepted + 1 :]) * 50
    adapter = OnlineAdapter(d, pair, sample_unit="round", method=method)
    try:
        clean = adapter.evaluate([r])["loss"]
        noisy = adapter.evaluate([dataclasses.replace(r, target_logits=garbage)])["loss"]
        assert clean == pytest.approx(noisy)
        garbage[r.num_accepted] += torch.randn_like(garbage[r.num_accepted]) * 50  # the first rejected slot does count
        assert adapter.evaluate([dataclasses.replace(r, target_logits=garbage)])["loss"] != pytest.approx(clean)
    finally:
        adapter.close()


def test_rollout_labels_follow_the_targets_own_greedy_continuation(pair):
    d = fresh_drafter(pair)
    r = real_rounds(pair, d)[3]
    adapter = OnlineAdapter(d, pair, sample_unit="round", label_mode="rollout")
    try:
        labels = adapter.worker.rollout(Sample.from_round(r, logits_dtype=None))
        prefix = torch.cat([r.context_ids, torch.tensor([r.bonus_token])])[None]
        greedy_tokens = pair.generate(prefix, attention_mask=torch.ones_like(prefix), do_sample=False, max_new_tokens=BLOCK - 1, min_new_tokens=BLOCK - 1, pad_token_id=PAD_ID)[0, prefix.shape[1] :]
        assert labels.shape == (BLOCK - 1, r.target_logits.shape[-1])
        assert torch.equal(labels.argmax(-1), greedy_tokens)
        # The first slot's label is the verify forward's own distribution at the bonus position.
        torch.testing.assert_close(labels[0], r.target_logits[0].float(), atol=1e-4, rtol=1e-4)
        before = adapter.evaluate([r])["loss"]
        with pytest.raises(ValueError, match="label_mode"):
            OnlineAdapter(fresh_drafter(pair), pair, label_mode="guess")
        assert before > 0
    finally:
        adapter.close()


# --------------------------------------------------------------------------- guard settings (issue 33, item 6)


@pytest.mark.parametrize("command", [["adapt", "--prompts-file", "p.jsonl"], ["serve", "--online"]])
def test_guard_flags_reach_the_config_and_unset_ones_keep_its_defaults(command):
    from adaflash_hf.cli import UsageError, build_parser
    from adaflash_hf.cli.online_args import check_online_args, online_config
    from adaflash_hf.online import OnlineConfig

    def parse(*flags):
        args = build_parser(only=(command[0],)).parse_args([*command, "--output-dir", "out", *flags])
        args.reference = True
        return args

    default = OnlineConfig()
    cfg = online_config(parse())
    assert (cfg.guard_samples, cfg.guard_margin, cfg.guard_confidence, cfg.rollback_rounds, cfg.rollback_margin) == (
        default.guard_samples, default.guard_margin, default.guard_confidence, default.rollback_rounds, default.rollback_margin)
    assert cfg.held_back == 16  # 16 of the default 128 requests
    cfg = online_config(parse("--guard-samples", "0", "--guard-margin", "-0.25", "--guard-confidence", "1.5",
                              "--rollback-rounds", "64", "--rollback-margin", "0.2"))
    assert (cfg.held_back, cfg.guard_margin, cfg.guard_confidence, cfg.rollback_rounds, cfg.rollback_margin) == (
        0, -0.25, 1.5, 64, 0.2)
    with pytest.raises(UsageError, match="guard_samples"):
        check_online_args(parse("--samples-per-update", "8", "--guard-samples", "8"))


def test_guard_settings_are_validated():
    from adaflash_hf.online import OnlineConfig

    assert OnlineConfig(samples_per_update=4).held_back == 0  # fewer than 8: off
    assert OnlineConfig(sample_unit="round").held_back == 0  # round samples cannot judge a candidate
    with pytest.raises(ValueError, match="sample_unit='request'"):
        OnlineConfig(sample_unit="round", guard_samples=4)
    with pytest.raises(ValueError, match="rollback_margin"):
        OnlineConfig(rollback_margin=-0.1)


# --------------------------------------------------------------------------- pacing (issue 33, item 5)


@pytest.mark.parametrize("share, busy, pause", [(1.0, 2.0, None), (0.5, 2.0, 2.0), (0.25, 1.0, 3.0), (0.1, 0.5, 4.5)])
def test_pacer_sleeps_so_steps_take_at_most_their_share(share, busy, pause):
    from adaflash_hf.online.pacing import Pacer

    slept = []
    pacer = Pacer(share, clock=iter([10.0, 10.0 + busy]).__next__, sleep=slept.append)
    pacer.start()
    pacer.done()
    assert slept == ([] if pause is None else [pytest.approx(pause)])
    if slept:
        assert busy / (busy + slept[0]) == pytest.approx(share)


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5, float("nan")])
def test_train_share_out_of_range_is_refused(share):
    from adaflash_hf.online import OnlineConfig

    with pytest.raises(ValueError, match="train_share"):
        OnlineConfig(train_share=share)


@pytest.mark.parametrize("command, default", [(["adapt", "--prompts-file", "p.jsonl"], 1.0), (["serve", "--online"], 0.25)])
def test_train_share_flag_reaches_the_config(command, default):
    from adaflash_hf.cli import UsageError, build_parser
    from adaflash_hf.cli.online_args import online_config

    def config(*flags):
        args = build_parser(only=(command[0],)).parse_args([*command, "--output-dir", "out", *flags])
        args.reference = True
        return online_config(args)

    assert config().train_share == default
    assert config("--train-share", "0.5").train_share == 0.5
    with pytest.raises(UsageError, match="--train-share"):
        config("--train-share", "0")


def test_a_paced_update_sleeps_between_its_steps(pair, monkeypatch):
    """The worker sleeps after every optimizer step when train_share < 1 (and never at 1.0)."""
    import adaflash_hf.online.pacing as pacing

    for share, expect_sleep in ((1.0, False), (0.5, True)):
        slept = []
        monkeypatch.setattr(pacing.time, "sleep", slept.append)
        d = fresh_drafter(pair)
        adapter = OnlineAdapter(d, pair, sample_unit="round", samples_per_update=4, epochs=1, batch_size=2,
                                train_share=share)
        try:
            samples = [Sample.from_round(r, logits_dtype=None) for r in real_rounds(pair, d)[:4]]
            adapter.worker.train(samples, 0)
        finally:
            adapter.close()
        assert (len(slept) == 2) if expect_sleep else not slept, (share, slept)
