"""Validation and test slices of the eval sets, deduplicated against the training data.

Every eval set (`data.eval_prompts`) has two slices: ``validation`` (for choosing recipes,
checkpoints and length rates) and ``test`` (reported once per shipped model). Both hold only the
records that are neither an exact nor a near duplicate of a training prompt:

* the training prompts are every user turn of every training sample of the math, code and chat
  domains (`data.chat_samples(d, "train")`, i.e. `data.TRAIN_SOURCES`). The reference target was
  pretrained on exactly these sources (`examples/research/pretokenize.py` renders `chat_samples(d, "train")` of every
  domain) and the drafter regenerates its answers from prompts of the same samples, so one set
  covers both. Prose chunks are left out: they are continuation text, not prompts, and no eval set
  dedup'd here is a prose set;
* normalisation: Unicode NFKC, lowercase, whitespace runs collapsed to one space, stripped;
* exact duplicate: the normalised prompt equals a normalised training prompt;
* near duplicate: Jaccard similarity >= `NEAR_JACCARD` between the sets of word `SHINGLE_WORDS`-gram
  shingles of the eval prompt and of some training prompt (a text shorter than that many words is
  one shingle). An inverted index (shingle -> training prompts) means each eval prompt is scored
  only against the training prompts that share a shingle with it.

The slice rule: a record goes to ``validation`` when the first 8 hex digits of sha256(normalised
prompt) are even, else ``test``. It depends on the prompt alone, so adding records to a file never
moves an existing record from one slice to the other, and both slices are about half the set.
The prompt is the first user message (what `adaflash bench` sends), or ``text`` for prose records.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections import Counter
from functools import lru_cache

from . import data as D

SPLITS = ("validation", "test", "all")
NEAR_JACCARD = 0.8
SHINGLE_WORDS = 5
# Domains whose training samples are prompts (user turns); prose is continuation text.
PROMPT_DOMAINS = ("math", "code", "chat")

_SPACE = re.compile(r"\s+")


def normalise(text: str) -> str:
    return _SPACE.sub(" ", unicodedata.normalize("NFKC", text).lower()).strip()


def shingles(norm: str) -> frozenset[str]:
    words = norm.split(" ")
    if len(words) < SHINGLE_WORDS:
        return frozenset([norm])
    return frozenset(" ".join(words[i : i + SHINGLE_WORDS]) for i in range(len(words) - SHINGLE_WORDS + 1))


def _prompt_text(rec: dict) -> str:
    return rec["messages"][0]["content"] if "messages" in rec else rec["text"]


class TrainingIndex:
    """The training prompts of one data folder: their normalised texts and a shingle -> prompt index."""

    def __init__(self, prompts: list[str]):
        self.exact = {normalise(p) for p in prompts}
        self.sizes: list[int] = []
        self.postings: dict[str, list[int]] = {}
        for i, norm in enumerate(sorted(self.exact)):
            sh = shingles(norm)
            self.sizes.append(len(sh))
            for s in sh:
                self.postings.setdefault(s, []).append(i)

    def max_jaccard(self, norm: str) -> float:
        """Highest Jaccard similarity of ``norm``'s shingles with any training prompt's (0 if none shares one)."""
        sh = shingles(norm)
        shared = Counter(i for s in sh if s in self.postings for i in self.postings[s])
        return max((n / (len(sh) + self.sizes[i] - n) for i, n in shared.items()), default=0.0)

    def kind(self, norm: str) -> str | None:
        """``"exact"``, ``"near"`` or None (not a duplicate) for a normalised eval prompt."""
        if norm in self.exact:
            return "exact"
        return "near" if self.max_jaccard(norm) >= NEAR_JACCARD else None


@lru_cache(maxsize=4)
def training_index(root: str | None) -> TrainingIndex:
    """The index of every user turn of the training samples under data folder ``root``; built once per
    process and folder (`split_counts` over many sets reuses it)."""
    prompts = [
        m["content"]
        for d in PROMPT_DOMAINS
        for s in D.chat_samples(d, "train", data_dir=root)
        for m in s.get("messages", ())
        if m["role"] == "user"
    ]
    return TrainingIndex(prompts)


def slice_of(norm: str) -> str:
    """``"validation"`` or ``"test"`` from the prompt's hash alone (stable as files grow)."""
    return "validation" if int(hashlib.sha256(norm.encode()).hexdigest()[:8], 16) % 2 == 0 else "test"


def _classified(name: str, data_dir=None) -> list[tuple[dict, str, str | None]]:
    """(record, normalised prompt, duplicate kind) for every record of eval set ``name``."""
    root = D.local_data_dir(data_dir)
    index = training_index(None if root is None else str(root))
    out = []
    for rec in D.eval_prompts(name, data_dir=data_dir):
        norm = normalise(_prompt_text(rec))
        out.append((rec, norm, index.kind(norm)))
    return out


def eval_split(name: str, split: str = "all", data_dir=None) -> list[dict]:
    """The records of eval set ``name`` that duplicate no training prompt, in file order: all of
    them (``"all"``), or the ``"validation"`` or ``"test"`` slice (`slice_of`)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    return [rec for rec, norm, kind in _classified(name, data_dir)
            if kind is None and split in ("all", slice_of(norm))]  # fmt: skip


def split_counts(name: str, data_dir=None) -> dict:
    """``{"total", "exact_duplicates", "near_duplicates", "validation", "test"}`` of eval set ``name``."""
    rows = _classified(name, data_dir)
    kinds = Counter(kind for _, _, kind in rows)
    slices = Counter(slice_of(norm) for _, norm, kind in rows if kind is None)
    return {"total": len(rows), "exact_duplicates": kinds["exact"], "near_duplicates": kinds["near"],
            "validation": slices["validation"], "test": slices["test"]}  # fmt: skip


__all__ = ["SPLITS", "NEAR_JACCARD", "SHINGLE_WORDS", "normalise", "eval_split", "split_counts", "slice_of"]
