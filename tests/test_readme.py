"""README.md and the docs pages it sends readers to, as a new user meets them.

* Every Python snippet of README.md, then of docs/usage.md and docs/export.md (which reuse the README's `target`,
  `tok` and `drafter`), runs as written, in order, with the Hub models swapped for the embedded reference pair, the GPU for
  the CPU, and long runs shortened: `SWAPS` is the only change made to the text.
* Every shell command of the README runs (the server's on a free port, the demo with fewer tokens), except the
  ones `NOT_RUN` names with the reason.
* The README stays a five-minute page: at most 12 KB, every link to a file in the repository, and every figure of
  its "What to expect" table a row of BENCHMARKS.md's table of current figures, word for word.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from adaflash_hf.cli import main
from adaflash_hf.reference import REFERENCE_DIR

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SNIPPET_FILES = (README, ROOT / "docs" / "usage.md", ROOT / "docs" / "export.md")
SWAPS = {
    '"Qwen/Qwen3-8B"': repr(os.path.join(REFERENCE_DIR, "target")),
    '"z-lab/Qwen3-8B-DFlash-b16"': repr(os.path.join(REFERENCE_DIR, "drafter")),
    '"cuda"': '"cpu"',
    # the reference pair's config says bfloat16, which this CPU only emulates (a training step's backward 7.4 s against
    # 0.4 s in float32); the snippets' 8B models on CUDA keep "auto"
    'dtype="auto"': 'dtype=__import__("torch").float32',
    "max_new_tokens=256": "max_new_tokens=16",
    "max_steps=100": "max_steps=1",
    "per_device_train_batch_size=8": "per_device_train_batch_size=2",
    "num_layers=5": "num_layers=1",
    '"/models/my-drafter-dflash"': '"out/my-drafter-dflash"',  # into the test's working directory, not /models
}
# README shell commands a test cannot run, and why (CI runs the install line; the suite is this test's own run).
NOT_RUN = {
    "pip install torch==2.13.0": "downloads: CI runs the install line",
    'pip install -e ".[dev]"': "downloads: CI runs the install line",
    "python -m pytest -x -q tests": "the suite this test is part of",
    "adaflash serve --target Qwen/Qwen3-8B --drafter z-lab/Qwen3-8B-DFlash-b16 --max-slots 16 --max-len 4096":
        "downloads an 8B model from the Hub",
}


def snippets(path: Path, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", path.read_text(encoding="utf-8"), flags=re.S | re.M)


def swapped(code: str) -> str:
    for old, new in SWAPS.items():
        code = code.replace(old, new)
    return code


def shell_commands() -> list[str]:
    """Each command of README's bash blocks: continuation lines joined, `&&` chains split, comments dropped."""
    out = []
    for block in snippets(README, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            out += [" ".join(c.split()) for c in line.split("&&") if c.strip()]
    return out


def test_the_snippets_and_swaps_are_there():
    code = [s for path in SNIPPET_FILES for s in snippets(path, "python")]
    assert len(snippets(README, "python")) >= 1 and len(code) >= 4
    assert all(any(old in s for s in code) for old in SWAPS)  # every swap still applies to the text


def test_snippets_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # snippets write runs/, my-drafter/, out/ into the working directory
    namespace: dict = {"__name__": "readme"}
    for path in SNIPPET_FILES:
        for i, code in enumerate(snippets(path, "python")):
            where = f"{path.relative_to(ROOT)} python snippet {i + 1}"
            try:
                exec(compile(swapped(code), where, "exec"), namespace)
            except Exception as e:  # noqa: BLE001 - name the snippet that failed
                pytest.fail(f"{where} failed: {type(e).__name__}: {e}\n{code}")
    out = capsys.readouterr().out
    assert "[]" not in out.splitlines()  # the online snippet's history is not empty
    assert (tmp_path / "my-drafter" / "config.json").is_file()
    assert (tmp_path / "out" / "my-drafter-dflash" / "config.json").is_file()


def test_every_shell_command_runs(tmp_path, capsys):
    commands = shell_commands()
    assert set(NOT_RUN) <= set(commands)
    ran = set()
    serve = "adaflash serve --port 8000"
    curl = next(c for c in commands if c.startswith("curl "))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    argv = ["timeout", "300", sys.executable, "-m", "adaflash_hf.cli", *shlex.split(serve)[1:]]
    argv[argv.index("8000")] = "0"  # a free port; the server prints the one it took
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=open(tmp_path / "serve.log", "w"), text=True, env=env)
    try:
        # `adaflash demo` (fewer tokens) here while the server starts on the other core
        assert main(["demo", "--max-new-tokens", "8"]) == 0
        assert "identical: True" in capsys.readouterr().out
        ran.add("adaflash demo")
        m = re.search(r"at (http://[\d.]+:\d+)/v1", proc.stdout.readline())
        assert m, (tmp_path / "serve.log").read_text()[-3000:]
        answer = subprocess.run(shlex.split(curl.replace("http://127.0.0.1:8000", m.group(1))), capture_output=True,
                                text=True, timeout=120)
        assert answer.returncode == 0 and answer.stdout.rstrip().endswith("data: [DONE]"), answer.stdout[-500:]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    ran |= {serve, curl}
    assert ran | set(NOT_RUN) == set(commands)  # a new command in the README needs running here, or a reason


def test_readme_is_short_and_links_only_to_files_in_the_repository():
    text = README.read_text(encoding="utf-8")
    assert len(text.encode()) <= 12 * 1024
    assert "SPEC" not in text and "shared/" not in text
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert links
    for link in links:
        assert link.startswith("http") or (ROOT / link).exists(), link
    # The pages it sends readers to link to files that exist too (the history page names the commit its old logs
    # live at), and every log BENCHMARKS.md cites is in the tree.
    for page in [ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md")]:
        if page.name == "benchmarks_history.md":
            continue
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            assert link.startswith("http") or (page.parent / link).exists(), (page.name, link)
    logs = ROOT / "docs" / "logs"
    for name, options, rest in re.findall(r"docs/logs/([\w.\-]*)(?:\{([^}]*)\})?([\w.\-]*)", (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")):
        for entry in [name + o + rest for o in options.split(",")] if options else [name + rest]:
            assert any(p.name.startswith(entry) for p in logs.iterdir()), entry  # `NAME*` globs too


def test_readme_figures_are_benchmarks_current_figures():
    text = README.read_text(encoding="utf-8")
    table = text.split("## What to expect", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith(("| what", "|---"))]
    assert len(rows) >= 3
    bench = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    current = bench.split("## Current figures", 1)[1].split("\n## ", 1)[0]
    for row in rows:
        what, figure = [c.strip() for c in row.strip("|").split("|")]
        assert f"| {what} | {figure} |" in current, row
