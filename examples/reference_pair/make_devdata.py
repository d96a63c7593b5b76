"""Build `.devdata/`, what `gpu_run.sh` carries to the GPU machine beside the checkout.

    python examples/reference_pair/make_devdata.py --data ../shared/data --out .devdata

* `.devdata/data.tar.gz`: the data files the drafter step (chat + prose training, held-out prompts
  of every domain) and the benchmarks read, compressed (24 MB of text -> ~7 MB) because the device
  tool sends at most 64 MiB with the checkout; `gpu_run.sh` unpacks it into `.devdata/data`.
* the pre-tokenised target corpus (`python -m adaflash_hf.training.pretokenize`), only with
  `--target-corpus` (step 1 of `gpu_run.sh`, training the target, needs it).
"""

import argparse
import subprocess
import sys
import tarfile
from pathlib import Path

FILES = (
    "codealpaca/code_alpaca_2k.jsonl",
    "gsm8k/test.jsonl",
    "math500/test.jsonl",
    "mathqa/test_1000.jsonl",
    "sharegpt/sharegpt_train.jsonl",
    "sharegpt/sharegpt_eval500.jsonl",
    "tinyshakespeare/input.txt",
    "us_speeches/us_speeches.jsonl",
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="../shared/data")
    ap.add_argument("--out", default=".devdata")
    ap.add_argument("--target-corpus", action="store_true", help="also pre-tokenise the target's training corpus")
    a = ap.parse_args(argv)
    src, out = Path(a.data), Path(a.out)
    files = list(FILES) + [str(p.relative_to(src)) for p in sorted((src / "gutenberg_novels").glob("*.txt"))]
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out / "data.tar.gz", "w:gz") as tar:
        for rel in files:
            tar.add(src / rel, arcname=f"data/{rel}")
    print(f"packed {len(files)} files into {out / 'data.tar.gz'}")
    if a.target_corpus:
        return subprocess.call([sys.executable, "-m", "adaflash_hf.training.pretokenize", "--out", a.out])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
