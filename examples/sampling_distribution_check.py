"""Speculative sampling against plain sampling, at scale (issue 36, item 5): the distribution check.

On the embedded reference pair, for every temperature of ``--temperatures`` (top-p ``--top-p``), each prompt
of ``--prompts`` is sampled ``--samples`` times by plain ``generate`` (the reference) and by each speculative
sampler of ``--samplers``:

  generate       ``target.generate(assistant_model=drafter)`` (the fixed verify length; on CUDA it may take the
                 engine's fast path)
  engine         the serving engine, each request drawing from its own generator (rejection sampling)
  engine_seeded  the serving engine, request i seeded ``seed + i`` (position-keyed samples)

and `adaflash_hf.bench.distribution.two_sample_check` compares each with plain sampling: first-token and
n-gram (2, 3) statistics of the first ``--tokens`` tokens, total variation and chi-square, permutation
thresholds within each prompt. ``--alpha`` is the family-wise level over all the real checks of the run
(Bonferroni over checks and statistics). Two negative controls run through ``generate`` at each
temperature and must FAIL the same test: ``accept_all`` (drafts kept without the rejection correction) and
``temperature`` (the speculative sampler at ``--control-temperature-scale`` times the temperature).

Writes ``sampling_distribution.json`` and ``sampling_distribution.md`` into ``--out`` (default ``$OUT``);
exit status 0 only when every real check passed and every control failed.

Usage:
    python examples/sampling_distribution_check.py --out $OUT                 # one H200, about 2 minutes
    python examples/sampling_distribution_check.py --smoke --out /tmp/sdc     # CPU, 1-2 minutes on two busy cores
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the GPU machine reaches no network: no minutes of Hub retries
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import log, reference_pair  # noqa: E402

from adaflash_hf.bench.distribution import (  # noqa: E402
    CheckSettings, SamplingSettings, accepting_every_draft, engine_rows, generate_rows, markdown_table, two_sample_check,
)  # fmt: skip

SAMPLERS = ("generate", "engine", "engine_seeded")
CONTROLS = ("accept_all", "temperature")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true",
                   help="CPU sizes: 1 prompt x 100 samples, 6 tokens, T=1.0 only, temperature control x1.5 (coarser: few "
                        "samples), 25 rows per call / engine slots")
    p.add_argument("--dataset", default="gsm8k", help="prompts (from $ADAFLASH_DATA, else built-in questions)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=3000, help="rows per prompt and sampler")
    p.add_argument("--tokens", type=int, default=12, help="new tokens per row (the n-grams' window)")
    p.add_argument("--temperatures", default="0.7,1.0")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--samplers", default=",".join(SAMPLERS))
    p.add_argument("--controls", default=",".join(CONTROLS))
    p.add_argument("--control-temperature-scale", type=float, default=1.15)
    p.add_argument("--permutations", type=int, default=4999)
    p.add_argument("--alpha", type=float, default=0.01, help="family-wise level over every real check of the run")
    p.add_argument("--batch", type=int, default=500, help="rows per generate call / engine slots")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=os.environ.get("OUT", "sampling_distribution_out"))
    args = p.parse_args(argv)
    if args.smoke:
        # batch 25, not 100: on CPU the engine's packed verify attends every slot's keys, so a step costs about
        # slots^2 (100 rows took 110 s per engine sampler at 100 slots, 34 s at 25); generate's cost is per row
        args.prompts, args.samples, args.tokens, args.temperatures, args.permutations, args.batch = 1, 100, 6, "1.0", 1999, 25
        args.control_temperature_scale = 1.5
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    args.samplers = [s for s in args.samplers.split(",") if s]
    args.controls = [c for c in args.controls.split(",") if c]
    bad = [s for s in args.samplers if s not in SAMPLERS] + [c for c in args.controls if c not in CONTROLS]
    if bad:
        p.error(f"unknown sampler / control {bad}: samplers {SAMPLERS}, controls {CONTROLS}")
    if args.prompts < 1 or args.samples < 2 or not args.samplers:
        p.error("need --prompts >= 1, --samples >= 2 and at least one sampler")
    return args


class Run:
    """The models, prompts and settings every check of the run shares."""

    def __init__(self, args):
        self.args = args
        self.target, self.drafter, self.prompts, _, self.source = reference_pair(args.device, torch.float32, args.dataset,
                                                                                 args.prompts)  # fmt: skip
        self.engine = None
        checks = len(args.temperatures) * len(args.samplers)  # the real checks share alpha
        self.check = CheckSettings(permutations=args.permutations, alpha=args.alpha / checks, seed=args.seed)

    def rows(self, sampler: str, sampling: SamplingSettings, seed: int) -> list[list[list[int]]]:
        """Every prompt's rows from one sampler (``plain`` included)."""
        a, out = self.args, []
        for i, prompt in enumerate(self.prompts):
            s = seed + 1000 * i
            if sampler in ("plain", "generate"):
                drafter = self.drafter if sampler == "generate" else None
                out.append(generate_rows(self.target, prompt, a.samples, sampling, s, a.batch, drafter=drafter))
            else:
                out.append(engine_rows(self.get_engine(), prompt, a.samples, sampling, s, seeded=sampler == "engine_seeded"))
        return out

    def get_engine(self):
        if self.engine is None:
            from adaflash_hf.engine import Engine

            longest = max(map(len, self.prompts)) + self.args.tokens + self.drafter.config.block_size
            self.engine = Engine(self.target, self.drafter, length_policy="fixed", max_slots=self.args.batch,
                                 max_len=max(256, 1 << longest.bit_length()), token_budget=4096)  # fmt: skip
        return self.engine


def run_temperature(run: Run, temperature: float, results: list, timings: dict) -> None:
    a = run.args
    sampling = SamplingSettings(temperature=temperature, top_p=a.top_p, max_new_tokens=a.tokens)
    t0 = time.perf_counter()
    reference = run.rows("plain", sampling, a.seed)
    timings[f"plain T={temperature}"] = time.perf_counter() - t0
    jobs = [(name, name, sampling, None) for name in a.samplers]
    if "accept_all" in a.controls:
        jobs.append(("control: accept every draft (generate)", "generate", sampling, accepting_every_draft))
    if "temperature" in a.controls:
        off = replace(sampling, temperature=temperature * a.control_temperature_scale)
        jobs.append((f"control: temperature x{a.control_temperature_scale:g} (generate)", "generate", off, None))
    for k, (label, sampler, settings, context) in enumerate(jobs):
        t0 = time.perf_counter()
        if context is not None:
            with context():
                rows = run.rows(sampler, settings, a.seed + 7919 * (k + 1))
        else:
            rows = run.rows(sampler, settings, a.seed + 7919 * (k + 1))
        timings[f"{label} T={temperature}"] = time.perf_counter() - t0
        res = two_sample_check(reference, rows, run.check, f"{label}, T={temperature:g}", device=a.device)
        results.append((res, context is not None or settings is not sampling))
        log(f"{res.label}: {'passed' if res.passed else 'FAILED'} "
            f"(min p {min(t.p_value for t in res.tests):.2g}, level {res.level:.2g}; {timings[f'{label} T={temperature}']:.1f} s)")  # fmt: skip


def write(args, run: Run, results, timings) -> bool:
    real = [r for r, control in results if not control]
    controls = [r for r, control in results if control]
    ok = all(r.passed for r in real) and not any(r.passed for r in controls)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = [
        "# Speculative sampling against plain sampling (reference pair)",
        "",
        f"- device: {args.device}; float32; prompts: {len(run.prompts)} from {run.source}; {args.samples} rows per prompt and "
        f"sampler, the first {args.tokens} new tokens (EOS ends a row); top-p {args.top_p}; seed {args.seed}",
        f"- test: permutation ({args.permutations} relabellings within each prompt), family-wise alpha {args.alpha} over "
        f"{len(real)} real checks, so each statistic is tested at the level shown",
        f"- real checks passed: {sum(r.passed for r in real)}/{len(real)}; controls failed: "
        f"{sum(not r.passed for r in controls)}/{len(controls)} -> **{'OK' if ok else 'NOT OK'}**",
        "",
    ]
    text = "\n".join(header + markdown_table([r for r, _ in results])) + "\n\nseconds: " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()) + "\n"
    (out / "sampling_distribution.md").write_text(text)
    data = dict(args={k: v for k, v in vars(args).items()}, source=run.source, ok=ok, timings=timings,
                checks=[dict(r.to_dict(), control=control) for r, control in results])  # fmt: skip
    (out / "sampling_distribution.json").write_text(json.dumps(data, indent=1) + "\n")
    print(text)
    return ok


def main(argv=None) -> int:
    args = parse_args(argv)
    run = Run(args)
    log(f"reference pair on {args.device}, {len(run.prompts)} prompts from {run.source}")
    results, timings = [], {}
    for t in args.temperatures:
        run_temperature(run, t, results, timings)
    ok = write(args, run, results, timings)
    log(f"real checks pass and controls fail: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
