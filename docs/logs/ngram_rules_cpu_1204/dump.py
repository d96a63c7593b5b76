"""Cache, per validation prompt, plain greedy output and the drafter's greedy drafts (+ confidences) at every position."""
import json, sys, time, torch
from adaflash_hf import load_reference_pair
from adaflash_hf.bench.prompts import load_prompts
from adaflash_hf.generation.prompts import encode_prompt
sets, n, split, out_path = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3], sys.argv[4]
torch.manual_seed(0); torch.set_num_threads(1)
target, drafter, tok = load_reference_pair()
block = drafter.config.block_size
eos = target.generation_config.eos_token_id; eos = set(eos if isinstance(eos, list) else [eos])
res = {}
for name in sets:
    t0 = time.time()
    label, prompts = load_prompts(name, n, None, split)
    items = []
    for prompt in prompts:
        ids = encode_prompt(tok, prompt)
        with torch.inference_mode():
            plain = target.generate(torch.tensor([ids]), max_new_tokens=128, do_sample=False)
        out = plain[0, len(ids):].tolist()
        out = out[: next((k + 1 for k, t in enumerate(out) if t in eos), len(out))]
        if len(out) < 2: continue
        seq = ids + out; p = len(ids)
        with torch.inference_mode():
            feats = drafter.select_context(target(torch.tensor([seq]), output_hidden_states=True).hidden_states)
            drafts, confs = [], []
            for j in range(len(out) - 1):
                cur = p + j
                states = drafter.draft_block(torch.tensor([seq[cur]]), feats[:, :cur], torch.arange(cur + block)[None])
                lp = drafter.compute_logits(states[:, 1:]).float().log_softmax(-1)[0]
                v, i = lp.max(-1)
                drafts.append(i.tolist()); confs.append([round(x, 3) for x in v.exp().tolist()])
        items.append(dict(p=p, seq=seq, drafts=drafts, confs=confs))
    res[label] = items
    print(label, len(items), round(time.time() - t0), flush=True)
    json.dump(res, open(out_path, "w"))
