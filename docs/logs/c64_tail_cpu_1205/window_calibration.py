"""Issue 35, PROJECTION (dev CPU): is the cost rule misled by the length head at c=64? For every row of a round
whose lengths the engine chose on its read ratios (not whole-block rounds), the tokens the rule expected within the
verified window (1 + the survival curve's sum over the verified drafts) against the tokens the row committed (1 +
accepted). Both are counted within the same window, so censoring does not bias the comparison. The engine and its
pricing are `docs/logs/first_hold_cpu_1205/model_time.py`'s (SPEC's table, 96 new tokens, n-grams off).

    ADAFLASH_DATA=/work/shared/data python docs/logs/c64_tail_cpu_1205/window_calibration.py gsm8k 64 128
"""
import sys, collections
sys.path.insert(0, "/work/main/docs/logs/first_hold_cpu_1205")
import model_time as mt
import numpy as np, torch
import adaflash_hf.engine.verify_lengths as vl
from adaflash_hf.speculation.length.rules import survival_curve
acc = collections.defaultdict(float)
pending = []
orig = vl.VerifyLengths._verify_lengths
def wrapped(self, running, ratio, guess=False, unread_whole=False):
    k = orig(self, running, ratio, guess, unread_whole)
    if not guess and ratio is not None:
        s = survival_curve(ratio.float().cpu().view(-1).numpy(), self.block_size, 1.0)
        for i, kk in enumerate(k.tolist()):
            if kk > 1:
                acc["expected"] += 1 + s[i, : kk - 1].sum(); acc["rows"] += 1
                acc["ratio"] += float(ratio.view(-1)[i])
    return k
vl.VerifyLengths._verify_lengths = wrapped
oobs = vl.VerifyLengths._observe_round
def obs(self, r, a, v):
    if v > 1 and not self._late_ratio:
        acc["realized"] += 1 + a; acc["obs"] += 1; acc["seen"] += (a + 1) / self.block_size
    return oobs(self, r, a, v)
vl.VerifyLengths._observe_round = obs
torch.manual_seed(0)
pair, cost = mt.load_reference_pair(), mt.cost_model()
name, c, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompts = mt.validation_prompts(name, n, pair[2])
acc.clear()
rate, outs, tau, counts = mt.tau_run(pair, cost, prompts, c, "cost")
print(name, c, n, round(tau, 3), counts, {k: round(v, 3) for k, v in acc.items()},
      "expected/row", round(acc["expected"] / max(acc["rows"], 1), 3),
      "realized/row", round(acc["realized"] / max(acc["obs"], 1), 3),
      "mean ratio", round(acc["ratio"] / max(acc["rows"], 1), 3),
      "mean seen", round(acc["seen"] / max(acc["obs"], 1), 3), flush=True)
