"""The online trainer on a device of its own (`OnlineConfig(trainer_device=...)`, `--trainer-device`): where its
models and optimizer live, the swap into the serving drafter, the copies it makes of the models, and the flag's
refusals before any model loads. CPU: the trainer on `cpu` beside a drafter serving on `cpu`; the GPU pairing
(`cuda:1` beside `cuda:0`) is examples/two_gpu/run.py's."""

from __future__ import annotations

import argparse

import pytest
import torch

from adaflash_hf.cli import main
from adaflash_hf.online import OnlineAdapter
from adaflash_hf.online.config import OnlineConfig, resolve_trainer_device
from adaflash_hf.online.placement import frozen_copy
from adaflash_hf.online.worker import copy_drafter
from online_helpers import fresh_drafter, greedy, pair, prompts, real_requests, same, snapshot  # noqa: F401 (pair: a fixture)


def _storages(model) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}


def test_an_update_trains_on_the_trainer_device_and_the_swap_installs_its_weights(pair):
    """With ``trainer_device="cpu"`` the shadow, its optimizer's state and the target the trainer reads live on the
    CPU (the serving target itself: the same device, nothing copied); the swap copies the shadow's weights into the
    serving drafter, which then serves the target's own greedy answers. Control: the update moved the weights."""
    d = fresh_drafter(pair)
    reqs = real_requests(pair, d)
    start = snapshot(d)
    adapter = OnlineAdapter(d, pair, trainer_device="cpu", samples_per_update=len(reqs), epochs=2, lr=1e-2,
                            head_lr=1e-2, guard_samples=0)  # fmt: skip
    try:
        for r in reqs:
            adapter.on_request(r)
        assert adapter.flush(120) and adapter.stats["updates"] == 1 and adapter.stats["failures"] == 0
        worker = adapter.worker
        assert adapter.config.trainer_device == torch.device("cpu") == worker.device
        assert worker.target is pair
        assert {p.device for p in worker.shadow.parameters()} == {torch.device("cpu")}
        state = [t for s in worker.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        assert state and {t.device for t in state} == {torch.device("cpu")}
        assert _storages(worker.shadow).isdisjoint(_storages(d))  # a copy, not the serving weights
        served = snapshot(d)
        for name, t in worker.shadow.state_dict().items():
            assert torch.equal(served[name], t.to(served[name].dtype)), name
        assert not same(start, served)
    finally:
        adapter.close()
    ids, mask, _ = prompts(7)
    assert torch.equal(greedy(pair, ids, mask, assistant_model=d), greedy(pair, ids, mask))


def test_the_copies_a_trainer_device_makes_hold_the_same_weights_in_their_own_memory(pair):
    """What a trainer on another device holds: the target copied tensor by tensor (tied weights one tensor, the same
    logits), and the drafter copied straight there and bound to that copy's embedding and head (the same drafts);
    neither shares memory with the serving models."""
    d = fresh_drafter(pair)
    target = frozen_copy(pair, "cpu")
    assert _storages(target).isdisjoint(_storages(pair)) and not any(p.requires_grad for p in target.parameters())
    tied = pair.get_output_embeddings().weight is pair.get_input_embeddings().weight
    assert (target.get_output_embeddings().weight is target.get_input_embeddings().weight) == tied
    ids, mask, _ = prompts(3)
    with torch.no_grad():
        torch.testing.assert_close(target(ids, attention_mask=mask).logits, pair(ids, attention_mask=mask).logits,
                                   rtol=0, atol=0)  # fmt: skip
    shadow = copy_drafter(d, target, torch.device("cpu"))
    assert _storages(shadow).isdisjoint(_storages(d)) and same(snapshot(d), snapshot(shadow))
    assert shadow._target_ref("embed") is target.get_input_embeddings()
    assert torch.equal(greedy(target, ids, mask, assistant_model=shadow), greedy(pair, ids, mask, assistant_model=d))


def test_trainer_device_names_resolve_against_the_devices_this_process_sees(monkeypatch):
    """``cuda:N`` counts the devices ``CUDA_VISIBLE_DEVICES`` shows (here two, physical 2 and 3): ``cuda:1`` is the
    second of them, ``cuda:2`` is refused naming the variable; ``cuda`` is ``cuda:0``; other kinds are refused."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert resolve_trainer_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_trainer_device("cuda") == torch.device("cuda", 0)
    assert OnlineConfig(trainer_device="cuda:1").trainer_device == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"cuda:2 is not available: this process sees 2 CUDA devices .*'2,3'"):
        resolve_trainer_device("cuda:2")
    with pytest.raises(ValueError, match="cpu or cuda:N, not meta"):
        OnlineConfig(trainer_device="meta")


@pytest.mark.parametrize("flags,words", [
    (["--online", "--trainer-device", "cuda:1"], ["--trainer-device cuda:1", "no CUDA device"]),
    (["--online", "--trainer-device", "gpu1"], ["--trainer-device gpu1", "not a device"]),
    (["--trainer-device", "cpu"], ["without --online: --trainer-device"]),
])  # fmt: skip
def test_serve_refuses_a_trainer_device_it_cannot_use_before_models_load(flags, words, capsys, monkeypatch):
    import adaflash_hf.cli.serve as serve

    monkeypatch.setattr(serve, "load_models_from_args", lambda *a, **k: pytest.fail("loaded the models"))
    assert main(["serve", "--port", "0", *flags]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("adaflash: error: ") and "(hint: " in line, line
    assert all(w in line for w in words), line


def test_the_flag_reaches_the_config():
    from adaflash_hf.cli.online_args import online_config
    from adaflash_hf.cli.serve import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert online_config(p.parse_args(["--online", "--trainer-device", "cpu"])).trainer_device == torch.device("cpu")
    assert online_config(p.parse_args(["--online"])).trainer_device is None  # default: beside the drafter


@pytest.mark.parametrize("gpus", [0, 1])
def test_the_two_gpu_script_refuses_a_host_with_fewer_than_two(gpus, monkeypatch, capsys):
    """examples/two_gpu/run.py stops with status 2 and says why before any work; control: two GPUs pass the check."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "two_gpu" / "run.py"
    spec = importlib.util.spec_from_file_location("two_gpu_run", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0" if gpus else "")
    with pytest.raises(SystemExit) as stop:
        script.main(["serve", "--out", "unused"])
    assert stop.value.code == 2
    assert f"needs two CUDA devices; this process sees {gpus}" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    script.two_gpus_or_exit()
