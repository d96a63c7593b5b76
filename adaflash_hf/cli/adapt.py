"""`adaflash adapt`: serve a jsonl stream of prompts with an `OnlineAdapter` attached, write versions."""

from __future__ import annotations

import json
import os
import sys
import time

from ..loading import PROMPTS_HINT
from .common import (
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
)
from .online_args import add_online_args, check_online_args, online_adapter

HELP = "online adaptation: serve a jsonl stream of prompts with an OnlineAdapter attached, write versions"
DESCRIPTION = (
    "Serve every prompt of --prompts-file with speculative decoding while an OnlineAdapter distils the\n"
    "drafter from the target's verification feedback (OPD; OSD as a baseline) in a background thread.\n"
    "Every update is swapped in between rounds and written atomically as a numbered version\n"
    "(--output-dir/v00001, ..., LATEST), and pushed to the Hub when --hub-repo is given (credentials from\n"
    "HF_TOKEN or `hf auth login`). Output stays identical to the target's; tau per update is printed at\n"
    "the end.\n\nexample:\n  adaflash adapt --reference --prompts-file prompts.jsonl --output-dir runs/online --samples-per-update 64"
)


def add_arguments(p) -> None:
    add_model_args(p)
    g = p.add_argument_group("stream")
    g.add_argument("--prompts-file", required=True, help=f"the prompt stream: {PROMPTS_HINT} (optional \"domain\" tags)")
    g.add_argument("--max-prompts", type=positive_int, help="serve only the first N prompts")
    add_sampling_args(p, 128)
    g = p.add_argument_group("adaptation")
    add_online_args(g)
    g.add_argument("--wait", action="store_true", help="after each prompt, wait for a triggered update to finish (reproducible)")
    g.add_argument("--flush", action="store_true", help="at the end, also train on the partial buffer")
    g.add_argument("--timeout", type=positive_float, default=600.0, help="seconds to wait for pending updates / pushes at the end")


def _records(args) -> list[dict]:
    sampling_kwargs(args)  # refuses sampling flags that cannot apply, before anything loads
    check_online_args(args)
    records = read_prompts_file(args.prompts_file)
    if args.max_prompts:
        records = records[: args.max_prompts]
    return records


def _serve(args, records, target, drafter, tok, adapter) -> int:
    """Serve every record with the adapter attached; the number of new tokens served."""
    import torch

    device = next(target.parameters()).device
    gen = sampling_kwargs(args)
    spec = {"length_policy": args.length_policy} if args.length_policy else {}
    served_tokens = 0
    bar = progress(total=len(records), desc="adapt", unit="prompt")
    try:
        for rec in records:
            adapter.set_domain(rec.get("domain"))
            ids = torch.tensor([encode(tok, rec["messages"], not args.no_chat_template)], device=device)
            torch.manual_seed(args.seed)
            with torch.inference_mode():
                out = target.generate(ids, assistant_model=drafter, **gen, **spec)
            served_tokens += out.shape[1] - ids.shape[1]
            if args.wait:
                adapter.wait_for_update()
            st = adapter.stats
            tau = st["tau_since_update"]
            bar.set_postfix(updates=st["updates"], tau="-" if tau is None else f"{tau:.2f}", refresh=False)
            bar.update(1)
    finally:
        bar.close()
        adapter.close(flush=args.flush, timeout=args.timeout, hub_timeout=args.timeout)
    return served_tokens


def _report(args, stats) -> None:
    if stats["history"]:
        print("\n| update | version | samples | loss first -> last | tau before | tau after (rounds) |")
        print("|---|---|---|---|---|---|")
        fmt = lambda x, d=3: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
        for h in stats["history"]:
            version = "refused" if not h["swapped"] else ("-" if h["version"] is None else str(h["version"]))
            if h["rollback_of"] is not None:
                version += " (rollback)"
            print(f"| {h['update']} | {version} | {h['samples']} | "
                  f"{fmt(h['loss_first'])} -> {fmt(h['loss_last'])} | {fmt(h['tau_before'], 2)} | "
                  f"{fmt(h['tau_after'], 2)} ({h['rounds_after']}) |")
        print("\ntau before: mean tokens per round served with the previous weights; tau after: with this update's weights. "
              "refused: the update lowered acceptance on held-back requests and never served; rollback: the update's "
              "previous weights restored after served tau fell.")
    elif args.method == "off":
        tau = stats["tau_since_update"]
        print(f"--method off: no training; tau over the stream {'-' if tau is None else f'{tau:.2f}'}")
    else:
        print(f"no update ran: {stats['rounds_seen']} rounds served, {args.samples_per_update or 'the default'} needed per update "
              "(pass --flush to train on a partial buffer, or lower --samples-per-update)")


def run(args) -> int:
    from ..online import list_versions

    records = _records(args)
    target, drafter, tok = load_models_from_args(args)
    check_policy(drafter, args.length_policy)
    adapter = online_adapter(args, drafter, target)
    cfg = adapter.config
    print(f"online adaptation ({cfg.method}) over {len(records)} prompts from {args.prompts_file}: an update every "
          f"{cfg.samples_per_update} {'finished requests' if cfg.sample_unit == 'request' else 'verified rounds'}, versions in {args.output_dir}"
          + (f", pushed to https://huggingface.co/{args.hub_repo}" if args.hub_repo else ""))
    adapter.attach()
    start = time.perf_counter()
    served_tokens = _serve(args, records, target, drafter, tok, adapter)
    stats = adapter.stats
    elapsed = time.perf_counter() - start
    print(f"\nserved {len(records)} prompts ({served_tokens} tokens, {stats['rounds_seen']} verify rounds) in {elapsed:.1f} s; "
          f"{stats['updates']} update(s), {stats['failures']} failed")
    _report(args, stats)
    versions = list_versions(args.output_dir) if os.path.isdir(args.output_dir) else []
    if versions:
        print(f"versions on disk: {', '.join(p.name for _, p in versions)} (newest: {versions[-1][1]})")
    if stats["hub"] is not None:
        print(f"hub: {json.dumps(stats['hub'], default=str)}")
    if stats["last_error"]:
        print(f"last update error: {stats['last_error']}", file=sys.stderr)
    return 0
