import sys, time, torch
from adaflash_hf import load_reference_pair
from adaflash_hf.bench.prompts import load_prompts
from adaflash_hf.generation.prompts import encode_prompt
from adaflash_hf.speculation.prompt_ngrams import PromptNgrams
target, drafter, tok = load_reference_pair()
n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 4
for spec in ("spec_bench:summarization", "spec_bench:rag"):
    label, prompts = load_prompts(spec, n_prompts, None, "validation")
    agg = {}
    for i, p in enumerate(prompts):
        ids = torch.tensor([encode_prompt(tok, p)])
        outs = {}
        for mw in (None, 20, 31):
            t = time.time()
            with torch.inference_mode():
                out, st = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=128, length_policy="fixed",
                                          return_stats=True, fast_path=False, prompt_ngrams=PromptNgrams(max_width=mw))
            outs[mw] = out[0].tolist()
            a = agg.setdefault(mw, [0, 0, 0])
            a[0] += st.new_tokens if st.new_tokens else sum(x + 1 for x in st.accepted); a[1] += st.rounds; a[2] += st.wide_rounds
            print(label, i, ids.shape[1], mw, f"tau={st.tau:.2f} rounds={st.rounds} wide={st.wide_rounds} ngram={st.ngram_rounds} {time.time()-t:.1f}s", flush=True)
        print(label, i, "identical outputs:", outs[None] == outs[31] == outs[20], flush=True)
    for mw, (new, rounds, wide) in agg.items():
        print(f"SUMMARY {label} max_width={mw}: tokens/round={new/rounds:.3f} rounds={rounds} wide_rounds={wide}", flush=True)
