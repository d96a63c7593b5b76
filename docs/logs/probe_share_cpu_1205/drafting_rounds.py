"""Where the cost rule's drafting rounds win or lose at c requests on the pair's gsm8k rounds under the H200 8B cost:
the default run's steps by kind, each priced as ``model_time.py`` prices it (its ``step_time``, the one pricing) and
as the same forwards without drafts.

    ADAFLASH_DATA=/work/shared/data python docs/logs/probe_share_cpu_1205/drafting_rounds.py 64
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "first_hold_cpu_1205"))
os.environ["COST"] = "h200"
import model_time as mt  # noqa: E402
import torch  # noqa: E402

from adaflash_hf import load_reference_pair  # noqa: E402


def main(c: int) -> None:
    torch.manual_seed(0)
    pair, cost = load_reference_pair(), mt.cost_model()
    e, bodies = mt.counted_engine(pair, cost, c, "cost")
    log = []
    real_commit = e._commit

    def commit(r, toks, verify_len=None):  # a verify's tokens and draft slots, by step
        if verify_len is not None:
            log[-1]["rows"] += 1
            log[-1]["tokens"] += len(toks)
            log[-1]["slots"] += verify_len - 1
        return real_commit(r, toks, verify_len=verify_len)

    e._commit = commit
    for p in mt.validation_prompts("gsm8k", c, pair[2]):
        e.submit(p, 96)
    B = pair[1].config.block_size
    while not e.idle:
        n, f0, b0, r0 = max(e.num_running, 1), len(e.forward_tokens), bodies[0], e.host_syncs
        d = {"rows": 0, "tokens": 0, "slots": 0}
        log.append(d)
        e.step()
        fwd = e.forward_tokens[f0:]
        d["body"] = bodies[0] > b0
        d["t"] = mt.step_time(cost, n, fwd, B, d["body"], e.host_syncs - r0 == 1)
        d["t_plain"] = mt.step_time(cost, n, [x - d["slots"] for x in fwd], B, False, False)  # same forwards, no drafts
        d["prefill"] = fwd[0] - d["rows"] - d["slots"] if d["rows"] else fwd[0]
    kinds = {}
    for d in log:
        k = ("prefill+" if d["prefill"] > 0 else "") + ("draft" if d["slots"] > 0 else ("probe" if d["body"] else "plain"))
        s = kinds.setdefault(k, [0, 0, 0.0, 0.0, 0, 0])
        for i, v in enumerate((1, d["tokens"], d["t"], d["t_plain"], d["rows"], d["slots"])):
            s[i] += v
    print(f"c={c}: steps {len(log)}, tokens {sum(d['tokens'] for d in log)}, modelled time {sum(d['t'] for d in log):.1f}")
    print("| kind | steps | tokens | rows | slots | time | time if the same forward carried no drafts | tokens per row |")
    for k, s in sorted(kinds.items()):
        print(f"| {k} | {s[0]} | {s[1]} | {s[4]} | {s[5]} | {s[2]:.1f} | {s[3]:.1f} | {s[1] / max(s[4], 1):.2f} |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 64)
