"""`adaflash generate`: speculative decoding of prompts given on the command line or in a jsonl file."""

from __future__ import annotations

import json
import os
import sys
import time

from ..loading import PROMPTS_HINT, UsageError
from .common import (
    PROG,
    add_model_args,
    add_sampling_args,
    check_policy,
    encode,
    load_models_from_args,
    positive_float,
    positive_int,
    progress,
    read_prompts_file,
    sampling_kwargs,
    verify_summary,
    write,
)

HELP = "generate text with a target + drafter (or --reference), optionally with per-round statistics"
DESCRIPTION = (
    "Generate with speculative decoding: target.generate(..., assistant_model=drafter). Prompts come from\n"
    "--prompt (repeatable) and/or --prompts-file (jsonl, one {\"prompt\": ...} or {\"messages\": [...]}\n"
    "per line), go through the tokenizer's chat template unless --no-chat-template, and are decoded\n"
    "--batch-size at a time (left padded). Greedy by default; --temperature > 0 samples losslessly.\n\n"
    "example:\n  adaflash generate --reference --prompt 'What is 2+2?' --stats --check"
)


def add_arguments(p) -> None:
    add_model_args(p)
    g = p.add_argument_group("prompts")
    g.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    g.add_argument("--prompts-file", help=f"prompts: {PROMPTS_HINT}")
    g.add_argument("--system", help="system message prepended to every prompt")
    g = add_sampling_args(p, 128)
    g.add_argument("--length-rate", type=positive_float, default=None, help="length head scale: adaptive k_hat = floor(a*B*rate); cost: expected accepted a*B*rate - 1")
    g.add_argument("--length-min", type=positive_int, default=None, help="smallest verify length (bonus slot included)")
    g.add_argument("--batch-size", type=positive_int, default=1, help="prompts decoded together")
    g.add_argument("--no-drafter", action="store_true", help="plain decoding with the target only (for comparison)")
    g = p.add_argument_group("output")
    g.add_argument("--stats", action="store_true", help="print tau, rounds and chosen verify lengths per batch, and a JSON summary")
    g.add_argument("--check", action="store_true", help="also decode plainly and report whether the outputs are identical (greedy only)")
    g.add_argument("--output", help="also write {prompt, response} records to this jsonl file")


def _records(args) -> list[dict]:
    if not args.prompt and not args.prompts_file:
        raise UsageError("no prompt given", "pass --prompt TEXT (repeatable) or --prompts-file FILE.jsonl")
    if args.check and args.temperature > 0:
        raise UsageError("--check compares with plain greedy decoding: it cannot apply with --temperature > 0",
                         "drop --check, or decode greedily (--temperature 0)")
    sampling_kwargs(args)  # refuses sampling flags that cannot apply, before anything loads
    records = [{"messages": [{"role": "user", "content": p}], "domain": None} for p in (args.prompt or [])]
    if args.prompts_file:
        records += read_prompts_file(args.prompts_file)
    if args.no_drafter and args.drafter:
        raise UsageError("--no-drafter and --drafter contradict each other", "drop one of them")
    unused = [f for f, v in (("--length-policy", args.length_policy), ("--length-rate", args.length_rate),
                             ("--length-min", args.length_min)) if v is not None]
    if args.no_drafter and unused:
        raise UsageError(f"{', '.join(unused)} cannot apply with --no-drafter (no verify rounds)", "drop them, or the --no-drafter")
    if args.output and os.path.isdir(args.output):
        raise UsageError(f"--output {args.output} is a directory", "pass a file name, e.g. out.jsonl")
    return records


def _spec_kwargs(args, drafter) -> dict:
    if drafter is None:
        return {}
    spec = dict(assistant_model=drafter, return_stats=True)
    for key in ("length_policy", "length_rate", "length_min"):
        if getattr(args, key) is not None:
            spec[key] = getattr(args, key)
    return spec


def _until_eos(new, eos: set) -> list[int]:
    kept = []
    for t in new.tolist():  # up to the first stop token (a finished row is padded after it)
        kept.append(t)
        if t in eos:
            break
    return kept


class _Run:
    """One `adaflash generate` invocation: the models, the prompts, and what has been produced so far."""

    def __init__(self, args, target, drafter, tok, records, out_file):
        self.args, self.target, self.drafter, self.tok, self.records, self.out_file = args, target, drafter, tok, records, out_file
        self.rows = [encode(tok, r["messages"], not args.no_chat_template, args.system) for r in records]
        pad = tok.pad_token_id if tok.pad_token_id is not None else (target.generation_config.pad_token_id or 0)
        self.pad = pad[0] if isinstance(pad, list) else pad
        self.gen, self.spec = sampling_kwargs(args), _spec_kwargs(args, drafter)
        eos = target.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.all_stats, self.total_new, self.total_time, self.identical = [], 0, 0.0, True

    def batch(self, b0: int) -> None:
        import torch

        from ..generation.prompts import left_pad

        args, target = self.args, self.target
        batch = self.rows[b0 : b0 + args.batch_size]
        ids, mask = left_pad(batch, self.pad, next(target.parameters()).device)
        torch.manual_seed(args.seed)
        t0 = time.perf_counter()
        with torch.inference_mode():
            res = target.generate(ids, attention_mask=mask, pad_token_id=self.pad, **self.gen, **self.spec)
        elapsed = time.perf_counter() - t0
        out, stats = res if self.drafter is not None else (res, None)
        ref = None
        if args.check and self.drafter is not None:
            with torch.inference_mode():
                ref = target.generate(ids, attention_mask=mask, pad_token_id=self.pad, **self.gen)
        self.total_time += elapsed
        for j in range(len(batch)):
            self.emit(b0 + j, out[j], out[j, ids.shape[1] :], None if ref is None else ref[j])
        if stats is not None:
            self.all_stats.append(stats)
            if args.stats:
                write(f"  [stats] rows {b0 + 1}-{b0 + len(batch)}: tau {stats.tau:.2f}, {stats.rounds} rounds, "
                      f"policy {stats.policy}, verify lengths [{verify_summary(stats.verify_lengths)}], {elapsed:.2f} s")

    def emit(self, k: int, row, new, ref_row) -> None:
        import torch

        kept = _until_eos(new, self.eos)
        self.total_new += len(kept)
        text = self.tok.decode(kept, skip_special_tokens=True)
        if len(self.rows) > 1:
            write(f"### [{k + 1}/{len(self.rows)}] {self.records[k]['messages'][-1]['content']}")
        write(text)
        record = {"prompt": self.records[k]["messages"], "response": text}
        if ref_row is not None:
            same = torch.equal(row, ref_row)
            self.identical &= same
            record["identical_to_plain"] = same
            if self.args.stats or not same:
                write(f"  identical to plain greedy: {same}")
        if self.out_file is not None:
            self.out_file.write(json.dumps(record) + "\n")

    def summary(self) -> dict:
        all_stats, total_time = self.all_stats, self.total_time
        rounds = sum(s.rounds for s in all_stats)
        accepted = sum(sum(s.accepted) for s in all_stats)
        summary = {"prompts": len(self.rows), "new_tokens": self.total_new, "seconds": round(total_time, 3),
                   "tokens_per_s": round(self.total_new / total_time, 1) if total_time else None}
        if all_stats:  # tau over every batch
            from ..speculation.rounds import tokens_per_round

            summary.update(tau=round(tokens_per_round(accepted, rounds), 3) if rounds else None, rounds=rounds,
                           policy=all_stats[0].policy,
                           mean_verify_length=round(sum(sum(s.verify_lengths) for s in all_stats) / max(rounds, 1), 3))
        return summary


def _warm_up(args, job: "_Run", target, drafter) -> None:
    """Build the engine generate will run on and capture its graphs before the first (timed) batch."""
    from ..generation.fast_path import warmup

    seconds = warmup(target, drafter, batch_size=min(args.batch_size, len(job.rows)), prompt_len=max(map(len, job.rows)),
                     max_new_tokens=args.max_new_tokens, length_policy=args.length_policy, length_rate=args.length_rate,
                     length_min=args.length_min)
    if args.stats:
        write(f"  [stats] engine built and warmed up in {seconds:.1f} s")


def run(args) -> int:
    records = _records(args)
    target, drafter, tok = load_models_from_args(args, need_drafter=not args.no_drafter)
    if args.no_drafter:
        drafter = None  # --reference loads the pair; --no-drafter decodes with its target alone
    if drafter is not None:
        check_policy(drafter, args.length_policy)
    out_file = open(args.output, "w", encoding="utf-8") if args.output else None
    job = _Run(args, target, drafter, tok, records, out_file)
    if drafter is not None and next(target.parameters()).device.type == "cuda":
        _warm_up(args, job, target, drafter)
    bar = progress(total=len(job.rows), desc="generate", unit="prompt", leave=False)
    try:
        for b0 in range(0, len(job.rows), args.batch_size):
            job.batch(b0)
            bar.update(min(args.batch_size, len(job.rows) - b0))
    finally:
        bar.close()
        if out_file is not None:
            out_file.close()
    if args.stats:
        print("[stats] " + json.dumps(job.summary()), file=sys.stderr)
    if args.output:
        print(f"wrote {args.output}", file=sys.stderr)
    if not job.identical:
        print(f"{PROG}: generate: speculative output differs from plain greedy decoding", file=sys.stderr)
        return 1
    return 0
