"""The pretokenized corpus a target trains on: random training windows and held-out windows / prompts.

``DIR`` is the output of ``python examples/research/pretokenize.py --out DIR``: ``train_tokens.npy``,
``eval_tokens.npy`` with ``eval_docs.npy`` (start, length, domain index per document) and
``eval_loss_spans.npy``, ``meta.json`` and ``tokenizer/``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

__all__ = ["WindowSampler", "eval_batches", "load_corpus", "sample_prompts"]


def load_corpus(data: str | Path):
    data = Path(data)
    for name in ("train_tokens.npy", "tokenizer"):
        if not (data / name).exists():
            raise FileNotFoundError(
                f"{data / name} not found: run `python examples/research/pretokenize.py --out {data}` first"
            )
    tokens = np.load(data / "train_tokens.npy")
    meta = json.loads((data / "meta.json").read_text()) if (data / "meta.json").exists() else {}
    ev = {}
    if (data / "eval_tokens.npy").exists():
        ev["tokens"] = np.load(data / "eval_tokens.npy")
        ev["docs"] = np.load(data / "eval_docs.npy")
        spans = data / "eval_loss_spans.npy"
        ev["spans"] = np.load(spans) if spans.exists() else np.zeros((0, 2), dtype=np.int32)
    return tokens, ev, meta


class WindowSampler:
    """Random contiguous windows of ``seq_len + 1`` tokens, drawn on the device."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, device, seed: int = 0):
        if len(tokens) < seq_len + 2:
            raise ValueError(f"corpus has {len(tokens)} tokens, fewer than seq_len + 2 = {seq_len + 2}")
        self.tokens = torch.from_numpy(tokens.astype(np.int64)).to(device)
        self.seq_len, self.batch_size = seq_len, batch_size
        self.offsets = torch.arange(seq_len + 1, device=device)
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed)
        self.high = len(tokens) - seq_len - 1

    def __call__(self):
        starts = torch.randint(0, self.high, (self.batch_size,), device=self.tokens.device, generator=self.gen)
        w = self.tokens[starts[:, None] + self.offsets]
        return w[:, :-1], w[:, 1:]


def eval_batches(ev: dict, domains: list[str], seq_len: int, max_windows: int = 256):
    """Non-overlapping windows of the held-out tokens, per domain: {domain: LongTensor [n, seq_len+1]}."""
    out = {}
    if not ev:
        return out
    tokens, docs = ev["tokens"].astype(np.int64), ev["docs"]
    for di, d in enumerate(domains):
        rows = docs[docs[:, 2] == di]
        if len(rows) == 0:
            continue
        a, b = int(rows[:, 0].min()), int((rows[:, 0] + rows[:, 1]).max())
        seg = tokens[a:b]
        L = min(seq_len, len(seg) - 1)
        if L < 2:
            continue
        n = min(max_windows, (len(seg) - 1) // L)
        w = np.stack([seg[i * L : i * L + L + 1] for i in range(n)])
        out[d] = torch.from_numpy(w)
    return out


def sample_prompts(ev: dict, domains: list[str], tok, prose_prefix: int = 32) -> list[tuple[str, list[int]]]:
    """One held-out prompt per domain from the eval split: the chat prompt up to the first
    assistant response (generation prompt included), or the first tokens of a prose chunk."""
    out = []
    if not ev:
        return out
    tokens, docs, spans = ev["tokens"], ev["docs"], ev["spans"]
    for di, d in enumerate(domains):
        rows = docs[docs[:, 2] == di]
        if len(rows) == 0:
            continue
        s, length, _ = (int(v) for v in rows[0])
        doc = tokens[s : s + length].astype(np.int64)
        inside = spans[(spans[:, 0] >= s) & (spans[:, 0] < s + length)]
        if d == "prose" or len(inside) == 0:
            ids = doc[: min(prose_prefix, len(doc) - 1)]
        else:
            ids = doc[: int(inside[0, 0]) - s]
            ids = ids[-384:]
        out.append((d, ids.tolist()))
    return out
