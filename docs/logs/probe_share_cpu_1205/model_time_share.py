"""PROJECTION from real rounds (dev CPU): `docs/logs/first_hold_cpu_1205/model_time.py` (the one implementation of the
modelled time) with the first probe's hold at several values of `verify_lengths.FIRST_PROBE_SHARE`.

    COST=real ADAFLASH_DATA=/work/shared/data python docs/logs/probe_share_cpu_1205/model_time_share.py gsm8k,spec_bench:rag 1:8,8 1.0,0.25
    COST=h200 ADAFLASH_DATA=/work/shared/data python docs/logs/probe_share_cpu_1205/model_time_share.py gsm8k 64,128 1.0,0.25,0.1
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "first_hold_cpu_1205"))
import model_time as mt  # noqa: E402

if __name__ == "__main__":
    mt.run(sys.argv[1].split(","), mt.parse_runs(sys.argv[2]),
           [("off", "off", {}), ("fixed", "fixed", {})] +
           [(f"cost, FIRST_PROBE_SHARE {s:g}", "cost", {"FIRST_PROBE_SHARE": s}) for s in map(float, sys.argv[3].split(","))])
