"""Where one engine round's time goes on a GPU: the reference pair's engine, steady state, per round layout and
concurrency (torch.profiler, host and device).

For each (mode, c): c gsm8k prompts are submitted and prefilled, a few rounds run unprofiled, then ``--steps`` rounds
are timed without the profiler (wall ms per round; ``--passes N``: N such passes, their median), then the same number
of rounds again under torch.profiler with host and device activities, and a third time under cProfile (the Python
functions the host spends its time in; ``--no-profile``: the timed passes only).
Per round it reports:

- ``wall_ms``: the round's time without a profiler;
- ``gpu_busy_ms``: the union of the device's kernels, copies and memsets (overlapping activity counted once);
- ``host_only_ms``: ``wall_ms - gpu_busy_ms``, the time the device waits for the host;
- ``syncs``: device-to-host synchronisations (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
  ``cudaEventSynchronize`` and synchronous ``cudaMemcpy``), and ``dtoh_copies`` (device-to-host memcpys, blocking
  or not);
- ``launches``: kernel launches from the host, and ``graph_launches`` (one CUDA graph replay each);
- the host's top runtime calls and Python functions.

    python examples/engine_probes/round_trace.py --out $OUT/round_trace --modes off,fixed,default --concurrency 1,32

Writes ``round_trace.json`` and ``round_trace.md`` into ``--out``. ``--smoke``: CPU, tiny, the same code path (no
device activity: the device columns read 0).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gpu_common as common  # noqa: E402

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
QUEUED = 8  # --modes queued: fixed rounds behind one read (EngineConfig.spec_rounds)
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def busy_us(events) -> float:
    """The union of device activity intervals (us); the round marks' device spans (``--trace-at``) are not activity."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
                   and e.name != "round")
    total, end = 0.0, float("-inf")
    for s, e in spans:
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def runtime_counts(events) -> Counter:
    """Host-side CUDA runtime / driver calls by name (profiler events of kind ``cuda_runtime`` / ``cuda_driver``)."""
    return Counter(e.name for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith(("cuda", "cu")))


def timed_passes(eng, handles, steps: int, passes: int, device) -> tuple[list[float], float]:
    """``passes`` timed passes of ``steps`` rounds: each pass's ms a round, and the tokens a round."""
    walls, tok0 = [], sum(len(h.token_ids) for h in handles)
    for _ in range(passes):
        common.sync(device)
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        common.sync(device)
        walls.append(1e3 * (time.perf_counter() - t) / steps)
    if any(h.done for h in handles):
        raise RuntimeError("a request finished inside the timed rounds: raise --max-new-tokens")
    return walls, (sum(len(h.token_ids) for h in handles) - tok0) / (steps * passes)


def profile_rounds(eng, handles, steps: int, device, passes: int = 1, profiled: bool = True, trace: str | None = None) -> dict:
    """``passes`` timed passes (``wall_ms``: their median), then one torch.profiler pass and one cProfile pass of
    ``steps`` rounds each (``profiled=False``: the timed passes only). ``trace``: the profiled pass also records Python
    stacks, marks each round (``record_function("round")``) and is written there as a gzipped Chrome trace
    (``round_kernels.py`` reads it)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    walls, tokens = timed_passes(eng, handles, steps, passes, device)
    wall_ms = statistics.median(walls)
    if not profiled:
        return {"wall_ms": wall_ms, "wall_passes_ms": walls, "tokens_per_round": tokens}
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])
    with profile(activities=acts, with_stack=trace is not None) as prof:
        for _ in range(steps):
            with record_function("round"):
                eng.step()
        common.sync(device)
    if trace:
        common.gzip_trace(prof, trace)
    ev = prof.events()
    rt = runtime_counts(ev)
    dtoh = sum(1 for e in ev if e.device_type == torch.autograd.DeviceType.CUDA and "DtoH" in e.name)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        eng.step()
    common.sync(device)
    pr.disable()
    st = pstats.Stats(pr)
    py = sorted(((v[2], v[3], v[0], f"{Path(k[0]).name}:{k[1]}({k[2]})") for k, v in st.stats.items()), reverse=True)
    return {"wall_ms": wall_ms, "wall_passes_ms": walls, "tokens_per_round": tokens, "gpu_busy_ms": busy_us(ev) / 1e3 / steps,
            "syncs": sum(rt[n] for n in SYNC_CALLS) / steps, "dtoh_copies": dtoh / steps,
            "launches": sum(rt[n] for n in LAUNCH_CALLS) / steps, "graph_launches": rt["cudaGraphLaunch"] / steps,
            "runtime_calls": {k: round(v / steps, 2) for k, v in rt.most_common(12)},
            "python_self_ms": [{"ms": round(1e3 * s / steps, 3), "cum_ms": round(1e3 * c / steps, 3), "calls": round(n / steps, 1),
                                "fn": f} for s, c, n, f in py[:15]]}


def engine_for(mode: str, target, drafter, kw: dict):
    from adaflash_hf.engine import Engine

    if mode == "off":
        return Engine(target, drafter=None, **kw)
    if mode == "default":
        return Engine(target, drafter=drafter, **kw)
    if mode == "queued":  # fixed rounds, QUEUED of them behind one read: a row's "round" is one step of QUEUED rounds
        return Engine(target, drafter=drafter, length_policy="fixed", spec_rounds=QUEUED, **kw)
    return Engine(target, drafter=drafter, length_policy=mode, **kw)


def models(args, device):
    """``(target, drafter, prompts, source)``: the reference pair (float32) and ``--dataset``'s prompts, or the
    Qwen3-8B-shaped target and a 5-layer drafter (random bf16 weights: drafts are rarely accepted) and random prompts
    of ``--prompt-len`` tokens."""
    if args.pair == "ref":
        target, drafter, prompts, _, source = common.reference_pair(device, torch.float32, args.dataset, max(args.concurrency))
        return target, drafter, prompts, source
    import replay_bench

    target = common.qwen3_8b_shape(device, args.smoke)
    drafter = replay_bench.build_drafter(target, device, args.smoke)
    vocab = target.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab - 1, (args.prompt_len,), generator=g).tolist() for _ in range(max(args.concurrency))]
    return target, drafter, prompts, f"random, {args.prompt_len} tokens"


def run(args) -> dict:
    device = "cpu" if args.smoke else "cuda"
    target, drafter, prompts, source = models(args, device)
    longest = max(map(len, prompts))
    res = {"meta": {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
                    "pair": args.pair, "prompts": source, "steps": args.steps, "max_new": args.max_new_tokens}, "rows": []}
    for c in args.concurrency:
        kw = dict(max_slots=c, max_len=longest + args.max_new_tokens + 40, token_budget=max(4096, longest + c * 16),
                  cuda_graphs=device == "cuda")
        for mode in args.modes:
            eng = engine_for(mode, target, drafter, kw)
            ps = [prompts[i % len(prompts)] for i in range(c)]
            eng.generate(ps, max_new_tokens=min(args.max_new_tokens, 160))  # graphs captured, kernels tuned
            handles = [eng.submit(p, args.max_new_tokens) for p in ps]
            while not all(h.token_ids for h in handles):
                eng.step()
            for _ in range(3):
                eng.step()
            trace = (str(Path(args.out) / f"trace_{args.pair}_{mode}_c{c}.json.gz")
                     if f"{mode}:{c}" in args.trace_at and not args.no_profile else None)
            row = {"mode": mode, "concurrency": c, **profile_rounds(eng, handles, args.steps, device, args.passes,
                                                                            not args.no_profile, trace)}
            while not all(h.done for h in handles):
                eng.step()
            common.log(f"{mode:8s} c={c:3d}: wall {row['wall_ms']:.3f} ms (passes "
                       f"{' '.join(f'{w:.3f}' for w in row['wall_passes_ms'])}), {row['tokens_per_round']:.2f} tokens")
            res["rows"].append(row)
            del eng
            common.free_memory()
    return res


def markdown(res: dict) -> str:
    lines = [f"# One round, {res['meta']['device']} (torch {res['meta']['torch']}), {res['meta']['steps']} rounds each", "",
             "| mode | c | tokens / round | wall ms | GPU busy ms | host-only ms | syncs | DtoH copies | kernel launches | graph launches |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        if "gpu_busy_ms" not in r:  # --no-profile: the timed passes only
            lines.append(f"| {r['mode']} | {r['concurrency']} | {r['tokens_per_round']:.2f} | {r['wall_ms']:.3f} | - | - | - | - | - | - |")
            continue
        lines.append(f"| {r['mode']} | {r['concurrency']} | {r['tokens_per_round']:.2f} | {r['wall_ms']:.3f} | {r['gpu_busy_ms']:.3f} | "
                     f"{r['wall_ms'] - r['gpu_busy_ms']:.3f} | {r['syncs']:.1f} | {r['dtoh_copies']:.1f} | {r['launches']:.1f} | "
                     f"{r['graph_launches']:.1f} |")
    lines += ["", "Timed passes, ms a round: " + "; ".join(
        f"{r['mode']} c={r['concurrency']} " + " ".join(f"{w:.3f}" for w in r["wall_passes_ms"]) for r in res["rows"])]
    for r in (r for r in res["rows"] if "runtime_calls" in r):
        lines += ["", f"## {r['mode']}, c={r['concurrency']}: runtime calls per round", "",
                  ", ".join(f"{k} {v}" for k, v in r["runtime_calls"].items()), "",
                  "Python functions by self time per round (cProfile; its own overhead inflates them):", ""]
        lines += [f"- {p['ms']} ms self, {p['cum_ms']} ms cumulative, {p['calls']} calls: `{p['fn']}`" for p in r["python_self_ms"][:10]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--modes", default="off,fixed,default")
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--dataset", default="gsm8k")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--passes", type=int, default=1, help="timed passes of --steps rounds (wall_ms: their median)")
    ap.add_argument("--no-profile", action="store_true", help="the timed passes only (no profiler, no cProfile)")
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--pair", choices=("ref", "8b"), default="ref",
                    help="ref: the reference pair; 8b: the Qwen3-8B-shaped target and a 5-layer drafter, random weights")
    ap.add_argument("--prompt-len", type=int, default=512, help="--pair 8b: random prompts of this length")
    ap.add_argument("--trace-at", default="", help="MODE:C,...: write these rows' profiled pass as a gzipped Chrome "
                    "trace with Python stacks (trace_PAIR_MODE_cC.json.gz in --out; round_kernels.py reads it)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    args.trace_at = {t for t in args.trace_at.split(",") if t}
    args.modes = [m for m in args.modes.split(",") if m]
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    if args.smoke:
        args.steps, args.concurrency, args.prompt_len = 2, [1, 2], 16
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rounds = 3 + args.steps * (args.passes + (0 if args.no_profile else 2))  # run(): 3 untimed, then the passes
    rounds *= QUEUED if "queued" in args.modes else 1  # a queued step is QUEUED rounds
    if args.smoke:
        args.max_new_tokens = 16 * rounds
    if 16 * rounds > args.max_new_tokens:  # a round commits up to a block (16 tokens) a request: none may end inside
        ap.error(f"--max-new-tokens {args.max_new_tokens} leaves no room for {rounds} rounds of up to 16 tokens a "
                 f"request: give at least {16 * rounds}, or fewer --steps / --passes")
    res = run(args)
    out = Path(args.out)
    (out / "round_trace.json").write_text(json.dumps(res, indent=1))
    (out / "round_trace.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
