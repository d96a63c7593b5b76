"""Every Python snippet of README.md runs as written, in order (later snippets reuse the first one's
`target`, `tok` and `drafter`), with the Hub models swapped for the embedded reference pair, the GPU
for the CPU, absolute output paths for the working directory, and long runs shortened: `SWAPS` is the only change made to the text."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from adaflash_hf.reference import REFERENCE_DIR

README = Path(__file__).resolve().parent.parent / "README.md"
SWAPS = {
    '"Qwen/Qwen3-8B"': repr(os.path.join(REFERENCE_DIR, "target")),
    '"z-lab/Qwen3-8B-DFlash-b16"': repr(os.path.join(REFERENCE_DIR, "drafter")),
    '"cuda"': '"cpu"',
    "max_new_tokens=256": "max_new_tokens=16",
    "max_steps=100": "max_steps=1",
    "per_device_train_batch_size=8": "per_device_train_batch_size=2",
    "num_layers=5": "num_layers=1",
    '"/models/my-drafter-dflash"': '"out/my-drafter-dflash"',  # into the test's working directory, not /models
}


def python_snippets() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), flags=re.S | re.M)


def swapped(code: str) -> str:
    for old, new in SWAPS.items():
        code = code.replace(old, new)
    return code


def test_readme_has_the_snippets():
    snippets = python_snippets()
    assert len(snippets) >= 5
    assert all(any(old in s for s in snippets) for old in SWAPS)  # every swap still applies to the text


def test_readme_snippets_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # snippets write runs/, my-drafter/, out/ into the working directory
    namespace: dict = {"__name__": "readme"}
    for i, code in enumerate(python_snippets()):
        try:
            exec(compile(swapped(code), f"README.md python snippet {i + 1}", "exec"), namespace)
        except Exception as e:  # noqa: BLE001 - name the snippet that failed
            pytest.fail(f"README snippet {i + 1} failed: {type(e).__name__}: {e}\n{code}")
    out = capsys.readouterr().out
    assert "[]" not in out.splitlines()  # the online snippet's history is not empty
    assert (tmp_path / "my-drafter" / "config.json").is_file()
    assert (tmp_path / "out" / "my-drafter-dflash" / "config.json").is_file()
