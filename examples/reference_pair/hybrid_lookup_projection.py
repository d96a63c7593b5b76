"""PROJECTION (issue 36 item 6): what proposing the prompt's own n-grams beside the drafter could buy, greedy.

Under greedy decoding a round's outcome is a function of the committed prefix: the drafter's block after bonus
token ``t`` depends only on the target's features of the tokens before it and on ``t``, prompt lookup's candidate
only on the tokens so far. So for every position of plain's greedy output this script computes, by teacher forcing
(one target forward over prompt + output, one stateless ``draft_block`` per position), how many drafts each
proposer would get accepted there, then walks the rounds of several rules that pick, per round, which proposal to
verify (only from what is known before verifying), and the oracle that always picks the better one:

  drafter      the drafter's block (`fixed`)
  lookup       transformers' prompt lookup (its computed candidates, `bench.prompt_lookup_tau`), at SETTINGS
  lookup_first prompt lookup's candidate whenever it has one, else the drafter's block
  agree        prompt lookup's candidate when its first token equals the drafter's first draft, else the drafter's
  longer       prompt lookup's candidate when it is longer than the drafter's expected accepted run (head ratio x
               block, the paper's estimate), else the drafter's
  oracle       the better of the two at every round (an upper bound, not a rule)

tau = (new tokens - 1) / rounds, the prefill left out (`speculation.rounds`). Checks: the walked `drafter` rule's tau equals
the real ``generate(assistant_model=drafter, length_policy="fixed")`` on the same prompts (float32, CPU: the
features of one full forward and of the loop's verify forwards agree), and `lookup` equals `prompt_lookup_rounds`.

Usage: python examples/reference_pair/hybrid_lookup_projection.py --sets spec_bench:summarization,spec_bench:rag \
           --prompts 20 --out runs/hybrid
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from adaflash_hf import load_reference_pair
from adaflash_hf.bench.prompt_lookup_tau import PromptLookupSettings, _candidates, prompt_lookup_rounds
from adaflash_hf.speculation.prompt_ngrams import NgramIndex
from adaflash_hf.bench.prompts import load_prompts
from adaflash_hf.generation.prompts import encode_prompt

RULES = ("drafter", "lookup", "lookup_first", "agree", "longer", "oracle")


def per_position(target, drafter, prompt: list[int], out: list[int], settings, eos) -> list[dict]:
    """For every bonus position j of ``out`` (new token j is the round's bonus): the drafter's drafts, accepted
    count and head ratio; prompt lookup's candidate and accepted count."""
    seq = prompt + out
    p, block = len(prompt), drafter.config.block_size
    with torch.inference_mode():
        feats = drafter.select_context(target(torch.tensor([seq]), output_hidden_states=True).hidden_states)
    index = NgramIndex(seq, settings.max_ngram)
    rows = []
    max_length = p + len(out)  # candidates never run past the output (what is verified past it is never kept)
    for j in range(len(out) - 1):
        cur = p + j  # tokens before the bonus: its features are the drafter's context
        with torch.inference_mode():
            states = drafter.draft_block(torch.tensor([seq[cur]]), feats[:, :cur], torch.arange(cur + block)[None])
            drafts = drafter.compute_logits(states[:, 1:]).argmax(-1)[0].tolist()
            ratio = float(drafter.predict_accept_ratio(states)) if drafter.length_head is not None else None
        truth = seq[cur + 1 :]
        index.extend_to(cur + 1)
        cand = _candidates(seq, cur + 1, max_length + 1, index, settings, eos)
        rows.append(dict(drafts=drafts, a_d=_run(drafts, truth), cand=cand, a_l=_run(cand, truth), ratio=ratio))
    return rows


def _run(proposal: list[int], truth: list[int]) -> int:
    n = 0
    while n < min(len(proposal), len(truth)) and proposal[n] == truth[n]:
        n += 1
    return n


def choose(rule: str, row: dict, block: int) -> int:
    """Accepted drafts of the round at this position under ``rule``."""
    use_lookup = {
        "drafter": False,
        "lookup": True,
        "lookup_first": bool(row["cand"]),
        "agree": bool(row["cand"]) and row["cand"][0] == row["drafts"][0],
        "longer": row["ratio"] is not None and len(row["cand"]) > row["ratio"] * block,
        "oracle": row["a_l"] > row["a_d"],
    }[rule]
    return row["a_l"] if use_lookup else row["a_d"]


def walk(rows: list[dict], rule: str, block: int) -> int:
    """Rounds from the first bonus to the end of the output."""
    j, rounds = 0, 0
    while j < len(rows):
        j += choose(rule, rows[j], block) + 1
        rounds += 1
    return rounds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default="spec_bench:summarization,spec_bench:rag,spec_bench:qa,spec_bench:translation,gsm8k")
    ap.add_argument("--split", default="test")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--lookup", default="20x4", help="prompt lookup's tokens x n-gram (the grid's usual choice)")
    ap.add_argument("--check", type=int, default=3, help="prompts per set checked against a real generate run")
    ap.add_argument("--out", default=os.environ.get("OUT", "hybrid_lookup_out"))
    args = ap.parse_args()
    tokens, ngram = (int(x) for x in args.lookup.split("x"))
    settings = PromptLookupSettings(tokens, ngram)
    torch.manual_seed(0)
    target, drafter, tok = load_reference_pair()
    block = drafter.config.block_size
    eos = target.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    result = {}
    for name in args.sets.split(","):
        t0 = time.perf_counter()
        label, prompts = load_prompts(name, args.prompts, None, args.split)
        new, rounds, checks = 0, {r: 0 for r in RULES}, []
        for i, prompt in enumerate(prompts):
            ids = encode_prompt(tok, prompt)
            with torch.inference_mode():
                plain = target.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False)
            out = plain[0, len(ids) :].tolist()
            out = out[: next((k + 1 for k, t in enumerate(out) if t in eos), len(out))]
            if len(out) < 2:
                continue
            rows = per_position(target, drafter, ids, out, settings, eos)
            walked = {r: walk(rows, r, block) for r in RULES}
            lookup = prompt_lookup_rounds(ids, out, args.max_new_tokens, eos, settings)
            # prompt lookup's own first round verifies candidates with the prefill: its later rounds match ours
            # whenever the prefill committed exactly one token
            if lookup.accepted[0] == 0 and walked["lookup"] != lookup.rounds:
                raise AssertionError(f"{label} prompt {i}: walked lookup {walked['lookup']} != computed {lookup.rounds}")
            if i < args.check:
                with torch.inference_mode():
                    spec, stats = target.generate(torch.tensor([ids]), assistant_model=drafter, do_sample=False,
                                                  max_new_tokens=args.max_new_tokens, length_policy="fixed",
                                                  return_stats=True)  # fmt: skip
                checks.append(dict(prompt=i, real_rounds=stats.rounds, walked=walked["drafter"],
                                   identical=spec[0, len(ids) :].tolist()[: len(out)] == out))  # fmt: skip
            new += len(out) - 1
            for r in RULES:
                rounds[r] += walked[r]
        result[label] = dict(prompts=len(prompts), tau={r: new / max(rounds[r], 1) for r in RULES}, checks=checks,
                             seconds=round(time.perf_counter() - t0, 1))  # fmt: skip
        print(label, json.dumps(result[label]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hybrid_lookup.json").write_text(json.dumps(dict(args=vars(args), sets=result), indent=1) + "\n")
    lines = ["| set (prompts) | " + " | ".join(RULES) + " | walked = real `fixed` rounds |", "|" + "---|" * (len(RULES) + 2)]
    for label, r in result.items():
        ok = all(c["real_rounds"] == c["walked"] and c["identical"] for c in r["checks"])
        lines.append(f"| {label} ({r['prompts']}) | " + " | ".join(f"{r['tau'][x]:.2f}" for x in RULES)
                     + f" | {'yes' if ok else 'NO'} ({len(r['checks'])}) |")  # fmt: skip
    (out / "hybrid_lookup.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
