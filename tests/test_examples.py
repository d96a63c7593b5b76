"""Every script in `examples/` runs offline on the reference pair in its `--smoke` mode."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from script_runner import BACKGROUND, Job, start_scripts

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# script -> what its output must say
EXPECTED = {
    "quickstart.py": ["identical: True", "tau"],
    "batched_generation.py": ["identical: True", "equals plain greedy alone: True"],
    "train_with_trainer.py": ["trained 3 steps", "saved and reloaded", "identical: True"],
    "online_adaptation.py": ["update 1 -> version 1", "identical: True"],
    "export_for_sglang_vllm.py": ["reloaded export decodes like the original: True", "identical: True", "sglang.launch_server", "vllm serve"],
    "engine_gpu_check.py": ["correctness: all exact"],
    "bf16_identity.py": ["float32 control: 0 of"],
    "replay_bench.py": ["identical to plain greedy: True | rows failed: 0", "## Issue 35's table, replay, poisson:0.9",
                        "timeline c=3: decode"],
    "head_calibration.py": ["## Per draft position", "| spec_bench:translation |"],
    "fast_generate_gpu.py": ["section errors: []"],
    "online_serving_cost.py": ["online run updated: True", "outputs equal across runs: True"],
    "sampling_distribution_check.py": ["real checks pass and controls fail: True", "controls failed: 2/2"],
    "server_load_test.py": ["answered 8/8, equal to alone 8/8", "'partial_headers: 408'", "'idle: closed'", "passed: True"],
}


HELPERS = {"gpu_common.py", "engine_gpu_report.py", "replay_tables.py"}  # helper modules of the GPU scripts: imported by the scripts above, not run on their own


def test_every_example_is_covered():
    assert sorted(p.name for p in EXAMPLES.glob("*.py") if p.name not in HELPERS) == sorted(EXPECTED)


# flags beside --smoke: the engine check on a tiny pair (the reference pair runs through the engine in
# tests/test_fresh_checkout.py, `bench --reference` with engine_fixed)
EXTRA_FLAGS = {"engine_gpu_check.py": ["--tiny"], "replay_bench.py": ["--measure-cost"]}  # the GPU runs' cost path too
LONGEST = ("engine_gpu_check.py", "fast_generate_gpu.py", "sampling_distribution_check.py", "train_with_trainer.py")
# one thread each (OMP_NUM_THREADS=1): the distribution check's smoke (plain, three samplers and two controls x 100
# rows, permutation tests) took 170 s on two cores loaded by other work (at 100 engine slots it ran past 240 s)
TIMEOUTS = {"sampling_distribution_check.py": 240.0}


def smoke_jobs(scripts, root: Path) -> tuple[list[Job], dict]:
    """The `--smoke` runs of `scripts`, each in its own working directory under `root`, the longest first."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    scripts = sorted(scripts, key=lambda script: (script not in LONGEST, script))
    return [Job(script, [EXAMPLES / script, "--smoke", *EXTRA_FLAGS.get(script, [])], cwd=root / script,
                timeout=TIMEOUTS.get(script, 120.0)) for script in scripts], env  # fmt: skip


@pytest.fixture(scope="module")
def smokes(request, tmp_path_factory):
    """Every selected script's `--smoke` run, each in its own process and working directory, forked from one
    interpreter that imported torch, transformers and adaflash_hf once (tests/script_runner.py). conftest.py
    started them in the background when collection finished; started here when it did not."""
    running = BACKGROUND.get("examples")
    if running is None:
        scripts = {item.callspec.params["script"] for item in request.session.items
                   if item.module is request.module and item.originalname == "test_example_smoke"}
        root = tmp_path_factory.mktemp("smokes")
        jobs, env = smoke_jobs(scripts, root)
        running = start_scripts(jobs, env, workdir=root / "logs", parallel=2)  # two cores; pytest waits meanwhile
    return running.wait()


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_example_smoke(script, smokes):
    proc = smokes[script]
    assert proc.returncode == 0, f"{script} failed (timed out: {proc.timed_out}):\n{proc.stdout}\n{proc.stderr}"
    for words in EXPECTED[script]:
        assert words in proc.stdout, f"{script}: {words!r} missing from:\n{proc.stdout}"
    assert "Traceback" not in proc.stderr


PLOT = EXAMPLES / "reference_pair" / "plot_online_methods.py"


def background_run(root: Path):
    """The plot script's two runs (tests/conftest.py's `background` fixture), each a fresh interpreter, on the second
    core while the in-process tests run: from committed online runs, and with no run given (a usage error)."""
    logs = Path(__file__).resolve().parents[1] / "docs" / "logs"
    runs = [f"opd token={logs / 'online_gpu_v4_gsm8k_opd_token'}:opd", f"v4={logs / 'online_gpu_v4_gsm8k'}",
            f"v4={logs / 'online_gpu_v4_codealpaca'}:osd"]
    return [Job("plot", [PLOT, root / "cmp.png", *runs], cwd=root, timeout=120.0),
            Job("plot_bad", [PLOT, root / "cmp.png"], cwd=root, timeout=60.0)], dict(os.environ), ()


def test_plot_online_methods_draws_one_panel_per_dataset(background):
    """The comparison plot of BENCHMARKS section 3, from committed online runs."""
    proc = background["plot"]
    assert proc.returncode == 0, proc.stderr
    out = Path(proc.argv[1])
    assert out.read_bytes()[:4] == b"\x89PNG" and f"wrote {out}" in proc.stdout
    bad = background["plot_bad"]
    assert bad.returncode != 0 and "LABEL=RUN_DIR" in bad.stderr
