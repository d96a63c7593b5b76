"""GPU probe: the decode step's attention and projections at Qwen3-8B shape, against hand-written Triton.

A. Slot attention (``adaflash_hf.engine.kernels.decode_attention``, split-KV Triton) against compiled
   flex_attention (the engine's default until then): error against flex and device ms per 36-layer
   forward (one block mask per forward, as the engine builds it), 1 and 16 query rows per slot.
B. One-row projections: cuBLAS, Inductor's tuned reduction (what ``FusedTarget`` uses) and a Triton
   GEMV over a small grid of tile shapes.
C. 16-row projections (a verify block): cuBLAS against a Triton ``tl.dot`` kernel with 16-row tiles.

Every projection runs over 36 distinct weights inside one CUDA graph (no L2 reuse, no launch gaps).
Writes ``$OUT/decode_kernels.json``. Run on the H200: ``python3 examples/engine_probes/decode_kernels.py``.
"""
import json
import os
import time
import traceback

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from adaflash_hf.engine.kernels.attention import INACTIVE, SlotAttention
from adaflash_hf.engine.kernels.decode_attention import decode_attention

torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
OUT = os.environ.get("OUT", "/tmp")
res = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name()}
T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def bench(fn, iters=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    e0.record()
    for _ in range(iters):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / iters


def save():
    with open(os.path.join(OUT, "decode_kernels.json"), "w") as f:
        json.dump(res, f, indent=1)


# ----------------------------------------------------------------------------- A. attention
L, H, KV, D, CTX, KVLEN = 36, 32, 8, 128, 1024, 1152
res["attention"] = []
for A in (2, 33, 129):
    k = torch.randn(L, A, KV, KVLEN, D, device=dev, dtype=dt)
    v = torch.randn_like(k)
    for qb in (1, 16):
        row = {"slot_rows": A, "q": qb}
        try:
            q = torch.randn(A, H, qb, D, device=dev, dtype=dt)
            att = SlotAttention(A, KVLEN, dev, "flex")
            start = torch.full((A,), CTX - qb, dtype=torch.int32)
            start[-1] = INACTIVE  # the padding row
            start[: A - 1] -= torch.arange(A - 1, dtype=torch.int32) % 7  # a little spread
            att.start.copy_(start)
            with torch.no_grad():
                ref = att(q, k[0], v[0], att.mask(qb), D ** -0.5)
                got = decode_attention(q, k[0], v[0], att.start, D ** -0.5)
            row["max_err_vs_flex"] = (got.float() - ref.float()).abs().max().item()
            row["padding_row_max"] = got[-1].abs().max().item()

            def flex_fwd():
                m = att.mask(qb)
                for li in range(L):
                    att(q, k[li], v[li], m, D ** -0.5)

            row["flex_ms"] = bench(flex_fwd)
            for sp in (None, 4, 8, 16, 32):
                if sp is not None and A > 2 and sp > 8:
                    continue
                row[f"triton_ms_splits_{sp or 'auto'}"] = bench(
                    lambda: [decode_attention(q, k[li], v[li], att.start, D ** -0.5, splits=sp) for li in range(L)])
        except Exception:  # noqa: BLE001
            row["error"] = traceback.format_exc()
        log(f"A: {row}")
        res["attention"].append(row)
        save()
    del k, v
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- B/C. projections
@triton.jit
def gemv_kernel(X, W, Y, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(W + rn[:, None] * stride_w + rk[None, :], eviction_policy="evict_first")
        x = tl.load(X + rk)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(Y + rn, tl.sum(acc, 1).to(Y.dtype.element_ty))


@triton.jit
def gemm16_kernel(X, W, Y, M, K, stride_x, stride_w, stride_y, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.arange(0, 16)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + rm[:, None] * stride_x + rk[None, :], mask=rm[:, None] < M, other=0.0)
        w = tl.load(W + rn[:, None] * stride_w + rk[None, :], eviction_policy="evict_first")
        acc += tl.dot(x, tl.trans(w))
    tl.store(Y + rm[:, None] * stride_y + rn[None, :], acc.to(Y.dtype.element_ty), mask=rm[:, None] < M)


def gemv(x, w, y, bn, bk, warps):
    gemv_kernel[(w.shape[0] // bn,)](x, w, y, w.shape[1], w.stride(0), BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)


def gemm16(x, w, y, bn, bk, warps, stages):
    gemm16_kernel[(w.shape[0] // bn,)](x, w, y, x.shape[0], w.shape[1], x.stride(0), w.stride(0), y.stride(0),
                                       BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)


import torch._inductor.config as icfg  # noqa: E402

icfg.coordinate_descent_tuning = True
inductor = torch.compile(lambda x, w: F.linear(x, w), dynamic=False)
shapes = {"qkv": (6144, 4096, 36), "o": (4096, 4096, 36), "gate_up": (24576, 4096, 36), "down": (4096, 12288, 36),
          "lm_head": (151936, 4096, 2)}
res["gemv"], res["gemm16"] = {}, {}
for name, (n, kdim, nw) in shapes.items():
    ws = [torch.randn(n, kdim, device=dev, dtype=dt) * 0.02 for _ in range(nw)]
    gb = n * kdim * 2 / 1e9
    r = res["gemv"][name] = {"GB_per_weight": gb}
    x1 = torch.randn(1, kdim, device=dev, dtype=dt)
    y1 = torch.empty(1, n, device=dev, dtype=dt)
    ref1 = F.linear(x1, ws[0]).float()
    with torch.no_grad():
        r["cublas_us"] = 1e3 * bench(lambda: [F.linear(x1, w) for w in ws]) / nw
        try:
            r["inductor_us"] = 1e3 * bench(lambda: [inductor(x1, w) for w in ws]) / nw
        except Exception:  # noqa: BLE001
            r["inductor_error"] = traceback.format_exc()[-500:]
    best = None
    for bn in (4, 8, 16, 32):
        for bk in (512, 1024):
            for warps in (4, 8):
                if bn * bk > 16384 or kdim % bk:
                    continue
                key = f"triton_bn{bn}_bk{bk}_w{warps}"
                try:
                    gemv(x1, ws[0], y1, bn, bk, warps)
                    err = (y1.float() - ref1).abs().max().item()
                    us = 1e3 * bench(lambda: [gemv(x1, w, y1, bn, bk, warps) for w in ws]) / nw
                    r[key] = {"us": us, "err": err}
                    if best is None or us < best[1]:
                        best = (key, us)
                except Exception:  # noqa: BLE001
                    r[key] = {"error": traceback.format_exc()[-300:]}
    r["triton_best"] = best
    log(f"B: {name} {gb * 1e3:.1f} MB: cublas {r['cublas_us']:.1f} us, inductor {r.get('inductor_us', float('nan')):.1f} us, "
        f"triton best {best} -> {gb / (best[1] * 1e-6) if best else 0:.2f} TB/s")
    save()

    x16 = torch.randn(16, kdim, device=dev, dtype=dt)
    y16 = torch.empty(16, n, device=dev, dtype=dt)
    ref16 = F.linear(x16, ws[0]).float()
    r = res["gemm16"][name] = {}
    with torch.no_grad():
        r["cublas_us"] = 1e3 * bench(lambda: [F.linear(x16, w) for w in ws]) / nw
    best = None
    for bn in (16, 32, 64):
        for bk in (128, 256):
            for warps, stages in ((4, 3), (4, 4), (8, 3)):
                key = f"triton_bn{bn}_bk{bk}_w{warps}_s{stages}"
                if kdim % bk:
                    continue
                try:
                    gemm16(x16, ws[0], y16, bn, bk, warps, stages)
                    err = (y16.float() - ref16).abs().max().item()
                    us = 1e3 * bench(lambda: [gemm16(x16, w, y16, bn, bk, warps, stages) for w in ws]) / nw
                    r[key] = {"us": us, "err": err}
                    if best is None or us < best[1]:
                        best = (key, us)
                except Exception:  # noqa: BLE001
                    r[key] = {"error": traceback.format_exc()[-300:]}
    r["triton_best"] = best
    log(f"C: {name} 16 rows: cublas {r['cublas_us']:.1f} us, triton best {best}")
    save()
    del ws
    torch.cuda.empty_cache()
log("done")
save()
