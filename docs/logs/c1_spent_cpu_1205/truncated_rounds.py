"""Issue 35, PROJECTION (dev CPU): the rounds whose verify the cost rule cut short of the block on their read ratios
(not whole-block rounds): how often every verified draft was accepted, predicted (the survival curve at the last
verified draft) and seen, and the tokens expected within the window against those committed. The engine and pricing
are `docs/logs/first_hold_cpu_1205/model_time.py`'s (SPEC's table, 96 new tokens, n-grams off); SPLIT=test takes the
set's test prompts instead of its validation prompts.

    ADAFLASH_DATA=/work/shared/data python docs/logs/c1_spent_cpu_1205/truncated_rounds.py spec_bench:summarization 1 24
    SPLIT=test ADAFLASH_DATA=/work/shared/data python docs/logs/c1_spent_cpu_1205/truncated_rounds.py \
        spec_bench:summarization 1 32
"""
import os
import sys, collections
sys.path.insert(0, "/work/main/docs/logs/first_hold_cpu_1205")
import model_time as mt
import torch
import adaflash_hf.engine.verify_lengths as vl
from adaflash_hf.speculation.length.rules import survival_curve
acc = collections.defaultdict(float); last = {}
orig = vl.VerifyLengths._verify_lengths
def wrapped(self, running, ratio, guess=False, unread_whole=False):
    k = orig(self, running, ratio, guess, unread_whole)
    if not guess and ratio is not None:
        s = survival_curve(ratio.float().cpu().view(-1).numpy(), self.block_size, 1.0)
        for i, (r, kk) in enumerate(zip(running, k.tolist())):
            last[id(r)] = (kk, s[i, kk - 2] if kk > 1 else 1.0, 1 + s[i, : kk - 1].sum())
    return k
vl.VerifyLengths._verify_lengths = wrapped
oobs = vl.VerifyLengths._observe_round
def obs(self, r, a, v):
    got = last.pop(id(r), None)
    if got and v > 1 and not self._late_ratio and v < self.block_size:
        kk, p_all, exp = got
        acc["trunc rows"] += 1; acc["pred all"] += p_all; acc["all"] += (a >= v - 1)
        acc["exp"] += exp; acc["real"] += 1 + a; acc["k"] += v
    return oobs(self, r, a, v)
vl.VerifyLengths._observe_round = obs
torch.manual_seed(0)
pair, cost = mt.load_reference_pair(), mt.cost_model()
name, c, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if os.environ.get("SPLIT", "validation") == "test":
    tok = pair[2]
    ps = mt.load_prompt_set(name, n, os.environ.get("ADAFLASH_DATA", "/work/shared/data"), split="test")
    prompts = [tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False) if isinstance(p, list)
               else tok(p)["input_ids"] for p in ps.prompts][:n]
else:
    prompts = mt.validation_prompts(name, n, pair[2])
rate, outs, tau, counts = mt.tau_run(pair, cost, prompts, c, "cost")
t = max(acc["trunc rows"], 1)
print(name, c, n, round(tau, 3), counts, "truncated rows", int(acc["trunc rows"]),
      "mean k", round(acc["k"] / t, 2),
      "P(all verified accepted) predicted", round(acc["pred all"] / t, 3), "seen", round(acc["all"] / t, 3),
      "tokens expected", round(acc["exp"] / t, 3), "committed", round(acc["real"] / t, 3), flush=True)
