import numpy as np, torch
from adaflash_hf import load_reference_pair
from adaflash_hf.bench.prompts import load_prompt_set
from adaflash_hf.engine import Engine
from adaflash_hf.speculation.length_policy import survival_curve
torch.manual_seed(0)
target, drafter, tok = load_reference_pair()
B = 16
ps = load_prompt_set("gsm8k", 128, "/work/shared/data", split="validation")
prompts = [tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False) for p in ps.prompts][64:128]
class Sink:
    def __init__(self): self.rows = []
    def on_round(self, v):
        if v.predicted_ratio is not None and v.verify_len == B: self.rows.append((v.predicted_ratio, v.num_accepted))
s = Sink()
Engine(target, drafter, length_policy="fixed", max_slots=64, max_len=4096, token_budget=4096, cuda_graphs=True, prompt_ngrams=0, round_sink=s).generate(prompts, 96)
a = np.array(s.rows); np.save("/tmp/gsm8k_rounds.npy", a)
L = np.clip(a[:, 0] * B - 1, 0, B - 1); order = np.argsort(L)
for b in np.array_split(order, 6):
    ratio = a[b, 0]; acc = a[b, 1]
    geo = survival_curve(ratio, B).mean(0)  # model P(A >= m), m = 1..15
    emp = np.array([(acc >= m).mean() for m in range(1, B)])
    print(f"pred L {L[b].mean():.2f} realized {acc.mean():.2f} | P(A>=m) m=1..8 model {np.round(geo[:8],2)} emp {np.round(emp[:8],2)}")
