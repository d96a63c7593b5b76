import sys, numpy as np, torch
import adaflash_hf.speculation.length_policy as lp
B = 16
a = np.load("/tmp/gsm8k_rounds.npy")
edges = np.quantile(a[:, 0], np.linspace(0, 1, 11)[1:-1])
idx = np.digitize(a[:, 0], edges)
table = np.array([[(a[idx == i, 1] >= m).mean() for m in range(1, B)] for i in range(10)])
geo = lp.survival_curve
def empirical(ratio, block_size, rate=1.0):
    r = np.asarray(ratio, dtype=np.float64).reshape(-1)
    return table[np.digitize(np.nan_to_num(r), edges)]
sys.argv = ["x"]
exec(open("docs/logs/probe_cap_cpu_1205/model_time.py").read().split("sets = sys.argv")[0])
ps = load_prompt_set("gsm8k", 64, "/work/shared/data", split="validation")
prompts = [tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False) for p in ps.prompts][:64]
for label, pol, surv in (("off", "off", geo), ("fixed", "fixed", geo), ("cost", "cost", geo), ("cost, empirical survival", "cost", empirical)):
    lp.survival_curve = surv
    tokens, t, outs, cnt = modelled(prompts, 64, pol, 0.02)
    r = tokens / t
    if label == "off": base = r
    print(label, round(r / base, 3), cnt, flush=True)
