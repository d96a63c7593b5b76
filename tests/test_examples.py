"""Every script in `examples/` runs offline on the reference pair in its `--smoke` mode."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# script -> what its output must say
EXPECTED = {
    "quickstart.py": ["identical: True", "tau"],
    "batched_generation.py": ["identical: True", "equals plain greedy alone: True"],
    "train_with_trainer.py": ["trained 3 steps", "saved and reloaded", "identical: True"],
    "online_adaptation.py": ["update 1 -> version 1", "identical: True"],
    "export_for_sglang_vllm.py": ["reloaded export decodes like the original: True", "identical: True", "sglang.launch_server", "vllm serve"],
    "engine_gpu_check.py": ["correctness: all exact"],
}


def test_every_example_is_covered():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXPECTED)


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_example_smoke(script, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--smoke"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"
    for words in EXPECTED[script]:
        assert words in proc.stdout, f"{script}: {words!r} missing from:\n{proc.stdout}"
    assert "Traceback" not in proc.stderr
