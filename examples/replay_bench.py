"""ACCEPTANCE REPLAY at the Qwen3-8B shape on one H200, plus the reference pair's own engine runs (issue 35 item 4):
the engine's tok/s of ``off`` / ``fixed`` / ``packed`` (the paper's adaptive floor rule) / ``default`` per
concurrency under known acceptance traces, closed batch and open-loop Poisson arrivals. Replay, not a model's result.

Random weights accept nothing, so the drafted tokens are made to follow a trace
(:mod:`adaflash_hf.bench.replay`): the 8B-shaped target (random bf16 weights) and a 5-layer drafter of
the z-lab DFlash shape (block 16, length head) run every forward and kernel of every round, the drafts
agree with the target's own greedy continuation for the trace's accepted count of that round and are
wrong right after, and the length head's ratio is the trace's. Each trace is replayed at the verify-length
settings of the drafter that recorded it (``ReplayPolicy``: the shipped head's rate 2.0, not the replay drafter's
1.0). The engine's real verify lengths, packing, graphs and reads are what is timed.

Traces (``--traces``):
  ``paper``      the paper's DFlash per-slot acceptance on Qwen3-8B (slot 1 0.89 ... slot 15 0.13,
                 geometric between the published ends: tau 7.06), oracle head (k_hat = accepted + 1, rate 1.0);
  ``paper_ref``  the same acceptance, head ratios of the reference pair's length head for rounds that
                 accepted as many (its real calibration, recorded on ``--ratio-set``), at the pair's policy;
  ``<set>``      the reference pair's own rounds on that eval set (``fixed`` mode, whole blocks, float32), accepted
                 counts and head ratios as recorded, each replayed request walking a recorded request's rounds in
                 order (``RecordedTrace.stream``: runs before 2026-12-05 drew them at random, which hides the
                 ratio's memory from round to round that the engine's guess before drafting uses; the two
                 shipped-head ``paper_ref`` rows stay random: per-slot acceptance has no order). Each such set also
                 gets the pair's real engine runs at
                 ``--real-concurrency`` (closed batch, EOS honoured, every mode; identity against ``off``).

Modes (``--modes``, round layouts of ``adaflash_hf.speculation.length.names.LAYOUTS``) and ``default``: what the trace's drafter
runs when no policy is asked for (its config's default policy); where its settings equal a mode's, that mode's
row stands for it (``same_as``). Arrivals (``--arrivals``): ``closed`` (one request per slot, all at once) and
``poisson:LOAD`` (open loop, ``max(c, --poisson-min-requests)`` requests at LOAD x ``off``'s closed-batch request
rate at that concurrency, at most c in the engine: mean latency and tok/s). One engine alive at a time: the one of
a setting is freed (its caches and graph pools) before the next setting's is built, so that c=128 fits an 80 GB card;
at each concurrency every trace of a setting runs on one engine (rows grouped by setting within a concurrency).

The target's greedy argmax is made decisive before anything runs: the embedding is scaled up so the
residual stream carries the input token, and the LM head rows are a permutation of the embedding
rows, so the next greedy token is ``perm[token]`` by a wide margin. Every forward is unchanged in
cost, but bf16 rounding that differs between batch shapes cannot flip an argmax, so the
precomputed continuation is what every verify accepts. Every output is checked against it (the
``off`` engine's and, for one prompt, HF ``generate``'s).

Writes ``replay_bench.json`` and ``replay_bench.md`` (issue 35's table per arrival pattern, then the rows behind it;
``replay_tables.py``) into ``--out`` (default ``$OUT``), rewritten after every row; rows are run in order of
importance (reference pair, closed batch, then each Poisson load) and skipped past ``--budget-s``.

The reference pair's prompts come from ``$ADAFLASH_DATA`` (default: ``shared/data`` in the checkout, else the
small excerpt in ``tests/fixtures/data``).

Usage:
    python examples/replay_bench.py --out $OUT                     # H200, every row: see BENCHMARKS section 9
    python examples/replay_bench.py --out $OUT --traces paper,paper_ref,gsm8k --arrivals closed --concurrency 1,32,128
    python examples/replay_bench.py --smoke --out /tmp/replay      # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_common as common  # noqa: E402  (the 8B builder, prompt loading, timing helpers)

from replay_tables import markdown  # noqa: E402

from adaflash_hf.bench.arrivals import poisson_arrivals, run_open_loop  # noqa: E402
from adaflash_hf.bench.replay import DraftReplay, RecordedTrace, paper_dflash_trace  # noqa: E402
from adaflash_hf.engine import LAYOUTS, Engine, EngineConfig, layout_args, round_layout  # noqa: E402
from adaflash_hf.engine.round_overhead import measure_room  # noqa: E402
from adaflash_hf.engine.warmup import measure_round_cost  # noqa: E402
from adaflash_hf.speculation.rounds import mean_tokens_per_round  # noqa: E402
from adaflash_hf.speculation.length.cost import RoundCost  # noqa: E402

log = common.log
BLOCK = 16
QUEUED = 8  # the queued mode's rounds behind one read (EngineConfig.spec_rounds)
EMBED_SCALE = 5e4  # embedding elements ~1000 against a residual update of ~15 RMS over 36 random layers


def decisive_argmax(model, seed: int = 0) -> torch.Tensor:
    """Make the greedy next token ``perm[token]`` with a wide margin (see the module docstring); returns ``perm``."""
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if emb.data_ptr() == head.data_ptr():
        raise ValueError("decisive_argmax needs untied embeddings")
    perm = torch.randperm(emb.shape[0], generator=torch.Generator().manual_seed(seed)).to(emb.device)
    with torch.no_grad():
        head[perm] = emb  # the logit of perm[t] is the input embedding of t against itself
        emb.mul_(EMBED_SCALE)
    return perm


def build_drafter(target, device, smoke: bool):
    """A 5-layer drafter of the target's width (z-lab DFlash shape: block 16, 5 target layers), random
    bf16 weights built on the device, with a length head; bound to ``target``."""
    from adaflash_hf import AdaFlashDrafter

    vocab = target.get_input_embeddings().weight.shape[0]
    torch.manual_seed(1)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            d = AdaFlashDrafter.from_target(target, num_layers=5, block_size=BLOCK, mask_token_id=vocab - 1,
                                            use_length_head=True)
    finally:
        torch.set_default_dtype(old)
    return d.eval()


def mode_args(drafter, mode: str, policy) -> dict:
    """The ``Engine`` arguments of ``mode``: a round layout of :data:`LAYOUTS` (``packed:adaptive``: that layout's
    lengths by the paper's floor rule instead of the ``cost`` rule), or ``default``, what the trace's drafter runs when
    no policy is asked for (``policy``: its :class:`ReplayPolicy`)."""
    if mode == "default":
        return {"drafter": drafter, "length_policy": policy.length_policy}
    if mode == "queued":  # fixed rounds, QUEUED of them behind one read (EngineConfig.spec_rounds)
        return {**layout_args(drafter, "fixed"), "spec_rounds": QUEUED}
    layout, _, rule = mode.partition(":")
    return layout_args(drafter, layout, rule or "cost")


class Engines:
    """The engine of one set of ``Engine`` arguments at a time, with its own :class:`DraftReplay` (request ids are per
    engine) unless ``refs`` is ``None``: asking for another frees this one (caches, graph pools) before building it.
    ``builds`` counts the engines built (a new one has captured nothing yet)."""

    def __init__(self, target, drafter, refs, **kw):
        self.target, self.drafter, self.refs, self.kw, self.built = target, drafter, refs, kw, {}
        self.round_cost = None  # measured on the device (--measure-cost): every engine built after takes it
        self.builds = 0

    def get(self, mode: str, policy):
        """``(engine, replay, key)`` for ``mode`` under ``policy``; ``key`` names the settings (two modes of equal
        key are the same run)."""
        args = mode_args(self.drafter, mode, policy)
        key = round_layout(args["drafter"], args.get("length_policy"), args.get("rectangular", False)) + (
            f":{args['length_policy']}" if "length_policy" in args else "") + (
            f":queued{args['spec_rounds']}" if "spec_rounds" in args else "")
        if key not in self.built:
            self.free()
            replay = DraftReplay(self.refs, None) if self.refs is not None and args["drafter"] is not None else None
            self.built[key] = (Engine(self.target, **args, draft_replay=replay, round_cost=self.round_cost, **self.kw), replay)
            self.builds += 1
        eng, replay = self.built[key]
        policy.apply(eng)
        return eng, replay, key

    def free(self) -> None:
        """Drop the live engine and give its device memory back."""
        self.built.clear()
        common.free_memory()


def measure_cost(target, drafter, kw: dict, context: int) -> tuple:
    """``(RoundCost, its record for meta)``: the round cost of a ``packed`` engine of ``kw`` on this device, its
    graphs and its real rounds' overheads (:func:`measure_round_cost`)."""
    t = time.perf_counter()
    # a prompt, and the timed rounds of each kind after it (--smoke's slots are short)
    steps = kw.get("decode_steps", EngineConfig().decode_steps)
    room = context + measure_room(drafter.config.block_size, steps)
    probe = Engine(target, **layout_args(drafter, "packed"), **{**kw, "max_len": max(kw["max_len"], room)})
    cost = measure_round_cost(probe, context=context)
    del probe
    common.free_memory()
    rec = {**cost.to_json(), "seconds": time.perf_counter() - t}
    log(f"measured round cost in {rec['seconds']:.1f}s: unit {cost.unit_ms:.3f} ms, draft fraction {cost.draft_fraction:.3f}, "
        f"overhead per round at rows {cost.rows}: drafting {[round(v, 2) for v in cost.spec_overhead]}, plain "
        f"{[round(v, 2) for v in cost.plain_overhead]}, the read whole blocks spare {[round(v, 2) for v in cost.read_overhead]} units")
    return cost, rec


def timeline_cost(eng, engines, c: int, args):
    """The round cost a ``--timeline-at`` row prices its steps with (``None``: no timeline at ``c``): the engine's own,
    else the one the engines were given (an ``off`` engine prices its plain steps as the default's planner would)."""
    if c not in {int(x) for x in args.timeline_at.split(",") if x}:
        return None
    own = eng.round_cost if eng.drafter is not None else None
    return own or engines.round_cost or RoundCost()


def reference_pair_phase(res, row, device, sets, args, smoke):
    """Per set: the reference pair (float32) records its whole-block rounds (the replay's traces, with the pair's
    policy) and runs for real at ``res['meta']['real_concurrency']`` in every mode; returns ``{set: RecordedTrace}``."""
    traces, conc = {}, res["meta"]["real_concurrency"]
    profile_at = {int(c) for c in args.profile_at.split(",") if c}
    n_rec, max_new = (2, 24) if smoke else (args.record_prompts, args.max_new_tokens)
    for name in sets:
        t = time.perf_counter()
        target, drafter, prompts, eos, source = common.reference_pair(device, torch.float32, name, max([n_rec, *conc]))
        prompts = [prompts[i % len(prompts)] for i in range(max([n_rec, *conc]))]
        longest = max(map(len, prompts))
        rec = RecordedTrace.record(target, drafter, prompts[:n_rec], max_new, name=f"reference pair, {name}",
                                   eos_token_id=eos, max_slots=n_rec, token_budget=max(4096, longest + n_rec * BLOCK))
        traces[name] = rec
        log(f"trace {name} ({source}): {len(rec.rounds)} whole-block rounds, tau {rec.tau:.2f}, mean head ratio "
            f"{statistics.mean(r.ratio for r in rec.rounds):.3f}, policy {rec.policy} ({time.perf_counter() - t:.1f}s)")
        if name not in res["meta"]["real_sets"]:
            continue
        kw = dict(max_slots=max(conc), max_len=longest + max_new + 8, token_budget=max(4096, longest + max(conc) * BLOCK),
                  cuda_graphs=True)
        engines = Engines(target, drafter, None, **kw)
        if args.measure_cost:  # the pair's own round: its host time is most of it (BENCHMARKS section 9)
            engines.round_cost, res["meta"].setdefault("round_cost_real", {})[name] = measure_cost(target, drafter, kw, longest)
        for c in conc:
            off = engines.get("off", rec.policy)[0]
            refs = {tuple(p): o.token_ids for p, o in zip(prompts[:c], off.generate(prompts[:c], max_new, eos_token_id=eos))}
            del off  # the engines hold the live one: the next mode's build frees it
            modes = res["meta"]["modes"]
            for mode in [m for m in modes if m == "off"] + [m for m in modes if m != "off"]:  # off's engine first: alive
                eng, _, key = engines.get(mode, rec.policy)
                row(dict(kind="real", mode=mode, trace=name, concurrency=c, arrival="closed"),
                    lambda: run_row(eng, None, prompts[:c], refs, max_new, device, args.reps, True,
                                    profile=c in profile_at, eos=eos, timeline=timeline_cost(eng, engines, c, args)), key)
        engines.free()
        del engines, target, drafter
        common.free_memory()
    return traces


def poisson_row(eng, replay, prompts, refs, max_new, device, rate, c, seed) -> dict:
    """One open-loop row: ``len(prompts)`` Poisson arrivals at ``rate`` requests per second, at most ``c`` in the
    engine (:func:`run_open_loop`), with the identity and trace checks; graph captures inside it are reported."""
    captures = lambda: eng.graphs.capture_seconds + (eng.draft_graphs.capture_seconds if eng.draft_graphs else 0.0)  # noqa: E731
    c0 = captures()
    r = run_open_loop(eng, prompts, max_new, poisson_arrivals(len(prompts), rate, seed), c, sync=lambda: common.sync(device))
    outs = r.pop("outputs")
    acc = [a for o in outs for a in o.accepted]
    row = {**{k: v for k, v in r.items() if k not in ("submitted_s", "done_s")},
           "rate": rate, "requests": len(prompts), "capture_s": captures() - c0,
           "tau": mean_tokens_per_round(acc) if acc else 1.0,
           "identical": sum(o.token_ids == refs[tuple(p)] for o, p in zip(outs, prompts))}
    if replay is not None:
        ok, total = replay.followed(outs)
        row["trace_followed"] = f"{ok}/{total}"
    return row


def submit_and_prefill(eng, prompts, max_new, eos=None) -> list:
    """Submit ``prompts`` and step the engine until each has its first token (a few rounds when the prompts
    exceed the token budget); returns the handles. A request that fails instead (e.g. the device out of memory) fails
    the row at once, naming why, rather than leaving it waiting for a token that never comes."""
    handles = [eng.submit(p, max_new, eos_token_id=eos) for p in prompts]
    while not all(h.token_ids or h.done for h in handles):
        if not eng.healthy:  # a failed round fails the requests in flight; the queued ones would wait for ever
            raise RuntimeError(f"the engine failed before every request had its first token: {eng.last_error}")
        if not eng.step():
            raise RuntimeError("the engine went idle before every request had its first token")
    errors = [o.error for o in (h.result() for h in handles if h.done) if o.finish_reason == "error"]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(handles)} requests failed: {errors[0]}")
    return handles


def timed_run(eng, prompts, max_new, device, eos=None) -> dict:
    """One timed run of ``prompts`` (all submitted at once), three rates from the same run (graph captures inside
    it subtracted): ``e2e``, every token over the whole run; ``decode``, the tokens after prefill over the time
    after it (from the first moment every request has its first token to the end: the closed batch's tail, where
    the requests whose draws accepted least run on at a small batch, included); ``full``, the same up to the round
    in which the first request finishes (every request of the concurrency running: the throughput at this
    concurrency; ``None`` when that is the first round). Also ``rounds`` (of that window) and ``outputs``."""
    def mark():
        common.sync(device)
        return time.perf_counter(), common.captured(eng)

    t0, c0 = mark()
    handles = submit_and_prefill(eng, prompts, max_new, eos)
    (t1, c1), tok1, rounds = mark(), sum(len(h.token_ids) for h in handles), 0
    while not any(h.done for h in handles):
        eng.step()
        rounds += 1
    (t2, c2), tok2 = mark(), sum(len(h.token_ids) for h in handles)
    while not all(h.done for h in handles):
        eng.step()
    t3, c3 = mark()
    outs = [h.result() for h in handles]
    total = sum(len(o.token_ids) for o in outs)
    span = lambda a, b, ca, cb: max(b - a - (cb - ca), 1e-9)  # noqa: E731
    return {"e2e": total / span(t0, t3, c0, c3), "decode": (total - tok1) / span(t1, t3, c1, c3),
            "full": (tok2 - tok1) / span(t1, t2, c1, c2) if rounds else None, "rounds": rounds, "outputs": outs}


def run_row(eng, replay, prompts, refs, max_new, device, reps, warm, profile=False, kernels=False, out_dir=None, eos=None,
            timeline=None):
    """One closed-batch (mode, trace, concurrency) row: warm-up if asked, timed runs, identity and trace checks,
    optionally the profiled per-step phases, the device kernels of mid-run forwards (with a host + device
    trace written into ``out_dir``) and (``timeline``: the round cost to price each step with) one more run with every
    step timed (:func:`gpu_common.round_timeline`)."""
    if warm:
        eng.generate(prompts, max_new_tokens=max_new, eos_token_id=eos)
    steps0, fwd0, reads0, whole0 = eng.num_steps, len(eng.forward_tokens), eng.host_syncs, eng.whole_rounds
    runs = [timed_run(eng, prompts, max_new, device, eos) for _ in range(reps)]
    outs = runs[-1]["outputs"]
    acc = [a for o in outs for a in o.accepted]
    vl = [v for o in outs for v in o.verify_lengths]
    fwd = eng.forward_tokens[fwd0:]
    full = [r["full"] for r in runs if r["full"] is not None]
    row = {"tok_per_s": statistics.median(r["decode"] for r in runs), "decode_runs": [r["decode"] for r in runs],
           "full_batch_tok_per_s": statistics.median(full) if full else None, "full_batch_runs": full,
           "full_batch_rounds": runs[-1]["rounds"], "end_to_end_tok_per_s": statistics.median(r["e2e"] for r in runs),
           "end_to_end_runs": [r["e2e"] for r in runs], "tau": mean_tokens_per_round(acc) if acc else 1.0,
           "mean_verify_len": sum(vl) / max(1, len(vl)), "steps_per_run": (eng.num_steps - steps0) / reps,
           "mean_forward_tokens": sum(fwd) / max(1, len(fwd)),
           # the engine's mid-round reads and whole-block rounds per timed run (issue 35 item 2)
           "mid_round_reads_per_run": (eng.host_syncs - reads0) / reps,
           "whole_rounds_per_run": (eng.whole_rounds - whole0) / reps,
           "identical": min(sum(o.token_ids == refs[tuple(p)] for o, p in zip(r["outputs"], prompts)) for r in runs),
           "requests": len(prompts)}
    if replay is not None:
        ok, total = replay.followed(outs)
        row["trace_followed"] = f"{ok}/{total}"
    if profile:
        row["phases"] = common.phase_breakdown(eng, lambda: eng.generate(prompts, max_new_tokens=max_new))
    if timeline is not None:
        tl = row["timeline"] = common.round_timeline(eng, prompts, max_new, device, eos, cost=timeline)
        log(f"timeline c={len(prompts)}: decode {tl['decode_tok_per_s']:.0f} tok/s; " + "; ".join(
            f"{k} {b['n']}x {b['ms']:.1f} ms (model {b['model_ms']:.1f}) {b['tokens']} tok" for k, b in sorted(tl["by_kind"].items())))
    if kernels:
        trace = os.path.join(out_dir, f"trace_{eng.layout}_c{len(prompts)}.json.gz") if out_dir else None
        row["kernels"] = decode_kernels(eng, prompts, max_new, device, trace=trace)
    return row


KERNEL_GROUPS = (("gemm (cuBLAS)", ("nvjet", "gemm", "cutlass", "splitKreduce")), ("attention", ("_split_kernel", "_merge_kernel")),
                 ("few-row projections (Triton)", ("_block_kernel", "_row_kernel")), ("rope + K/V store", ("_rope_store",)),
                 ("fused elementwise (Inductor)", ("triton_",)), ("gather / index", ("index",)), ("cat / copy", ("Cat", "copy")))


def decode_kernels(eng, prompts, max_new, device, steps: int = 6, trace: str | None = None) -> dict:
    """Device kernels per target forward in the middle of a run (torch.profiler over ``steps`` engine steps once
    every prompt is prefilled), summed by kind (:data:`KERNEL_GROUPS`), the top names, and the profiled steps'
    wall time (the device idles for the rest); ``trace``: a gzipped Chrome trace of host and device there.
    ``{}`` off CUDA."""
    handles = submit_and_prefill(eng, prompts, max_new)
    fwd0 = eng.num_steps
    kp = common.kernel_profile(lambda: [eng.step() for _ in range(steps)], device, top=40, keep_all=True, trace=trace)
    forwards = max(1, (eng.num_steps - fwd0) // (3 if trace else 2))  # kernel_profile's calls: warm, profiled[, traced]
    while not all(h.done for h in handles):
        eng.step()
    if not kp:
        return {}
    groups = dict.fromkeys([g for g, _ in KERNEL_GROUPS] + ["other"], 0.0)
    for k in kp.pop("all"):
        g = next((g for g, keys in KERNEL_GROUPS if any(x in k["name"] for x in keys)), "other")
        groups[g] += k["us"] / 1e3 / forwards
    return {**kp, "forwards": forwards, "kernel_ms_per_forward": kp["kernel_ms"] / forwards,
            "wall_ms_per_forward": kp["wall_ms"] / forwards,
            "groups_ms_per_forward": {g: round(v, 3) for g, v in groups.items()}}


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "replay_bench_out"))
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, every step")
    ap.add_argument("--device", default=None)
    ap.add_argument("--concurrency", default="1,8,32,64,128", help="the 8B-shaped replay's ('' for none: real runs only)")
    ap.add_argument("--traces", default="paper,paper_ref,gsm8k,alpaca_eval,humaneval",
                    help="paper, paper_ref and sets of the reference pair's own rounds")
    ap.add_argument("--ratio-set", default=None, help="the set whose recorded head ratios paper_ref uses (default: "
                    "the first set in --traces, else gsm8k)")
    ap.add_argument("--arrivals", default="closed,poisson:0.5,poisson:0.9",
                    help="closed (all at once) and poisson:LOAD (open loop at LOAD x off's closed-batch request rate)")
    ap.add_argument("--modes", default="off,fixed,packed:adaptive",
                    help=f"round layouts of {LAYOUTS} (packed / rectangular: lengths by the cost rule; packed:adaptive: by "
                    "the paper's floor rule); queued: fixed rounds, QUEUED of them behind one read (EngineConfig."
                    "spec_rounds); 'default' (the trace drafter's own policy) is always run")
    ap.add_argument("--measure-cost", action="store_true", help="the cost rule weighs this GPU's measured round cost "
                    "(engine.warmup.measure_round_cost: graphs and each round's overhead; the replay's and each reference "
                    "pair's own) instead of SPEC section 6's table")
    ap.add_argument("--real-concurrency", default="1,32,128", help="the reference pair's own engine runs ('' for none)")
    ap.add_argument("--record-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--poisson-min-requests", type=int, default=4, help="a Poisson row sends max(c, this) requests")
    ap.add_argument("--reps", type=int, default=1, help="timed closed-batch runs per row after the warm-up (median)")
    ap.add_argument("--profile-at", default="", help="concurrencies whose closed rows (every trace, and the real runs) "
                    "also get a profiled run")
    ap.add_argument("--timeline-at", default="", help="concurrencies whose closed rows (every trace, and the real runs) "
                    "also get a run with every engine step timed and priced by the round cost (where the default's time "
                    "goes against off's)")
    ap.add_argument("--kernels-at", default="", help="concurrencies whose off and paper-trace closed rows also get a "
                    "device-kernel profile (mid-run target forwards, by kind)")
    ap.add_argument("--budget-s", type=float, default=500.0, help="rows that would start after this are skipped")
    args = ap.parse_args(argv)
    ints = lambda v: [int(c) for c in v.split(",") if c]  # noqa: E731
    arrivals = [a for a in args.arrivals.split(",") if a]
    modes = [m for m in args.modes.split(",") if m]
    bad = [a for a in arrivals if a != "closed" and not (a.startswith("poisson:") and _load(a) > 0)]
    bad += [m for m in modes if m != "queued" and (m.partition(":")[0] not in LAYOUTS
                                                   or m.partition(":")[2] not in ("", "cost", "adaptive"))]
    if bad or not arrivals or "off" not in modes:
        raise SystemExit(f"bad --arrivals / --modes {bad}: arrivals closed or poisson:LOAD (LOAD > 0); modes of "
                         f"{', '.join(LAYOUTS)}, off among them (the ratios' reference)")
    args.conc, args.real_conc = ([1, 3] if args.concurrency else [], [1, 3]) if args.smoke else (
        ints(args.concurrency), ints(args.real_concurrency))
    if args.smoke:  # one Poisson load is enough to run its path; one timeline too
        arrivals, args.timeline_at = ["closed", "poisson:0.9"], "3"
    args.arrival_list, args.mode_list = arrivals, modes + ["default"]
    return args


def _load(arrival: str) -> float:
    try:
        return float(arrival.split(":", 1)[1])
    except ValueError:
        return -1.0


class Results:
    """The run's results (``res``: meta, traces, rows, checks), rewritten to ``out_dir`` after every row; rows that
    would start after ``deadline`` are recorded as skipped."""

    def __init__(self, res: dict, out_dir: Path, deadline: float):
        self.res, self.out_dir, self.deadline = res, out_dir, deadline
        self.done = {}  # (kind, trace, c, arrival, engine key) -> the row already run with those settings

    def save(self) -> None:
        self.res["meta"]["total_s"] = time.perf_counter() - common.T0
        for name, text in (("replay_bench.json", json.dumps(self.res, indent=1, default=str)),
                           ("replay_bench.md", markdown(self.res))):
            tmp = self.out_dir / (name + ".tmp")
            tmp.write_text(text)
            tmp.replace(self.out_dir / name)

    def row(self, meta: dict, fn, key: str) -> None:
        """Run ``fn`` for the row ``meta`` (unless a row of the same settings ran: then its figures), record it."""
        r, cell = dict(meta), (meta["kind"], meta.get("trace"), meta["concurrency"], meta["arrival"], key)
        if cell in self.done:  # e.g. default = packed: the same engine and settings, one run
            r.update({k: v for k, v in self.done[cell].items() if k not in meta}, same_as=self.done[cell]["mode"])
        elif time.perf_counter() > self.deadline:
            r["error"] = "skipped: time budget"
        else:
            try:
                r.update(fn())
                self.done[cell] = r
            except Exception:  # noqa: BLE001 - record and go on
                r["error"] = traceback.format_exc()
                log(f"{meta} FAILED\n{r['error']}")
        if "tok_per_s" in r:
            log(f"{r['kind']:6s} {r['mode']:7s} {r.get('trace') or '-':11s} c={r['concurrency']:4d} {r['arrival']:12s} "
                f"{r['tok_per_s']:9.1f} tok/s  tau {r['tau']:.2f}  identical {r['identical']}/{r['requests']}"
                + (f"  latency {r['latency_s']:.2f}s" if "latency_s" in r else "") + (f"  = {r['same_as']}" if "same_as" in r else ""))
        elif "error" in r and "same_as" not in r:
            log(f"{meta}: {r['error'].splitlines()[-1]}")
        self.res["rows"].append(r)
        self.save()


def build_traces(results: Results, args, device, smoke: bool) -> dict:
    """Phase 1: the reference pair's rounds per set (the traces) and its own engine runs; the traces asked for."""
    res = results.res
    wanted = ["paper", "paper_ref", "gsm8k"] if smoke else [t for t in args.traces.split(",") if t]
    sets = [t for t in wanted if t not in ("paper", "paper_ref")]
    ratio_set = args.ratio_set or (sets[0] if sets else "gsm8k")
    record_sets = sets + ([ratio_set] if "paper_ref" in wanted and ratio_set not in sets else [])
    res["meta"]["real_sets"] = sets if args.real_conc else []
    root = Path(__file__).resolve().parent.parent
    for data in (root / "shared" / "data", root / "tests" / "fixtures" / "data"):  # unless ADAFLASH_DATA says
        if data.is_dir():
            os.environ.setdefault("ADAFLASH_DATA", str(data))
    res["meta"]["data"] = os.environ.get("ADAFLASH_DATA")
    recorded = {}
    try:
        recorded = reference_pair_phase(res, results.row, device, record_sets, args, smoke)
    except Exception:  # noqa: BLE001 - the paper trace still runs
        res["checks"]["record_error"] = traceback.format_exc()
        log("the reference pair's phase FAILED\n" + res["checks"]["record_error"])
    traces = {}
    for name in wanted:
        if name == "paper":
            traces[name] = paper_dflash_trace(BLOCK)
        elif name == "paper_ref" and ratio_set in recorded:
            traces[name] = paper_dflash_trace(BLOCK, ratio_from=recorded[ratio_set])
        elif name in recorded:
            traces[name] = recorded[name]
    for name, tr in traces.items():
        head = "oracle head" if name == "paper" else f"shipped head, rate {tr.policy.length_rate:g}"
        res["traces"][name] = {"description": tr.name, "tau": tr.tau, "head": head, "policy": tr.policy.to_json(),
                               **({"rounds": tr.to_json()["rounds"]} if isinstance(tr, RecordedTrace) else {"probs": tr.probs})}
    results.save()
    return traces


def build_replay(results: Results, args, device, smoke: bool, plen: int, max_new: int):
    """Phase 2: the 8B-shaped target and drafter, the engines, the prompts and their greedy continuations (the off
    engine's, checked against the permutation walk and HF generate); returns ``(engines, prompts)``."""
    res, conc = results.res, args.conc
    t = time.perf_counter()
    target = common.qwen3_8b_shape(device, smoke)
    perm = decisive_argmax(target)
    drafter = build_drafter(target, device, smoke)
    res["meta"]["drafter"] = (f"{drafter.config.num_hidden_layers} layers, hidden {drafter.config.hidden_size}, block "
                              f"{BLOCK}, target layers {list(drafter.config.target_layer_ids)}, length head")
    common.sync(device)
    log(f"built the 8B-shaped target + drafter in {time.perf_counter() - t:.1f}s ({res['meta']['drafter']})")
    vocab = target.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    n_prompts = max(max(conc), args.poisson_min_requests)
    prompts = [torch.randint(0, vocab - 1, (plen,), generator=g).tolist() for _ in range(n_prompts)]
    kw = dict(max_slots=max(conc), max_len=plen + max_new + 8, token_budget=max(4096, max(conc) * BLOCK + plen),
              cuda_graphs=True)
    engines = Engines(target, drafter, {}, **kw)
    if args.measure_cost:
        engines.round_cost, res["meta"]["round_cost"] = measure_cost(target, drafter, kw, plen)
    t = time.perf_counter()
    off = engines.get("off", paper_dflash_trace(BLOCK).policy)[0]
    engines.refs.update({tuple(p): o.token_ids for p, o in zip(prompts, off.generate(prompts, max_new_tokens=max_new))})
    refs = engines.refs
    walk = sum(o[i + 1] == int(perm[o[i]]) for o in refs.values() for i in range(len(o) - 1))
    res["checks"]["argmax_is_the_permutation"] = f"{walk}/{sum(len(o) - 1 for o in refs.values())}"
    hf = common.greedy_refs(target, prompts[:1], min(16, max_new))[0]
    res["checks"]["off_equals_hf_generate"] = hf == refs[tuple(prompts[0])][: len(hf)]
    log(f"references: {len(refs)} prompts in {time.perf_counter() - t:.1f}s; greedy = perm walk "
        f"{res['checks']['argmax_is_the_permutation']}; off == HF generate: {res['checks']['off_equals_hf_generate']}")
    results.save()
    return engines, prompts


def replay_rows(results: Results, args, engines, traces: dict, prompts, device, max_new: int, smoke: bool) -> None:
    """Phase 3: closed batch first (every trace), then each Poisson load: off first at each concurrency (its
    closed-batch request rate sets the Poisson rates), then every mode of every trace."""
    refs, rows = engines.refs, results.res["rows"]
    profile_at = {int(c) for c in args.profile_at.split(",") if c}
    kernels_at = {3} if smoke else {int(c) for c in args.kernels_at.split(",") if c}  # smoke: the path, no profiler on CPU
    warmed = set()
    for arrival in ["closed"] + [a for a in args.arrival_list if a != "closed"]:
        closed = arrival == "closed"
        for c in args.conc:
            todo = [(None, "off")]  # closed-batch off rows always run: their request rate sets the Poisson rates
            if not closed or "closed" in args.arrival_list:  # by setting: one engine alive, built once per concurrency
                todo += [(name, m) for m in args.mode_list if m != "off" for name in traces]
            for name, mode in todo:
                tr = traces.get(name) or paper_dflash_trace(BLOCK)
                eng, replay, key = engines.get(mode, tr.policy)
                if replay is not None:
                    replay.trace = tr
                meta = dict(kind="replay", mode=mode, concurrency=c, arrival=arrival, **({"trace": name} if name else {}))
                fresh = (key, c, engines.builds) not in warmed  # an engine built for this row has captured nothing
                warmed.add((key, c, engines.builds))
                if closed:
                    warm = fresh
                    first = name in (None, "paper")
                    fn = lambda eng=eng, replay=replay, warm=warm, first=first, c=c: run_row(
                        eng, replay, prompts[:c], refs, max_new, device, args.reps, warm, c in profile_at,
                        first and c in kernels_at, results.out_dir,
                        timeline=timeline_cost(eng, engines, c, args))
                else:
                    off_row = next((r for r in rows if r["kind"] == "replay" and r["mode"] == "off"
                                    and r["concurrency"] == c and r["arrival"] == "closed" and "end_to_end_tok_per_s" in r), None)
                    if off_row is None:
                        continue
                    rate = _load(arrival) * off_row["end_to_end_tok_per_s"] / max_new
                    n = max(c, args.poisson_min_requests)
                    if fresh:  # its captures and compiles out of the timed open loop
                        eng.generate(prompts[:c], max_new_tokens=max_new)
                    fn = lambda eng=eng, replay=replay, rate=rate, n=n, c=c: poisson_row(
                        eng, replay, prompts[:n], refs, max_new, device, rate, c, seed=c)
                results.row(meta, fn, key)


def main(argv=None) -> int:
    args = parse(argv)
    smoke = args.smoke
    if smoke:
        torch.set_num_threads(1)  # tiny shapes: one thread beats a few shared ones
    device = args.device or ("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    max_new, plen = (12, 16) if smoke else (args.max_new_tokens, args.prompt_len)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    res = {"meta": {"label": "ACCEPTANCE REPLAY (not a model's result) + the reference pair's real runs", "device": device,
                    "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else "", "torch": torch.__version__,
                    "smoke": smoke, "concurrency": args.conc, "real_concurrency": args.real_conc, "real_sets": [],
                    "arrivals": args.arrival_list, "modes": args.mode_list, "prompt_len": plen, "max_new_tokens": max_new,
                    "reps": args.reps, "block_size": BLOCK}, "traces": {}, "rows": [], "checks": {}}
    results = Results(res, out_dir, common.T0 + args.budget_s)
    traces = build_traces(results, args, device, smoke)
    if args.conc:  # --concurrency '': the reference pair's real runs only
        engines, prompts = build_replay(results, args, device, smoke, plen, max_new)
        replay_rows(results, args, engines, traces, prompts, device, max_new, smoke)
    bad = [r for r in res["rows"] if "identical" in r and r["identical"] != r["requests"]]
    res["checks"]["rows_not_identical"] = len(bad)
    results.save()
    print(markdown(res))
    log(f"done: {len(res['rows'])} rows, {len(bad)} with outputs different from plain greedy; wrote {out_dir}")
    failed = [r for r in res["rows"] if "error" in r] + ([res["checks"]["record_error"]] if "record_error" in res["checks"] else [])
    hf = res["checks"].get("off_equals_hf_generate", True)  # checked where the replay ran
    print("identical to plain greedy:", not bad and hf, "| rows failed:", len(failed))
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
