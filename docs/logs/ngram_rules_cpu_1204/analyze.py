import json, sys
from rules import AllIndex, run, W
data = {}
for f in sys.argv[1:]: data.update(json.load(open(f)))
for label, items in data.items():
    cats = dict(same=0, drafter_wrong=0, drafter_better=0, other_cand=0, none=0)
    loss = dict(cats)
    for it in items:
        seq, p = it["seq"], it["p"]; idx = AllIndex(seq, 4)
        for j, drafts in enumerate(it["drafts"]):
            cur = p + j + 1; truth = seq[cur:]
            conts = idx.conts(cur, 1, "left")
            cands = [c for c in (seq[s: min(s + W, cur)] for n, s in conts) if c]
            a_d = run(drafts, truth)
            best, bl = None, 0
            for c in cands[:8]:
                l = run(c, drafts)
                if l > bl: best, bl = c, l
            chosen = run(best, truth) if best else a_d
            allc = [run(c, truth) for c in cands]
            orc = max([a_d] + allc)
            if orc == chosen: cats["same"] += 1; continue
            g = orc - chosen
            if best is None:
                k = "drafter_wrong" if a_d < orc else "none"
            elif a_d == orc: k = "drafter_better"
            elif any(run(c, truth) == orc and c[0] != drafts[0] for c in cands): k = "drafter_wrong"
            else: k = "other_cand"
            cats[k] += 1; loss[k] += g
    print(label, cats, {k: v for k, v in loss.items() if k != "same"})
