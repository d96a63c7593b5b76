import json, sys
from collections import defaultdict
import os
W = int(os.environ.get("W", 15))

def run(prop, truth):
    n = 0
    while n < min(len(prop), len(truth)) and prop[n] == truth[n]:
        n += 1
    return n

class AllIndex:
    def __init__(self, toks, top):
        self.toks, self.top, self.occ, self.length = toks, top, defaultdict(list), 0
    def extend_to(self, length):
        t = self.toks
        for nxt in range(self.length, length):
            for n in range(1, min(self.top, nxt) + 1):
                self.occ[tuple(t[nxt - n: nxt])].append(nxt - n)
        self.length = max(self.length, length)
    def conts(self, cur, min_n, order):
        """continuations (n, start) longest n first; within n leftmost or rightmost first"""
        self.extend_to(cur)
        out = []
        for n in range(min(self.top, cur - 1), min_n - 1, -1):
            starts = self.occ.get(tuple(self.toks[cur - n: cur]), [])
            it = starts if order == "left" else reversed(starts)
            for s in it:
                out.append((n, s + n))
        return out

def proposals(item, rule, top=4):
    seq, p = item["seq"], item["p"]
    idx = AllIndex(seq, top)
    res = []
    for j, drafts in enumerate(item["drafts"]):
        cur = p + j + 1
        truth = seq[cur:]
        a_d = run(drafts, truth)
        kind, *args = rule
        if kind == "drafter":
            res.append(a_d); continue
        conts = idx.conts(cur, args[0] if args else 1, args[1] if len(args) > 1 else "left")
        cands = [seq[s: min(s + W, cur)] for n, s in conts]
        cands = [c for c in cands if c]
        if kind == "lookup":  # transformers' prompt lookup, 20 tokens x n-gram 4 (no EOS crop: a projection)
            c = [seq[s: min(s + 20, cur)] for n, s in conts[:1]]
            res.append(run(c[0], truth) if c else 0); continue
        if kind == "agree":  # leftmost-longest only
            c = cands[0] if cands else []
            res.append(run(c, truth) if c and c[0] == drafts[0] else a_d)
        elif kind == "agree_any":
            c = next((c for c in cands if c[0] == drafts[0]), None)
            res.append(run(c, truth) if c else a_d)
        elif kind == "agree_best":  # longest agreement with drafts, ties -> order of cands
            best, bl = None, 0
            for c in cands:
                l = run(c, drafts)
                if l > bl: best, bl = c, l
            res.append(run(best, truth) if best else a_d)
        elif kind == "best_k":  # first K candidates in order (n desc, left first), longest agreement
            K = args[2]; best, bl = None, 0
            for c in cands[:K]:
                l = run(c, drafts)
                if l > bl: best, bl = c, l
            res.append(run(best, truth) if best else a_d)
        elif kind == "best_min":  # agreement >= m needed for candidates from n-gram matches shorter than 2
            best, bl = None, 0
            for (n, s), c in zip([x for x in conts if seq[x[1]: min(x[1] + W, cur)]], cands):
                l = run(c, drafts)
                if n == 1 and l < args[2]: continue
                if l > bl: best, bl = c, l
            res.append(run(best, truth) if best else a_d)
        elif kind == "fallback":  # best_k8; if none agrees, the top candidate when the drafter is unsure at pos 1
            K, tau_c, n0 = 8, args[2], args[3]
            pairs = [(x, seq[x[1]: min(x[1] + W, cur)]) for x in conts]
            pairs = [(x, c) for x, c in pairs if c]
            best, bl = None, 0
            for x, c in pairs[:K]:
                l = run(c, drafts)
                if l > bl: best, bl = c, l
            if best is None and pairs and item["confs"][j][0] < tau_c and pairs[0][0][0] >= n0:
                best = pairs[0][1]
            res.append(run(best, truth) if best else a_d)
        elif kind == "oracle_any":
            res.append(max([a_d] + [run(c, truth) for c in cands]))
        elif kind == "agree_oracle":
            res.append(max(a_d, max([run(c, truth) for c in cands] or [0])))
    return res

def walk(accs):
    j = r = 0
    while j < len(accs):
        j += accs[j] + 1; r += 1
    return r

RULES = {"lookup20x4": ("lookup", 4), "drafter": ("drafter",), "agree": ("agree", 1, "left"), "any_L1": ("agree_any", 1, "left"),
         "any_R1": ("agree_any", 1, "right"), "any_R2": ("agree_any", 2, "right"), "any_L2": ("agree_any", 2, "left"),
         "best_L1": ("agree_best", 1, "left"), "best_R1": ("agree_best", 1, "right"), "best_R2": ("agree_best", 2, "right"),
         "best_k4": ("best_k", 1, "left", 4), "best_k8": ("best_k", 1, "left", 8), "best_k16": ("best_k", 1, "left", 16),
         "best_k32": ("best_k", 1, "left", 32), "fb.3n2": ("fallback", 1, "left", 0.3, 2), "fb.5n2": ("fallback", 1, "left", 0.5, 2), "fb.5n3": ("fallback", 1, "left", 0.5, 3), "fb.7n3": ("fallback", 1, "left", 0.7, 3), "fb1n4": ("fallback", 1, "left", 1.01, 4), "oracle_any": ("oracle_any", 1, "left")}
for k in ("any_R1", "any_R2", "best_R1", "best_R2", "any_L2", "best_L1", "best_k32", "best_k16", "best_k4", "any_L1"): RULES.pop(k)
if __name__ == "__main__":
    data = {}
    for f in sys.argv[1:]:
        data.update(json.load(open(f)))
    print("| set | " + " | ".join(RULES) + " |")
    for label, items in data.items():
        row = []
        for name, rule in RULES.items():
            new = rounds = 0
            for it in items:
                accs = proposals(it, rule)
                new += len(accs); rounds += walk(accs)
            row.append(new / rounds)
        print(f"| {label} ({len(items)}) | " + " | ".join(f"{x:.2f}" for x in row) + " |")
