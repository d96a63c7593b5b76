import random, time, torch
from adaflash_hf.speculation.prompt_ngrams import PromptNgrams, agree_with_drafts  # host cost of the rule per round
random.seed(0)
def mk(): return [random.randrange(300) for _ in range(300)]
for matches in (1, 8):
    rule = PromptNgrams(matches=matches)
    idx = [rule.index(mk()) for _ in range(128)]
    for g in idx: g.candidates(15)
    new = [[random.randrange(300) for _ in range(5)] for _ in range(128)]
    R = 30; tc = ta = 0.0
    d = torch.randint(0, 300, (128, 15))
    for _ in range(R):
        for g, n in zip(idx, new): g.tokens.extend(n)
        t = time.perf_counter(); c = [g.candidates(15) for g in idx]; t1 = time.perf_counter()
        agree_with_drafts(d, c); t2 = time.perf_counter()
        tc += t1 - t; ta += t2 - t1
    print(f"matches {matches}: candidates {tc/R*1e3:.2f} ms/round, agree {ta/R*1e3:.2f} ms/round, {sum(map(len, c))} candidates")
