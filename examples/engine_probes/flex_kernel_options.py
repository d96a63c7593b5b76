"""GPU probe: flex_attention ``kernel_options`` for the engine's batch-1 decode (1 token) and verify
(16 tokens) forwards at Qwen3-8B shape, context 1024: CUDA-graph replay ms of each, their ratio, and
the 16-token forward's top kernels. Run on the H200 from the repository root:
``python3 examples/engine_probes/flex_kernel_options.py``; the run of 2026-11-29 is
``docs/logs/engine_probes/flex_kernel_options.txt``."""
import sys, traceback
sys.path.insert(0, "examples")  # gpu_common: the 8B-shaped model and timers
import torch
import gpu_common as E
from adaflash_hf.engine.graphs import DecodeGraphs
from adaflash_hf.engine.kernels.fused import FusedTarget
from adaflash_hf.engine.target import PackedLayout, make_target_cache
from adaflash_hf.engine.kernels import attention as A
from adaflash_hf.engine.kernels.attention import BLOCK

model = E.qwen3_8b_shape("cuda", False)
fused, _ = FusedTarget.build(model)
print("rows", fused.row_kernels, flush=True)
orig = A.SlotAttention.__call__
OPTS = {}


def call(self, q, k, v, mask, scale):
    gqa = q.shape[1] != k.shape[1]
    if self.backend == "flex" and OPTS:
        return A._flex()(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa, kernel_options=dict(OPTS))
    return orig(self, q, k, v, mask, scale)


A.SlotAttention.__call__ = call
variants = [{}, {"FORCE_USE_FLEX_ATTENTION": True}, {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": 16, "BLOCK_N": 64},
            {"SPLIT_KV": 8}, {"SPLIT_KV": 32}]
for opts in variants:
    OPTS.clear(); OPTS.update(opts)
    try:
        cache = make_target_cache(model, 1, 1024 + 16, spare_slots=1, len_multiple=BLOCK)
        g = DecodeGraphs(model, cache, None, max_tokens=16, max_q=16, fused=fused)
        s = cache.alloc(); cache.advance(s, 1024)
        res = {}
        for q in (1, 16):
            b = g.prepare(list(range(q)), PackedLayout.from_cache(cache, [s], [q]))
            g.replay(b); torch.cuda.synchronize()
            res[q] = E.time_ms(lambda: g.graphs[b].replay(), "cuda", 10)
            if q == 16:
                kp = E.kernel_profile(lambda: g._forward(*b), "cuda")
                res["kp16"] = E.fmt_kernels(kp, 6)
        print(opts, f"q1 {res[1]:.3f} q16 {res[16]:.3f} ratio {res[16] / res[1]:.3f}", res["kp16"], flush=True)
        del g, cache
        torch.cuda.empty_cache()
    except Exception:
        print(opts, "FAILED", traceback.format_exc()[-600:], flush=True)
