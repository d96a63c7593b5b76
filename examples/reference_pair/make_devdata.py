"""Build `.devdata/`, what `gpu_run.sh` carries to the GPU machine beside the checkout.

    python examples/reference_pair/make_devdata.py --data ../shared/data --out .devdata

* `.devdata/data.tar.gz`: the data files the drafter recipes (training sources of all four domains, held-out prompts
  of every domain) and the benchmarks read, compressed (24 MB of text -> ~7 MB) because the device
  tool sends at most 64 MiB with the checkout; `gpu_run.sh` unpacks it into `.devdata/data`.
* the pre-tokenised target corpus (`python examples/research/pretokenize.py`), only with
  `--target-corpus` (step 1 of `gpu_run.sh`, training the target, needs it).
* with `--online` instead, `.devdata/data.tar.xz` (~3 MB), what `gpu_online.sh` reads: the chat + prose
  drafter's training prompts and the held-out sets of the online runs (see `online_pack`).
"""

import argparse
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

# The benchmark sets that are not a domain's eval source (the bench reads them by name).
BENCH_ONLY = ("math500/test.jsonl", "mathqa/test_1000.jsonl", "spec_bench/question.jsonl", "mt_bench/question.jsonl")
# The sets of the tau tables (BENCHMARKS.md), counted after an --eval-only pack.
BENCH_SETS = ("gsm8k", "mathqa", "math500", "codealpaca", "sharegpt", "prose")


def data_files(eval_only: bool = False) -> list[str]:
    """Every file the drafter recipes (all four domains) and the benchmarks read, each once; with
    ``eval_only`` the benchmarks' files alone (a small carry when the checkout itself is large)."""
    from adaflash_hf.training.data import EVAL_SOURCES, TRAIN_SOURCES

    groups = (EVAL_SOURCES,) if eval_only else (TRAIN_SOURCES, EVAL_SOURCES)
    rels = [r for sources in groups for files in sources.values() for r in files]
    return sorted(set(rels) | set(BENCH_ONLY))


# The online runs' unseen domains (their held-out sets) and how many user turns per conversation the
# chat + prose recipe prompts (`gpu_drafters.sh chatprose`: --prompts-per-sample 16).
ONLINE_EVAL = ("gsm8k/test.jsonl", "codealpaca/code_alpaca_2k.jsonl")
CHAT_TURNS = 16
LAST_ANSWER_CHARS = 200


def _chat_for_prompts(record: dict, turns: int) -> dict | None:
    """One ShareGPT conversation as the recipe reads it (`data._sharegpt_messages`), up to the answer
    of its `turns`-th user turn, that answer cut to LAST_ANSWER_CHARS: a prompt holds a user turn and
    the turns before it, so every prompt of the recipe is unchanged."""
    from adaflash_hf.training.data import _sharegpt_messages

    msgs = _sharegpt_messages(record["conversations"])
    users = [i for i, m in enumerate(msgs) if m["role"] == "user"][:turns]
    if not users:
        return None
    kept = msgs[: users[-1] + 2]
    kept[-1] = {"role": "assistant", "content": kept[-1]["content"][:LAST_ANSWER_CHARS].strip() or "."}
    return {"conversations": [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]} for m in kept]}


def _prose_prefix(rel: str, raw: bytes, fraction: float) -> bytes:
    """The first ``fraction`` of a prose source: whole records of a .jsonl, else text cut at a paragraph
    break (its held-out part is then the last 2% of this prefix's chunks)."""
    if rel.endswith(".jsonl"):
        lines = raw.decode("utf-8").splitlines(keepends=True)
        return "".join(lines[: max(1, round(len(lines) * fraction))]).encode("utf-8")
    text = raw.decode("utf-8")
    end = round(len(text) * fraction)
    cut = text.rfind("\n\n", 0, end)
    return text[: cut if cut > 0 else end].encode("utf-8")


def online_pack(src: Path, prose_fraction: float) -> dict[str, bytes]:
    """``{relative path: bytes}`` of the online pack: every ShareGPT training conversation up to the
    answer of its 16th user turn (`_chat_for_prompts`: the chat prompts are those of the full data);
    the first ``prose_fraction`` of each prose source (the recipe's 6,000 prose prompts use ~500 of
    its ~1,200 chunks at 0.25); the held-out gsm8k and codealpaca sets whole. No chat held-out set:
    train the drafter with ``--eval-domains math,code,prose``."""
    from adaflash_hf.training.data import TRAIN_SOURCES

    (chat,) = TRAIN_SOURCES["chat"]
    rows = [_chat_for_prompts(json.loads(line), CHAT_TURNS) for line in (src / chat).read_text("utf-8").splitlines() if line.strip()]
    files = {chat: "".join(json.dumps(r) + "\n" for r in rows if r is not None).encode("utf-8")}
    for rel in TRAIN_SOURCES["prose"]:
        files[rel] = _prose_prefix(rel, (src / rel).read_bytes(), prose_fraction)
    for rel in ONLINE_EVAL:
        files[rel] = (src / rel).read_bytes()
    return files


def write_online_pack(src: Path, out: Path, prose_fraction: float) -> Path:
    """`online_pack` as ``out/data.tar.xz`` (written to a temporary name, then renamed)."""
    files = online_pack(src, prose_fraction)
    path, tmp = out / "data.tar.xz", out / "data.tar.xz.tmp"
    try:
        with tarfile.open(tmp, "w:xz", preset=9) as tar:
            for rel, data in files.items():
                info = tarfile.TarInfo(f"data/{rel}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="../shared/data")
    ap.add_argument("--out", default=".devdata")
    ap.add_argument("--eval-only", action="store_true", help="only the held-out and benchmark files (no training sources)")
    ap.add_argument("--target-corpus", action="store_true", help="also pre-tokenise the target's training corpus")
    ap.add_argument("--online", action="store_true", help="only what gpu_online.sh reads, as data.tar.xz (online_pack)")
    ap.add_argument("--prose-fraction", type=float, default=0.25, help="--online: the share of each prose source packed")
    a = ap.parse_args(argv)
    src, out = Path(a.data), Path(a.out)
    if a.online:
        if a.eval_only or a.target_corpus:
            ap.error("--online packs its own selection: leave out --eval-only and --target-corpus")
        if not 0 < a.prose_fraction <= 1:
            ap.error(f"--prose-fraction must be in (0, 1], got {a.prose_fraction}")
        from adaflash_hf.training.data import TRAIN_SOURCES

        missing = [r for r in (*TRAIN_SOURCES["chat"], *TRAIN_SOURCES["prose"], *ONLINE_EVAL) if not (src / r).is_file()]
        if missing:
            ap.error(f"{src} lacks {', '.join(missing)} (--data: the shared data folder)")
        out.mkdir(parents=True, exist_ok=True)
        path = write_online_pack(src, out, a.prose_fraction)
        print(f"packed {path} ({path.stat().st_size / 1e6:.2f} MB)")
        return 0
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
        return subprocess.call([sys.executable, str(Path(__file__).resolve().parents[1] / "research" / "pretokenize.py"), "--out", a.out])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
