"""Build `.devdata/`, what `gpu_run.sh` carries to the GPU machine beside the checkout.

    python examples/reference_pair/make_devdata.py --data ../shared/data --out .devdata

* `.devdata/data.tar.gz`: the data files the drafter recipes (training sources of all four domains, held-out prompts
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

# The benchmark sets that are not a domain's eval source (the bench reads them by name).
BENCH_ONLY = ("math500/test.jsonl", "mathqa/test_1000.jsonl")
# The sets of the tau tables (BENCHMARKS.md), counted after an --eval-only pack.
BENCH_SETS = ("gsm8k", "mathqa", "math500", "codealpaca", "sharegpt", "prose")


def data_files(eval_only: bool = False) -> list[str]:
    """Every file the drafter recipes (all four domains) and the benchmarks read, each once; with
    ``eval_only`` the benchmarks' files alone (a small carry when the checkout itself is large)."""
    from adaflash_hf.training.data import EVAL_SOURCES, TRAIN_SOURCES

    groups = (EVAL_SOURCES,) if eval_only else (TRAIN_SOURCES, EVAL_SOURCES)
    rels = [r for sources in groups for files in sources.values() for r in files]
    return sorted(set(rels) | set(BENCH_ONLY))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="../shared/data")
    ap.add_argument("--out", default=".devdata")
    ap.add_argument("--eval-only", action="store_true", help="only the held-out and benchmark files (no training sources)")
    ap.add_argument("--target-corpus", action="store_true", help="also pre-tokenise the target's training corpus")
    a = ap.parse_args(argv)
    src, out = Path(a.data), Path(a.out)
    files = data_files(a.eval_only)
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out / "data.tar.gz", "w:gz") as tar:
        for rel in files:
            tar.add(src / rel, arcname=f"data/{rel}")
    print(f"packed {len(files)} files into {out / 'data.tar.gz'}")
    if a.eval_only:  # what `adaflash bench --datasets ...` can draw from this carry (prose: its held-out chunks only)
        from adaflash_hf.training.data import eval_prompts

        print("eval prompts: " + ", ".join(f"{d} {len(eval_prompts(d, data_dir=src))}" for d in BENCH_SETS))
    if a.target_corpus:
        return subprocess.call([sys.executable, "-m", "adaflash_hf.training.pretokenize", "--out", a.out])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
