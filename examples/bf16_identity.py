"""How often greedy speculative output differs from plain greedy output in bfloat16 (issue 19, item 6).

Speculative decoding is lossless in exact arithmetic: every emitted token is the target's argmax at
its position. In floating point the verify forward scores 16 tokens in one pass while plain decoding
scores one; the matrix products and attention reductions then run in other kernels / tile shapes
and round differently. In float32 the difference (~1e-6 relative) never flips an argmax in
practice; in bfloat16 (8 significant bits) two candidates whose logits are within rounding of each
other (a near-tie) can swap, and from that token on the texts diverge. Plain decoding has the same
sensitivity to batch size. This script measures it.

Sections (each timed, each skippable; results rewritten after every section):

  b8     Qwen3-8B shape, random bf16 weights on the GPU (``gpu_common.qwen3_8b_shape``) and a
         5-layer random bf16 drafter, ``--n`` random prompts: engine ``off`` vs engine with a drafter
         (``--modes``, default ``fixed``) over all prompts; HF ``generate`` plain (batch 1) vs
         ``generate(assistant_model=drafter)`` over the first ``--hf-n8b``.
  ref    the embedded reference pair in bf16 over ``--n`` real prompts (``--datasets``, from
         ``--data-dir`` / ``$ADAFLASH_DATA``, else the built-in sample, made distinct by numbering),
         the same comparisons (HF ones over the first ``--hf-nref``).
  fp32   the reference pair in float32: the control (0 differences expected).
  b8_fp32  the strict option, the 8B-shaped target in float32 (``--n-fp32`` of the b8 prompts): engine
         with a drafter vs engine ``off`` (0 differences expected), bf16 vs float32 plain decoding, and
         the cost: engine tokens per second in bf16 and in float32 on the same prompts.

For every differing prompt: the first differing position and, at that position of the reference
text, the target's top-2 logit margin (one prefill forward), against the bf16 spacing (ulp) at the
top logit. Over the HF prompts: the share of generated positions whose top-2 margin is below a few
ulps (the near-ties where a rounding difference can flip the argmax).

Writes ``bf16_identity.json`` and ``bf16_identity.md`` into ``--out`` (default ``$OUT``).

Usage:
    python examples/bf16_identity.py --out $OUT                # one H200, about 4 minutes
    python examples/bf16_identity.py --smoke --out /tmp/bf16   # CPU: tiny b8 and the fp32 control, ~30 s
    python examples/bf16_identity.py --smoke --smoke-all --out /tmp/bf16   # CPU, every section, ~1 minute
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

# The GPU machine reaches no network: named datasets come from --data-dir / $ADAFLASH_DATA or the built-in
# sample, without minutes of Hub retries first (export HF_HUB_OFFLINE=0 to allow the Hub).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import Sections, first_diff, free_memory, log, qwen3_8b_shape  # noqa: E402

NEAR_TIE_ULPS = 4  # a top-2 margin below this many bf16 ulps counts as a near-tie


# ----------------------------------------------------------------------------- models and prompts
def pair_8b(device, smoke: bool):
    """The 8B-shaped random bf16 target and a 5-layer random bf16 drafter (block 16) bound to it."""
    from adaflash_hf import AdaFlashDrafter

    target = qwen3_8b_shape(device, smoke)
    vocab = target.config.vocab_size
    torch.manual_seed(1)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):  # built in place: ~1B parameters at this shape
            drafter = AdaFlashDrafter.from_target(target, num_layers=5, block_size=16, mask_token_id=vocab - 1).eval()
    finally:
        torch.set_default_dtype(old)
    return target, drafter


def random_prompts(n: int, vocab: int, seed: int = 0, lo: int = 16, hi: int = 200) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, vocab - 2, (k,), generator=g).tolist() for k in lengths]


def real_prompts(tok, datasets: str, n: int, data_dir) -> tuple[list[list[int]], str]:
    """``n`` distinct chat prompts, taken in turn from the comma-separated ``datasets`` (each falls
    back to its domain's built-in sample offline), numbered ("Question 40: ...") when repeated."""
    from adaflash_hf.bench.prompts import load_prompts
    from adaflash_hf.generation.prompts import encode_prompt

    names = [d for d in datasets.split(",") if d]
    sets = [load_prompts(d, -(-n // len(names)), data_dir) for d in names]
    interleaved = [m for group in zip(*(ms for _, ms in sets)) for m in group] or sets[0][1]
    base = list({json.dumps(m, sort_keys=True): m for m in interleaved}.values())  # two sets may share a sample
    source = ", ".join(f"{label} ({len(ms)})" for label, ms in sets) + (f", numbered to {n}" if len(base) < n else "")
    messages = []
    for i in range(n):
        m = copy.deepcopy(base[i % len(base)])
        if i >= len(base):  # a repeat: made distinct by its number
            if isinstance(m, str):
                m = f"Question {i}: {m}"
            else:
                m[-1]["content"] = f"Question {i}: {m[-1]['content']}"
        messages.append(m)
    return [encode_prompt(tok, m) for m in messages], source


# ----------------------------------------------------------------------------- decoding
def engine_outputs(target, drafter, prompts, mode: str, max_new: int, slots: int, max_len: int,
                   speed: dict | None = None) -> list[list[int]]:
    """Greedy outputs of the engine; ``speed[mode]``: generated tokens per second of the run itself
    (engine construction and CUDA-graph capture excluded)."""
    from adaflash_hf.engine import Engine, layout_args

    eng = Engine(target, **layout_args(drafter, mode), max_slots=slots, max_len=max_len,
                 token_budget=max(512, slots * 16))
    sync = torch.cuda.synchronize if next(target.parameters()).is_cuda else (lambda: None)
    if speed is not None:  # kernels compiled for this dtype before the timed run
        eng.generate(prompts[:2], max_new_tokens=4)
    sync()
    t = time.perf_counter()
    outs = [o.token_ids for o in eng.generate(prompts, max_new_tokens=max_new)]
    sync()
    if speed is not None:
        speed[mode] = round(sum(map(len, outs)) / (time.perf_counter() - t), 1)
    del eng  # its cache and graph pool, before the next engine is built
    free_memory()
    return outs


def _greedy_config(target, max_new: int):
    """Greedy, exactly ``max_new`` tokens (no EOS stop)."""
    gc = copy.deepcopy(target.generation_config)
    gc.eos_token_id, gc.pad_token_id, gc.do_sample, gc.max_new_tokens = None, 0, False, max_new
    gc.temperature = gc.top_p = gc.top_k = None
    return gc


def hf_outputs(target, prompts, max_new: int, drafter=None) -> list[list[int]]:
    """Batch-1 greedy ``generate``: plain, or speculative with ``drafter``."""
    device = next(target.parameters()).device
    gc = _greedy_config(target, max_new)
    outs = []
    for p in prompts:
        kw = {"assistant_model": drafter} if drafter is not None else {}
        ids = torch.tensor([p], device=device)
        mask = torch.ones_like(ids)  # explicit: a prompt token equal to the pad id is not padding
        out = target.generate(ids, attention_mask=mask, generation_config=gc, **kw)
        outs.append(out[0, len(p):].tolist())
    return outs


# ----------------------------------------------------------------------------- analysis
def _ulp(x: float, dtype=torch.bfloat16) -> float:
    """Spacing of ``dtype`` numbers at magnitude ``x``."""
    mant = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]
    e = torch.tensor(abs(x) or 1e-30).log2().floor().item()
    return 2.0 ** (e - mant)


@torch.no_grad()
def margin_at(target, prompt, ref, pos: int, other: int | None) -> dict:
    """The target's logits after ``prompt + ref[:pos]`` (one prefill): top-2 margin, the reference
    token's lead over the other text's token, and the bf16 ulp at the top logit."""
    device = next(target.parameters()).device
    logits = target(torch.tensor([prompt + ref[:pos]], device=device), logits_to_keep=1).logits[0, -1].float()
    top = logits.topk(2)
    out = {"pos": pos, "top1": top.values[0].item(), "top2_margin": (top.values[0] - top.values[1]).item(),
           "ulp_bf16_at_top1": _ulp(top.values[0].item())}
    if pos < len(ref) and other is not None:
        out["ref_minus_other"] = (logits[ref[pos]] - logits[other]).item()
    out["margin_in_ulps"] = out["top2_margin"] / out["ulp_bf16_at_top1"]
    return out


@torch.no_grad()
def near_tie_share(target, prompts, refs) -> dict:
    """Over the generated positions of ``refs``: the share whose top-2 margin is below
    ``NEAR_TIE_ULPS`` bf16 ulps of the top logit (one prefill forward per prompt)."""
    device = next(target.parameters()).device
    total = near = 0
    margins = []
    for p, r in zip(prompts, refs):
        logits = target(torch.tensor([p + r], device=device)).logits[0, len(p) - 1 : len(p) + len(r) - 1].float()
        top = logits.topk(2, dim=-1).values
        m = top[:, 0] - top[:, 1]
        ulp = torch.exp2(torch.floor(torch.log2(top[:, 0].abs().clamp_min(1e-30))) - 7)
        near += int((m < NEAR_TIE_ULPS * ulp).sum())
        total += m.numel()
        margins.append(m.cpu())
    allm = torch.cat(margins) if margins else torch.zeros(0)
    return {"positions": total, "near_ties": near, "share": near / max(total, 1),
            "median_top2_margin": allm.median().item() if allm.numel() else None}


def _until_eos(seq: list[int], eos: set[int]) -> list[int]:
    return next((seq[: k + 1] for k, t in enumerate(seq) if t in eos), seq)


def compare(target, prompts, outs: list, refs: list, label: str, with_margins: bool = True) -> dict:
    """Prompts where ``outs`` differs from ``refs`` (the reference), first differing positions, margins."""
    diffs = []
    eos = target.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) - {None}
    for i, (o, r) in enumerate(zip(outs, refs)):
        # HF generate stops at EOS even with eos_token_id=None (it falls back to the model's); the
        # engine decodes max_new tokens: compare both up to the first EOS, the same stop rule.
        o, r = _until_eos(o, eos), _until_eos(r, eos)
        j = first_diff(o, r)
        if j is not None and (j < len(o) or j < len(r)):
            row = {"prompt": i, "first_diff": j}
            if with_margins:
                row["at_first_diff"] = margin_at(target, prompts[i], r, j, o[j] if j < len(o) else None)
            diffs.append(row)
    n = len(refs)
    firsts = sorted(d["first_diff"] for d in diffs)
    res = {"label": label, "prompts": n, "differ": len(diffs), "share": len(diffs) / max(n, 1),
           "first_diff_positions": firsts, "cases": diffs}
    if diffs and with_margins:
        ulps = sorted(d["at_first_diff"]["margin_in_ulps"] for d in diffs)
        res["median_margin_in_ulps_at_first_diff"] = ulps[len(ulps) // 2]
    log(f"  {label}: {len(diffs)}/{n} prompts differ" + (f" (first at {firsts[:8]})" if firsts else ""))
    return res


# ----------------------------------------------------------------------------- one section
def run_section(target, drafter, prompts, *, modes, max_new: int, hf_n: int, slots: int, max_len: int) -> dict:
    """Engine off vs each mode over every prompt; HF plain vs engine off / modes / assisted over ``hf_n``."""
    rep = {"prompts": len(prompts), "max_new_tokens": max_new, "hf_prompts": hf_n, "timings_s": {}, "comparisons": []}

    def timed(name, fn):
        t = time.perf_counter()
        out = fn()
        rep["timings_s"][name] = round(time.perf_counter() - t, 2)
        log(f"  {name}: {rep['timings_s'][name]:.1f}s")
        return out

    off = timed("engine_off", lambda: engine_outputs(target, None, prompts, "off", max_new, slots, max_len))
    spec = {m: timed(f"engine_{m}", lambda m=m: engine_outputs(target, drafter, prompts, m, max_new, slots, max_len))
            for m in modes}
    for m in modes:
        rep["comparisons"].append(compare(target, prompts, spec[m], off, f"engine {m} vs engine off"))
    if hf_n:
        sub = prompts[:hf_n]
        plain = timed("hf_plain", lambda: hf_outputs(target, sub, max_new))
        assisted = timed("hf_assisted", lambda: hf_outputs(target, sub, max_new, drafter))
        rep["comparisons"].append(compare(target, sub, assisted, plain, "HF assisted vs HF plain (batch 1)"))
        rep["comparisons"].append(compare(target, sub, off[:hf_n], plain, "engine off vs HF plain (no drafter: batching alone)"))
        for m in modes:
            rep["comparisons"].append(compare(target, sub, spec[m][:hf_n], plain, f"engine {m} vs HF plain"))
        rep["near_ties"] = timed("near_ties", lambda: near_tie_share(target, sub, plain))
        log(f"  near-ties: {rep['near_ties']['near_ties']}/{rep['near_ties']['positions']} positions "
            f"(top-2 margin < {NEAR_TIE_ULPS} bf16 ulps)")
    return rep


def fp32_cost(target, drafter, prompts, *, modes, max_new: int, slots: int, max_len: int) -> dict:
    """The strict option, loading the target in float32: its output identity (engine with a drafter
    vs engine ``off``, both float32) and its cost (engine tokens per second, bf16 vs float32, same
    prompts). Converts ``target`` and ``drafter`` to float32 in place."""
    rep = {"prompts": len(prompts), "tokens_per_s": {}}
    outs = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        target.to(dtype)
        drafter.to(dtype)
        speed = rep["tokens_per_s"].setdefault(name, {})
        for m in ["off", *modes]:
            outs[name, m] = engine_outputs(target, drafter, prompts, m, max_new, slots, max_len, speed)
        log(f"  {name} tokens/s: {speed}")
    rep["comparisons"] = [compare(target, prompts, outs["fp32", m], outs["fp32", "off"], f"fp32: engine {m} vs engine off")
                          for m in modes]
    rep["comparisons"].append(compare(target, prompts, outs["bf16", "off"], outs["fp32", "off"],
                                      "bf16 engine off vs fp32 engine off (rounding of plain decoding)", with_margins=False))
    rep["fp32_time_factor"] = {m: round(rep["tokens_per_s"]["bf16"][m] / rep["tokens_per_s"]["fp32"][m], 2)
                               for m in ["off", *modes]}
    log(f"  float32 costs x{rep['fp32_time_factor']} the time per token of bf16")
    return rep


# ----------------------------------------------------------------------------- report
def markdown(res: dict) -> str:
    m = res["meta"]
    out = ["# bf16 identity: speculative vs plain greedy", "",
           f"device {m['device']} {m.get('gpu', '')}, torch {m['torch']}, {m['max_new_tokens']} new tokens per prompt, "
           f"total {m.get('total_s', 0):.0f}s", "",
           "| section | comparison | prompts | differ | share | first differing positions | median top-2 margin at it (bf16 ulps) |",
           "|---|---|---|---|---|---|---|"]
    for name in ("b8", "ref", "fp32", "b8_fp32"):
        sec = res.get(name)
        if not isinstance(sec, dict) or "comparisons" not in sec:
            if isinstance(sec, dict) and "error" in sec:
                out.append(f"| {name} | error: {sec['error'][:80]} | | | | | |")
            continue
        for c in sec["comparisons"]:
            firsts = ", ".join(map(str, c["first_diff_positions"][:10])) or "-"
            med = c.get("median_margin_in_ulps_at_first_diff")
            out.append(f"| {name} | {c['label']} | {c['prompts']} | {c['differ']} | {100 * c['share']:.1f}% | {firsts} | "
                       f"{'-' if med is None else f'{med:.2f}'} |")
    out.append("")
    for name in ("b8", "ref", "fp32"):
        nt = (res.get(name) or {}).get("near_ties") if isinstance(res.get(name), dict) else None
        if nt:
            out.append(f"- {name}: {nt['near_ties']} of {nt['positions']} generated positions ({100 * nt['share']:.2f}%) have a "
                       f"top-2 margin below {NEAR_TIE_ULPS} bf16 ulps; median top-2 margin {nt['median_top2_margin']:.3f}")
    for name in ("b8", "ref", "fp32"):
        sec = res.get(name)
        if isinstance(sec, dict) and "timings_s" in sec:
            out.append(f"- {name} timings (s): " + ", ".join(f"{k} {v}" for k, v in sec["timings_s"].items()))
    cost = res.get("b8_fp32")
    if isinstance(cost, dict) and "fp32_time_factor" in cost:
        out.append(f"- strict option (target in float32, 8B shape, {cost['prompts']} prompts): engine tokens/s "
                   f"{cost['tokens_per_s']}; float32 takes x{cost['fp32_time_factor']} the time per token")
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "bf16_identity_out")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes (8B shape shrunk): sections b8 and fp32")
    ap.add_argument("--smoke-all", action="store_true", help="with --smoke: every section")
    ap.add_argument("--device", default=None)
    ap.add_argument("--n", type=int, default=200, help="prompts per section")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--hf-n8b", type=int, default=12, help="prompts through HF generate (batch 1) in section b8")
    ap.add_argument("--hf-nref", type=int, default=32, help="prompts through HF generate (batch 1) in ref / fp32")
    ap.add_argument("--modes", default="fixed", help="engine verify modes with a drafter (fixed, packed, rectangular)")
    ap.add_argument("--slots", type=int, default=32, help="engine concurrency")
    ap.add_argument("--n-fp32", type=int, default=64, help="prompts of the 8B float32 section (identity and cost)")
    ap.add_argument("--datasets", default="gsm8k,humaneval,mt_bench,alpaca_eval",
                    help="comma-separated prompt sets of sections ref / fp32 (offline: the built-in samples)")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--skip", default="", help="comma-separated sections to skip (b8,ref,fp32,b8_fp32)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip sections that would start after this")
    args = ap.parse_args(argv)

    smoke = args.smoke
    device = args.device or ("cpu" if smoke else ("cuda" if torch.cuda.is_available() else "cpu"))
    n = min(args.n, 3) if smoke else args.n
    max_new = min(args.max_new_tokens, 6) if smoke else args.max_new_tokens
    hf8, hfr = (min(args.hf_n8b, 1), min(args.hf_nref, 2)) if smoke else (args.hf_n8b, args.hf_nref)
    modes = [m for m in args.modes.split(",") if m]
    skip = set(filter(None, args.skip.split(",")))
    if smoke and not args.smoke_all:  # the quick smoke: tiny b8 and the float32 control
        skip |= {"ref", "b8_fp32"}
    meta = {"device": device, "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else "",
            "torch": torch.__version__, "smoke": smoke, "n": n, "max_new_tokens": max_new, "modes": modes,
            "near_tie_ulps": NEAR_TIE_ULPS}
    run = Sections(args.out, "bf16_identity", markdown, meta, skip, args.budget_s)
    section, res = run.section, run.results

    def b8():
        target, drafter = pair_8b(device, smoke)
        prompts = random_prompts(n, target.config.vocab_size)
        try:
            return run_section(target, drafter, prompts, modes=modes, max_new=max_new, hf_n=hf8, slots=args.slots,
                               max_len=512)
        finally:
            del target, drafter

    def ref(dtype):
        from adaflash_hf import load_reference_pair

        target, drafter, tok = load_reference_pair(device=device, dtype=dtype)
        prompts, source = real_prompts(tok, args.datasets, n, args.data_dir)
        rep = run_section(target.eval(), drafter.eval(), prompts, modes=modes, max_new=max_new, hf_n=hfr,
                          slots=args.slots, max_len=1024)
        rep["prompt_source"] = source
        return rep

    section("b8", b8)
    section("ref", lambda: ref(torch.bfloat16))
    section("fp32", lambda: ref(torch.float32))

    def b8_fp32():
        target, drafter = pair_8b(device, smoke)
        prompts = random_prompts(n, target.config.vocab_size)[: min(args.n_fp32, n)]
        try:
            return fp32_cost(target, drafter, prompts, modes=modes, max_new=max_new, slots=args.slots, max_len=512)
        finally:
            del target, drafter

    section("b8_fp32", b8_fp32)
    print(markdown(res))
    control = res.get("fp32", {}).get("comparisons")
    if control:
        print(f"float32 control: {sum(c['differ'] for c in control)} of {sum(c['prompts'] for c in control)} "
              "compared outputs differ")


if __name__ == "__main__":
    main()
