import sys, numpy as np, torch
from adaflash_hf import load_reference_pair
from adaflash_hf.bench.prompts import load_prompt_set
from adaflash_hf.engine import Engine
torch.manual_seed(0)
target, drafter, tok = load_reference_pair()
class Sink:
    def __init__(self): self.rows = []
    def on_round(self, v):
        if v.predicted_ratio is not None and v.verify_len == 16: self.rows.append((v.predicted_ratio, v.num_accepted))
for name in sys.argv[1].split(","):
    ps = load_prompt_set(name, 8, "/work/shared/data", split="validation")
    prompts = [tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False) if isinstance(p, list) else tok(p)["input_ids"] for p in ps.prompts][:8]
    s = Sink()
    e = Engine(target, drafter, length_policy="fixed", max_slots=8, max_len=4096, token_budget=4096, cuda_graphs=True, prompt_ngrams=0, round_sink=s)
    e.generate(prompts, 96)
    a = np.array(s.rows)
    L = np.clip(a[:, 0] * 16 - 1, 0, 15)
    print(name, len(a), "mean pred L", L.mean().round(2), "mean realized", a[:, 1].mean().round(2))
    for lo, hi in ((0, 0.5), (0.5, 1), (1, 2), (2, 4), (4, 8), (8, 16)):
        m = (L >= lo) & (L < hi)
        if m.any(): print(f"  pred L in [{lo},{hi}): n={m.sum()} pred {L[m].mean():.2f} realized {a[m,1].mean():.2f}")
