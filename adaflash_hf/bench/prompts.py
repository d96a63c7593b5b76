"""The prompts of a benchmark dataset: a named eval set (`adaflash_hf.training.data`) or ``jsonl:PATH``."""

from __future__ import annotations

from pathlib import Path

from ..loading import read_jsonl


def load_prompts(spec: str, limit: int, data_dir) -> tuple[str, list[list[dict] | str]]:
    """(label, prompts) of a dataset name or ``jsonl:PATH``: chat message lists, or raw strings
    for continuation prompts (records with a ``"text"`` field and no ``"messages"``)."""
    if spec.startswith("jsonl:"):
        path = Path(spec[len("jsonl:") :])
        records = [rec for _, rec in read_jsonl(str(path), "--datasets")]
        label = path.stem
    else:
        from ..training.data import eval_prompts

        records = eval_prompts(spec, limit=limit, data_dir=data_dir)
        label = spec.strip().lower()
    out = []
    for i, rec in enumerate(records[:limit]):
        if isinstance(rec.get("messages"), list):
            out.append(rec["messages"])
        elif isinstance(rec.get("prompt"), str):
            out.append([{"role": "user", "content": rec["prompt"]}])
        elif isinstance(rec.get("text"), str):
            out.append(rec["text"])
        else:
            raise ValueError(f"{spec}: record {i} has no 'prompt' string, 'messages' list or 'text' string")
    if not out:
        raise ValueError(f"{spec}: no prompts")
    return label, out
