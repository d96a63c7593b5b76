"""Where the cost rule's drafting rounds win or lose at c=64 on the pair's gsm8k rounds under the H200 8B cost: the
default run's steps by kind, each priced as ``model_time.py`` prices it and as the same forwards without drafts.

    ADAFLASH_DATA=/work/shared/data python docs/logs/probe_share_cpu_1205/drafting_rounds.py 64
"""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "first_hold_cpu_1205"))
os.environ["COST"] = "h200"
import model_time as mt
import torch
from adaflash_hf import load_reference_pair
from adaflash_hf.bench.prompts import load_prompt_set
from adaflash_hf.engine import Engine

c = int(sys.argv[1]) if len(sys.argv) > 1 else 64
torch.manual_seed(0)
pair, cost = load_reference_pair(), mt.cost_model()
target, drafter, tok = pair
ps = load_prompt_set("gsm8k", c, "/work/shared/data", split="validation")
prompts = [tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False) if isinstance(p, list) else tok(p)["input_ids"] for p in ps.prompts][:c]
e = Engine(target, drafter, length_policy="cost", round_cost=cost, max_slots=c, max_len=4096, token_budget=max(4096, 64 * c), cuda_graphs=True, prompt_ngrams=0)
log = []
real_commit = e._commit
def commit(r, toks, verify_len=None, **kw):
    if verify_len is not None:
        log[-1]["rows"] += 1; log[-1]["tokens"] += len(toks); log[-1]["slots"] += verify_len - 1
    return real_commit(r, toks, verify_len=verify_len, **kw) if verify_len is not None else real_commit(r, toks, **kw)
e._commit = commit
bodies = [0]
real = e.draft_graphs.run_body
def body(slots, ctx, bonus):
    bodies[0] += bonus is not None
    return real(slots, ctx, bonus)
e.draft_graphs.run_body = body
handles = [e.submit(p, 96) for p in prompts]
B = drafter.config.block_size
while not e.idle:
    n, f0, b0, r0 = e.num_running, len(e.forward_tokens), bodies[0], e.host_syncs
    log.append({"rows": 0, "tokens": 0, "slots": 0})
    e.step()
    fwd = e.forward_tokens[f0:]
    n = max(n, 1)
    read = cost.read_time(n) if e.host_syncs - r0 == 1 else 0.0
    d = log[-1]; d.update(n=n, body=bodies[0] > b0, fwd=fwd)
    if d["body"]:
        d["t"] = cost.verify_time(n, fwd[0]) + cost.draft_time(n, B) + cost.overhead(n, True) - read
    else:
        d["t"] = sum(cost.verify_time(n, x) + cost.overhead(n, False) for x in fwd)
    d["t_plain"] = sum(cost.verify_time(n, x - d["slots"]) + cost.overhead(n, False) for x in fwd)  # same forward, no drafts
    d["prefill"] = fwd[0] - d["rows"] - d["slots"] if d["rows"] else fwd[0]
tot_t = sum(d["t"] for d in log); tot_tok = sum(d["tokens"] for d in log)
kinds = {}
for d in log:
    k = ("prefill+" if d["prefill"] > 0 else "") + ("draft" if d["slots"] > 0 else ("probe" if d["body"] else "plain"))
    s = kinds.setdefault(k, [0, 0, 0.0, 0.0, 0, 0])
    s[0] += 1; s[1] += d["tokens"]; s[2] += d["t"]; s[3] += d["t_plain"]; s[4] += d["rows"]; s[5] += d["slots"]
print(f"c={c}: steps {len(log)}, tokens {tot_tok}, modelled time {tot_t:.1f}")
print("| kind | steps | tokens | rows | slots | time | time if the same forward carried no drafts | tokens per row |")
for k, s in sorted(kinds.items()):
    print(f"| {k} | {s[0]} | {s[1]} | {s[4]} | {s[5]} | {s[2]:.1f} | {s[3]:.1f} | {s[1] / max(s[4], 1):.2f} |")
