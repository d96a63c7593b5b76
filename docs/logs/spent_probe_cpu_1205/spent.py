"""Issue 35, PROJECTION (dev CPU): the engine's in-round choice once its drafter body has run. Today a round whose
ratios make the cost rule (pricing the body as if a plain round could still save it) decode every request plainly
verifies nothing but bonus tokens: a probe that learns only its head's ratios. Variants (``SPENT_MODE`` of the
prototype's `engine/verify_lengths.py`): ``spent``, such a round verifies what pays with the body's time spent
(``drafted=True``; the plain decision for the next rounds still priced with the body), its acceptance counted into the
guess like any round's (branch `eager-sunk`'s prototype did this); ``unobserved``, the same lengths, but those rounds
left out of the guess (as today, when they verify nothing). Each step priced and tau counted by
`docs/logs/first_hold_cpu_1205/model_time.py`'s `tau_table` under SPEC's table; every output compared with `off`'s.

    PYTHONPATH=PROTOTYPE_TREE ADAFLASH_DATA=/work/shared/data python docs/logs/spent_probe_cpu_1205/spent.py \
        spec_bench:summarization 1:12,64:48
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "first_hold_cpu_1205"))
import model_time as mt  # noqa: E402

import adaflash_hf.engine.verify_lengths as vl  # noqa: E402

MODES = os.environ.get("MODES", "off,spent,unobserved").split(",")
VARIANTS = [("off", "off", "off"), ("fixed", "fixed", "off")] + [(f"cost, {m}", "cost", m) for m in MODES]


def apply(mode):
    vl.SPENT_MODE = mode


if __name__ == "__main__":
    mt.tau_table(sys.argv[1].split(","), mt.parse_runs(sys.argv[2]), VARIANTS, apply)
