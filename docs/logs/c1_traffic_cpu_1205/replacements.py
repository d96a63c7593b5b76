"""Issue 35 (dev CPU): which Spec-Bench summarization test prompts make `generate`'s fast path replace its cached
engine at batch 1 (max_len rounded up to a power of two, as `fast_path._engine_for` sizes it; the token budget adds
prompt 28). `python docs/logs/c1_traffic_cpu_1205/replacements.py`"""
import sys
sys.path.insert(0, "/work/main/docs/logs/first_hold_cpu_1205")
import model_time as mt
from adaflash_hf import load_reference_pair
t, d, tok = load_reference_pair()
ps = mt.load_prompt_set("spec_bench:summarization", 32, "/work/shared/data", split="test")
L = [len(tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False)) for p in ps.prompts][:32]
m = 0
for i, l in enumerate(L):
    need = l + 128 + 16
    p2 = max(256, 1 << (need - 1).bit_length())
    print(i, l, p2, "REBUILD" if p2 > m else "")
    m = max(m, p2)
