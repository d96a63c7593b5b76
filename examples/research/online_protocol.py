"""The paper's online protocol through the serving engine: does serving a source make the drafter better on it?

For each method (``opd``, ``osd``; ``off`` is measured once, as nothing changes) a fresh copy of the drafter
serves a stream of one source's prompts through the continuous-batching :class:`~adaflash_hf.engine.Engine`
(``concurrency`` requests decoded together) with an :class:`OnlineAdapter` attached. After every update of
``samples_per_update`` requests, greedy tau is measured on held-out prompts of the same source (disjoint from
the stream) through the same engine with the adapter detached, and every held-out output is compared with
plain greedy decoding. Each measurement also records acceptance per draft position (the paper's Fig. 5c)
and how often a round accepted 0, 1, ..., B-1 drafts (the acceptance density, Fig. 5b).

    python examples/research/online_protocol.py --target T --drafter D --dataset alpaca_eval --updates 4 --out runs/p
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass

import torch

from adaflash_hf.speculation.rounds import mean_tokens_per_round, position_counts
from adaflash_hf.online.adapter import OnlineAdapter, copy_drafter
from adaflash_hf.online.config import OnlineConfig
from online_experiment import HeadError, stream_order
from adaflash_hf.online.versions import write_text_atomic

__all__ = ["ProtocolSettings", "RoundRouter", "eos_ids", "measure_held_out", "parse_args", "prompt_ids", "run_protocol",
           "serving_engine"]


@dataclass(frozen=True)
class ProtocolSettings:
    """How the stream is served and measured (the adapter's own settings are an :class:`OnlineConfig`)."""

    updates: int = 8
    concurrency: int = 32
    max_new_tokens: int = 128
    policy: str = "fixed"
    max_len: int = 2048


class RoundRouter:
    """The engine's round sink: the adapter while the stream is served, a measurement's tally otherwise."""

    def __init__(self):
        self.sink = None

    def on_round(self, verified) -> None:
        if self.sink is not None:
            self.sink.on_round(verified)

    def on_request(self, finished) -> None:
        on_request = getattr(self.sink, "on_request", None)
        if on_request is not None:
            on_request(finished)


def measure_held_out(engine, router, prompts, references, settings: ProtocolSettings, eos) -> dict:
    """Greedy tau of the engine's drafter on ``prompts`` (no adapter), and whether every output is plain greedy's."""
    block = engine.block_size
    head = router.sink = HeadError(block)
    outs = engine.generate(prompts, settings.max_new_tokens, eos_token_id=eos)
    router.sink = None
    accepted = [a for o in outs for a in o.accepted]
    verify = [v for o in outs for v in o.verify_lengths]
    by_pos = position_counts(accepted, verify, block - 1)
    density = Counter(accepted)
    return {
        "tau": mean_tokens_per_round(accepted),
        "identical": all(o.token_ids == r for o, r in zip(outs, references)),
        "rounds": len(accepted),
        "mean_verify_length": sum(verify) / max(len(verify), 1),
        "head_mae": head.mae,
        "acceptance_by_position": [a / v if v else None for v, a in by_pos],
        "accepted_density": [density.get(k, 0) / max(len(accepted), 1) for k in range(block)],
    }


def serving_engine(target, drafter, settings: ProtocolSettings, router):
    from adaflash_hf.engine import Engine

    return Engine(target, drafter, length_policy=settings.policy if drafter is not None else None,
                  max_slots=settings.concurrency, max_len=settings.max_len, token_budget=settings.max_len,
                  round_sink=router)


def _run_method(target, drafter, method, stream, held, refs, eos, settings, config, record) -> dict:
    """One method's curve: held-out measurements after 0, 1, ... updates (``record(curve, updates)`` after each, with
    the adapter's update records so far: a run stopped early keeps the guard's decisions too).

    An update is one training on ``samples_per_update`` served requests, whatever came of it: swapped in, refused by
    the guard or failed. After a refusal or a failure the serving weights are the ones measured last, so that
    measurement is carried (``"measured": False``) instead of repeated; a rollback changes them, so it is measured."""
    d = copy_drafter(drafter, target)
    router = RoundRouter()
    engine = serving_engine(target, d, settings, router)
    curve = [{"update": 0, "served": 0, **measure_held_out(engine, router, held, refs, settings, eos)}]
    record(curve, [])
    if method == "off":
        return {"curve": curve, "updates": [], "failures": 0}
    adapter = OnlineAdapter(d, target, config.replace(method=method))
    served, measured = 0, 0  # measured: the swaps (updates and rollbacks) behind the latest measurement
    try:
        for update in range(1, settings.updates + 1):
            router.sink = adapter
            before = _counts(adapter)
            while _attempts(adapter) < update and served < len(stream) and not adapter.stopped:
                chunk = stream[served : served + config.samples_per_update]
                engine.generate(chunk, settings.max_new_tokens, eos_token_id=eos)
                served += len(chunk)
                adapter.wait_for_update()
            router.sink = None
            if _attempts(adapter) < update:
                break
            stats = adapter.stats
            outcome = next(k for k, b, a in zip(("swapped", "refused", "failed"), before, _counts(adapter)) if a > b)
            swaps = stats["updates"] + stats["rollbacks"]
            if swaps == measured:
                point = {**{k: v for k, v in curve[-1].items() if k not in ("update", "served", "loss", "outcome")},
                         "measured": False}
            else:
                point = measure_held_out(engine, router, held, refs, settings, eos)
            measured = swaps
            curve.append({"update": update, "served": served, "loss": stats["last_loss"], "outcome": outcome, **point})
            record(curve, stats["history"])
            print(f"[protocol] {method} update {update} ({outcome}): held-out tau {curve[-1]['tau']:.3f} "
                  f"identical={curve[-1]['identical']} (served {served})", flush=True)
    finally:
        adapter.close()
    return {"curve": curve, "updates": adapter.stats["history"], "failures": adapter.counters.failures}


def _attempts(adapter: OnlineAdapter) -> int:
    """Updates trained so far, whatever came of them (rollbacks are not trainings)."""
    return sum(_counts(adapter))


def _counts(adapter: OnlineAdapter) -> tuple[int, int, int]:
    c = adapter.counters
    return c.updates, c.swaps_refused, c.failures


def run_protocol(target, drafter, tokenizer, stream, held_out, methods=("opd", "osd", "off"),
                 settings: ProtocolSettings = ProtocolSettings(), config: OnlineConfig | None = None,
                 checkpoint=None) -> dict:
    """Held-out tau per update per method (module docstring); ``stream`` / ``held_out``: lists of prompt ids.
    ``checkpoint(result)`` is called after every measurement (a run stopped early keeps what it measured)."""
    config = config or OnlineConfig()
    eos = eos_ids(tokenizer, target)
    plain = serving_engine(target, None, settings, None)
    refs = [o.token_ids for o in plain.generate(held_out, settings.max_new_tokens, eos_token_id=eos)]
    del plain
    result = {"settings": asdict(settings), "config": {k: str(v) for k, v in asdict(config).items()},
              "stream": len(stream), "held_out": len(held_out), "methods": {}}
    for method in methods:
        torch.manual_seed(config.seed)
        start = time.perf_counter()

        def record(curve, updates, method=method):
            result["methods"][method] = {"curve": curve, "updates": updates, "complete": False}
            if checkpoint is not None:
                checkpoint(result)

        out = _run_method(target, drafter, method, stream, held_out, refs, eos, settings, config, record)
        result["methods"][method] = {**out, "seconds": time.perf_counter() - start, "complete": True}
        if checkpoint is not None:
            checkpoint(result)
    return result


def eos_ids(tokenizer, target) -> tuple[int, ...]:
    ids = set()
    for e in (tokenizer.eos_token_id, getattr(target.generation_config, "eos_token_id", None)):
        ids.update([e] if isinstance(e, int) else (e or []))
    return tuple(sorted(ids))


def prompt_ids(tokenizer, records, limit_tokens: int) -> list[list[int]]:
    from adaflash_hf.generation.prompts import encode_prompt

    ids = [list(encode_prompt(tokenizer, r.get("messages", r.get("text")))) for r in records]
    return [x for x in ids if len(x) <= limit_tokens]


def parse_args(argv=None) -> tuple[argparse.Namespace, OnlineConfig, ProtocolSettings]:
    """The command line's arguments, the adapter's :class:`OnlineConfig` (``--set``, validated) and the
    :class:`ProtocolSettings`, before anything is loaded (a run file's typo fails here, not on the GPU)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--dataset", required=True, help="an eval dataset name (eval_prompts), e.g. spec_bench:rag")
    p.add_argument("--methods", default="opd,osd,off")
    p.add_argument("--held-out", type=int, default=64, help="the first N prompts (after --skip) are measured, never served")
    p.add_argument("--skip", type=int, default=0, help="leave out the first N prompts (e.g. a validation slice)")
    p.add_argument("--stream", type=int, default=None, help="serve at most N prompts (default: all the rest)")
    p.add_argument("--repeat-stream", type=int, default=1, help="serve the stream this many times (small sources)")
    p.add_argument("--seed", type=int, default=0, help="seeds the adapter and the stream's order (0: file order)")
    p.add_argument("--updates", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--policy", default="fixed", choices=("fixed", "adaptive"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an OnlineConfig field (e.g. --set lr=1e-4 --set batch_size=16); repeatable")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    for method in a.methods.split(","):
        if method not in ("opd", "osd", "off"):
            p.error(f"--methods takes opd, osd and off, got {method!r}")
    overrides = {k: _value(v) for k, v in (s.split("=", 1) for s in a.set)}
    config = OnlineConfig(seed=a.seed, **overrides)
    settings = ProtocolSettings(updates=a.updates, concurrency=a.concurrency, max_new_tokens=a.max_new_tokens, policy=a.policy)
    return a, config, settings


def main(argv=None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from adaflash_hf.modeling import AdaFlashDrafter
    from adaflash_hf.training.data import eval_prompts

    a, config, settings = parse_args(argv)
    tok = AutoTokenizer.from_pretrained(a.target)
    target = AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.float32).to(a.device).eval()
    drafter = AdaFlashDrafter.from_pretrained(a.drafter, dtype=torch.float32).to(a.device).eval()
    ids = prompt_ids(tok, eval_prompts(a.dataset)[a.skip :], settings.max_len - settings.max_new_tokens)
    held, rest = ids[: a.held_out], ids[a.held_out :]
    stream = stream_order(rest[: a.stream] if a.stream else rest, a.seed) * a.repeat_stream
    os.makedirs(a.out, exist_ok=True)

    def save(result):
        args = sys.argv[1:] if argv is None else argv
        result.update(dataset=a.dataset, seed=a.seed, command="python examples/research/online_protocol.py " + " ".join(args))
        write_text_atomic(os.path.join(a.out, "protocol.json"), json.dumps(result, indent=2, default=str))

    result = run_protocol(target, drafter, tok, stream, held, tuple(a.methods.split(",")), settings, config, save)
    save(result)
    return 0 if all(c["identical"] for r in result["methods"].values() for c in r["curve"]) else 1


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"none": None, "true": True, "false": False}.get(text.lower(), text)


if __name__ == "__main__":
    raise SystemExit(main())
