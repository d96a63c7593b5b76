"""Issue 35's tau goal at concurrency 1 against the guess before a round (dev CPU; the time is a PROJECTION): the
reference pair's validation prompts through the real engine, `fixed` against the `cost` rule with the guess before a
round taken as the request's last head ratio (`GUESS_PRIOR_ROUNDS` 0, the rule before commit b83f686) or as its
rounds' mean acceptance shrunk toward the traffic's by that many rounds (`PRIORS`, default "0,8"; 8 is the default
now), every output compared with `off`'s. Each step priced and tau counted by
`docs/logs/first_hold_cpu_1205/model_time.py`'s `tau_table` (the one implementation) under SPEC's table.

    ADAFLASH_DATA=/work/shared/data python docs/logs/c1_guess_cpu_1205/guess.py spec_bench:translation,prose 1:12,64:64
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "first_hold_cpu_1205"))
import model_time as mt  # noqa: E402

import adaflash_hf.engine.verify_lengths as vl  # noqa: E402

PRIORS = [float(w) for w in os.environ.get("PRIORS", "0,8").split(",")]
VARIANTS = [("off", "off", None), ("fixed", "fixed", None)] + [
    (f"cost, guess {'last ratio' if w == 0 else f'shrunk by {w:g}'}", "cost", w) for w in PRIORS]


def apply(window):
    vl.GUESS_PRIOR_ROUNDS = 8.0 if window is None else window


if __name__ == "__main__":
    mt.tau_table(sys.argv[1].split(","), mt.parse_runs(sys.argv[2]), VARIANTS, apply)
