"""Named evaluation datasets on the Hugging Face Hub: one table, loaded with 🤗 ``datasets``.

`adaflash_hf.training.data.eval_prompts` reads a named dataset from the local data folder
(``$ADAFLASH_DATA`` / ``shared/data``) when that folder holds the dataset's subfolder, and otherwise
from the source listed here through ``datasets.load_dataset`` (cached under ``HF_DATASETS_CACHE``;
``HF_DATASETS_OFFLINE=1`` / ``HF_HUB_OFFLINE=1`` load from that cache only). Hub columns are renamed to
the field names of the local files, so one formatting code path serves both.

Sources that are not Hub datasets (Spec-Bench, EAGLE's question sets, Tiny Shakespeare) go through
the ``json`` / ``text`` builders with the URL of the file the local copy was taken from; ``datasets``
downloads and caches them the same way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


class HubUnavailable(RuntimeError):
    """A named dataset could not be loaded through ``datasets`` (not installed, offline, not cached)."""


@dataclass(frozen=True)
class HubDataset:
    """Where one named eval dataset lives on the Hub, and how its records map to the local format.

    ``path`` is a Hub dataset id, or a ``datasets`` builder (``"json"``, ``"text"``) with
    ``data_files``; ``config`` the Hub config name; ``split`` the split read; ``text_field`` the field
    (after ``rename``) that holds the prompt text; ``rename`` maps Hub columns to the local files'
    field names; ``domain`` picks the built-in sample used when neither local data nor the Hub is
    reachable; ``local`` is the file of the local data folder holding the same kind of records.
    """

    name: str
    path: str
    split: str
    text_field: str
    domain: str
    config: str | None = None
    data_files: str | None = None
    rename: dict[str, str] = field(default_factory=dict)
    builder_kwargs: dict = field(default_factory=dict)
    local: str = ""
    note: str = ""

    def describe(self) -> str:
        where = self.path if self.data_files is None else f"{self.path}:{self.data_files}"
        return where + (f" ({self.config})" if self.config else "") + f" split={self.split}"


_RAW = "https://raw.githubusercontent.com"
EAGLE_URL = _RAW + "/SafeAILab/EAGLE/main/eagle/data/{task}/question.jsonl"

HUB_DATASETS: dict[str, HubDataset] = {
    d.name: d
    for d in (
        HubDataset("gsm8k", "openai/gsm8k", "test", "question", "math", config="main", local="gsm8k/test.jsonl"),
        HubDataset("mathqa", "allenai/math_qa", "test", "problem", "math",
                   rename={"Problem": "problem", "Rationale": "rationale", "category": "type"},
                   local="mathqa/test_1000.jsonl", note="the full test split (local: 1,000 of its 2,985)"),
        HubDataset("math500", "HuggingFaceH4/MATH-500", "test", "problem", "math", local="math500/test.jsonl"),
        HubDataset("aime2025", "MathArena/aime_2025", "train", "problem", "math", local="aime2025/aime2025.jsonl"),
        HubDataset("aime2024", "HuggingFaceH4/aime_2024", "train", "problem", "math", local="aime2024/aime2024.jsonl"),
        HubDataset("mbpp", "google-research-datasets/mbpp", "test", "prompt", "code", config="sanitized",
                   local="mbpp/sanitized-mbpp.jsonl"),
        HubDataset("humaneval", "openai/openai_humaneval", "test", "prompt", "code", local="humaneval/HumanEval.jsonl"),
        HubDataset("codealpaca", "sahil2801/CodeAlpaca-20k", "train", "instruction", "code",
                   local="codealpaca/code_alpaca_2k.jsonl", note="the 20k set (local: the official 2k file)"),
        HubDataset("sharegpt", "json", "train", "conversations", "chat",
                   data_files="hf://datasets/anon8231489123/ShareGPT_Vicuna_unfiltered/ShareGPT_V3_unfiltered_cleaned_split.json",
                   local="sharegpt/sharegpt_eval500.jsonl", note="ShareGPT V3 (local: a 500-conversation English subset)"),
        HubDataset("alpaca_eval", "json", "train", "instruction", "chat",
                   data_files="hf://datasets/tatsu-lab/alpaca_eval/alpaca_eval.json", local="alpaca_eval/alpaca_eval.jsonl"),
        HubDataset("mt_bench", "HuggingFaceH4/mt_bench_prompts", "train", "turns", "chat",
                   rename={"prompt": "turns", "prompt_id": "question_id"}, local="mt_bench/question.jsonl"),
        HubDataset("spec_bench", "json", "train", "turns", "chat",
                   data_files=_RAW + "/hemingkx/Spec-Bench/main/data/spec_bench/question.jsonl",
                   local="spec_bench/question.jsonl"),
        *(
            HubDataset(f"eagle_bench:{t}", "json", "train", "turns", dom, data_files=EAGLE_URL.format(task=t),
                       local=f"eagle_bench/{t}.jsonl")
            for t, dom in (("alpaca", "chat"), ("gsm8k", "math"), ("humaneval", "code"), ("qa", "chat"), ("sum", "chat"))
        ),
        HubDataset("prose", "text", "train", "text", "prose",
                   data_files=_RAW + "/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
                   builder_kwargs={"sample_by": "document"}, local="tinyshakespeare/input.txt",
                   note="Tiny Shakespeare only (local: 7 Gutenberg novels, Tiny Shakespeare, US speeches)"),
    )
}


def hub_load_args(spec: HubDataset) -> tuple[str, dict]:
    """(path, keyword arguments) of the ``datasets.load_dataset`` call for ``spec`` (one seam: tests
    point it at a local fixture)."""
    kwargs: dict = {"split": spec.split, **spec.builder_kwargs}
    if spec.config:
        kwargs["name"] = spec.config
    if spec.data_files:
        kwargs["data_files"] = spec.data_files
    return spec.path, kwargs


def _remote(path: str, kwargs: dict) -> bool:
    """Whether a ``load_dataset(path, **kwargs)`` call would go to the network (a Hub id or URLs)."""
    files = kwargs.get("data_files")
    if files is not None:
        return str(files).startswith(("http://", "https://", "hf://"))
    return not os.path.exists(path)


def load_hub_records(name: str) -> list[dict]:
    """The records of named dataset ``name`` read with ``datasets.load_dataset``, columns renamed to
    the local files' field names. Raises `HubUnavailable` (one line, what to do) when it cannot."""
    if name not in HUB_DATASETS:
        raise KeyError(f"no Hub source for dataset {name!r}; known: {', '.join(HUB_DATASETS)}")
    spec = HUB_DATASETS[name]
    try:
        import datasets
    except ImportError as e:
        raise HubUnavailable(f"{name}: the `datasets` library is not installed (pip install datasets)") from e
    path, kwargs = hub_load_args(spec)
    if _remote(path, kwargs):
        from ..loading import hub_offline_unless_reachable

        hub_offline_unless_reachable()  # no network: the cache only, at once, not ~20 s of retries
    try:
        ds = datasets.load_dataset(path, **kwargs)
    except Exception as e:  # offline, not cached, no network, moved upstream: all one answer
        msg = " ".join(str(e).split())[:200]
        raise HubUnavailable(f"{name}: datasets.load_dataset({spec.describe()}) failed ({type(e).__name__}: {msg})") from e
    rows = [{spec.rename.get(k, k): v for k, v in r.items()} for r in ds]
    if rows and spec.text_field not in rows[0]:
        raise HubUnavailable(f"{name}: {spec.describe()} has no {spec.text_field!r} column (got {', '.join(rows[0])})")
    return rows


__all__ = ["HubDataset", "HubUnavailable", "HUB_DATASETS", "hub_load_args", "load_hub_records"]
