"""ACCEPTANCE REPLAY at the Qwen3-8B shape on one H200: the engine's tok/s of ``off`` / ``fixed`` / ``packed``
per concurrency under known acceptance traces (issue 18, item 3). Replay, not a model's result.

Random weights accept nothing, so the drafted tokens are made to follow a trace
(:mod:`adaflash_hf.bench.replay`): the 8B-shaped target (random bf16 weights) and a 5-layer drafter of
the z-lab DFlash shape (block 16, length head) run every forward and kernel of every round, the drafts
agree with the target's own greedy continuation for the trace's accepted count of that round and are
wrong right after, and the length head's ratio is the trace's. The engine's real verify lengths, packing,
graphs and reads are what is timed.

Traces (``--traces``):
  ``paper``      the paper's DFlash per-slot acceptance on Qwen3-8B (slot 1 0.89 ... slot 15 0.13,
                 geometric between the published ends: tau 7.06), oracle head (k_hat = accepted + 1);
  ``paper_ref``  the same acceptance, head ratios of the reference pair's length head for rounds that
                 accepted as many (its real calibration, recorded on the first ``--domains`` set);
  ``<domain>``   the reference pair's own rounds on that set (``fixed`` mode, whole blocks), accepted
                 counts and head ratios as recorded.

The target's greedy argmax is made decisive before anything runs: the embedding is scaled up so the
residual stream carries the input token, and the LM head rows are a permutation of the embedding
rows, so the next greedy token is ``perm[token]`` by a wide margin. Every forward is unchanged in
cost, but bf16 rounding that differs between batch shapes cannot flip an argmax, so the
precomputed continuation is what every verify accepts. Every output is checked against it (the
``off`` engine's and, for one prompt, HF ``generate``'s).

Writes ``replay_bench.json`` and ``replay_bench.md`` into ``--out`` (default ``$OUT``), rewritten after
every row; prints progress and a summary.

The reference pair's prompts come from ``$ADAFLASH_DATA`` (default: ``shared/data`` in the checkout, else the
small excerpt in ``tests/fixtures/data``).

Usage:
    python examples/replay_bench.py --out $OUT                     # H200, about 6-8 minutes
    python examples/replay_bench.py --smoke --out /tmp/replay      # CPU, tiny shapes, ~20 s
    # packed verify lengths by the paper's floor rule instead of the default cost rule; the cost rule on this GPU's
    # own measured cost: --length-policy adaptive / --measure-cost (and --length-rate for the head's calibration)
"""

from __future__ import annotations

import argparse
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

from adaflash_hf.bench.replay import DraftReplay, RecordedTrace, paper_dflash_trace  # noqa: E402
from adaflash_hf.spec.rounds import mean_tokens_per_round  # noqa: E402

log = common.log
BLOCK = 16
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


def record_traces(device, domains, n, max_new, smoke):
    """The reference pair's rounds per domain (fixed mode, bf16 on the GPU; float32 on the CPU)."""
    out = {}
    dtype = torch.float32 if smoke else torch.bfloat16
    for dom in domains:
        t = time.perf_counter()
        target, drafter, prompts, eos, source = common.reference_pair(device, dtype, dom, n)
        longest = max(len(p) for p in prompts)
        rec = RecordedTrace.record(target, drafter, prompts, max_new, name=f"reference pair, {dom}", eos_token_id=eos,
                                   max_slots=len(prompts), token_budget=max(4096, longest + len(prompts) * BLOCK))
        acc = [r.accepted for r in rec.rounds]
        out[dom] = rec
        log(f"trace {dom} ({source}): {len(acc)} whole-block rounds, tau {rec.tau:.2f}, "
            f"mean head ratio {statistics.mean(r.ratio for r in rec.rounds):.3f} ({time.perf_counter() - t:.1f}s)")
        del target, drafter
        common.free_memory()
    return out


def submit_and_prefill(eng, prompts, max_new) -> list:
    """Submit ``prompts`` and step the engine until each has its first token (a few rounds when the prompts
    exceed the token budget); returns the handles."""
    handles = [eng.submit(p, max_new) for p in prompts]
    while not all(h.token_ids for h in handles):
        eng.step()
    return handles


def timed_run(eng, prompts, max_new, device) -> dict:
    """One timed run of ``prompts`` (all submitted at once), three rates from the same run (graph captures inside
    it subtracted): ``e2e``, every token over the whole run; ``decode``, the tokens after prefill over the time
    after it (from the first moment every request has its first token to the end: the closed batch's tail, where
    the requests whose draws accepted least run on at a small batch, included); ``full``, the same up to the round
    in which the first request finishes (every request of the concurrency running: the throughput at this
    concurrency; ``None`` when that is the first round). Also ``rounds`` (of that window) and ``outputs``."""
    dg = getattr(eng, "draft_graphs", None)
    captures = lambda: eng.graphs.capture_seconds + (dg.capture_seconds if dg is not None else 0.0)  # noqa: E731

    def mark():
        common.sync(device)
        return time.perf_counter(), captures()

    t0, c0 = mark()
    handles = submit_and_prefill(eng, prompts, max_new)
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


def run_row(eng, replay, prompts, refs, max_new, device, reps, warm, profile, kernels=False, out_dir=None):
    """One (mode, trace, concurrency) row: warm-up if asked, timed runs, identity and trace checks,
    optionally the profiled per-step phases and the device kernels of mid-run forwards (with a host + device
    trace written into ``out_dir``)."""
    if warm:
        eng.generate(prompts, max_new_tokens=max_new)
    steps0, fwd0 = eng.num_steps, len(eng.forward_tokens)
    runs = [timed_run(eng, prompts, max_new, device) for _ in range(reps)]
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
           "identical": min(sum(o.token_ids == refs[tuple(p)] for o, p in zip(r["outputs"], prompts)) for r in runs),
           "requests": len(prompts)}
    if replay is not None:
        ok, total = replay.followed(outs)
        row["trace_followed"] = f"{ok}/{total}"
    if profile:
        row["phases"] = common.phase_breakdown(eng, lambda: eng.generate(prompts, max_new_tokens=max_new))
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


def markdown(res: dict) -> str:
    m = res["meta"]
    out = ["# ACCEPTANCE REPLAY, Qwen3-8B shape (random bf16 weights), engine tok/s", "",
           f"{m.get('gpu') or m['device']}; {m['prompt_len']}-token prompts, {m['max_new_tokens']} new tokens per "
           f"request, one request per concurrency slot, all submitted at once; drafter: {m.get('drafter', '')}; packed "
           f"verify lengths by `{m.get('packed_policy', 'adaptive')}`, length rate {m.get('length_rate') or 'of the drafter config'}. "
           "Replay: the drafts follow the trace, the engine's forwards, kernels and verify lengths are real. "
           "Not a model's result. tok/s: decode, after every request has its first token, to the end of the run (the "
           "closed batch's tail included); full batch: the same up to the first request's end (median of the runs).", ""]
    off = {r["concurrency"]: r for r in res["rows"] if r["mode"] == "off" and "tok_per_s" in r}
    for name, tr in res.get("traces", {}).items():
        out += [f"## trace `{name}`: {tr['description']} (trace tau {tr['tau']:.2f})", "",
                "| concurrency | off tok/s | fixed tok/s (x off) | packed tok/s (x off, x fixed) | tau fixed / packed "
                "| packed verify len | identical | trace followed | end-to-end tok/s |", "|---|---|---|---|---|---|---|---|---|"]
        for c in m["concurrency"]:
            f = next((r for r in res["rows"] if r.get("trace") == name and r["mode"] == "fixed" and r["concurrency"] == c), {})
            p = next((r for r in res["rows"] if r.get("trace") == name and r["mode"] == "packed" and r["concurrency"] == c), {})
            o = off.get(c, {})
            ot, ft, pt = o.get("tok_per_s"), f.get("tok_per_s"), p.get("tok_per_s")
            ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"  # noqa: E731
            num = lambda v: f"{v:.0f}" if v else (f.get("error") or p.get("error") or "-")[:40]  # noqa: E731
            out.append(f"| {c} | {num(ot)} | {num(ft)} ({ratio(ft, ot)}) | {num(pt)} ({ratio(pt, ot)}, {ratio(pt, ft)}) | "
                       f"{f.get('tau', 0):.2f} / {p.get('tau', 0):.2f} | {p.get('mean_verify_len', 0):.2f} | "
                       f"{o.get('identical', '-')}/{f.get('identical', '-')}/{p.get('identical', '-')} of {c} | "
                       f"{f.get('trace_followed', '-')}, {p.get('trace_followed', '-')} | "
                       + " / ".join(f"{r['end_to_end_tok_per_s']:.0f}" if "end_to_end_tok_per_s" in r else "-" for r in (o, f, p)) + " |")
        out.append("")
        out += [f"Full batch (trace `{name}`): decode tok/s while every request of the concurrency runs (the closed "
                "batch's tail left out)", "", "| concurrency | off | fixed (x off) | packed (x off, x fixed) | rounds off / fixed / packed |",
                "|---|---|---|---|---|"]
        for c in m["concurrency"]:
            rows = [off.get(c, {})] + [next((r for r in res["rows"] if r.get("trace") == name and r["mode"] == mode
                                             and r["concurrency"] == c), {}) for mode in ("fixed", "packed")]
            o, f, p = (r.get("full_batch_tok_per_s") for r in rows)
            ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"  # noqa: E731
            num = lambda v: f"{v:.0f}" if v else "-"  # noqa: E731
            out.append(f"| {c} | {num(o)} | {num(f)} ({ratio(f, o)}) | {num(p)} ({ratio(p, o)}, {ratio(p, f)}) | "
                       + " / ".join(str(r.get("full_batch_rounds", "-")) for r in rows) + " |")
        out.append("")
    prof = [r for r in res["rows"] if "phases" in r]
    if prof:
        out += ["## Per step (profiled run, device synced per phase)", "", "| trace | mode | concurrency | phases |",
                "|---|---|---|---|"]
        out += [f"| {r.get('trace', '-')} | {r['mode']} | {r['concurrency']} | {common.fmt_phases(r['phases'])} |" for r in prof]
        out.append("")
    for r in (r for r in res["rows"] if r.get("kernels")):
        k = r["kernels"]
        out += [f"## Device kernels, {r['mode']} at concurrency {r['concurrency']} (torch.profiler, {k['forwards']} target "
                f"forwards mid-run, no prefill: {k['kernel_ms_per_forward']:.2f} ms of kernel time per forward in "
                f"{k['wall_ms_per_forward']:.2f} ms of wall time, profiler on)", "",
                "By kind, ms per forward: " + ", ".join(f"{g} {v:.2f}" for g, v in k["groups_ms_per_forward"].items()), "",
                "| ms per forward | calls per forward | kernel |", "|---|---|---|"]
        out += [f"| {t['us'] / 1e3 / k['forwards']:.3f} | {t['count'] / k['forwards']:.1f} | `{t['name'][:90]}` |" for t in k["top"]]
        out.append("")
    if res.get("checks"):
        out += ["## Checks", "", "```", json.dumps(res["checks"], indent=1, default=str), "```", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "replay_bench_out"))
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, every step")
    ap.add_argument("--device", default=None)
    ap.add_argument("--concurrency", default="1,8,32,64,128")
    ap.add_argument("--traces", default="paper,paper_ref,gsm8k,sharegpt")
    ap.add_argument("--domains", default="gsm8k,sharegpt", help="sets whose reference-pair rounds are recorded")
    ap.add_argument("--record-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=1, help="timed runs per row after the warm-up (median)")
    ap.add_argument("--profile-at", default="1,128", help="concurrencies that also get a profiled run")
    ap.add_argument("--kernels-at", default="", help="concurrencies whose off and paper-trace rows also get a device-kernel "
                    "profile (mid-run target forwards, by kind)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="rows that would start after this are skipped")
    ap.add_argument("--length-policy", default="cost", choices=("cost", "adaptive"),
                    help="the packed layout's verify-length rule: cost (the default rule) or adaptive (the paper's floor rule)")
    ap.add_argument("--length-rate", type=float, default=None, help="the length head's rate (default: the drafter config's, 1.0)")
    ap.add_argument("--measure-cost", action="store_true", help="the packed engine's cost model measured on this GPU "
                    "(engine.warmup.measure_round_cost) instead of SPEC section 6's table")
    args = ap.parse_args(argv)
    smoke = args.smoke
    device = args.device or ("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    conc = [1, 3] if smoke else [int(c) for c in args.concurrency.split(",")]
    max_new = 12 if smoke else args.max_new_tokens
    plen = 16 if smoke else args.prompt_len
    domains = ["gsm8k"] if smoke else [d for d in args.domains.split(",") if d]
    traces_wanted = ["paper", "paper_ref", "gsm8k"] if smoke else [t for t in args.traces.split(",") if t]
    profile_at = {int(c) for c in args.profile_at.split(",") if c}
    kernels_at = {3} if smoke else {int(c) for c in args.kernels_at.split(",") if c}  # smoke: the path, no profiler on CPU
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    deadline = common.T0 + args.budget_s
    res = {"meta": {"label": "ACCEPTANCE REPLAY (not a model's result)", "device": device,
                    "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else "", "torch": torch.__version__,
                    "smoke": smoke, "concurrency": conc, "prompt_len": plen, "max_new_tokens": max_new,
                    "reps": args.reps, "block_size": BLOCK, "packed_policy": args.length_policy,
                    "length_rate": args.length_rate}, "traces": {}, "rows": [], "checks": {}}

    def save():
        res["meta"]["total_s"] = time.perf_counter() - common.T0
        for name, text in (("replay_bench.json", json.dumps(res, indent=1, default=str)), ("replay_bench.md", markdown(res))):
            tmp = out_dir / (name + ".tmp")
            tmp.write_text(text)
            tmp.replace(out_dir / name)

    # 1. Traces (the reference pair's rounds are recorded first: the 8B model then has the GPU to itself).
    root = Path(__file__).resolve().parent.parent
    for data in (root / "shared" / "data", root / "tests" / "fixtures" / "data"):  # unless ADAFLASH_DATA says
        if data.is_dir():
            os.environ.setdefault("ADAFLASH_DATA", str(data))
    res["meta"]["data"] = os.environ.get("ADAFLASH_DATA")
    recorded = {}
    need = [d for d in domains if d in traces_wanted] or (domains[:1] if "paper_ref" in traces_wanted else [])
    try:
        recorded = record_traces(device, need, 2 if smoke else args.record_prompts, 24 if smoke else 64, smoke)
    except Exception:  # noqa: BLE001 - the paper trace still runs
        res["checks"]["record_error"] = traceback.format_exc()
        log("recording traces FAILED\n" + res["checks"]["record_error"])
    traces = {}
    for name in traces_wanted:
        if name == "paper":
            traces[name] = paper_dflash_trace(BLOCK)
        elif name == "paper_ref" and need and need[0] in recorded:
            traces[name] = paper_dflash_trace(BLOCK, ratio_from=recorded[need[0]])
        elif name in recorded:
            traces[name] = recorded[name]
    for name, tr in traces.items():
        res["traces"][name] = {"description": tr.name, "tau": tr.tau,
                               **({"rounds": tr.to_json()["rounds"]} if isinstance(tr, RecordedTrace) else {"probs": tr.probs})}
    save()

    # 2. The 8B-shaped target and the drafter; prompts and their greedy continuations (the off engine).
    from adaflash_hf.engine import Engine, layout_args

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
    prompts = [torch.randint(0, vocab - 1, (plen,), generator=g).tolist() for _ in range(max(conc))]
    budget = max(4096, max(conc) * BLOCK + plen)
    kw = dict(max_slots=max(conc), max_len=plen + max_new + 8, token_budget=budget, cuda_graphs=True)
    t = time.perf_counter()
    off = Engine(target, None, **kw)
    refs = {tuple(p): o.token_ids for p, o in zip(prompts, off.generate(prompts, max_new_tokens=max_new))}
    walk = sum(o[i + 1] == int(perm[o[i]]) for o in refs.values() for i in range(len(o) - 1))
    res["checks"]["argmax_is_the_permutation"] = f"{walk}/{sum(len(o) - 1 for o in refs.values())}"
    hf = common.greedy_refs(target, prompts[:1], min(16, max_new))[0]
    res["checks"]["off_equals_hf_generate"] = hf == refs[tuple(prompts[0])][: len(hf)]
    log(f"references: {len(refs)} prompts in {time.perf_counter() - t:.1f}s; greedy = perm walk "
        f"{res['checks']['argmax_is_the_permutation']}; off == HF generate: {res['checks']['off_equals_hf_generate']}")
    save()

    def row(mode, c, trace_name, fn):
        r = {"mode": mode, "concurrency": c, **({"trace": trace_name} if trace_name else {})}
        if time.perf_counter() > deadline:
            r["error"] = "skipped: time budget"
            log(f"{mode} {trace_name or ''} c={c}: skipped (time budget)")
        else:
            try:
                r.update(fn())
                log(f"{mode:6s} {trace_name or '-':9s} c={c:4d} {r['tok_per_s']:9.1f} tok/s (full batch "
                    f"{r['full_batch_tok_per_s'] or 0:.1f})  tau {r['tau']:.2f}  verify "
                    f"{r['mean_verify_len']:.2f}  identical {r['identical']}/{r['requests']}  "
                    f"followed {r.get('trace_followed', '-')}" + (f"  | {common.fmt_phases(r['phases'])}" if "phases" in r else ""))
            except Exception:  # noqa: BLE001 - record and go on
                r["error"] = traceback.format_exc()
                log(f"{mode} {trace_name} c={c} FAILED\n{r['error']}")
        res["rows"].append(r)
        save()

    # 3. off per concurrency, then fixed and packed per trace and concurrency.
    for c in conc:
        row("off", c, None, lambda c=c: run_row(off, None, prompts[:c], refs, max_new, device, args.reps, True, c in profile_at,
                                                          c in kernels_at, out_dir))
    del off
    common.free_memory()
    replays = {m: DraftReplay(refs, None) for m in ("fixed", "packed")}  # one each: request ids are per engine
    engines = {m: Engine(target, **layout_args(drafter, m, args.length_policy), draft_replay=replays[m],
                         length_rate=args.length_rate, **kw) for m in replays}
    if args.measure_cost:
        from adaflash_hf.engine.warmup import measure_round_cost

        t = time.perf_counter()
        cost = engines["packed"].round_cost = measure_round_cost(engines["packed"], context=min(plen, kw["max_len"] - 2 * BLOCK))
        res["meta"]["round_cost"] = {"rows": cost.rows, "tokens_per_row": cost.tokens_per_row, "verify": cost.verify,
                                     "draft_fraction": cost.draft_fraction, "seconds": time.perf_counter() - t}
        log(f"measured round cost in {time.perf_counter() - t:.1f}s: draft fraction {cost.draft_fraction:.3f}")
    warmed = set()
    for name, tr in traces.items():
        for rp in replays.values():
            rp.trace = tr
        for c in conc:
            for mode, eng in engines.items():
                warm = (mode, c) not in warmed
                warmed.add((mode, c))
                row(mode, c, name, lambda eng=eng, mode=mode, c=c, warm=warm: run_row(
                    eng, replays[mode], prompts[:c], refs, max_new, device, args.reps, warm,
                    c in profile_at and name == "paper", c in kernels_at and name == "paper", out_dir))
    bad = [r for r in res["rows"] if "identical" in r and r["identical"] != r["requests"]]
    res["checks"]["rows_not_identical"] = len(bad)
    save()
    print(markdown(res))
    log(f"done: {len(res['rows'])} rows, {len(bad)} with outputs different from plain greedy; wrote {out_dir}")
    failed = [r for r in res["rows"] if "error" in r] + ([res["checks"]["record_error"]] if "record_error" in res["checks"] else [])
    print("identical to plain greedy:", not bad and res["checks"]["off_equals_hf_generate"], "| rows failed:", len(failed))
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
