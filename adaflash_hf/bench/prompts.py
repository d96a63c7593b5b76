"""The prompts of a benchmark dataset: a named eval set (`adaflash_hf.training.data`: the local data
folder, else the Hub through `datasets`, else the built-in sample with a one-line note) or ``jsonl:PATH``;
of a named set, all its records or a slice deduplicated against the training data (`training.splits`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..loading import read_jsonl


@dataclass
class PromptSet:
    """One benchmark set: its label, first-turn prompts, and each prompt's later user turns (multi-turn
    sets such as MT-bench; empty lists elsewhere). See `.multiturn` for how later turns are benchmarked."""

    label: str
    prompts: list
    later_turns: list[list[str]] = field(default_factory=list)

    @property
    def multi_turn(self) -> bool:
        return any(self.later_turns)


def load_prompts(spec: str, limit: int, data_dir, split: str = "all") -> tuple[str, list[list[dict] | str]]:
    """(label, prompts) of a dataset name or ``jsonl:PATH``: chat message lists, or raw strings
    for continuation prompts (records with a ``"text"`` field and no ``"messages"``).
    ``split``: ``"all"``, every record as listed (no deduplication); ``"validation"`` / ``"test"``: that
    slice of a named set, training duplicates removed (`training.splits.eval_split`)."""
    s = load_prompt_set(spec, limit, data_dir, split)
    return s.label, s.prompts


def load_prompt_set(spec: str, limit: int, data_dir, split: str = "all") -> PromptSet:
    """`load_prompts` with each record's later user turns (``"turns"[1:]``, e.g. MT-bench's second question).

    Example:
        >>> load_prompt_set("mt_bench", 2, None).later_turns[0]  # doctest: +SKIP
        ['Rewrite your previous response. Start every sentence with the letter A.']
    """
    if split != "all" and spec.startswith("jsonl:"):
        raise ValueError(f"--split {split} applies to named eval sets, not {spec}")
    if spec.startswith("jsonl:"):
        path = Path(spec[len("jsonl:") :])
        records = [rec for _, rec in read_jsonl(str(path), "--datasets")]
        label = path.stem
    else:
        from ..training import data as D

        label = spec.strip().lower()
        try:
            if split == "all":
                records = D.eval_prompts(spec, limit=limit, data_dir=data_dir)
            else:
                from ..training.splits import eval_split

                records = eval_split(spec, split, data_dir=data_dir)
        except D.HubUnavailable as e:
            # No local copy and no Hub (offline, not cached): the sample shipped with the package.
            domain = D.dataset_domain(label)
            records = D.builtin_prompts(domain, limit=limit)
            print(f"note: {label}: no local data folder and no Hub access ({e}); using the built-in {domain} "
                  f"sample ({len(records)} prompts)" + (f"; --split {split} not applied to it" if split != "all" else ""),
                  file=sys.stderr)
    out, later = [], []
    for i, rec in enumerate(records[:limit]):
        turns = rec.get("turns")
        later.append([str(t) for t in turns[1:]] if isinstance(turns, list) else [])
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
    return PromptSet(label, out, later)
