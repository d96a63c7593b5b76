"""`adaflash` CLI: help of every subcommand, one-line errors for user mistakes, info / export / demo / generate / adapt.

Everything runs in-process through `adaflash_hf.cli.main(argv)` (it returns the exit status).
Checkpoints for `info` / `export` are tiny ones written into a temporary folder with the library's
own save / export code; `demo`, `generate` and `adapt` use the embedded reference pair.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import build_drafter, build_tiny_target

from adaflash_hf import AdaFlashDrafter, export_dflash
from adaflash_hf.modeling import write_dflash_checkpoint
from adaflash_hf.cli import main
from adaflash_hf.modeling.checkpoint_layouts import is_dflash_layout
from adaflash_hf.reference import REFERENCE_DIR

SUBCOMMANDS = ("demo", "generate", "bench", "train", "adapt", "serve", "export", "info")


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Tiny checkpoints: a target (not a drafter), and drafters in the native, DFlash and AdaFlash layouts."""
    root = tmp_path_factory.mktemp("ckpts")
    target = build_tiny_target("qwen3", seed=1)
    target.save_pretrained(root / "target")
    with_head = build_drafter(target, num_layers=2, block_size=8, seed=2)
    with_head.save_pretrained(root / "native")
    no_head = build_drafter(target, num_layers=1, block_size=8, seed=3, use_length_head=False)
    export_dflash(no_head, str(root / "dflash"))
    # The released AdaFlash layout (head at the top level); export_dflash puts the head in length_head/.
    write_dflash_checkpoint(with_head, str(root / "adaflash"), dtype=None, head_layout="released")
    (root / "nonempty").mkdir()
    (root / "nonempty" / "keep.txt").write_text("x")
    (root / "noconfig").mkdir()
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"prompt": "Tell me a story.", "domain": "chat"}\n{"messages": [{"role": "user", "content": "Hi"}]}\n')
    (root / "bad.jsonl").write_text('{"prompt": "ok"}\nnot json\n')
    return {
        "root": root,
        "target_model": target,
        "with_head": with_head,
        "no_head": no_head,
        **{k: str(root / k) for k in ("target", "native", "dflash", "adaflash", "nonempty", "noconfig")},
        "prompts": str(prompts),
        "bad_prompts": str(root / "bad.jsonl"),
        "missing": str(root / "does-not-exist"),
    }


def run(argv, capsys):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


# ----------------------------------------------------------------------------- help
@pytest.mark.parametrize("command", [None, *SUBCOMMANDS])
def test_help(command, capsys):
    argv = ["--help"] if command is None else [command, "--help"]
    rc, out, err = run(argv, capsys)
    assert rc == 0, err
    prog = "adaflash" if command is None else f"adaflash {command}"
    assert f"usage: {prog}" in out
    if command is None:
        for name in SUBCOMMANDS:
            assert name in out
    else:
        assert len(out.splitlines()) > 5  # a description and the flags, not just usage
    assert "Traceback" not in out + err


@pytest.mark.parametrize("command", [None, *SUBCOMMANDS])
def test_help_is_fast_without_torch(command):
    """`adaflash --help` and every command's `--help` import neither torch nor transformers: `python -X importtime` lists every module imported."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    argv = [sys.executable, "-X", "importtime", "-m", "adaflash_hf.cli", *([command] if command else []), "--help"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage: adaflash" in proc.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & {"torch", "transformers"}


def test_serve_length_policies_are_the_engines():
    import argparse

    from adaflash_hf.cli.serve import add_arguments
    from adaflash_hf.engine import Engine, round_layout  # noqa: F401 - the engine resolves the same names
    from adaflash_hf.speculation.length.names import ENGINE_POLICIES, POLICY_NAMES

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert set(ENGINE_POLICIES) <= set(POLICY_NAMES)
    for name in ENGINE_POLICIES:
        assert p.parse_args(["--length-policy", name]).length_policy == name
    assert p.parse_args([]).length_policy is None and not p.parse_args([]).plain


class _On:
    """A stand-in drafter whose parameters live on ``device`` (no GPU needed to test the choice)."""

    def __init__(self, device):
        self.device = torch.device(device)

    def parameters(self):
        yield self  # what online_config reads of a parameter: its .device


@pytest.mark.parametrize("flags,device,expected", [
    ([], "cpu", "thread"),                            # serve's default, auto: a thread on the CPU
    ([], "cuda", "process"),                          # ... a child process on CUDA
    ([], None, "thread"),                             # the flags' own check, before any model loads
    (["--trainer", "thread"], "cuda", "thread"),      # asked for: kept
    (["--trainer", "process"], "cpu", "process"),
])
def test_serve_trainer_auto_follows_the_drafters_device(flags, device, expected):
    import argparse

    from adaflash_hf.cli.online_args import online_config
    from adaflash_hf.cli.serve import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--online", *flags])
    assert online_config(args, None if device is None else _On(device)).trainer == expected


@pytest.mark.parametrize("command", ["serve", "adapt"])
def test_a_trainer_process_without_room_in_dev_shm_is_one_line(command, ckpts, capsys, monkeypatch, tmp_path):
    import adaflash_hf.online.trainer_process as tp

    monkeypatch.setattr(tp, "_SHM", str(tmp_path))
    monkeypatch.setattr(tp.os, "statvfs", lambda path: os.statvfs_result((4096, 1, 0, 0, 4096, 0, 0, 0, 0, 255)))
    extra = ["--online", "--port", "0"] if command == "serve" else ["--prompts-file", ckpts["prompts"]]
    rc, out, err = run([command, "--reference", "--trainer", "process", "--output-dir", str(tmp_path / "out"), *extra],
                       capsys)
    assert rc == 2, (out, err)
    last = err.strip().splitlines()[-1]
    assert last.startswith("adaflash: error: the online trainer process needs") and "GiB free" in last, last
    assert "(hint: --trainer thread" in last and "Traceback" not in err


def test_no_command_prints_help(capsys):
    rc, out, _ = run([], capsys)
    assert rc == 0 and "usage: adaflash" in out


# ----------------------------------------------------------------------------- user errors
def _error_cases(c):
    """(argv, words the one-line message must contain); no case loads a model."""
    return {
        "unknown-subcommand": (["frobnicate"], ["invalid choice", "frobnicate"]),
        "info-missing-path": (["info", c["missing"]], ["not found", c["missing"]]),
        "info-not-a-drafter": (["info", c["target"]], ["not a drafter checkpoint", "qwen3"]),
        "info-no-config": (["info", c["noconfig"]], ["no config.json"]),
        "export-missing-path": (["export", c["missing"], os.path.join(c["root"], "exp-a")], ["not found"]),
        "export-not-a-drafter": (["export", c["target"], os.path.join(c["root"], "exp-b")], ["not a drafter checkpoint"]),
        "export-non-empty-dir": (["export", c["native"], c["nonempty"]], ["not empty", c["nonempty"]]),
        "generate-missing-target": (["generate", "--target", c["missing"], "--drafter", c["native"], "--prompt", "hi"], ["--target", "not found"]),
        "generate-missing-drafter": (["generate", "--target", c["target"], "--drafter", c["missing"], "--prompt", "hi"], ["--drafter", "not found"]),
        "generate-not-a-drafter": (["generate", "--target", c["target"], "--drafter", c["target"], "--prompt", "hi"], ["--drafter", "not a drafter checkpoint"]),
        "generate-drafter-as-target": (["generate", "--target", c["native"], "--drafter", c["native"], "--prompt", "hi"], ["--target", "is a drafter checkpoint"]),
        "generate-bad-length-policy": (["generate", "--reference", "--prompt", "hi", "--length-policy", "sometimes"], ["--length-policy", "sometimes"]),
        "generate-missing-prompts-file": (["generate", "--reference", "--prompts-file", c["missing"] + ".jsonl"], ["prompts file not found"]),
        "generate-bad-prompts-file": (["generate", "--reference", "--prompts-file", c["bad_prompts"]], ["bad.jsonl:2", "not valid JSON"]),
        "generate-no-prompt": (["generate", "--reference"], ["no prompt"]),
        "generate-check-with-sampling": (["generate", "--reference", "--prompt", "hi", "--check", "--temperature", "0.7"], ["--check", "--temperature"]),
        "generate-no-drafter-and-drafter": (["generate", "--target", c["target"], "--drafter", c["native"], "--no-drafter", "--prompt", "hi"], ["--no-drafter", "--drafter"]),
        "generate-top-p-when-greedy": (["generate", "--reference", "--prompt", "hi", "--top-p", "0.9"], ["--top-p", "greedy"]),
        "generate-length-policy-without-drafter": (["generate", "--reference", "--prompt", "hi", "--no-drafter", "--length-policy", "fixed"], ["--length-policy", "--no-drafter"]),
        "export-reference-and-drafter": (["export", c["native"], os.path.join(c["root"], "exp-c"), "--reference"], ["--reference", "not both"]),
        "info-no-checkpoint": (["info"], ["no checkpoint"]),
        "info-reference-and-checkpoint": (["info", c["native"], "--reference"], ["--reference", "not both"]),
        "generate-bad-top-p": (["generate", "--reference", "--prompt", "hi", "--top-p", "1.5"], ["--top-p", "1.5"]),
        "generate-no-target": (["generate", "--prompt", "hi"], ["no target"]),
        "generate-reference-and-target": (["generate", "--reference", "--target", c["target"], "--prompt", "hi"], ["--reference", "not both"]),
        "demo-bad-length-policy": (["demo", "--length-policy", "sometimes"], ["--length-policy"]),
        "demo-zero-tokens": (["demo", "--max-new-tokens", "0"], ["--max-new-tokens", "positive integer"]),
        "bench-missing-target": (["bench", "--target", c["missing"]], ["--target", "not found"]),
        "bench-unknown-dataset": (["bench", "--reference", "--datasets", "nosuchset"], ["unknown dataset", "nosuchset"]),
        "bench-missing-jsonl": (["bench", "--reference", "--datasets", "jsonl:" + c["missing"]], ["prompts file not found"]),
        "bench-missing-data": (["bench", "--reference", "--datasets", "gsm8k", "--data-dir", c["missing"]], ["data folder not found"]),
        "bench-unknown-method": (["bench", "--reference", "--methods", "plain,warp"], ["unknown method", "warp"]),
        "train-missing-target": (["train", "--target", c["missing"], "--out", os.path.join(c["root"], "tr")], ["--target", "not found"]),
        "train-drafter-as-target": (["train", "--target", c["native"], "--out", os.path.join(c["root"], "tr")], ["is a drafter checkpoint"]),
        "train-missing-required": (["train", "--reference"], ["required", "--out"]),
        "train-bad-flag-value": (["train", "--reference", "--out", os.path.join(c["root"], "tr"), "--steps", "many"], ["--steps", "many"]),
        "train-unknown-domain": (["train", "--reference", "--out", os.path.join(c["root"], "tr"), "--domains", "poetry"], ["unknown domain", "poetry"]),
        "train-missing-data": (["train", "--reference", "--out", os.path.join(c["root"], "tr"), "--data", c["missing"]], ["data folder not found"]),
        "adapt-missing-prompts-file": (["adapt", "--reference", "--prompts-file", c["missing"] + ".jsonl", "--output-dir", os.path.join(c["root"], "o")], ["prompts file not found"]),
        "adapt-missing-output-dir": (["adapt", "--reference", "--prompts-file", c["prompts"]], ["required", "--output-dir"]),
        "adapt-bad-length-policy": (["adapt", "--reference", "--prompts-file", c["prompts"], "--output-dir", os.path.join(c["root"], "o"), "--length-policy", "x"], ["--length-policy"]),
        "adapt-bad-hub-repo": (["adapt", "--reference", "--prompts-file", c["prompts"], "--output-dir", os.path.join(c["root"], "o"), "--hub-repo", "no-slash"], ["--hub-repo", "org/name"]),
        "adapt-bad-method": (["adapt", "--reference", "--prompts-file", c["prompts"], "--output-dir", os.path.join(c["root"], "o"), "--method", "magic"], ["--method", "magic"]),
    }  # fmt: skip


ERROR_CASES = sorted(_error_cases({k: "" for k in ("root", "missing", "target", "native", "nonempty", "noconfig", "prompts", "bad_prompts")}))


@pytest.mark.parametrize("case", ERROR_CASES)
def test_user_error_is_one_line(case, ckpts, capsys):
    argv, words = _error_cases(ckpts)[case]
    rc, out, err = run(argv, capsys)
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("adaflash: error: ") and "(hint: " in line, line
    for w in words:
        assert w in line, (w, line)
    assert "Traceback" not in out + err


def test_drafter_that_does_not_fit_the_target(ckpts, capsys):
    """Loading happens here (messages of the loaders may precede it), but the error is still one line, no traceback."""
    ref_target = os.path.join(REFERENCE_DIR, "target")
    rc, out, err = run(["generate", "--target", ref_target, "--drafter", ckpts["native"], "--prompt", "hi"], capsys)
    assert rc == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("adaflash: error:") and "does not fit the target" in last
    assert "Traceback" not in err


def test_internal_errors_keep_their_traceback(monkeypatch):
    """Only user mistakes become one-line errors: a bug inside a command propagates."""
    import adaflash_hf.cli as cli
    import adaflash_hf.cli.info

    def boom(args):
        raise RuntimeError("internal bug")

    monkeypatch.setattr(adaflash_hf.cli.info, "run", boom)
    with pytest.raises(RuntimeError, match="internal bug"):
        cli.main(["info", "anything"])


# ----------------------------------------------------------------------------- info
def _info(path, capsys, *extra):
    rc, out, err = run(["info", path, "--json", *extra], capsys)
    assert rc == 0, err
    return json.loads(out)


@pytest.mark.parametrize(
    "name, layout, drafter_key, head, trained",
    [("native", "native", "with_head", True, False), ("dflash", "DFlash", "no_head", False, None), ("adaflash", "AdaFlash", "with_head", True, True)],
)
def test_info_reports_layout_and_fields(name, layout, drafter_key, head, trained, ckpts, capsys):
    info = _info(ckpts[name], capsys)
    drafter, target = ckpts[drafter_key], ckpts["target_model"]
    cfg = drafter.config
    assert info["layout"] == layout
    assert info["target"] == {
        "num_target_layers": target.config.num_hidden_layers,
        "hidden_size": target.config.hidden_size,
        "vocab_size": target.config.vocab_size,
    }
    assert info["target_layer_ids"] == list(cfg.target_layer_ids)
    assert info["block_size"] == cfg.block_size == 8
    assert info["mask_token_id"] == cfg.mask_token_id
    assert info["drafter"]["num_hidden_layers"] == cfg.num_hidden_layers
    assert info["length_head"]["present"] is head
    assert info["length_head"]["in_weights"] is head
    assert info["length_head"]["trained"] is trained  # exported AdaFlash heads are the released, trained kind
    assert info["parameters"] == sum(p.numel() for p in drafter.parameters())
    assert info["weights"]["status"] == "match the config"
    # The text form carries the same facts.
    rc, out, _ = run(["info", ckpts[name]], capsys)
    assert rc == 0
    assert "layout" in out and layout in out and str(list(cfg.target_layer_ids)) in out
    assert f"{info['parameters']:,}" in out


def test_info_reads_no_weights(ckpts, capsys, monkeypatch):
    """`info` works from config.json + safetensors headers: loading tensors is never needed."""
    import safetensors

    def no_tensors(*a, **k):
        raise AssertionError("info must not load tensors")

    monkeypatch.setattr(AdaFlashDrafter, "from_pretrained", no_tensors)
    monkeypatch.setattr(safetensors.safe_open, "get_tensor", no_tensors, raising=False)
    assert _info(ckpts["adaflash"], capsys)["layout"] == "AdaFlash"


def test_info_fit_against_a_target(ckpts, capsys):
    assert _info(ckpts["native"], capsys, "--target", ckpts["target"])["fits"]["ok"] is True
    rc, out, _ = run(["info", ckpts["native"], "--target", os.path.join(REFERENCE_DIR, "target")], capsys)
    assert rc == 1 and "NO:" in out and "hidden_size" in out


def test_info_on_the_reference_drafter(capsys):
    folder = os.path.join(REFERENCE_DIR, "drafter")
    info = _info(folder, capsys)
    assert info["layout"] == "native"
    with open(os.path.join(folder, "config.json")) as f:
        assert info["target_layer_ids"] == json.load(f)["target_layer_ids"]
    assert info["length_head"] == {"present": True, "in_weights": True, "trained": True, "dim": 256}


def test_info_reference_checks_the_pair(capsys):
    rc, out, _ = run(["info", "--reference"], capsys)
    assert rc == 0 and "fits --target" in out and "yes" in out
    assert "15 draft tokens + 1 bonus token" in out


# ----------------------------------------------------------------------------- export
def test_export_writes_a_loadable_dflash_checkpoint(ckpts, tmp_path, capsys):
    out_dir = tmp_path / "served"
    rc, out, err = run(["export", ckpts["native"], out_dir, "--target", "Qwen/Qwen3-8B", "--tp", "2"], capsys)
    assert rc == 0, err
    config = json.loads((out_dir / "config.json").read_text())
    assert is_dflash_layout(config) and config["architectures"] == ["DFlashDraftModel"]
    assert (out_dir / "length_head" / "config.json").exists()  # the head travels beside the engines' files
    loaded = AdaFlashDrafter.from_pretrained(str(out_dir))
    original = ckpts["with_head"].state_dict()
    written = getattr(torch, config["torch_dtype"])  # bf16 unless --dtype says otherwise
    for k, v in loaded.state_dict().items():
        assert torch.equal(v.float(), original[k].to(written).float()), k
    assert "sglang.launch_server --model-path Qwen/Qwen3-8B --speculative-algorithm DFLASH" in out
    assert f"--speculative-draft-model-path {out_dir}" in out and "--tp-size 2" in out
    assert "vllm serve Qwen/Qwen3-8B --speculative-config" in out and '"method": "dflash"' in out
    # And `info` recognises what export wrote (DFlash for the engines; the head is in length_head/).
    assert _info(str(out_dir), capsys)["layout"] == "DFlash"


def test_export_into_existing_empty_dir_and_dtype(ckpts, tmp_path, capsys):
    out_dir = tmp_path / "empty"
    out_dir.mkdir()
    rc, out, err = run(["export", ckpts["dflash"], out_dir, "--dtype", "bf16"], capsys)
    assert rc == 0, err
    assert "<target-model>" in out
    info = _info(str(out_dir), capsys)
    assert info["layout"] == "DFlash" and info["weights"]["dtypes"] == ["BF16"]


# ----------------------------------------------------------------------------- demo / generate / adapt (reference pair)
def test_demo_runs_and_is_lossless(capsys):
    rc, out, err = run(["demo", "--max-new-tokens", "8"], capsys)
    assert rc == 0, err
    assert "identical: True" in out
    assert out.count("identical to plain greedy: True") == 3
    for words in ("tau", "verify lengths chosen", "speedup over plain decoding, measured in this run"):
        assert words in out


def test_generate_with_stats_and_check(tmp_path, capsys):
    out_file = tmp_path / "out.jsonl"
    rc, out, err = run(
        ["generate", "--reference", "--prompt", "What is 2+2?", "--prompt", "Hi", "--batch-size", "2",
         "--max-new-tokens", "8", "--stats", "--check", "--output", out_file], capsys,
    )  # fmt: skip
    assert rc == 0, err
    assert out.count("identical to plain greedy: True") == 2
    assert "[stats]" in out and "tau" in out
    summary = json.loads(err.split("[stats] ", 1)[1].splitlines()[0])
    assert summary["prompts"] == 2 and summary["tau"] >= 1.0
    records = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert len(records) == 2 and all(r["identical_to_plain"] for r in records)


def test_adapt_writes_versions_and_reports_tau(ckpts, tmp_path, capsys):
    out_dir = tmp_path / "online"
    rc, out, err = run(
        ["adapt", "--reference", "--prompts-file", ckpts["prompts"], "--output-dir", out_dir, "--samples-per-update", "4",
         "--epochs", "1", "--max-new-tokens", "12", "--wait", "--flush"], capsys,
    )  # fmt: skip
    assert rc == 0, err
    assert "| update | version |" in out and "tau before" in out
    assert (out_dir / "LATEST").is_file()
    latest = out_dir / (out_dir / "LATEST").read_text().strip()
    assert AdaFlashDrafter.from_pretrained(str(latest)).config.model_type == "adaflash"
