"""Online adaptation (SPEC section 4): buffer, worker, hot swap, versions, Hub sink, faults.

Everything runs on CPU with tiny seeded models; the worker is a real background thread.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import threading
import time
import uuid
from concurrent.futures import Future
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from generation_helpers import PAD_ID, make_drafter, make_target, ragged_prompts

from adaflash_hf import AdaFlashDrafter
from adaflash_hf.spec.rounds import FinishedRequest, VerifiedRound
from adaflash_hf.online import (
    OnlineAdapter,
    OnlineAdapterCallback,
    ReplayBuffer,
    RequestSample,
    RoundLock,
    Sample,
    VersionStore,
    adapt_from_jsonl,
    estimate_sample_bytes,
    latest_version,
    list_versions,
    redact,
    render_card,
)
from adaflash_hf.online import versions as versions_mod
from adaflash_hf.spec.hooks import hooks_for

SENTINEL = "hf_SENTINELtokenDoNotLeak0123456789"
BLOCK = 8


class Collect:
    def __init__(self):
        self.rounds: list[VerifiedRound] = []

    def on_round(self, verified):
        self.rounds.append(verified)


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    target = make_target(layers=3, seed=1)
    target.requires_grad_(False)
    return target


def fresh_drafter(target, seed=0):
    return make_drafter(target, block_size=BLOCK, num_layers=1, seed=seed)


def prompts(seed=0, n=2, lengths=(5, 9)):
    ids, mask, rows = ragged_prompts(n, list(lengths), seed)
    return ids, mask, rows


def real_rounds(target, drafter, n_tokens=24, seed=0):
    sink = Collect()
    ids, mask, _ = prompts(seed)
    target.generate(ids, attention_mask=mask, assistant_model=drafter, round_sink=sink, do_sample=False,
                    max_new_tokens=n_tokens, pad_token_id=PAD_ID)  # fmt: skip
    return sink.rounds


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a, b, prefix=""):
    return all(torch.equal(a[k], b[k]) for k in a if k.startswith(prefix))


def greedy(target, ids, mask, **kw):
    return target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=PAD_ID, **kw)


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
            assert adapter._swap_pending.wait(30), "the worker never reached the swap"
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
    assert adapter.rounds_seen == 0
    adapter.attach()
    greedy(pair, ids, mask, assistant_model=d)
    seen = adapter.rounds_seen
    assert seen > 0 and len(adapter.buffer) == 0  # "off" collects statistics only
    adapter.detach()
    greedy(pair, ids, mask, assistant_model=d)
    assert adapter.rounds_seen == seen
    greedy(pair, ids, mask, assistant_model=d, round_sink=adapter)
    assert adapter.rounds_seen > seen
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


# --------------------------------------------------------------------------- versions


def test_versions_are_atomic_and_survive_a_crash(pair, tmp_path, monkeypatch):
    d = fresh_drafter(pair)
    store = VersionStore(tmp_path / "out", keep_versions=2)
    v1 = store.write(d.save_pretrained, metadata={"note": "first"})
    assert v1.name == "v00001" and latest_version(tmp_path / "out") == v1
    assert (tmp_path / "out" / "LATEST").read_text().strip() == "v00001"

    def crash_mid_write(path):
        d.save_pretrained(path)
        Path(path, "model.safetensors").write_bytes(b"half a tensor")
        raise OSError("disk full (injected)")

    with pytest.raises(OSError, match="injected"):
        store.write(crash_mid_write)
    assert latest_version(tmp_path / "out") == v1
    assert [n for n, _ in list_versions(tmp_path / "out")] == [1]
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".tmp")]

    # A hard crash after the rename but before the marker: LATEST still names v1.
    with monkeypatch.context() as m:
        m.setattr(versions_mod, "write_text_atomic", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            store.write(d.save_pretrained)
    assert latest_version(tmp_path / "out") == v1
    # A hard crash mid-write leaves a temporary directory behind; it is invisible and cleaned up.
    junk = tmp_path / "out" / ".tmp-adaflash-v00009-dead"
    junk.mkdir()
    (junk / "model.safetensors").write_bytes(b"junk")
    assert latest_version(tmp_path / "out") == v1
    loaded = AdaFlashDrafter.from_pretrained(latest_version(tmp_path / "out"))
    assert same(snapshot(d), snapshot(loaded))

    v3 = store.write(d.save_pretrained)
    assert v3.name == "v00003" and latest_version(tmp_path / "out") == v3 and not junk.exists()
    assert [n for n, _ in list_versions(tmp_path / "out")] == [2, 3]  # rolling window of 2
    assert json.loads((v3 / "adaflash_version.json").read_text())["version"] == 3
    link = tmp_path / "out" / "latest"
    assert link.is_symlink() and link.resolve() == v3.resolve()


def test_adapter_writes_versions_with_card(pair, tmp_path):
    d = fresh_drafter(pair)
    rounds = real_rounds(pair, d)
    adapter = OnlineAdapter(d, pair, sample_unit="round", samples_per_update=1000, epochs=1, output_dir=str(tmp_path / "v"),
                            keep_versions=2, target_name="tiny/qwen3-target", domain="math")  # fmt: skip
    try:
        for _ in range(3):
            for r in rounds[:3]:
                adapter.on_round(r)
            assert adapter.flush(30)
        st = adapter.stats
        assert st["updates"] == 3 and st["versions"] == [1, 2, 3] and st["domains"] == {"math": 9}
        latest = latest_version(tmp_path / "v")
        assert latest.name == "v00003" and len(list_versions(tmp_path / "v")) == 2
        assert same(snapshot(d), snapshot(AdaFlashDrafter.from_pretrained(latest)))
        card = (latest / "README.md").read_text()
        assert "tiny/qwen3-target" in card and "math (9 samples)" in card and "{{" not in card
        assert "samples per update: 1000 verified rounds" in card
        assert "| 3 | 3 |" in card
    finally:
        adapter.close()


def test_render_card_and_redaction(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SENTINEL)
    assert redact(f"Bearer {SENTINEL}!") == "Bearer ***!"
    assert "hf_" not in redact("token hf_abcdefghijklmnopqrstuvwxyz12 leaked")
    card = render_card({"target_name": f"org/model {SENTINEL}", "history": [], "domains": {"code": 3}})
    assert SENTINEL not in card and "code (3 samples)" in card and "{{" not in card


# --------------------------------------------------------------------------- Hub


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """Patch `HfApi.create_repo` / `upload_folder` to write a local HF cache (models--org--name/
    snapshots/<commit>/..., refs/main), and point huggingface_hub at it (read back offline)."""
    import huggingface_hub
    import huggingface_hub.constants as constants

    cache = tmp_path / "hf_cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    state = {"uploads": [], "fail_next": 0, "created": []}

    def create_repo(self, repo_id, **kwargs):
        assert "token" not in kwargs or kwargs["token"] is None
        state["created"].append(repo_id)
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, *, repo_id, folder_path, commit_message=None, run_as_future=False, **kwargs):
        assert kwargs.get("token") is None, "tokens must come from the environment, not arguments"
        fut = Future()
        if state["fail_next"]:
            state["fail_next"] -= 1
            fut.set_exception(ConnectionError(f"503 from hub (Authorization: Bearer {os.environ.get('HF_TOKEN')})"))
        else:
            repo = cache / ("models--" + repo_id.replace("/", "--"))
            commit = uuid.uuid4().hex + uuid.uuid4().hex[:8]
            shutil.copytree(folder_path, repo / "snapshots" / commit)
            (repo / "refs").mkdir(parents=True, exist_ok=True)
            (repo / "refs" / "main").write_text(commit)
            state["uploads"].append((repo_id, commit_message, commit))
            fut.set_result(commit)
        return fut if run_as_future else fut.result()

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    return state


def _go_offline(monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def _assert_no_sentinel(root: Path, text: str = ""):
    assert SENTINEL not in text
    for p in root.rglob("*"):
        if p.is_file():
            assert SENTINEL.encode() not in p.read_bytes(), f"token leaked into {p}"


def test_hub_push_round_trip_and_no_token_leak(pair, tmp_path, fake_hub, monkeypatch, caplog):
    monkeypatch.setenv("HF_TOKEN", SENTINEL)
    caplog.set_level(logging.DEBUG)
    fake_hub["fail_next"] = 1  # first attempt fails (with the token in its message): retried, redacted
    d = fresh_drafter(pair)
    rounds = real_rounds(pair, d)
    adapter = OnlineAdapter(d, pair, sample_unit="round", samples_per_update=1000, epochs=1, output_dir=str(tmp_path / "out"),
                            hub_repo="org/name", hub_backoff_s=0.01, target_name="org/target")  # fmt: skip
    try:
        for r in rounds[:4]:
            adapter.on_round(r)
        assert adapter.flush(60)
        hub = adapter.stats["hub"]
        assert hub["pushes"] == 1 and hub["failures"] == 1 and hub["last_pushed"] == 1
        assert fake_hub["created"] == ["org/name"] and len(fake_hub["uploads"]) == 1
        assert SENTINEL not in hub["last_error"] and "***" in hub["last_error"]
    finally:
        adapter.close()
    _go_offline(monkeypatch)
    pulled = AdaFlashDrafter.from_pretrained("org/name")
    assert same(snapshot(d), snapshot(pulled))
    snap = next((tmp_path / "hf_cache" / "models--org--name" / "snapshots").iterdir())
    card = (snap / "README.md").read_text()
    assert "org/target" in card and "org/name" in card
    _assert_no_sentinel(tmp_path, caplog.text)
    assert "retrying" in caplog.text


def test_hub_failures_never_reach_serving(pair, tmp_path, fake_hub, monkeypatch):
    fake_hub["fail_next"] = 100
    d = fresh_drafter(pair)
    rounds = real_rounds(pair, d)
    adapter = OnlineAdapter(d, pair, sample_unit="round", samples_per_update=1000, epochs=1, output_dir=str(tmp_path / "out"),
                            hub_repo="org/down", hub_max_retries=2, hub_backoff_s=0.01)  # fmt: skip
    try:
        for r in rounds[:4]:
            adapter.on_round(r)
        assert adapter.flush(60)
        st = adapter.stats
        assert st["updates"] == 1 and st["hub"]["gave_up"] == 1 and st["hub"]["failures"] == 3
        assert latest_version(tmp_path / "out") is not None  # the local copy stays
        ids, mask, _ = prompts(2)
        assert torch.equal(greedy(pair, ids, mask, assistant_model=d, round_sink=adapter), greedy(pair, ids, mask))
    finally:
        adapter.close()


# --------------------------------------------------------------------------- Trainer callback / external traffic


def test_trainer_callback_writes_and_pushes_versions(pair, tmp_path, fake_hub, monkeypatch):
    from transformers import TrainerState

    monkeypatch.setenv("HF_TOKEN", SENTINEL)
    d = fresh_drafter(pair)
    cb = OnlineAdapterCallback(str(tmp_path / "cb"), hub_repo="org/cb", every_n_steps=2, keep_versions=5)
    state = TrainerState()
    for step in (1, 2, 3, 4):
        state.global_step = step
        state.log_history.append({"loss": 1.0 / step, "step": step})
        cb.on_step_end(None, state, None, model=d)
    cb.on_save(None, state, None, model=d)  # same step as the last every_n_steps publish: no duplicate
    cb.on_train_end(None, state, None)
    assert [n for n, _ in list_versions(tmp_path / "cb")] == [1, 2]
    assert cb.hub.stats["pushes"] >= 1 and cb.failures == 0
    meta = json.loads((latest_version(tmp_path / "cb") / "adaflash_version.json").read_text())
    assert meta["step"] == 4 and meta["loss"] == 0.25
    _go_offline(monkeypatch)
    assert same(snapshot(d), snapshot(AdaFlashDrafter.from_pretrained("org/cb")))
    _assert_no_sentinel(tmp_path)


def test_external_traffic_publishes_dflash_versions(pair, tmp_path):
    d = fresh_drafter(pair)
    path = tmp_path / "traffic.jsonl"
    with open(path, "w") as f:
        for seed in range(3):
            ids, mask, rows = prompts(seed, n=1, lengths=(6,))
            out = pair.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=PAD_ID)
            resp = out[0, ids.shape[1]:].tolist()
            f.write(json.dumps({"prompt_ids": rows[0].tolist(), "response_ids": resp, "domain": "synthetic"}) + "\n")
        f.write("not json\n")
    before = snapshot(d)
    rounds = adapt_from_jsonl(pair, fresh_drafter(pair), path, sample_unit="round", anchors_per_response=4,
                              samples_per_update=6, epochs=1, lr=1e-2)  # fmt: skip
    assert rounds["records"] == 3 and rounds["updates"] == 2 and rounds["domains"] == {"synthetic": 12}
    stats = adapt_from_jsonl(pair, d, path, output_dir=str(tmp_path / "engine"), samples_per_update=2, epochs=1,
                             lr=1e-2)  # fmt: skip
    assert stats["records"] == 3 and stats["updates"] == 2 and stats["failures"] == 0
    assert stats["domains"] == {"synthetic": 3}
    latest = latest_version(tmp_path / "engine")
    config = json.loads((latest / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and "dflash_config" in config  # what SGLang / vLLM read
    assert same(snapshot(d), snapshot(AdaFlashDrafter.from_pretrained(latest)))
    assert not same(before, snapshot(d))
    assert isinstance(hooks_for(d).weights_lock, nullcontext)


def test_close_drains_a_running_update(pair):
    d = fresh_drafter(pair)
    rounds = real_rounds(pair, d)
    adapter = OnlineAdapter(d, pair, sample_unit="round", samples_per_update=4, epochs=2)
    for r in rounds[:4]:
        adapter.on_round(r)
    adapter.close()  # waits for the update already triggered, then stops the worker
    assert adapter._thread is not None and not adapter._thread.is_alive()
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
        assert adapter._busy  # the update was still running all along
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


@pytest.mark.parametrize("target,expected", [("Qwen/Qwen3-8B", "base_model: Qwen/Qwen3-8B"), ("/tmp/local target", None), (None, None)])
def test_card_metadata_links_hub_targets_only(target, expected):
    front = render_card({"target_name": target}).split("---")[1]
    assert "library_name: transformers" in front and "speculative-decoding" in front
    assert (expected in front) if expected else ("base_model" not in front)


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


# --------------------------------------------------------------------------- request samples (the default unit)


class CollectRequests(Collect):
    def __init__(self):
        super().__init__()
        self.requests: list[FinishedRequest] = []

    def on_request(self, finished):
        self.requests.append(finished)


def real_requests(target, drafter, seeds=(0, 1), n_tokens=24):
    sink = CollectRequests()
    for seed in seeds:
        ids, mask, _ = prompts(seed)
        target.generate(ids, attention_mask=mask, assistant_model=drafter, round_sink=sink, do_sample=False,
                        max_new_tokens=n_tokens, pad_token_id=PAD_ID)  # fmt: skip
    return sink.requests


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
        assert len(adapter.buffer) == 0 and adapter.rounds_seen == 1
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

    from adaflash_hf.online import experiment
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
        assert not same(start, snapshot(d)) and adapter.rounds_seen == sum(o.rounds for o in outs)
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
    from adaflash_hf.online.experiment import stream_order

    prompts = list(range(50))
    order = stream_order(prompts, seed)
    assert sorted(order) == prompts and order == stream_order(prompts, seed) and prompts == list(range(50))
    assert (order == prompts) == (seed == 0)
