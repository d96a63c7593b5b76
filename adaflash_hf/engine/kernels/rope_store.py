"""Qwen3's q/k RMSNorm, RoPE and the static decode path's stores in one Triton kernel.

:func:`.elementwise.qk_norm_rope_store` compiled by Inductor is four kernels per layer (the norm and RoPE,
then one scatter each for the K cache, the V cache and the queries' slot layout).
Here one program per (token, head) does all of it: a q or k head is normalised (when the model has
q/k norms), rotated and written to the query layout or the K cache, a v head is copied to the V cache.
The norm and RoPE of a head are :func:`.norms.norm_rope_head`, the same code as the other fused kernels'.

Needs Triton (see :mod:`.decode_attention`); :class:`~.fused.FusedTarget` imports it only when it runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .elementwise import SlotStore
from .norms import norm_rope_head, unsupported

__all__ = ["qk_norm_rope_store_triton", "unsupported"]


@triton.jit
def _rope_store_kernel(Q, K, V, QW, KW, COS, SIN, KC, VC, LAYER, SLOTS, POS, QO, QSLOTS, QROWS,
                       sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sc_t,
                       skc_l, skc_s, skc_h, skc_p, svc_l, svc_s, svc_h, svc_p, sqo_s, sqo_h, sqo_r, eps,
                       HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    t, h = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, HALF)
    if h < HQ + HKV:  # a q or k head: norm, RoPE, store
        if h < HQ:
            src = Q + t * sq_t + h * sq_h
            wgt = QW
            dst = QO + tl.load(QSLOTS + t) * sqo_s + h * sqo_h + tl.load(QROWS + t) * sqo_r
        else:
            src = K + t * sk_t + (h - HQ) * sk_h
            wgt = KW
            dst = (KC + tl.load(LAYER) * skc_l + tl.load(SLOTS + t) * skc_s + (h - HQ) * skc_h
                   + tl.load(POS + t) * skc_p)
        o1, o2 = norm_rope_head(src, wgt, COS + t * sc_t, SIN + t * sc_t, d, eps, HALF, HAS_NORM)
        tl.store(dst + d, o1.to(dst.dtype.element_ty))
        tl.store(dst + HALF + d, o2.to(dst.dtype.element_ty))
    else:  # a v head: to the V cache as it is
        src = V + t * sv_t + (h - HQ - HKV) * sv_h
        dst = VC + tl.load(LAYER) * svc_l + tl.load(SLOTS + t) * svc_s + (h - HQ - HKV) * svc_h + tl.load(POS + t) * svc_p
        tl.store(dst + d, tl.load(src + d).to(dst.dtype.element_ty))
        tl.store(dst + HALF + d, tl.load(src + HALF + d).to(dst.dtype.element_ty))


def qk_norm_rope_store_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                              k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                              *store: torch.Tensor) -> torch.Tensor:
    """:func:`.elementwise.qk_norm_rope_store` in one kernel: ``q [T, heads, d]``, ``k, v [T, kv_heads, d]`` (views
    with a contiguous last dimension), ``cos, sin [T, d]``, ``store`` a :class:`~.elementwise.SlotStore`'s fields.
    Returns ``store.q_out``.

    Example:
        >>> out = qk_norm_rope_store_triton(q, k, v, qn.weight, kn.weight, 1e-6, cos, sin, *slot_store)  # doctest: +SKIP
    """
    s = SlotStore(*store)
    T, HQ, d = q.shape
    HKV = k.shape[1]
    why = unsupported(d)
    if why is not None:
        raise ValueError(f"qk_norm_rope_store_triton: {why}")
    if any(x.stride(-1) != 1 for x in (q, k, v, cos, sin)) or cos.stride(0) != sin.stride(0):
        raise ValueError("qk_norm_rope_store_triton: q, k, v, cos and sin need a contiguous last dimension")
    has_norm = q_weight is not None
    qw = q_weight if has_norm else q
    kw = k_weight if has_norm else k
    kc, vc = s.k_cache, s.v_cache
    _rope_store_kernel[(T, HQ + 2 * HKV)](
        q, k, v, qw, kw, cos, sin, kc, vc, s.layer, s.slots, s.positions, s.q_out, s.q_slots, s.q_rows,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        kc.stride(0), kc.stride(1), kc.stride(2), kc.stride(3), vc.stride(0), vc.stride(1), vc.stride(2), vc.stride(3),
        s.q_out.stride(0), s.q_out.stride(1), s.q_out.stride(2), eps,
        HQ=HQ, HKV=HKV, HALF=d // 2, HAS_NORM=has_norm, num_warps=1)
    return s.q_out
