import json, sys
from rules import AllIndex, run, W, walk
def accs(item, key, pool, K):
    seq, p = item["seq"], item["p"]; idx = AllIndex(seq, 4); out = []
    for j, drafts in enumerate(item["drafts"]):
        cur = p + j + 1; truth = seq[cur:]
        a_d = run(drafts, truth)
        idx.extend_to(cur)
        cands, taken = [], set()
        for n in range(min(4, cur - 1), 0, -1):
            occ = idx.occ.get(tuple(seq[cur - n: cur]), [])
            occ = occ[:K] if pool == "first" else occ[-K:] if pool == "last" else occ
            for s in occ:
                if s + n < cur and s + n not in taken:
                    taken.add(s + n); cands.append((n, s + n, seq[s + n: min(s + n + W, cur)]))
        best, bk = None, None
        for n, st, c in cands:
            l = run(c, drafts)
            if l == 0: continue
            k = {"agree_n_left": (l, n, -st), "agree_n_right": (l, n, st), "agree_right": (l, st), "agree_left": (l, -st),
                 "n_agree_right": (n, l, st)}[key]
            if bk is None or k > bk: best, bk = c, k
        out.append(run(best, truth) if best else a_d)
    return out
data = {}
for f in sys.argv[1:]: data.update(json.load(open(f)))
V = [("agree_n_left", "first", 8), ("agree_n_left", "all", 0), ("agree_n_right", "all", 0), ("agree_right", "all", 0),
     ("agree_left", "all", 0), ("n_agree_right", "all", 0), ("agree_n_right", "last", 8), ("agree_right", "last", 8), ("agree_n_right", "last", 4), ("agree_n_right", "last", 16)]
print("| set | " + " | ".join(f"{k} {p}{K or ''}" for k, p, K in V) + " |")
for label, items in data.items():
    row = []
    for key, pool, K in V:
        new = rounds = 0
        for it in items:
            a = accs(it, key, pool, K); new += len(a); rounds += walk(a)
        row.append(new / rounds)
    print(f"| {label} | " + " | ".join(f"{x:.2f}" for x in row) + " |", flush=True)
