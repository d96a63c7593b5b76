"""Drafter training in two processes (what `accelerate launch --num_processes 2` runs), on the CPU with the gloo
backend: the same steps as one process with two-fold gradient accumulation, one writer, evaluation on the main
process, each process on its own samples."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from transformers import Qwen3Config, Qwen3ForCausalLM

from adaflash_hf.training import train_drafter
from adaflash_hf.training.checkpoint import drafter_state_dict
from adaflash_hf.training.trainer import DrafterTrainer

WORLD, BATCH, STEPS, SAMPLES = 2, 2, 3, 16
WRITES = {"open", "os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "os.chmod", "os.truncate",
          "os.link", "os.symlink", "shutil.rmtree", "shutil.move"}  # fmt: skip


def _recording_train(report: dict):
    """``DrafterTrainer.train`` that notes each batch's samples (their token ids) and the trained weights."""
    original = DrafterTrainer.train

    def train(self, *args, **kwargs):
        collate = self.data_collator
        batches = report.setdefault("batches", [])

        def recording(rows):
            batches.append([list(r["input_ids"]) for r in rows])
            return collate(rows)

        self.data_collator = recording
        report["start"] = {k: v.detach().clone() for k, v in drafter_state_dict(self._training_model().drafter).items()}
        try:
            return original(self, *args, **kwargs)
        finally:
            self.data_collator = collate
            report["weights"] = {k: v.detach().clone() for k, v in drafter_state_dict(self._training_model().drafter).items()}

    return train


def _counting(report: dict, name: str, fn):
    def counted(*args, **kwargs):
        report[name] = report.get(name, 0) + 1
        return fn(*args, **kwargs)

    return counted


def _watch_writes(root: str, seen: list) -> None:
    """An audit hook noting every file system change under ``root`` this process makes (Python's own writes and
    those of the temporary folders an atomic save fills from native code)."""
    root = os.path.realpath(root)

    def under(p) -> bool:
        return isinstance(p, (str, bytes, os.PathLike)) and os.path.realpath(os.fsdecode(p)).startswith(root)

    def hook(event, args):
        if event not in WRITES:
            return
        if event == "open":
            path, mode, flags = args
            writes = (mode is not None and any(c in mode for c in "wax+")) or \
                (mode is None and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
            if writes and under(path):
                seen.append(f"{event} {os.fsdecode(path)}")
        elif any(under(a) for a in args[:2]):
            seen.append(f"{event} {args[0]}")

    sys.addaudithook(hook)


def _rank(rank: int, port: int, recipe: train_drafter.DrafterRecipe, watched: str, reports: str) -> None:
    """One process of the launch: the environment `accelerate launch` gives it, then the recipe's `run`."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    report: dict = {"writes": []}
    _watch_writes(watched, report["writes"])
    DrafterTrainer.train = _recording_train(report)
    train_drafter.acceptance_proxy = _counting(report, "evaluations", train_drafter.acceptance_proxy)
    assert train_drafter.run(recipe) == 0
    torch.save(report, Path(reports) / f"rank{rank}.pt")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny target with its tokenizer, and a regeneration cache of samples of varied lengths (made here: the
    recipe only reads it)."""
    from adaflash_hf.training.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("ddp")
    tok = train_tokenizer(["hello world, how are you?", "the quick brown fox jumps over the lazy dog 12345"] * 20,
                          vocab_size=300)
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          max_position_embeddings=512, eos_token_id=tok.eos_token_id))  # fmt: skip
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    recipe = train_drafter.DrafterRecipe(
        target=str(root / "target"), out="", device="cpu", domains=["chat"], eval_domains=["chat"], eval_per_domain=1,
        num_prompts=SAMPLES, max_new_tokens=6, gen_batch_size=2, block_size=4, batch_size=BATCH, steps=STEPS,
        lr=1e-2, max_length=64, logging_steps=1, progress=False, regen_cache=str(root / "regen.jsonl"))  # fmt: skip
    g = torch.Generator().manual_seed(1)
    samples = []
    for i in range(SAMPLES):
        prompt, answer = 3 + i % 3, 5 + (7 * i) % 11  # lengths that group_by_length orders
        ids = torch.randint(5, 300, (prompt + answer,), generator=g).tolist()
        samples.append({"input_ids": ids, "loss_mask": [0] * prompt + [1] * answer, "domain": "chat"})
    train_drafter._settings_file(Path(recipe.regen_cache)).write_text(json.dumps(train_drafter._regen_settings(recipe)))
    Path(recipe.regen_cache).write_text("".join(json.dumps(s) + "\n" for s in samples))
    return root, recipe, samples


def test_two_processes_take_the_steps_of_one_with_gradient_accumulation(made, tmp_path, monkeypatch):
    """Two gloo processes train the drafter: both end with identical weights, equal (fp32 tolerance) to one process
    taking the same optimizer steps as batches of two with two-fold gradient accumulation (DDP averages the two
    processes' gradients of their batch means; accumulation sums each batch mean's gradient halved: the same
    update). The processes see different samples, together those the one process sees, in the same steps. Only rank
    0 evaluates and writes (the drafter, the log, the summary); an audit hook sees rank 1 change nothing under the
    output folder. Control: the weights moved from the start."""
    root, recipe, samples = made
    reports = tmp_path / "reports"
    reports.mkdir()
    ddp = dataclasses.replace(recipe, out=str(tmp_path / "runs" / "ddp"))
    # forkserver: the two processes are forked from a server that imported adaflash_hf once (as spawn, each is handed
    # the pickled recipe and rebuilt from the same preparation data; only the imports are not paid again per process)
    mp.set_forkserver_preload(["adaflash_hf.training.train_drafter"])
    mp.start_processes(_rank, args=(_free_port(), ddp, str(tmp_path / "runs"), str(reports)), nprocs=WORLD,
                       start_method="forkserver")  # fmt: skip
    ranks = [torch.load(reports / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]

    one: dict = {}
    monkeypatch.setattr(DrafterTrainer, "train", _recording_train(one))
    single = dataclasses.replace(recipe, out=str(tmp_path / "one"), grad_accum=WORLD, eval_per_domain=0)
    assert train_drafter.run(single) == 0

    for name, t in ranks[0]["weights"].items():
        assert torch.equal(ranks[1]["weights"][name], t), name  # DDP: one model on both ranks
        torch.testing.assert_close(t, one["weights"][name], rtol=1e-4, atol=1e-5, msg=name)
    assert all(torch.equal(ranks[0]["start"][k], v) for k, v in one["start"].items())  # one start for all
    assert any(not torch.allclose(v, one["weights"][k], atol=1e-3) for k, v in one["start"].items())

    # the same samples in the same steps: step s of the two ranks is batches 2s and 2s + 1 of the one process (the
    # data loaders may collate a batch ahead, never trained on: only the steps' batches are compared)
    assert len(one["batches"]) >= WORLD * STEPS and all(len(r["batches"]) >= STEPS for r in ranks)
    for s in range(STEPS):
        assert [ranks[r]["batches"][s] for r in range(WORLD)] == one["batches"][WORLD * s: WORLD * (s + 1)]
    seen = [{tuple(x) for b in r["batches"][:STEPS] for x in b} for r in ranks]
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == WORLD * BATCH * STEPS

    assert ranks[0].get("evaluations") == 1 and "evaluations" not in ranks[1]
    assert ranks[1]["writes"] == [] and ranks[0]["writes"], ranks[1]["writes"]  # control: rank 0's writes are seen
    out = Path(ddp.out)
    summary = json.loads((out / "train_summary.json").read_text())
    assert (summary["processes"], summary["samples_per_step"], summary["steps"]) == (WORLD, WORLD * BATCH, STEPS)
    assert "chat" in summary["eval_accept_proxy"] and summary["timings"]["train_samples_per_s"] > 0
    assert len([json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]) >= STEPS
    assert (out / "config.json").is_file() and not list(out.parent.glob(".tmp-adaflash-*"))


def test_a_launch_without_a_regeneration_cache_is_refused_before_any_work(made, tmp_path, monkeypatch):
    """Several processes must read one regeneration: without the cache file (or asked to regenerate) the launch
    stops with one error saying how to make it, before a model loads; one process with the same recipe runs."""
    _, recipe, _ = made
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(train_drafter, "_load_target", lambda *a: pytest.fail("loaded the target"))
    for changes in ({"regen_cache": None}, {"regen_cache": str(tmp_path / "absent.jsonl")}, {"regen_only": True}):
        with pytest.raises(train_drafter.RecipeError, match="--regen-cache FILE --regen-only.*launch with"):
            train_drafter.run(dataclasses.replace(recipe, out=str(tmp_path / "x"), **changes))
    monkeypatch.setenv("WORLD_SIZE", "1")
    train_drafter.check_recipe(dataclasses.replace(recipe, regen_cache=None))  # control: one process regenerates
