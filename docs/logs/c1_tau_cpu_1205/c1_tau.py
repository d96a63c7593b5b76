"""Issue 35's tau goal at concurrency 1, beside its modelled time (dev CPU; the time is a PROJECTION): the reference
pair's validation prompts one at a time through the real engine, `fixed` against the `cost` rule (the default) and a
variant, every output compared with `off`'s. Each step is priced as `docs/logs/first_hold_cpu_1205/model_time.py` (the
one implementation: `step_time`) prices it, under SPEC's table or, with `COST=h200`, the 8B shape's cost the H200
measured on 2026-12-05. Tau: tokens per round over every round (a plain round counts 1), as the benchmark counts it.

    ADAFLASH_DATA=/work/shared/data python docs/logs/c1_tau_cpu_1205/c1_tau.py spec_bench:translation,prose 1:12,64:64

The variants set two knobs that exist only at commit 3436c48 (a prototype, reverted after this projection):
`verify_lengths.SUNK_BODY` (the rule decided after the drafter's body prices only the LM head, `DRAFT_HEAD_SHARE` 0.4
of the drafter's time, and no drafting overhead beyond a plain round's) and `GUESS_WEIGHT` (the guess before a round is
an EMA of the request's ratios with this weight on the newest; 1.0: the last ratio). Run it on that commit's tree.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "first_hold_cpu_1205"))
import model_time as mt  # noqa: E402

import adaflash_hf.engine.verify_lengths as vl  # noqa: E402

DEFAULTS = {k: getattr(vl, k) for k in ("FIRST_PROBE_SHARE", "PLAIN_PROBE_ROUNDS", "PROBE_SHARE", "SUNK_BODY", "GUESS_WEIGHT")}
VARIANTS = [("off", "off", {}), ("fixed", "fixed", {}),
            ("cost, as before", "cost", {"SUNK_BODY": False, "GUESS_WEIGHT": 1.0}),
            ("cost, body sunk", "cost", {"SUNK_BODY": True, "GUESS_WEIGHT": 1.0}),
            ("cost, body sunk, guess EMA 0.5", "cost", {"SUNK_BODY": True, "GUESS_WEIGHT": 0.5}),
            ("cost, body sunk, guess EMA 0.25", "cost", {"SUNK_BODY": True, "GUESS_WEIGHT": 0.25})]


def apply(settings):
    for k, v in {**DEFAULTS, **settings}.items():
        setattr(vl, k, v)


if __name__ == "__main__":
    mt.tau_table(sys.argv[1].split(","), mt.parse_runs(sys.argv[2]), VARIANTS, apply)
