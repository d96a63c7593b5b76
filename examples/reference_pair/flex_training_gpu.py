"""GPU check and timing of the drafter's training step: the dense block mask against the sparse flex rule.

On the reference pair (bf16 autocast, fp32 master weights, as ``train_drafter`` runs), batch shapes like the
regenerated answers (prompts of 20-300 tokens, answers of 60-160):

1. identity: the flex rule's loss and every gradient against the dense mask's on the same batch and anchors;
2. time per optimizer step (forward, backward, AdamW) for each ``--variants`` entry ``MODE:MAX_ANCHORS``;
3. a torch.profiler table of the CUDA kernels of one step per mode.

    python examples/reference_pair/flex_training_gpu.py --out $OUT --batch 128
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from adaflash_hf import load_reference_pair
from adaflash_hf.training.blocks import sample_anchors
from adaflash_hf.training.model import DrafterTrainingModel


def batch(b: int, vocab: int, seed: int, device) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(20, 300, (b,), generator=g)
    answer = torch.randint(60, 160, (b,), generator=g)
    T = int((prompt + answer).max())
    ids = torch.randint(0, vocab - 1, (b, T), generator=g)
    pos = torch.arange(T)
    am = pos[None] < (prompt + answer)[:, None]
    lm = am & (pos[None] >= prompt[:, None])
    return {"input_ids": ids.to(device), "attention_mask": am.to(device), "loss_mask": lm.to(device)}


def identity(target, drafter, data) -> dict:
    anchors, valid = sample_anchors(data["loss_mask"], drafter.config.block_size, 512)
    res = {}
    for mode in ("dense", "flex"):
        model = DrafterTrainingModel(target, drafter, block_attention=mode)
        drafter.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**data, anchors=anchors, anchor_valid=valid)
        out["loss"].backward()
        res[mode] = (out, {n: p.grad.float().clone() for n, p in drafter.named_parameters() if p.grad is not None})
    d, dg = res["dense"]
    report = {"loss_dense": float(d["loss"]), "accept_len_dense": float(d["accept_len"]), "params_with_grad": len(dg)}
    for mode in ("flex",):
        f, fg = res[mode]
        rel = {n: float((fg[n] - dg[n]).norm() / dg[n].norm().clamp(min=1e-12)) for n in dg}
        report.update({f"loss_{mode}": float(f["loss"]), f"accept_len_{mode}": float(f["accept_len"]),
                       f"max_grad_rel_diff_{mode}": max(rel.values()), f"worst_param_{mode}": max(rel, key=rel.get)})
    return report


def time_steps(target, drafter, data_list, mode: str, max_anchors: int, steps: int) -> dict:
    model = DrafterTrainingModel(target, drafter, block_attention=mode, max_anchors=max_anchors)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-5, fused=True)

    def step(data):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**data)
        out["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out

    t = time.perf_counter()
    step(data_list[0])
    torch.cuda.synchronize()
    first = time.perf_counter() - t
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    blocks = tokens = 0
    for i in range(steps):
        out = step(data_list[1 + i % (len(data_list) - 1)])
        blocks += int(out["num_blocks"])
        tokens += int(out["num_tokens"])
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / steps
    prof = None
    if os.environ.get("PROFILE", "1") == "1":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            step(data_list[1])
            torch.cuda.synchronize()
        ka = p.key_averages()
        prof = (ka.table(sort_by="self_cuda_time_total", row_limit=25) + "\n"
                + ka.table(sort_by="self_cpu_time_total", row_limit=12))
    return {"mode": mode, "max_anchors": max_anchors, "first_step_s": round(first, 2), "step_ms": round(dt * 1e3, 1),
            "blocks_per_s": round(blocks / steps / dt), "labelled_tokens_per_s": round(tokens / steps / dt),
            "peak_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1), "profile": prof}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--variants", default="dense:512,flex:512,flex:64,dense:64")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    target, drafter, _ = load_reference_pair("cuda", torch.bfloat16)
    drafter = drafter.float().train()
    vocab = target.config.vocab_size
    report = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    try:
        report["identity"] = identity(target, drafter, batch(8, vocab, 0, "cuda"))
    except Exception as exc:  # noqa: BLE001 - reported; the timings still run
        report["identity"] = {"error": f"{type(exc).__name__}: {exc}"[-3000:]}
    print(json.dumps(report["identity"]), flush=True)
    data = [batch(a.batch, vocab, s, "cuda") for s in range(1, 6)]
    report["timing"] = []
    for v in a.variants.split(","):
        mode, n = v.split(":")
        try:
            r = time_steps(target, drafter, data, mode, int(n), a.steps)
        except Exception as exc:  # noqa: BLE001 - a failing variant is a result, the others still run
            r = {"mode": mode, "max_anchors": int(n), "error": f"{type(exc).__name__}: {exc}"[:2000]}
        print(json.dumps({k: v for k, v in r.items() if k != "profile"}), flush=True)
        if r.get("profile"):
            print(r["profile"], flush=True)
        report["timing"].append(r)
    with open(os.path.join(a.out, "flex_training.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
