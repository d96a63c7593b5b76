import cProfile, pstats, sys, time, torch
from adaflash_hf import load_reference_pair
from adaflash_hf.engine import Engine
torch.manual_seed(0); torch.set_num_threads(1)
target, drafter, tok = load_reference_pair()
n = int(sys.argv[2])
prompts = [tok("Question: A train travels 60 miles in 1.5 hours. How far does it go in 4 hours at the same speed?")["input_ids"]] * n
stats = {}
for policy in ("fixed", sys.argv[1]):
    e = Engine(target, drafter, length_policy=policy, max_slots=8, max_len=512, token_budget=256, cuda_graphs=True, prompt_ngrams=0)
    e.generate(prompts, max_new_tokens=32)
    s0 = e.num_steps
    pr = cProfile.Profile(); pr.enable()
    out = e.generate(prompts, max_new_tokens=64)
    pr.disable()
    rounds = e.num_steps - s0
    st = pstats.Stats(pr).stats
    stats[policy] = ({f"{k[0].split('/')[-1]}:{k[2]}": (v[1] / rounds, v[2] / rounds) for k, v in st.items()}, rounds)
    print(policy, "rounds", rounds, "calls/round", sum(v[1] for v in st.values()) / rounds)
a, ra = stats["fixed"]; b, rb = stats[sys.argv[1]]
rows = sorted(set(a) | set(b), key=lambda k: -(b.get(k, (0, 0))[0] - a.get(k, (0, 0))[0]))
for k in rows[:25]:
    print(f"{k:60s} fixed {a.get(k, (0,0))[0]:7.1f} {sys.argv[1]} {b.get(k, (0,0))[0]:7.1f} calls/round; tottime/round ms {1e3*a.get(k,(0,0))[1]:.3f} {1e3*b.get(k,(0,0))[1]:.3f}")
