"""How repetitive are the reference target's greedy outputs, per held-out domain?

    OMP_NUM_THREADS=2 python examples/reference_pair/repetition_by_domain.py \
        --out docs/logs/repetition_by_domain_v4

BENCHMARKS.md section 1 reports greedy tau of drafter v4 per held-out set (cpu_tau_64_v4): MathQA
(2.22) is as high as ShareGPT chat (2.15) although the drafter never saw math. The suspected reason
is that the target's greedy MathQA outputs (and partly its chat outputs) are repetition loops, and
a loop is easy for any drafter to predict. This script measures that on the same prompts the bench
used, decoding the target alone:

- ``copyable``: the share of generated tokens whose 4-gram (ending at that token) already occurred
  earlier in prompt + output, i.e. tokens that copying an earlier span would have predicted;
- ``distinct2``: distinct bigrams / bigrams of the output (low means repetitive);
- EOS rate and output length.

It then puts the per-set means beside the bench's tau (method ``fixed``) and gives the Spearman rank
correlation of tau and copyable over the sets. Prompts are built by `adaflash_hf.bench`'s own
functions; each prompt is decoded alone (no padding) with plain greedy ``target.generate``, the
output cut after its first EOS exactly as the bench cuts its rows, so lengths count the EOS token.

Outputs in ``--out``: ``repetition.json`` (per-set aggregates and per-prompt values) and
``repetition.md`` (the table).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

from adaflash_hf import load_reference_pair
from adaflash_hf.bench.prompts import load_prompts
from adaflash_hf.bench.timing import trim
from adaflash_hf.generation.prompts import encode_prompt

REPO = Path(__file__).resolve().parents[2]
DATASETS = ("gsm8k", "mathqa", "codealpaca", "sharegpt", "math500", "prose")
BENCH_JSON = REPO / "docs/logs/cpu_tau_64_v4/bench.json"


def copyable_fraction(prompt: list[int], generated: list[int], n: int = 4) -> float | None:
    """Share of generated tokens ``t_i`` (``i >= n - 1``, counted within `generated`) whose n-gram
    ``t_{i-n+1..i}`` already ended somewhere earlier in ``prompt + generated[:i]``: tokens that
    copying an earlier span of the context would have predicted. None when `generated` has fewer
    than `n` tokens.

    >>> copyable_fraction([], [1, 2, 3, 4, 1, 2, 3, 4, 5], n=2)  # of 8 bigrams, the 2nd 1-2, 2-3, 3-4
    0.375
    """
    if len(generated) < n:
        return None
    seq = list(prompt) + list(generated)
    start = len(prompt)
    seen = {tuple(seq[j - n + 1 : j + 1]) for j in range(n - 1, start + n - 1)}
    hits = 0
    for i in range(n - 1, len(generated)):
        gram = tuple(seq[start + i - n + 1 : start + i + 1])
        hits += gram in seen
        seen.add(gram)
    return hits / (len(generated) - n + 1)


def distinct_bigrams(generated: list[int]) -> float | None:
    """Distinct bigrams / bigrams of `generated` (None below two tokens).

    >>> distinct_bigrams([7, 8, 7, 8, 7])
    0.5
    """
    grams = list(zip(generated, generated[1:]))
    return len(set(grams)) / len(grams) if grams else None


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman rank correlation: Pearson correlation of the ranks (ties get their mean rank)."""

    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def bench_figures(path: Path) -> dict[str, dict]:
    """Per dataset: tau of method ``fixed`` and plain's total new tokens, from a bench.json."""
    cells = json.loads(path.read_text(encoding="utf-8"))["results"]
    out: dict[str, dict] = {}
    for c in cells:
        if c["method"] == "fixed":
            out.setdefault(c["dataset"], {})["tau"] = c["tau"]
        elif c["method"] == "plain":
            out.setdefault(c["dataset"], {})["plain_new_tokens"] = c["new_tokens"]
    return out


def measure_set(name, target, tokenizer, num_prompts, gen_kwargs, eos_ids):
    _, prompts = load_prompts(name, num_prompts, None)
    rows = []
    for i, prompt in enumerate(prompts):
        ids = encode_prompt(tokenizer, prompt)
        input_ids = torch.tensor([ids])
        with torch.inference_mode():
            out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **gen_kwargs)
        gen = trim(out[0, len(ids) :], eos_ids)
        rows.append(
            dict(
                index=i,
                prompt_tokens=len(ids),
                length=len(gen),
                eos=bool(gen) and gen[-1] in eos_ids,
                copyable=copyable_fraction(ids, gen),
                distinct2=distinct_bigrams(gen),
                text=tokenizer.decode(gen, skip_special_tokens=True),
            )
        )
    return rows


def aggregate(rows: list[dict]) -> dict:
    return dict(
        prompts=len(rows),
        copyable=_mean(r["copyable"] for r in rows),
        copyable_undefined=sum(r["copyable"] is None for r in rows),
        distinct2=_mean(r["distinct2"] for r in rows),
        eos_rate=_mean(float(r["eos"]) for r in rows),
        mean_length=_mean(r["length"] for r in rows),
        new_tokens=sum(r["length"] for r in rows),
    )


def _command() -> str:
    threads = os.environ.get("OMP_NUM_THREADS")
    return (f"OMP_NUM_THREADS={threads} " if threads else "") + shlex.join(["python", *sys.argv])


def _f(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def markdown(result: dict) -> str:
    env, sets = result["environment"], result["sets"]
    lines = [
        "# Repetition of the target's greedy outputs per held-out set",
        "",
        f"- date (UTC): {env['date_utc']}",
        f"- versions: torch {env['torch']}, transformers {env['transformers']}, python {env['python']}",
        f"- command: `{env['command']}`",
        f"- prompts per set: {result['num_prompts']}, max new tokens: {result['max_new_tokens']}, fp32 CPU, "
        "one prompt per `generate` call (no padding); tau from `cpu_tau_64_v4/bench.json` (method fixed, concurrency 32)",
        f"- wall time: {result['wall_s']:.0f} s",
        "",
        "| set | tau (fixed) | copyable | distinct2 | EOS rate | mean length |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in sorted(sets.items(), key=lambda kv: -(kv[1]["tau"] or 0)):
        lines.append(
            f"| {name} | {_f(s['tau'], '.2f')} | {_f(s['copyable'])} | {_f(s['distinct2'])} | "
            f"{_f(s['eos_rate'], '.2f')} | {_f(s['mean_length'], '.1f')} |"
        )
    lines += [
        "",
        f"Spearman rank correlation of per-set tau and per-set copyable ({len(sets)} sets): "
        f"**{_f(result['spearman_tau_copyable'])}**",
        "",
        "copyable: mean over prompts of the share of generated tokens t_i (i >= 3) whose 4-gram ending at t_i "
        "already occurred in prompt + output before it; distinct2: distinct bigrams / bigrams of the output; "
        "lengths count the EOS token, as the bench's new-token counts do.",
        "",
        "Check against the bench (its plain rows were decoded in left-padded batches of 32):",
        "",
        "| set | new tokens here | bench plain new tokens |",
        "|---|---|---|",
    ]
    for name, s in sets.items():
        lines.append(f"| {name} | {s['new_tokens']} | {_f(s['bench_plain_new_tokens'], 'd')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output folder for repetition.json and repetition.md")
    ap.add_argument("--num-prompts", type=int, default=64, help="prompts per set, the first N as the bench takes them")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="greedy tokens generated per prompt")
    args = ap.parse_args(argv)

    target, _, tokenizer = load_reference_pair(dtype=torch.float32)
    # Same generation arguments and EOS set as bench.run_bench's greedy plain method.
    gen_kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    gen_kwargs["pad_token_id"] = 0 if pad_id is None else pad_id
    eos = target.generation_config.eos_token_id
    if eos is None and tokenizer.eos_token_id is not None:
        eos = tokenizer.eos_token_id
        gen_kwargs["eos_token_id"] = eos
    eos_ids = set(eos if isinstance(eos, list) else ([] if eos is None else [eos]))

    bench = bench_figures(BENCH_JSON)
    t0 = time.perf_counter()
    sets, per_prompt = {}, {}
    for name in DATASETS:
        t = time.perf_counter()
        rows = measure_set(name, target, tokenizer, args.num_prompts, gen_kwargs, eos_ids)
        per_prompt[name] = rows
        sets[name] = dict(
            tau=bench.get(name, {}).get("tau"),
            bench_plain_new_tokens=bench.get(name, {}).get("plain_new_tokens"),
            **aggregate(rows),
        )
        print(f"{name}: {len(rows)} prompts in {time.perf_counter() - t:.0f} s, copyable {_f(sets[name]['copyable'])}",
              file=sys.stderr, flush=True)  # fmt: skip

    names = [n for n in DATASETS if sets[n]["tau"] is not None and sets[n]["copyable"] is not None]
    date = subprocess.run(["date", "-u"], capture_output=True, text=True).stdout.strip()
    result = dict(
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        eos_token_ids=sorted(eos_ids),
        bench_json=str(BENCH_JSON.relative_to(REPO)),
        wall_s=time.perf_counter() - t0,
        spearman_tau_copyable=spearman([sets[n]["tau"] for n in names], [sets[n]["copyable"] for n in names]),
        spearman_sets=names,
        environment=dict(
            date_utc=date,
            torch=torch.__version__,
            transformers=transformers.__version__,
            python=sys.version.split()[0],
            omp_num_threads=torch.get_num_threads(),
            command=_command(),
        ),
        sets=sets,
        per_prompt=per_prompt,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "repetition.json").write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "repetition.md").write_text(markdown(result), encoding="utf-8")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
