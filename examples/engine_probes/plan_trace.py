"""Where the default (``cost``) engine's time goes against ``off`` in a closed batch, round by round, on a GPU: the
reference pair's engine, gsm8k prompts, a warm-up run and then a timed run (as ``replay_bench.py --real-concurrency``
times its rows), with every ``Engine.step`` timed (device synchronised) and classified: a plain stretch (``steps``
plain decode steps behind one read), a drafting round (its verify lengths), a prefill round. The planner's state
(probe back-off, the traffic's mean acceptance) and its round cost are printed beside.

    python examples/engine_probes/plan_trace.py --out $OUT/plan_trace --concurrency 1,32

Writes ``plan_trace.json`` and ``plan_trace.md`` into ``--out``. ``--smoke``: CPU, the same code path.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gpu_common as common  # noqa: E402

from adaflash_hf.engine import Engine  # noqa: E402
from adaflash_hf.speculation.length.cost import RoundCost  # noqa: E402
from adaflash_hf.speculation.length.names import layout_args  # noqa: E402


def run(eng, prompts, max_new, device, eos) -> dict:
    eng.generate(prompts, max_new_tokens=max_new, eos_token_id=eos)  # warm, as replay_bench's rows
    return common.round_timeline(eng, prompts, max_new, device, eos)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--modes", default="off,default,fixed")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--variants", default="", help="default variants to time beside: no_overlap (n-grams indexed only "
                    "when drafting), no_ngrams (prompt_ngrams=0), never (a cost table where drafting never pays: plain stretches only, "
                    "no measurement, no probes)")
    args = ap.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    conc = [int(c) for c in args.concurrency.split(",")]
    max_new = 24 if args.smoke else args.max_new_tokens
    target, drafter, prompts, eos, source = common.reference_pair(device, torch.float32, "gsm8k", max(conc))
    longest = max(map(len, prompts[: max(conc)]))
    kw = dict(max_slots=max(conc), max_len=longest + max_new + 8, token_budget=max(4096, longest + max(conc) * 16),
              cuda_graphs=not args.smoke)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res, lines = {}, ["# Plan trace", ""]
    modes = args.modes.split(",") + [f"default+{v}" for v in args.variants.split(",") if v]
    for mode in modes:
        margs = {"drafter": drafter} if mode.startswith("default") else layout_args(drafter, mode, "cost")
        extra = {"prompt_ngrams": 0} if mode.endswith("no_ngrams") else {}
        if mode.endswith("never"):
            extra["round_cost"] = RoundCost.flat(spec_overhead=1e9)
        eng = Engine(target, **margs, **kw, **extra)
        if mode.endswith("no_overlap"):
            eng._ngram_event = eng.plain.ngram_event = None  # the round's and the plain decoder's
        rc = eng.round_cost.to_json() if eng.drafter is not None else None
        for c in conc:
            r = run(eng, prompts[:c], max_new, device, eos)
            holds = eng.planner.probe_holds(c) if eng.drafter is not None else None
            res[f"{mode}_c{c}"] = {**r, "round_cost": rc, "probe_holds": holds}
            lines.append(f"## {mode}, c={c}: decode {r['decode_tok_per_s']:.0f} tok/s; probe holds {holds}")
            lines.append("")
            lines.append("| kind | rounds | ms | tokens | ms / token |")
            lines.append("|---|---|---|---|---|")
            for k, b in sorted(r["by_kind"].items()):
                lines.append(f"| {k} | {b['n']} | {b['ms']:.2f} | {b['tokens']} | {b['ms'] / max(1, b['tokens']):.4f} |")
            lines.append("")
            seq = " ".join(f"{x['kind'].split()[0][0]}{x['tokens']}" for x in r["rows"][:80])
            lines.append(f"sequence (p: plain/prefill, d: drafting; tokens): {seq}")
            lines.append("")
            common.log(lines[-6 - len(r["by_kind"])])
        if rc is not None:
            lines.append(f"{mode} round cost: `{json.dumps(rc)}`")
            lines.append("")
        del eng
        common.free_memory()
    common.write_report(out, "plan_trace", res, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
