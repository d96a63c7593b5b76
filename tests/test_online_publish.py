"""Online adaptation (SPEC section 4), what it publishes: atomic versions with their card, the Hub sink,
the Trainer callback and external traffic. CPU, tiny seeded models."""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from concurrent.futures import Future
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from generation_helpers import PAD_ID

from adaflash_hf import AdaFlashDrafter
from adaflash_hf.online import (
    OnlineAdapter,
    OnlineAdapterCallback,
    VersionStore,
    adapt_from_jsonl,
    latest_version,
    list_versions,
    redact,
    render_card,
)
from adaflash_hf.online import versions as versions_mod
from adaflash_hf.speculation.hooks import hooks_for
from online_helpers import SENTINEL, pair, fresh_drafter, prompts, real_rounds, snapshot, same, greedy  # noqa: F401 (pair: a fixture)


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


def _numbered(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("v"))


def test_a_half_deleted_version_is_not_listed(pair, tmp_path):
    """What an in-place delete cut short leaves (issue 34): a vNNNNN folder without its config or weights."""
    d = fresh_drafter(pair)
    out = tmp_path / "out"
    store = VersionStore(out, keep_versions=5)
    for _ in range(3):
        store.write(d.save_pretrained)
    (out / "v00001" / "model.safetensors").unlink()
    (out / "v00003" / "config.json").unlink()  # even the one LATEST names
    assert [n for n, _ in list_versions(out)] == [2] and latest_version(out) == out / "v00002"
    AdaFlashDrafter.from_pretrained(latest_version(out))
    assert store.write(d.save_pretrained).name == "v00004"  # past v00003: its name is taken
    assert _numbered(out) == ["v00002", "v00004"]  # the next prune removes the half-deleted ones


def test_a_prune_cut_short_leaves_no_partial_version(pair, tmp_path, monkeypatch):
    d = fresh_drafter(pair)
    out = tmp_path / "out"
    store = VersionStore(out, keep_versions=1)
    store.write(d.save_pretrained)

    def killed_midway(path, *args, **kwargs):  # deletes the config, then the process dies
        Path(path, "config.json").unlink()
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(versions_mod, "shutil", SimpleNamespace(rmtree=killed_midway))  # the store's deletes only
        with pytest.raises(KeyboardInterrupt):
            store.write(d.save_pretrained)  # v00002 is written, then pruning v00001 is cut short
    assert _numbered(out) == ["v00002"] and [n for n, _ in list_versions(out)] == [2]
    AdaFlashDrafter.from_pretrained(latest_version(out))
    store.write(d.save_pretrained)  # sweeps the half-deleted temporary
    assert _numbered(out) == ["v00003"] and not [p for p in out.iterdir() if p.name.startswith(".tmp")]


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


@pytest.mark.parametrize("target,expected", [("Qwen/Qwen3-8B", "base_model: Qwen/Qwen3-8B"), ("/tmp/local target", None), (None, None)])
def test_card_metadata_links_hub_targets_only(target, expected):
    front = render_card({"target_name": target}).split("---")[1]
    assert "library_name: transformers" in front and "speculative-decoding" in front
    assert (expected in front) if expected else ("base_model" not in front)
