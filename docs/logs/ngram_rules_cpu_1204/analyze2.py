import json, sys
from collections import Counter
from rules import AllIndex, run, W
data = {}
for f in sys.argv[1:]: data.update(json.load(open(f)))
for label, items in data.items():
    c_in8, c_agreefirst, c_nbetter, c_nworse, c_right = Counter(), Counter(), Counter(), Counter(), Counter()
    for it in items:
        seq, p = it["seq"], it["p"]; idx = AllIndex(seq, 4)
        for j, drafts in enumerate(it["drafts"]):
            cur = p + j + 1; truth = seq[cur:]
            conts = [(n, s) for n, s in idx.conts(cur, 1, "left") if s < cur]
            cands = [seq[s: min(s + W, cur)] for n, s in conts]
            a_d = run(drafts, truth)
            best, bl, bi = None, 0, None
            for i, c in enumerate(cands[:8]):
                l = run(c, drafts)
                if l > bl: best, bl, bi = c, l, i
            if best is None: continue
            chosen = run(best, truth)
            allc = [run(c, truth) for c in cands]
            orc = max(allc)
            if orc <= max(chosen, a_d): continue
            oi = allc.index(orc)
            c_in8[oi < 8] += orc - chosen
            c_agreefirst[cands[oi][0] == drafts[0]] += orc - chosen
            c_nbetter[(conts[oi][0] > conts[bi][0], conts[oi][0] == conts[bi][0])] += orc - chosen
            c_right[conts[oi][1] > conts[bi][1]] += orc - chosen
    print(label, "in first 8:", dict(c_in8), "agrees first:", dict(c_agreefirst), "(n higher, n equal):", dict(c_nbetter), "oracle to the right:", dict(c_right))
