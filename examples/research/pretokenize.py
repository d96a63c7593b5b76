"""Train the reference tokenizer and pretokenize the training corpus.

    python examples/research/pretokenize.py --out DIR [--data PATH] [--vocab-size 8192]

Writes into DIR:

* ``tokenizer/``: the trained tokenizer (``AutoTokenizer.from_pretrained(DIR/"tokenizer")``);
* ``train_tokens.npy``: uint16, every training document back to back, each followed by
  ``<|endoftext|>``. Math/code/chat samples are rendered with the ChatML chat template, prose chunks
  are plain text. Documents are grouped by domain (math, code, chat, prose), shuffled within a domain;
* ``train_docs.npy``: int32 ``[n_docs, 3]`` = (start, length incl. the eos, domain id) per document;
* ``train_loss_spans.npy``: int32 ``[n_spans, 2]``, half-open absolute token ranges ``[a, b)`` of
  the "response" tokens: each assistant turn's content + its ``<|im_end|>`` in chat-formatted
  documents, and the whole text (eos excluded) of prose documents. Prompts, template tokens and
  separators are outside. This is where SFT losses and DFlash anchors belong
  (``loss_mask(n_tokens, spans)`` rebuilds a per-token 0/1 mask);
* ``eval_tokens.npy``, ``eval_docs.npy``, ``eval_loss_spans.npy``: the same for held-out samples
  (gsm8k test, code_alpaca_2k, sharegpt eval500, held-out prose), capped per domain;
* ``meta.json``: domain names / ids, per-domain token counts and token ranges, file sizes, settings.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from adaflash_hf.training import data as D
from adaflash_hf.training.tokenizer import EOS, IM_END, render_sample, train_tokenizer

DOMAIN_IDS = {d: i for i, d in enumerate(D.TRAIN_DOMAINS)}
_ASSISTANT_SPAN = re.compile(re.escape("<|im_start|>assistant\n") + r"(.*?" + re.escape(IM_END) + ")", re.S)


def _tokenizer_texts(samples_by_domain: dict[str, list[dict]]):
    """Raw text (message contents, prose chunks) for tokenizer training; no template markup."""
    for samples in samples_by_domain.values():
        for s in samples:
            if "messages" in s:
                for m in s["messages"]:
                    yield m["content"]
            else:
                yield s["text"]


def _char_len(samples_by_domain) -> int:
    return sum(len(t) for t in _tokenizer_texts(samples_by_domain))


def encode_documents(tok, samples: list[dict], desc: str = "encode", batch: int = 512, progress: bool = True):
    """Render + tokenize samples. Returns (list of int arrays incl. trailing eos, list of uint8 masks)."""
    backend = tok.backend_tokenizer if hasattr(tok, "backend_tokenizer") else tok._tokenizer
    eos = tok.convert_tokens_to_ids(EOS)
    ids_out, mask_out = [], []
    it = range(0, len(samples), batch)
    for i in tqdm(it, desc=desc, unit="batch", disable=not progress, leave=False):
        chunk = samples[i : i + batch]
        texts = [render_sample(tok, s) for s in chunk]
        encs = backend.encode_batch(texts, add_special_tokens=False)
        for s, text, enc in zip(chunk, texts, encs):
            ids = np.asarray(enc.ids + [eos], dtype=np.int64)
            if "messages" in s:
                mask = np.zeros(len(ids), dtype=np.uint8)
                spans = [m.span(1) for m in _ASSISTANT_SPAN.finditer(text)]
                if spans:
                    starts = np.asarray([o[0] for o in enc.offsets], dtype=np.int64)
                    ends = np.asarray([o[1] for o in enc.offsets], dtype=np.int64)
                    sel = np.zeros(len(starts), dtype=bool)
                    for a, b in spans:
                        sel |= (starts >= a) & (ends <= b) & (ends > starts)
                    mask[: len(sel)] = sel
            else:
                mask = np.ones(len(ids), dtype=np.uint8)
                mask[-1] = 0
            ids_out.append(ids)
            mask_out.append(mask)
    return ids_out, mask_out


def mask_to_spans(mask: np.ndarray) -> np.ndarray:
    """0/1 per-token mask -> int32 ``[n, 2]`` half-open runs of ones."""
    m = np.concatenate([[0], np.asarray(mask, dtype=np.int8), [0]])
    d = np.diff(m)
    return np.stack([np.flatnonzero(d == 1), np.flatnonzero(d == -1)], axis=1).astype(np.int32)


def loss_mask(n_tokens: int, spans: np.ndarray) -> np.ndarray:
    """Inverse of ``mask_to_spans``: a bool mask of length ``n_tokens``."""
    d = np.zeros(n_tokens + 1, dtype=np.int32)
    np.add.at(d, spans[:, 0], 1)
    np.add.at(d, spans[:, 1], -1)
    return np.cumsum(d[:-1]) > 0


def _write_split(out: Path, prefix: str, docs_by_domain: dict, masks_by_domain: dict) -> dict:
    all_ids, all_masks, index, stats = [], [], [], {}
    pos = 0
    for d in D.TRAIN_DOMAINS:
        start = pos
        for ids, m in zip(docs_by_domain[d], masks_by_domain[d]):
            index.append((pos, len(ids), DOMAIN_IDS[d]))
            all_ids.append(ids)
            all_masks.append(m)
            pos += len(ids)
        n_loss = int(sum(int(m.sum()) for m in masks_by_domain[d]))
        stats[d] = {"docs": len(docs_by_domain[d]), "tokens": pos - start, "loss_tokens": n_loss,
                    "range": [start, pos]}
    tokens = np.concatenate(all_ids) if all_ids else np.zeros(0, dtype=np.int64)
    assert tokens.max(initial=0) < 2**16, "vocab does not fit in uint16"
    masks = np.concatenate(all_masks) if all_masks else np.zeros(0, dtype=np.uint8)
    assert len(tokens) < 2**31
    np.save(out / f"{prefix}_tokens.npy", tokens.astype(np.uint16))
    np.save(out / f"{prefix}_docs.npy", np.asarray(index, dtype=np.int32).reshape(-1, 3))
    np.save(out / f"{prefix}_loss_spans.npy", mask_to_spans(masks))
    return {"n_tokens": int(len(tokens)), "domains": stats}


def _sample_texts(texts: list[str], tokenizer_chars: int | None, n_chars: int, rng: random.Random) -> list[str]:
    """A random sample of ``texts`` of about ``tokenizer_chars`` characters (all of them if None)."""
    if tokenizer_chars is None or tokenizer_chars >= n_chars:
        return texts
    rng.shuffle(texts)
    keep, total = [], 0
    for t in texts:
        keep.append(t)
        total += len(t)
        if total >= tokenizer_chars:
            break
    return keep


def _encode_splits(tok, train: dict, evals: dict, eval_tokens_per_domain: int, rng: random.Random, progress: bool):
    """Token ids and loss masks per domain: every (shuffled) training sample, and the first eval
    samples up to about ``eval_tokens_per_domain`` tokens."""
    tr_ids, tr_masks, ev_ids, ev_masks = {}, {}, {}, {}
    for d in D.TRAIN_DOMAINS:
        samples = list(train[d])
        rng.shuffle(samples)
        tr_ids[d], tr_masks[d] = encode_documents(tok, samples, desc=f"encode {d}", progress=progress)
        e_ids, e_masks = encode_documents(tok, evals[d], desc=f"encode eval {d}", progress=progress)
        keep, total = 0, 0
        while keep < len(e_ids) and total < eval_tokens_per_domain:
            total += len(e_ids[keep])
            keep += 1
        ev_ids[d], ev_masks[d] = e_ids[:keep], e_masks[:keep]
    return tr_ids, tr_masks, ev_ids, ev_masks


def pretokenize(
    out: str | Path,
    data_dir=None,
    vocab_size: int = 8192,
    tokenizer_chars: int | None = None,
    eval_tokens_per_domain: int = 64_000,
    limit_per_domain: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Train the tokenizer and write the pretokenized corpus into ``out`` (see module docstring).

    ``tokenizer_chars``: train the tokenizer on a random sample of about this many characters
    (default: all training text). ``limit_per_domain``: use only the first N samples per domain
    (for tests). Returns the meta dict (also written to ``out/meta.json``).
    """
    t0 = time.time()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)

    train = {}
    for d in tqdm(D.TRAIN_DOMAINS, desc="load train", disable=not progress):
        train[d] = D.chat_samples(d, "train", limit_per_domain, data_dir)
    evals = {}
    for d in D.TRAIN_DOMAINS:
        evals[d] = D.chat_samples(d, "eval", limit_per_domain, data_dir)
    n_chars = _char_len(train)
    print(f"[pretokenize] loaded {sum(map(len, train.values()))} train samples, {n_chars / 1e6:.1f}M chars "
          f"({time.time() - t0:.1f}s)", flush=True)

    # --- tokenizer
    texts = _sample_texts(list(_tokenizer_texts(train)), tokenizer_chars, n_chars, rng)
    t1 = time.time()
    tok = train_tokenizer(texts, vocab_size=vocab_size, show_progress=progress, length=len(texts))
    tok.save_pretrained(out / "tokenizer")
    print(f"[pretokenize] tokenizer: {len(tok)} tokens, trained on {sum(map(len, texts)) / 1e6:.1f}M chars "
          f"in {time.time() - t1:.1f}s -> {out / 'tokenizer'}", flush=True)

    # --- encode
    tr_ids, tr_masks, ev_ids, ev_masks = _encode_splits(tok, train, evals, eval_tokens_per_domain, rng, progress)
    train_meta = _write_split(out, "train", tr_ids, tr_masks)
    eval_meta = _write_split(out, "eval", ev_ids, ev_masks)

    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    files["tokenizer/"] = sum(p.stat().st_size for p in (out / "tokenizer").iterdir())
    meta = {
        "format": "adaflash-pretokenized-v1",
        "dtype": "uint16",
        "vocab_size": len(tok),
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "mask_token_id": tok.mask_token_id,
        "im_end_token_id": tok.convert_tokens_to_ids(IM_END),
        "domains": list(D.TRAIN_DOMAINS),
        "train": train_meta,
        "eval": eval_meta,
        "train_chars": n_chars,
        "seed": seed,
        "files_bytes": files,
        "seconds": round(time.time() - t0, 1),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    _print_summary(meta, out)
    return meta


def _print_summary(meta: dict, out: Path) -> None:
    print(f"\n[pretokenize] {out}  ({meta['seconds']}s, vocab {meta['vocab_size']})")
    print(f"{'domain':<8} {'docs':>7} {'tokens':>11} {'loss tok':>11} {'eval tok':>9}")
    for d in meta["domains"]:
        s, e = meta["train"]["domains"][d], meta["eval"]["domains"][d]
        print(f"{d:<8} {s['docs']:>7} {s['tokens']:>11,} {s['loss_tokens']:>11,} {e['tokens']:>9,}")
    print(f"{'total':<8} {'':>7} {meta['train']['n_tokens']:>11,} {'':>11} {meta['eval']['n_tokens']:>9,}")
    print(f"chars/token: {meta['train_chars'] / max(1, meta['train']['n_tokens']):.2f}")
    for name, size in meta["files_bytes"].items():
        print(f"  {name:<22} {size / 1e6:8.2f} MB")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--data", default=None, help=f"data folder (default: ${D.ENV_VAR} or ../shared/data)")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--tokenizer-chars", type=int, default=None,
                    help="train the tokenizer on a random sample of this many characters (default: all)")
    ap.add_argument("--eval-tokens", type=int, default=64_000, help="held-out tokens per domain (cap)")
    ap.add_argument("--limit", type=int, default=None, help="samples per domain (testing)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    pretokenize(a.out, a.data, a.vocab_size, a.tokenizer_chars, a.eval_tokens, a.limit, a.seed,
                progress=not a.no_progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
