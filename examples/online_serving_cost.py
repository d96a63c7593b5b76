"""What online adaptation costs and buys a server over time (issue 33 items 5 and 7): tok/s and tau per chunk of
requests served through the engine, static (adapter ``off``) against online (OPD), from the same drafter.

Each chunk of ``--chunk`` requests is served at ``--concurrency`` (continuous batching) while the adapter trains
beside it whenever an update is due (no waiting: as a server runs it); a chunk is marked ``training`` when an update
was in progress at its start or end. Writes ``serving_cost.json`` (per chunk: requests served so far, tok/s, tau,
whether an update was training, updates so far) and ``serving_cost.png`` (tok/s and tau per chunk, both runs).

    python examples/online_serving_cost.py --dataset alpaca_eval --requests 2048 --out $OUT/cost
    python examples/online_serving_cost.py --methods off,opd@0.25,opd@0.25+process   # thread vs child process
    python examples/online_serving_cost.py --smoke          # CPU: built-in prompts, 12 requests, an update every 4
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
from adaflash_hf.engine.warmup import warmup
from adaflash_hf.modeling import AdaFlashDrafter
from adaflash_hf.online import OnlineAdapter, OnlineConfig
from adaflash_hf.online.adapter import copy_drafter
from adaflash_hf.speculation.rounds import mean_tokens_per_round

sys.path.insert(0, str(Path(__file__).resolve().parent / "research"))  # the online protocol's engine and router
from online_protocol import ProtocolSettings, RoundRouter, eos_ids, prompt_ids, serving_engine  # noqa: E402


def serve(target, drafter, stream, run: str, args, eos, record) -> dict:
    """Serve ``stream`` chunk by chunk with an adapter attached as ``run`` says (``off``, ``opd``, ``opd@0.25``: OPD
    with ``train_share`` 0.25; a ``+process`` suffix trains in a child process); ``record(rows)`` after each chunk."""
    spec, _, trainer = run.partition("+")
    method, _, share = spec.partition("@")
    d = copy_drafter(drafter, target)
    router = RoundRouter()
    settings = ProtocolSettings(concurrency=args.concurrency, max_new_tokens=args.max_new_tokens)
    engine = serving_engine(target, d, settings, router)
    # Capture and compile before timing (both runs alike): the first chunks would otherwise time graph captures.
    warmup(engine, args.concurrency)
    engine.generate(stream[: args.chunk], args.max_new_tokens, eos_token_id=eos)
    adapter = OnlineAdapter(d, target, OnlineConfig(method=method, lr=args.lr, seed=0, train_share=float(share or 1.0),
                                                    samples_per_update=args.samples_per_update, trainer=trainer or "thread"))
    router.sink = adapter
    rows, served, texts = [], 0, []
    try:
        for start in range(0, len(stream), args.chunk):
            chunk = stream[start : start + args.chunk]
            busy_before = adapter.busy
            t0 = time.perf_counter()
            outs = engine.generate(chunk, args.max_new_tokens, eos_token_id=eos)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            served += len(chunk)
            tokens = sum(len(o.token_ids) for o in outs)
            texts.extend(o.token_ids for o in outs)
            rows.append({"served": served, "tok_s": tokens / dt, "seconds": dt, "tokens": tokens,
                         "tau": mean_tokens_per_round([a for o in outs for a in o.accepted]),
                         "training": busy_before or adapter.busy, "updates": adapter.counters.updates})
            print(f"[{run}] {served} requests: {rows[-1]['tok_s']:.0f} tok/s, tau {rows[-1]['tau']:.3f}, "
                  f"training={rows[-1]['training']}, updates {adapter.counters.updates}", flush=True)
            record({"chunks": rows, "outputs": texts})
        adapter.wait_for_update(120)  # the update triggered last: counted, not timed
    finally:
        adapter.close(abandon=True)
    history = adapter.stats["history"]
    return {"chunks": rows, "outputs": texts, "updates": adapter.counters.updates, "update_seconds": [h["seconds"] for h in history]}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(6, 5), sharex=True)
    for method, r in result["methods"].items():
        xs = [c["served"] for c in r["chunks"]]
        a.plot(xs, [c["tok_s"] for c in r["chunks"]], marker=".", label=method)
        b.plot(xs, [c["tau"] for c in r["chunks"]], marker=".", label=method)
    a.set_ylabel("tok/s")
    b.set_ylabel("tau of the chunk")
    b.set_xlabel("requests served")
    a.legend()
    a.set_title(f"{result['dataset']}: static (off) vs online (opd), concurrency {result['concurrency']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from adaflash_hf.training.data import builtin_prompts, eval_prompts

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="a target folder (default: the embedded reference pair)")
    p.add_argument("--drafter", help="its drafter folder (with --target)")
    p.add_argument("--dataset", default="alpaca_eval")
    p.add_argument("--requests", type=int, default=2048, help="requests served per run (the source cycled)")
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--samples-per-update", type=int, default=128)
    p.add_argument("--methods", default="off,opd", help="runs: off, opd, osd; METHOD@SHARE sets train_share (opd@0.25); "
                   "+process trains in a child process (opd+process, opd@0.5+process)")
    p.add_argument("--smoke", action="store_true", help="CPU check: built-in prompts, 12 requests, an update every 4")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="serving_cost")
    a = p.parse_args(argv)
    if a.smoke:
        a.requests, a.chunk, a.concurrency, a.max_new_tokens, a.samples_per_update, a.device = 12, 4, 4, 16, 4, "cpu"
    if a.target:
        tok = AutoTokenizer.from_pretrained(a.target)
        target = AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.float32)
        drafter = AdaFlashDrafter.from_pretrained(a.drafter, dtype=torch.float32)
    else:
        target, drafter, tok = load_reference_pair()
    target, drafter = target.to(a.device).eval(), drafter.to(a.device).eval()
    records = builtin_prompts("chat") if a.smoke else eval_prompts(a.dataset)
    ids = prompt_ids(tok, records, 2048 - a.max_new_tokens)
    stream = (ids * (a.requests // len(ids) + 1))[: a.requests]
    eos = eos_ids(tok, target)
    result = {"dataset": a.dataset, "concurrency": a.concurrency, "chunk": a.chunk, "lr": a.lr, "methods": {}}
    os.makedirs(a.out, exist_ok=True)
    outputs = {}  # per run, compared at the end (not written: megabytes of token ids)

    def save(method, r):  # after every chunk: a run stopped early keeps what it served
        outputs[method] = r["outputs"]
        result["methods"][method] = {k: v for k, v in r.items() if k != "outputs"}
        result["outputs_equal_across_runs"] = all(o == next(iter(outputs.values())) for o in outputs.values())
        with open(os.path.join(a.out, "serving_cost.json"), "w") as f:
            json.dump(result, f, indent=1)

    for method in a.methods.split(","):
        save(method, serve(target, drafter, stream, method, a, eos, lambda r, m=method: save(m, r)))
    plot(result, os.path.join(a.out, "serving_cost.png"))
    same = result["outputs_equal_across_runs"]  # greedy: every run gives the target's own tokens
    updates = {m: r["updates"] for m, r in result["methods"].items()}
    updated = any(n > 0 for run, n in updates.items() if not run.startswith("off"))
    print(f"updates per run: {updates}; online run updated: {updated}; outputs equal across runs: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
