"""PROJECTION from real rounds (dev CPU): the reference pair's own rounds, decided by the real engine under the 8B-shaped
H200 cost model, timed by that model instead of a clock.

Each engine step of the shipped pair (float32, prompt n-grams off, 96 new tokens) is priced with the engine's own
`RoundCost` (default: SPEC section 6's H200 table, overheads and read estimate): a round that ran the drafter's body
costs `round_time(n, tokens, B)` less the read when it made one device read, not two (`fixed`'s rounds, the whole-block
stretches: the ratios not read mid-round); every plain forward
`verify_time(n, n) + plain overhead`; prefill forwards alike (the same for every variant). Tokens per modelled time
of each variant, against `off` (no drafter) and `fixed`, per set and concurrency c (the first c validation prompts run
together; at c=1 the first N one at a time). Variants: the `cost` policy with the probe cap at PROBE_SHARE = 0.02
(the default), 0.05, and 1.0 (the cap stays at PLAIN_PROBE_ROUNDS = 8, the rule before the change). Every output is
compared with `off`'s. Runs `docs/logs/first_hold_cpu_1205/model_time.py` (the one implementation) with these
variants, the first probe's hold at 1 (the rule of the time), and this
run's pricing (a probe that decided plain priced as a plain round: see the README's caveat).

    ADAFLASH_DATA=/work/shared/data python docs/logs/probe_cap_cpu_1205/model_time.py gsm8k 1:8,64,128
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "first_hold_cpu_1205"))
from model_time import parse_runs, run  # noqa: E402

BEFORE = {"FIRST_PROBE_SHARE": 1e9}  # the first probe after 1 plain round, as the engine did at the time
run(sys.argv[1].split(","), parse_runs(sys.argv[2]),
    [("off", "off", {}), ("fixed", "fixed", {}),
     ("cost, probes <= 2% (default)", "cost", {**BEFORE, "PROBE_SHARE": 0.02}),
     ("cost, probes <= 5%", "cost", {**BEFORE, "PROBE_SHARE": 0.05}),
     ("cost, cap 8 (before)", "cost", {**BEFORE, "PROBE_SHARE": 1.0})],
    probes_charged=False)
