"""Turn the drafter's regeneration cache into a corpus for the small autoregressive assistant.

    python examples/reference_pair/assistant_corpus.py --regen-cache regen.jsonl --target DIR --out CORPUS
    python examples/research/train_target.py --data CORPUS --out OUT --hidden-size 128 --layers 2 ...

The ``hf_assisted`` baseline needs a small autoregressive model with the target's tokenizer. The
fair one is trained the way a user would distil a draft model: on the target's own answers (the
same regenerated samples the DFlash drafter learns from), so the two drafters see the same data.
Writes ``CORPUS/train_tokens.npy`` (uint16, every prompt + answer followed by eos) and
``CORPUS/tokenizer`` (the target's), which is what ``train_target --data`` reads.
"""

import argparse
import json
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--regen-cache", required=True)
    ap.add_argument("--target", required=True, help="target folder (its tokenizer is copied)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(a.target)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with open(a.regen_cache) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line)["input_ids"] + [tok.eos_token_id])
    tokens = np.fromiter((t for r in rows for t in r), dtype=np.uint16)
    np.save(out / "train_tokens.npy", tokens)
    tok.save_pretrained(out / "tokenizer")
    print(f"{len(rows)} samples, {len(tokens)} tokens -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
