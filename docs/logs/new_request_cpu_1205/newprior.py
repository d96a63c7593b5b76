"""Issue 35, PROJECTION (dev CPU): a request yet to draft guessed at the traffic's mean acceptance (once any round has
been seen) against accepting everything, on the tree of `prototype.diff` (its `NEW_GUESS_PRIOR` switch; the committed
rule is the switch on). `model_time.py`'s engine and pricing; see README.md for the commands."""
import sys
sys.path.insert(0, "/work/main/docs/logs/first_hold_cpu_1205")
import model_time as mt
mt.run(sys.argv[1].split(","), mt.parse_runs(sys.argv[2]),
       [("off", "off", {}), ("fixed", "fixed", {}), ("cost", "cost", {"NEW_GUESS_PRIOR": False}),
        ("cost, new request at the traffic's prior", "cost", {"NEW_GUESS_PRIOR": True})])
