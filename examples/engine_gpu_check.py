"""GPU check of the continuous-batching engine (issue 6) -- run by a later session on the H200.

What it does:
1. correctness: for a few prompts, every verify mode's greedy output equals the target's own eager
   ``generate(do_sample=False)`` on that prompt alone (exact in float32; in bf16 a near-tie can flip
   a token, so mismatches are reported with the first diverging position rather than asserted);
2. timing: throughput (generated tokens / s) of ``off`` / ``fixed`` / ``packed`` at each concurrency
   (default 1, 32, 64, 128), with the reference pair on real prompts; mean tau, steps, tokens per
   forward. The engine is still *eager* here (no CUDA graphs / flex_attention yet): these numbers
   measure the scheduler + packed attention path, not the final engine.

TODO (next session): capture the decode-time forwards as CUDA graphs per (batch, tokens) bucket and
add "graph replay == eager" to step 1; swap ``packed_attention`` for flex_attention.

Usage:
    python examples/engine_gpu_check.py --smoke                    # CPU, reference pair, tiny sizes
    python examples/engine_gpu_check.py --smoke --tiny             # CPU, tiny random models, seconds
    python examples/engine_gpu_check.py --dtype bfloat16 --out runs/engine_gpu_check.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def _tiny_pair(device, dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from adaflash_hf import AdaFlashDrafter

    torch.manual_seed(0)
    target = Qwen3ForCausalLM(Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                          max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
                                          pad_token_id=None, attn_implementation="sdpa")).eval()
    target.generation_config.pad_token_id = target.generation_config.eos_token_id = None
    drafter = AdaFlashDrafter.from_target(target, num_layers=1, block_size=8, mask_token_id=127).eval()
    target.to(device=device, dtype=dtype)
    drafter.to(device=device, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 126, (int(n),), generator=g).tolist() for n in torch.randint(4, 40, (256,), generator=g)]
    return target, drafter.bind_target(target), prompts, None


def _reference_pair(device, dtype, dataset, n):
    from adaflash_hf import load_reference_pair
    from adaflash_hf.bench import _encode, _load_prompts

    target, drafter, tok = load_reference_pair(device=device, dtype=dtype)
    _, messages = _load_prompts(dataset, n, None)
    prompts = [_encode(tok, m) for m in messages]
    return target.eval(), drafter.eval(), prompts, tok.eos_token_id


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def check_correctness(target, drafter, prompts, max_new, modes, max_len):
    from adaflash_hf.engine import Engine

    report = {}
    device = next(target.parameters()).device
    refs = []
    for p in prompts:
        out = target.generate(torch.tensor([p], device=device), do_sample=False, max_new_tokens=max_new,
                              eos_token_id=None, pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    for mode in modes:
        engine = Engine(target, drafter, verify_mode=mode, max_slots=len(prompts), max_len=max_len, token_budget=max_len * 2)
        outs = engine.generate(prompts, max_new_tokens=max_new)
        mism = []
        for i, (o, r) in enumerate(zip(outs, refs)):
            if o.token_ids != r:
                first = next(j for j, (a, b) in enumerate(zip(o.token_ids + [-1], r + [-2])) if a != b)
                mism.append({"prompt": i, "first_diff": first})
        report[mode] = {"prompts": len(prompts), "exact": len(prompts) - len(mism), "mismatches": mism,
                        "slots_free_at_end": engine.cache.num_free == len(prompts)}
        print(f"[correctness] {mode:12s} exact {len(prompts) - len(mism)}/{len(prompts)}", flush=True)
    return report


def time_modes(target, drafter, prompts, max_new, modes, concurrency, max_len, token_budget, eos):
    from adaflash_hf.engine import Engine

    device = next(target.parameters()).device
    rows = []
    for c in concurrency:
        batch = [prompts[i % len(prompts)] for i in range(c)]
        for mode in modes:
            engine = Engine(target, drafter, verify_mode=mode, max_slots=c, max_len=max_len, token_budget=token_budget)
            engine.generate(batch[: min(c, 2)], max_new_tokens=4)  # warm-up
            warm_fwd, warm_steps = len(engine.forward_tokens), engine.num_steps
            _sync(device)
            t0 = time.perf_counter()
            outs = engine.generate(batch, max_new_tokens=max_new, eos_token_id=eos)
            _sync(device)
            dt = time.perf_counter() - t0
            toks = sum(len(o.token_ids) for o in outs)
            fwd = engine.forward_tokens[warm_fwd:]
            row = {"concurrency": c, "mode": mode, "tokens": toks, "seconds": dt, "tok_per_s": toks / dt,
                   "tau": (sum(o.tau * o.rounds for o in outs) / max(1, sum(o.rounds for o in outs))) if mode != "off" else 1.0,
                   "steps": engine.num_steps - warm_steps, "mean_forward_tokens": sum(fwd) / max(1, len(fwd))}
            rows.append(row)
            print(f"[timing] c={c:4d} {mode:12s} {row['tok_per_s']:9.1f} tok/s  tau {row['tau']:.2f}  "
                  f"steps {row['steps']}  tokens/forward {row['mean_forward_tokens']:.1f}", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, the reference pair in float32, tiny sizes")
    ap.add_argument("--tiny", action="store_true", help="with --smoke: tiny random models instead of the reference pair")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--dataset", default="gsm8k")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--check-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,32,64,128")
    ap.add_argument("--modes", default="off,fixed,packed")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--token-budget", type=int, default=2048)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    if args.smoke:
        device, dtype = args.device or "cpu", torch.float32
        if args.tiny:
            target, drafter, prompts, eos = _tiny_pair(device, dtype)
        else:
            target, drafter, prompts, eos = _reference_pair(device, dtype, args.dataset, 4)
        concurrency, max_new, max_len, budget, n_check = [1, 2], 8, 512, 1024, 2
    else:
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = getattr(torch, args.dtype)
        target, drafter, prompts, eos = _reference_pair(device, dtype, args.dataset, args.num_prompts)
        concurrency = [int(c) for c in args.concurrency.split(",")]
        max_new, max_len, budget, n_check = args.max_new_tokens, args.max_len, args.token_budget, args.check_prompts
    modes = args.modes.split(",")
    longest = max(len(p) for p in prompts)
    if longest + max_new > max_len:
        prompts = [p for p in prompts if len(p) + max_new <= max_len]
        print(f"note: dropped prompts longer than max_len - max_new_tokens ({max_len - max_new})", file=sys.stderr)
    with torch.no_grad():
        result = {
            "device": str(device), "dtype": str(dtype), "engine": "eager (no CUDA graphs yet)",
            "correctness": check_correctness(target, drafter, prompts[:n_check], min(max_new, 32),
                                             ["off", "fixed", "packed", "rectangular"], max_len),
            "timing": time_modes(target, drafter, prompts, max_new, modes, concurrency, max_len, budget, eos),
        }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    ok = all(r["exact"] == r["prompts"] for r in result["correctness"].values())
    print("correctness:", "all exact" if ok else "MISMATCHES (see report; bf16 near-ties possible)")
    return 0 if (ok or dtype != torch.float32) else 1


if __name__ == "__main__":
    sys.exit(main())
