import sys, numpy as np, torch
import adaflash_hf.engine.verify_lengths as vlmod
from adaflash_hf import load_reference_pair
from adaflash_hf.bench.prompts import load_prompt_set
from adaflash_hf.engine import Engine
from adaflash_hf.speculation.round_cost import RoundCost
torch.manual_seed(0)
target, drafter, tok = load_reference_pair()
B = 16
name = sys.argv[1]; c = int(sys.argv[2])
ps = load_prompt_set(name, 2 * c, "/work/shared/data", split="validation")
prompts = [tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False) if isinstance(p, list) else tok(p)["input_ids"] for p in ps.prompts]
fit_p, run_p = prompts[c:2 * c], prompts[:c]
class Sink:
    def __init__(self): self.rows = []
    def on_round(self, v):
        if v.predicted_ratio is not None and v.verify_len == B: self.rows.append((v.predicted_ratio, v.num_accepted))
s = Sink()
Engine(target, drafter, length_policy="fixed", max_slots=c, max_len=4096, token_budget=4096, cuda_graphs=True, prompt_ngrams=0, round_sink=s).generate(fit_p, 96)
a = np.array(s.rows); L = np.clip(a[:, 0] * B - 1, 0, B - 1); order = np.argsort(L)
bins = np.array_split(order, 10)
xs = np.array([L[b].mean() for b in bins]); ys = np.array([a[b, 1].mean() for b in bins])
ys = np.maximum.accumulate(ys)  # monotone
print("fit rounds", len(a), "map", list(zip(xs.round(2), ys.round(2))))
COST = RoundCost()
sys.argv = ["x"]
exec(open("docs/logs/probe_cap_cpu_1205/model_time.py").read().split("sets = sys.argv")[0])
real = vlmod.VerifyLengths._verify_lengths
def calibrated(self, running, ratio, guess=False, **kw):
    if ratio is not None and self.layout != "fixed":
        Lp = np.clip(ratio.float().cpu().numpy().reshape(-1) * B - 1, 0, B - 1)
        ratio = torch.tensor((np.interp(Lp, xs, ys) + 1) / B, dtype=torch.float32)
    return real(self, running, ratio, guess, **kw)
for label, pol, cal in (("off", "off", False), ("fixed", "fixed", False), ("cost", "cost", False), ("cost, calibrated", "cost", True)):
    vlmod.VerifyLengths._verify_lengths = calibrated if cal else real
    tokens, t, outs, cnt = modelled(run_p, c, pol, 0.02)
    r = tokens / t
    if label == "off": base = r
    print(label, round(r / base, 3), cnt)
