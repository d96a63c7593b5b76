"""Named datasets through 🤗 `datasets` (CPU, seconds, never the network).

Each entry of `hub_datasets.HUB_DATASETS` is loaded by `eval_prompts` from a data folder that lacks
its subfolder, so it goes through `datasets.load_dataset`; `hub_load_args` (the one seam) is pointed
at a tiny fixture written in tmp_path with the Hub's column names, keeping the entry's split and
builder options. Also: the built-in sample, and `adaflash bench --reference` with an empty data
folder and no network (the built-in sample, one-line note).
"""

from __future__ import annotations

import json
import socket
import tomllib
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")

from adaflash_hf.training import data as D  # noqa: E402
from adaflash_hf.training import hub_datasets as H  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# One record per entry, with the columns of its Hub source (before `rename`).
_TURNS = {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now another."], "reference": []}
HUB_ROWS = {
    "gsm8k": {"question": "Tom has 2 apples and buys 3. How many?", "answer": "2+3=<<2+3=5>>5\n#### 5"},
    "mathqa": {"Problem": "what is 10 % of 50 ?", "Rationale": '"10 / 100 * 50 = 5 answer : b"', "options": "a ) 4 , b ) 5",
               "correct": "b", "annotated_formula": "", "linear_formula": "", "category": "gain"},
    "math500": {"problem": "Compute $1+1$.", "solution": "$\\boxed{2}$", "answer": "2", "subject": "Algebra", "level": 1,
                "unique_id": "test/algebra/1.json"},
    "aime2025": {"problem_idx": 1, "problem": "Find the sum of all integer bases b > 9.", "answer": 70},
    "aime2024": {"id": 60, "problem": "Every morning Aya goes for a walk.", "solution": "...", "answer": "204",
                 "url": "https://example.invalid", "year": "2024"},
    "mbpp": {"source_file": "x.py", "task_id": 11, "prompt": "Write a function to remove a character.",
             "code": "def f(s):\n    return s", "test_imports": [], "test_list": ["assert f('a') == 'a'"]},
    "humaneval": {"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Add.\"\"\"\n",
                  "canonical_solution": "    return a + b\n", "test": "", "entry_point": "add"},
    "codealpaca": {"instruction": "Reverse a list in Python.", "input": "[1, 2]", "output": "x[::-1]"},
    "sharegpt": {"id": "abc", "conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello!"}]},
    "alpaca_eval": {"instruction": "Name three colours.", "output": "Red, green, blue.", "generator": "g", "dataset": "helpful_base"},
    "mt_bench": {"prompt": ["Write a haiku.", "Now another."], "prompt_id": 81, "category": "writing", "reference": []},
    "spec_bench": _TURNS,
    **{f"eagle_bench:{t}": _TURNS for t in D.EAGLE_TASKS},
}
PROSE_TEXT = "\n\n".join(f"Paragraph {i}: " + "the quick brown fox jumps over the lazy dog. " * 8 for i in range(60))


@pytest.fixture
def hub_fixture(tmp_path, monkeypatch):
    """Point `hub_load_args` at local fixture files (json / text builders), record the calls, and cut
    the network off."""
    calls = []
    real = H.hub_load_args

    def fake(spec):
        path, kwargs = real(spec)
        calls.append((spec.name, path, dict(kwargs)))
        kwargs = {k: v for k, v in kwargs.items() if k not in ("name", "data_files")}
        split = kwargs["split"]
        if spec.path == "text":
            f = tmp_path / "prose.txt"
            f.write_text(PROSE_TEXT, encoding="utf-8")
            return "text", {**kwargs, "data_files": {split: str(f)}, "cache_dir": str(tmp_path / "cache")}
        f = tmp_path / f"{spec.name.replace(':', '_')}.jsonl"
        f.write_text(json.dumps(HUB_ROWS[spec.name]) + "\n", encoding="utf-8")
        return "json", {**kwargs, "data_files": {split: str(f)}, "cache_dir": str(tmp_path / "cache")}

    monkeypatch.setattr(H, "hub_load_args", fake)
    _no_network(monkeypatch)
    empty = tmp_path / "data"
    empty.mkdir()
    return empty, calls


def _no_network(monkeypatch):
    def refuse(*a, **k):
        raise OSError("network disabled in tests")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_every_named_dataset_has_one_entry():
    names = set(D.EVAL_DATASETS) - {"blend", "eagle_bench"}
    assert names <= set(H.HUB_DATASETS)
    assert set(HUB_ROWS) | {"prose"} == set(H.HUB_DATASETS)
    for spec in H.HUB_DATASETS.values():
        assert spec.path and spec.split and spec.text_field and spec.domain in D.BUILTIN_DOMAINS
        assert "/" in spec.local  # the local file holding the same records (folder/file)


@pytest.mark.parametrize("name", sorted(set(HUB_ROWS)))
def test_named_dataset_loads_through_datasets(name, hub_fixture):
    empty, calls = hub_fixture
    spec = H.HUB_DATASETS[name]
    rows = D.eval_prompts(name, data_dir=empty)
    assert [c[0] for c in calls] == [name]
    _, path, kwargs = calls[0]
    assert path == spec.path and kwargs["split"] == spec.split and kwargs.get("name") == spec.config
    assert len(rows) == 1
    raw = HUB_ROWS[name]
    hub_col = {v: k for k, v in spec.rename.items()}.get(spec.text_field, spec.text_field)
    expected = raw[hub_col]
    if spec.text_field == "turns":
        expected = expected[0]
    elif spec.text_field == "conversations":
        expected = expected[0]["value"]
    content = rows[0]["messages"][0]["content"]
    assert content.strip() and expected.strip().split("\n")[0] in content
    assert rows[0]["dataset"] == name.split(":")[0]


def test_mapping_fields_reach_the_records(hub_fixture):
    empty, _ = hub_fixture
    assert D.eval_prompts("gsm8k", data_dir=empty)[0]["reference"] == "5"
    mq = D.eval_prompts("mathqa", data_dir=empty)[0]
    assert mq["reference"] == "b" and mq["category"] == "gain" and "Options: a ) 4" in mq["messages"][0]["content"]
    mt = D.eval_prompts("mt_bench", data_dir=empty)[0]
    assert mt["turns"] == ["Write a haiku.", "Now another."] and mt["question_id"] == 81 and mt["reference"] is None
    assert D.eval_prompts("aime2025", data_dir=empty)[0]["reference"] == "70"
    assert D.eval_prompts("sharegpt", data_dir=empty)[0]["reference"] == "Hello!"


def test_prose_loads_through_datasets(hub_fixture):
    empty, calls = hub_fixture
    rows = D.eval_prompts("prose", data_dir=empty)
    assert calls and calls[0][1] == "text" and calls[0][2]["sample_by"] == "document"
    assert rows and all(r["text"] and r["reference"] for r in rows)


def test_blend_and_eagle_bench_through_datasets(hub_fixture):
    empty, calls = hub_fixture
    blend = D.eval_prompts("blend", data_dir=empty)
    assert [r["source"] for r in blend] == list(D.BLEND_PARTS)
    eagle = D.eval_prompts("eagle_bench", data_dir=empty)
    assert [r["task"] for r in eagle] == list(D.EAGLE_TASKS)


def test_local_folder_wins_over_the_hub(tmp_path, monkeypatch):
    """A data folder holding the dataset's subfolder is read as before; the Hub is never asked."""
    monkeypatch.setattr(H, "hub_load_args", lambda spec: pytest.fail("the Hub was asked"))
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text(json.dumps({"question": "Q?", "answer": "#### 7"}) + "\n")
    monkeypatch.setenv(D.ENV_VAR, str(tmp_path))
    assert D.eval_prompts("gsm8k")[0]["reference"] == "7"


def test_no_data_folder_means_the_hub(tmp_path, monkeypatch):
    monkeypatch.delenv(D.ENV_VAR, raising=False)
    monkeypatch.setattr(D, "_repo_root", lambda: None)
    monkeypatch.chdir(tmp_path)
    assert D.local_data_dir() is None
    with pytest.raises(FileNotFoundError):  # a folder asked for explicitly must exist
        D.local_data_dir(tmp_path / "nowhere")


def test_offline_without_cache_is_hub_unavailable(tmp_path, monkeypatch):
    _no_network(monkeypatch)

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach the Hub (offline mode is enabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(D.HubUnavailable, match="gsm8k.*openai/gsm8k"):
        D.eval_prompts("gsm8k", data_dir=tmp_path)


def test_builtin_sample_ships_with_the_package():
    total = 0
    for domain in D.BUILTIN_DOMAINS:
        rows = D.builtin_prompts(domain)
        assert len(rows) == 8
        for r in rows:
            assert r["dataset"] == f"builtin:{domain}" and r["source"]
            assert (r["text"] if domain == "prose" else r["messages"][0]["content"]).strip()
        total += (D.BUILTIN_DIR / f"{domain}.jsonl").stat().st_size
    assert total < 16_000
    assert (D.BUILTIN_DIR / "README.md").is_file()
    assert [r["dataset"] for r in D.builtin_prompts("blend", limit=3)] == ["builtin:math", "builtin:code", "builtin:chat"]
    assert D.builtin_prompts("mbpp", limit=1)[0]["dataset"] == "builtin:code"
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert any("datasets" in d for d in data["project"]["dependencies"])
    assert "builtin_prompts/*.jsonl" in data["tool"]["setuptools"]["package-data"]["adaflash_hf.training"]


def test_bench_reference_runs_offline_with_an_empty_data_folder(tmp_path, monkeypatch, capsys):
    """`adaflash bench --reference --num-prompts 1 --max-new-tokens 4 --methods plain` with an empty
    ADAFLASH_DATA and no network: the default dataset (gsm8k) falls back to the built-in sample."""
    from adaflash_hf.cli import main

    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv(D.ENV_VAR, str(empty))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache", raising=False)
    _no_network(monkeypatch)
    rc = main(["bench", "--reference", "--num-prompts", "1", "--max-new-tokens", "4", "--methods", "plain",
               "--device", "cpu", "--threads", "1"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    notes = [line for line in err.splitlines() if line.startswith("note: gsm8k")]
    assert len(notes) == 1 and "built-in math sample" in notes[0]
