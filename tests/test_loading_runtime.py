"""What every command sets up before it generates: torch's CPU threads (one shared rule, `set_cpu_threads`) and the
Hub's offline mode when the Hub cannot be reached (`hub_offline_unless_reachable`)."""

from __future__ import annotations

import socket
import sys
import time

import pytest
import torch

from adaflash_hf import loading
from adaflash_hf.cli import main
from adaflash_hf.training.hub_datasets import HubUnavailable, load_hub_records


@pytest.fixture
def threads(monkeypatch):
    """Torch starts the test at 2 threads and gets its count back afterwards."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


class _Big(torch.nn.Module):
    """A model of 200M parameters that takes no memory (meta tensors)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(200_000, 1_000, device="meta"))


def test_the_thread_rule(threads, monkeypatch):
    small = torch.nn.Linear(4, 4)
    assert loading.set_cpu_threads(None, "cpu", small, None) == 1
    torch.set_num_threads(2)
    assert loading.set_cpu_threads(3, "cpu", small) == 3  # asked for: kept
    torch.set_num_threads(2)
    assert loading.set_cpu_threads(None, "cpu", _Big()) == 2  # a large model keeps torch's count
    assert loading.set_cpu_threads(None, torch.device("cuda"), small) == 2  # so does another device
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert loading.set_cpu_threads(None, "cpu", small) == 2  # the environment's choice is respected


@pytest.mark.parametrize("argv", [
    ["demo", "--prompt", "Hi", "--max-new-tokens", "2"],
    ["generate", "--reference", "--prompt", "Hi", "--max-new-tokens", "2"],
    ["bench", "--reference", "--datasets", "gsm8k", "--num-prompts", "1", "--max-new-tokens", "2", "--methods", "plain",
     "--warmup", "0", "--no-plots", "--quiet"],
], ids=lambda a: a[0])
def test_every_generating_command_picks_one_thread_for_the_reference_pair(argv, threads, capsys):
    assert main(argv) == 0, capsys.readouterr().err
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    assert main([*argv, "--threads", "2"]) == 0  # the control: a count asked for is kept
    assert torch.get_num_threads() == 2


# ----------------------------------------------------------------------------- the Hub, offline
@pytest.fixture
def fresh_hub_state(monkeypatch):
    """No offline variable set, nothing probed yet; every flag the probe may change is restored afterwards."""
    import datasets
    import huggingface_hub

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(loading, "_hub_offline", None)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    return monkeypatch


def _unreachable(*args, **kwargs):
    raise OSError("no route to host")


def test_an_unreachable_hub_means_offline_at_once(fresh_hub_state, capsys):
    import datasets

    fresh_hub_state.setattr(socket, "create_connection", _unreachable)
    start = time.perf_counter()
    try:
        load_hub_records("gsm8k")  # from the cache if it is there, else refused at once (the caller falls back)
    except HubUnavailable:
        pass
    assert time.perf_counter() - start < 10  # ~20 s of retries before
    assert loading.os.environ["HF_HUB_OFFLINE"] == loading.os.environ["HF_DATASETS_OFFLINE"] == "1"
    assert sys.modules["huggingface_hub"].constants.HF_HUB_OFFLINE and datasets.config.HF_HUB_OFFLINE
    assert "unreachable" in capsys.readouterr().err


def test_a_reachable_hub_stays_online(fresh_hub_state):
    """The control: the probe connects, nothing changes."""

    class _Conn:
        def close(self):
            pass

    fresh_hub_state.setattr(socket, "create_connection", lambda *a, **k: _Conn())
    assert loading.hub_offline_unless_reachable() is False
    assert "HF_HUB_OFFLINE" not in loading.os.environ


@pytest.mark.parametrize("value, offline", [("1", True), ("0", False)])
def test_the_offline_variables_are_respected_without_a_probe(value, offline, fresh_hub_state):
    fresh_hub_state.setenv("HF_HUB_OFFLINE", value)
    fresh_hub_state.setattr(socket, "create_connection", lambda *a, **k: pytest.fail("probed the Hub"))
    assert loading.hub_offline_unless_reachable() is offline
