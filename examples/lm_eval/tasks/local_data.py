"""The two tasks' documents from the local data folder (``$ADAFLASH_DATA`` or ``../shared/data``): lm-eval's
``custom_dataset`` hook, so nothing is fetched from the Hub. MathQA's choices are lm-eval's own ``doc_to_choice``."""

from __future__ import annotations

import datasets
from lm_eval.tasks.mathqa.utils import doc_to_choice  # noqa: F401 - the task file names it

from adaflash_hf.training.data import data_dir, load_jsonl


def _split(rows: list[dict]) -> datasets.Dataset:
    return datasets.Dataset.from_list(rows)


def gsm8k(**kwargs) -> datasets.DatasetDict:
    """gsm8k's test problems (``train`` for the few-shot examples), as ``question`` / ``answer``."""
    root = data_dir() / "gsm8k"
    return datasets.DatasetDict({s: _split(load_jsonl(root / f"{s}.jsonl")) for s in ("train", "test")})


def mathqa(**kwargs) -> datasets.DatasetDict:
    """The MathQA test sample with lm-eval's field names (``Problem``, ``options``, ``correct``)."""
    rows = load_jsonl(data_dir() / "mathqa" / "test_1000.jsonl")
    return datasets.DatasetDict({"test": _split([{"Problem": r["problem"], "options": r["options"],
                                                  "correct": r["correct"]} for r in rows])})
