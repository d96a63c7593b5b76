"""GPU probe: one-row (batch-1 decode) projections at Qwen3-8B shape, cuBLAS against Inductor's tuned
matrix-vector reduction (``coordinate_descent_tuning``), plus two compiled layer pieces (MLP with the
activation fused into the down projection; qkv + q/k norm + RoPE + K/V store + query scatter).

Each projection runs over 36 distinct weights inside one CUDA graph (no L2 reuse, no launch gaps).
Writes ``$OUT/probe.json`` (default /tmp). Run on the H200 with ``python3 examples/engine_probes/one_row_gemv.py``;
the run of 2026-11-29 is ``docs/logs/engine_probes/one_row_gemv.json``.
This informed :class:`adaflash_hf.engine.kernels.fused.FusedTarget`'s one-row kernels; the engine now measures
the choice itself at build time (``FusedTarget.tune_row_kernels``)."""
import json
import os
import sys
import time

import torch
import torch._inductor.config as icfg
import torch.nn.functional as F

torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
res = {"torch": torch.__version__}
OUT = os.environ.get("OUT", "/tmp")


def bench(fn, iters=30):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
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


def kernels(fn):
    from torch.profiler import ProfilerActivity, profile
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn(); torch.cuda.synchronize()
    ev = [e for e in p.events() if e.device_type.name == "CUDA"]
    return len(ev), sorted({e.name[:80] for e in ev})


shapes = {"qkv": (6144, 4096, 36), "o": (4096, 4096, 36), "gate_up": (24576, 4096, 36), "down": (4096, 12288, 36),
          "lm_head": (151936, 4096, 2)}
lin = torch.compile(lambda x, w: F.linear(x, w), dynamic=False)
icfg.coordinate_descent_tuning = True
gemv = torch.compile(lambda x, w: F.linear(x, w), dynamic=False)
for name, (n, k, L) in shapes.items():
    ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(L)]
    x = torch.randn(1, k, device=dev, dtype=dt)
    out = {}
    t0 = time.time()
    gemv(x, ws[0]); torch.cuda.synchronize()
    out["gemv_compile_s"] = round(time.time() - t0, 1)
    a, b = F.linear(x, ws[0]).float(), gemv(x, ws[0]).float()
    out["rel_err"] = float((a - b).norm() / a.norm())
    for label, f in (("cublas", F.linear), ("gemv", gemv)):
        ms = bench(lambda: [f(x, w) for w in ws])
        out[label + "_ms_per"] = round(ms / L, 5)
        out[label + "_TBps"] = round(n * k * 2 / (ms / L) / 1e9, 2)
    out["gemv_kernels"] = kernels(lambda: gemv(x, ws[0]))
    res[name] = out
    print(name, out, flush=True)
    json.dump(res, open(os.path.join(OUT, "probe.json"), "w"), indent=1)
    del ws
    torch.cuda.empty_cache()

# A fused MLP block at M=1: residual add + RMSNorm + gate_up GEMV + act*up + down GEMV.
H, I = 4096, 12288


def mlp(h, delta, nw, wgu, wd):
    h = h + delta
    x32 = h.float()
    x = nw * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)
    g, u = F.linear(x, wgu).chunk(2, dim=-1)
    return h, F.linear(F.silu(g) * u, wd)


cmlp = torch.compile(mlp, dynamic=False)
Ls = 36
wgus = [torch.randn(2 * I, H, device=dev, dtype=dt) * 0.02 for _ in range(Ls)]
wds = [torch.randn(H, I, device=dev, dtype=dt) * 0.02 for _ in range(Ls)]
nw = torch.ones(H, device=dev, dtype=dt)
h = torch.randn(1, H, device=dev, dtype=dt)
d = torch.randn(1, H, device=dev, dtype=dt)
t0 = time.time()
cmlp(h, d, nw, wgus[0], wds[0]); torch.cuda.synchronize()
res["mlp_compile_s"] = round(time.time() - t0, 1)
ref = mlp(h, d, nw, wgus[0], wds[0])[1].float()
res["mlp_rel_err"] = float((ref - cmlp(h, d, nw, wgus[0], wds[0])[1].float()).norm() / ref.norm())
res["mlp_fused_ms_per"] = round(bench(lambda: [cmlp(h, d, nw, a, b) for a, b in zip(wgus, wds)]) / Ls, 5)
res["mlp_eager_ms_per"] = round(bench(lambda: [mlp(h, d, nw, a, b) for a, b in zip(wgus, wds)]) / Ls, 5)
res["mlp_kernels"] = kernels(lambda: cmlp(h, d, nw, wgus[0], wds[0]))
print({k: v for k, v in res.items() if k.startswith("mlp")}, flush=True)
del wgus, wds
torch.cuda.empty_cache()

# Attention input at M=1: qkv GEMV + q/k norm + RoPE + K/V cache store + query scatter, one compiled function.
icfg.coordinate_descent_tuning = True
nh, nkv, hd, S, ML = 32, 8, 128, 17, 1024


def rot(x):
    return torch.cat((-x[..., hd // 2:], x[..., : hd // 2]), -1)


def attn_in(x, wqkv, qw, kw, cos, sin, kc, vc, slots, pos, qs, qslots, rows):
    q, k, v = F.linear(x, wqkv).split([nh * hd, nkv * hd, nkv * hd], -1)
    q, k, v = q.view(-1, nh, hd), k.view(-1, nkv, hd), v.view(-1, nkv, hd)
    y = torch.cat([q, k], 1)
    y32 = y.float()
    w = torch.cat([qw.expand(nh, -1), kw.expand(nkv, -1)])
    y = w * (y32 * torch.rsqrt(y32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(y.dtype)
    y = y * cos[:, None] + rot(y) * sin[:, None]
    kc[slots, :, pos] = y[:, nh:]
    vc[slots, :, pos] = v
    qs[qslots, :, rows] = y[:, :nh]


cattn = torch.compile(attn_in, dynamic=False)
wq = [torch.randn(6144, H, device=dev, dtype=dt) * 0.02 for _ in range(36)]
kc = torch.zeros(S, nkv, ML, hd, device=dev, dtype=dt)
vc = torch.zeros_like(kc)
qs = torch.zeros(2, nh, 1, hd, device=dev, dtype=dt)
qw, kw = torch.ones(hd, device=dev, dtype=dt), torch.ones(hd, device=dev, dtype=dt)
cos, sin = torch.randn(1, hd, device=dev, dtype=dt), torch.randn(1, hd, device=dev, dtype=dt)
i3, i500, i0 = (torch.tensor([v], device=dev) for v in (3, 500, 0))
args = lambda w: (h, w, qw, kw, cos, sin, kc, vc, i3, i500, qs, i0, i0)
t0 = time.time()
cattn(*args(wq[0])); torch.cuda.synchronize()
res["attn_in_compile_s"] = round(time.time() - t0, 1)
k_c, q_c = kc[3, :, 500].clone(), qs[0, :, 0].clone()
kc.zero_(); qs.zero_()
attn_in(*args(wq[0]))
res["attn_in_err"] = [float((k_c.float() - kc[3, :, 500].float()).abs().max()), float((q_c.float() - qs[0, :, 0].float()).abs().max())]
res["attn_in_fused_ms_per"] = round(bench(lambda: [cattn(*args(w)) for w in wq]) / 36, 5)
res["attn_in_eager_ms_per"] = round(bench(lambda: [attn_in(*args(w)) for w in wq]) / 36, 5)
res["attn_in_kernels"] = kernels(lambda: cattn(*args(wq[0])))
print({k: v for k, v in res.items() if k.startswith("attn")}, flush=True)
json.dump(res, open(os.path.join(OUT, "probe.json"), "w"), indent=1)
