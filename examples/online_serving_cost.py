"""What online adaptation costs and buys a server over time (issue 33 items 5 and 7): tok/s and tau per chunk of
requests served through the engine, static (adapter ``off``) against online (OPD), from the same drafter.

Each chunk of ``--chunk`` requests is served at ``--concurrency`` (continuous batching) while the adapter trains
beside it whenever an update is due (no waiting: as a server runs it); a chunk is marked ``training`` when an update
was in progress at its start or end. Writes ``serving_cost.json`` (per chunk: requests served so far, tok/s, tau,
whether an update was training, updates so far) and ``serving_cost.png`` (tok/s and tau per chunk, both runs).

    python examples/online_serving_cost.py --dataset alpaca_eval --requests 2048 --out $OUT/cost
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from adaflash_hf.modeling import AdaFlashDrafter
from adaflash_hf.online import OnlineAdapter, OnlineConfig
from adaflash_hf.online.adapter import copy_drafter
from adaflash_hf.online.protocol import ProtocolSettings, RoundRouter, eos_ids, prompt_ids, serving_engine
from adaflash_hf.spec.rounds import mean_tokens_per_round


def serve(target, drafter, stream, method: str, args, eos, record) -> dict:
    """Serve ``stream`` chunk by chunk with an adapter of ``method`` attached; ``record(rows)`` after each chunk."""
    d = copy_drafter(drafter, target)
    router = RoundRouter()
    settings = ProtocolSettings(concurrency=args.concurrency, max_new_tokens=args.max_new_tokens)
    engine = serving_engine(target, d, settings, router)
    adapter = OnlineAdapter(d, target, OnlineConfig(method=method, lr=args.lr, seed=0))
    router.sink = adapter
    rows, served = [], 0
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
            rows.append({"served": served, "tok_s": tokens / dt, "seconds": dt, "tokens": tokens,
                         "tau": mean_tokens_per_round([a for o in outs for a in o.accepted]),
                         "training": busy_before or adapter.busy, "updates": adapter.updates})
            print(f"[{method}] {served} requests: {rows[-1]['tok_s']:.0f} tok/s, tau {rows[-1]['tau']:.3f}, "
                  f"training={rows[-1]['training']}, updates {adapter.updates}", flush=True)
            record({"chunks": rows})
    finally:
        adapter.close(abandon=True)
    history = adapter.stats["history"]
    return {"chunks": rows, "update_seconds": [h["seconds"] for h in history]}


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

    from adaflash_hf.training.data import eval_prompts

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="adaflash_hf/reference/target")
    p.add_argument("--drafter", default="adaflash_hf/reference/drafter")
    p.add_argument("--dataset", default="alpaca_eval")
    p.add_argument("--requests", type=int, default=2048, help="requests served per run (the source cycled)")
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--methods", default="off,opd")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(a.target)
    target = AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.float32).to(a.device).eval()
    drafter = AdaFlashDrafter.from_pretrained(a.drafter, dtype=torch.float32).to(a.device).eval()
    ids = prompt_ids(tok, eval_prompts(a.dataset), 2048 - a.max_new_tokens)
    stream = (ids * (a.requests // len(ids) + 1))[: a.requests]
    eos = eos_ids(tok, target)
    result = {"dataset": a.dataset, "concurrency": a.concurrency, "chunk": a.chunk, "lr": a.lr, "methods": {}}
    os.makedirs(a.out, exist_ok=True)
    def save(method, r):  # after every chunk: a run stopped early keeps what it served
        result["methods"][method] = r
        with open(os.path.join(a.out, "serving_cost.json"), "w") as f:
            json.dump(result, f, indent=1)

    for method in a.methods.split(","):
        save(method, serve(target, drafter, stream, method, a, eos, lambda r, m=method: save(m, r)))
    plot(result, os.path.join(a.out, "serving_cost.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
