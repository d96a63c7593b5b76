"""One plain read (``decode_steps`` greedy steps behind one device read) taken apart, ``off``'s engine against a
drafting engine that decodes plainly (a cost table where drafting never pays), on the reference pair, gsm8k prompts.

For each engine and concurrency ``c``, after the prompts are prefilled and a few reads warm the graphs, ``--reads``
reads are timed part by part (the device synchronised around each part, so the parts add up to more than a read):

- ``launch_ms``: :meth:`.graphs.DecodeGraphs.run_greedy`'s host call (inputs staged, the step replays queued);
- ``device_ms``: its replays on the device (CUDA events around the queued steps);
- ``read_ms``: the read of the steps' tokens (``tolist``) once the device is idle;
- ``index_ms``: the n-gram indexing a plain stretch does while the device runs (drafting engine only);
- ``step_ms``: a whole ``Engine.step`` (a plain stretch), device synchronised before and after; ``step_mean_ms``
  its mean (a stretch that first stores the drafter's context, :class:`.decode_steps.PlainDecoder`, is slower);
- ``store_ms``: storing that stretch's features as the drafter's context (what a drafting round's body, or a later
  stretch whose kept rows are full, runs; drafting engine only).

    python examples/engine_probes/plain_read.py --out $OUT/plain_read --concurrency 1,32,128

Writes ``plain_read.json`` and ``plain_read.md``. ``--smoke``: CPU, tiny, the same code path (device columns 0).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gpu_common as common  # noqa: E402

from adaflash_hf.engine import Engine  # noqa: E402
from adaflash_hf.engine.round_ngrams import index_while  # noqa: E402
from adaflash_hf.engine.target import PackedLayout  # noqa: E402
from adaflash_hf.speculation.length.cost import RoundCost  # noqa: E402


def timed(fn, device) -> float:
    common.sync(device)
    t = time.perf_counter()
    fn()
    common.sync(device)
    return 1e3 * (time.perf_counter() - t)


def parts(eng, device, reads: int) -> dict:
    """Each part of a plain read of ``eng``'s running requests, ``reads`` times (medians, ms)."""
    running, g, steps = list(eng._running), eng.graphs, eng.decode_steps
    layout = PackedLayout.from_cache(eng.cache, [r.slot for r in running], [1] * len(running))
    tokens = [r.bonus for r in running]
    out = {k: [] for k in ("launch_ms", "device_ms", "read_ms", "index_ms", "step_ms", "store_ms")}
    cuda = device.type == "cuda"
    for _ in range(reads):
        common.sync(device)
        t = time.perf_counter()
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        end = torch.cuda.Event(enable_timing=True) if cuda else None
        if cuda:
            start.record()
        new = g.run_greedy(tokens, layout, steps, 0)
        if cuda:
            end.record()
        out["launch_ms"].append(1e3 * (time.perf_counter() - t))
        common.sync(device)
        out["device_ms"].append(start.elapsed_time(end) if cuda else 0.0)
        out["read_ms"].append(timed(new.tolist, device))
        if eng.drafter is not None and eng.prompt_ngrams.enabled:
            for r in running:  # as a stretch would meet them: its last read's tokens not yet indexed
                if r.ngrams is not None:
                    r.ngrams.length = max(0, r.ngrams.length - steps)
            out["index_ms"].append(timed(lambda: index_while(eng.prompt_ngrams, running, lambda: True), device))
        out["step_ms"].append(timed(eng.step, device))
    med = {k: statistics.median(v) for k, v in out.items() if v}
    med["step_mean_ms"] = statistics.fmean(out["step_ms"])
    if eng.drafter is not None:  # one more stretch, then its features stored (and the kept rows started afresh)
        for _ in range(reads):
            eng.step()
            out["store_ms"].append(timed(lambda: eng.plain._store_pending_context(running), device))
            eng.plain.forget()
        med["store_ms"] = statistics.median(out["store_ms"])
    return med


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--concurrency", default="1,32,128")
    ap.add_argument("--reads", type=int, default=20)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    conc = [int(c) for c in args.concurrency.split(",")]
    reads = 3 if args.smoke else args.reads
    target, drafter, prompts, eos, _ = common.reference_pair(device, torch.float32, "gsm8k", max(conc))
    longest = max(map(len, prompts[: max(conc)]))
    max_new = 16 + (args.reads + 4) * 8 * 4  # room for every read (each part of a read writes past the last)
    kw = dict(max_slots=max(conc), max_len=longest + max_new + 8, token_budget=max(4096, longest + max(conc) * 16),
              cuda_graphs=True)  # the static path (graphs on CUDA), which plain stretches need
    engines = {"off": dict(drafter=None), "plain": dict(drafter=drafter, round_cost=RoundCost.flat(spec_overhead=1e9))}
    res, lines = {}, ["# One plain read taken apart (medians, ms)", "",
                      "| engine | c | launch | device | read | index | step | step (mean) | store |",
                      "|---|---|---|---|---|---|---|---|---|"]
    for name, margs in engines.items():
        eng = Engine(target, **margs, **kw)
        for c in conc:
            eng.generate(prompts[:c], max_new_tokens=32, eos_token_id=None)  # graphs of this c captured
            for p in prompts[:c]:
                eng.submit(p, max_new, eos_token_id=None)
            for _ in range(4):
                eng.step()
            r = res[f"{name}_c{c}"] = parts(eng, device, reads)
            lines.append(f"| {name} | {c} | " + " | ".join(f"{r.get(k, 0.0):.3f}" for k in
                                                         ("launch_ms", "device_ms", "read_ms", "index_ms", "step_ms", "step_mean_ms", "store_ms")) + " |")
            common.log(lines[-1])
            eng.run_until_idle()
        del eng
        common.free_memory()
    common.write_report(args.out, "plain_read", res, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
