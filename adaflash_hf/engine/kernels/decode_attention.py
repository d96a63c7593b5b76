"""Split-KV attention over the slot layout, written in Triton: one kernel for decode and verify forwards.

:class:`~.attention.SlotAttention`'s contract (query row ``i`` of slot ``b`` sees key ``j`` iff
``j <= start[b] + i``; ``INACTIVE`` slots give zeros) computed the way flash-decoding does: the keys a
slot may see are cut into ``splits`` chunks, each ``(slot, kv head, chunk)`` program attends its chunk
with all of the kv head's query rows at once (``heads / kv_heads`` heads x ``q`` rows: the 4 x 16 = 64
rows of a Qwen3-8B verify block are one tensor-core tile), and a second kernel merges the chunks'
partial softmaxes (:func:`merge_partials` is the same math in PyTorch). Chunk bounds are computed on
the device from ``start``, so one CUDA graph serves any context length.

Why not flex_attention: its decoding path is three kernels per layer and was the largest
non-projection cost of a decode step, and the main reason a 16-token verify cost more than a 1-token
forward (measured in ``docs/engine.md``).

This module needs Triton (``torch`` ships it on CUDA; the ``[dev]`` extra installs it on CPU, where
the tests run the kernels in Triton's interpreter); :mod:`.attention` imports it only when the
``"triton"`` backend runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import TILE_ROWS

__all__ = ["decode_attention", "merge_partials", "splits_for", "unsupported"]

BLOCK_N = 64  # keys per inner step


def merge_partials(acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """Merge per-chunk attention partials: ``acc [..., S, M, D]`` (unnormalised ``sum p v``), ``m, l [..., S, M]``
    (row max of the base-2 scores and ``sum p``, relative to it). Rows with no visible key (``l == 0``
    everywhere) come out as zeros. Returns ``[..., M, D]`` in float32."""
    m_max = m.amax(dim=-2, keepdim=True)
    m_max = torch.where(torch.isinf(m_max), torch.zeros_like(m_max), m_max)
    w = torch.exp2(m - m_max)  # chunks without keys: exp2(-inf) = 0
    num = (w[..., None] * acc).sum(dim=-3)
    den = (w * l).sum(dim=-2)
    return torch.where(den[..., None] > 0, num / den.clamp_min(1e-30)[..., None], torch.zeros_like(num))


@triton.jit
def _split_kernel(Q, K, V, START, ACC, ML, OUT,
                  sq_b, sq_h, sq_i, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h, so_i,
                  scale_log2, kv_len,
                  GROUP: tl.constexpr, QB: tl.constexpr, M: tl.constexpr, D: tl.constexpr,
                  BLOCK: tl.constexpr, SPLITS: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    b, g, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_heads = tl.num_programs(1)
    st = tl.load(START + b)
    rows = tl.arange(0, M)
    used = rows < GROUP * QB
    head = g * GROUP + rows // QB
    qi = rows % QB
    d = tl.arange(0, D)
    q = tl.load(Q + b * sq_b + head[:, None] * sq_h + qi[:, None] * sq_i + d[None, :], mask=used[:, None], other=0.0)
    if CAUSAL:
        last = st + qi  # each row's last visible key
        n_keys = st + QB
    else:
        last = st + qi * 0
        n_keys = st + 1
    n_keys = tl.minimum(tl.maximum(n_keys, 0), kv_len)  # INACTIVE slots: no keys
    chunk = tl.cdiv(tl.cdiv(n_keys, SPLITS), BLOCK) * BLOCK
    lo = s * chunk
    hi = tl.minimum(lo + chunk, n_keys)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    for n0 in range(lo, hi, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        inside = n < hi
        k = tl.load(K + b * sk_b + g * sk_h + n[:, None] * sk_n + d[None, :], mask=inside[:, None], other=0.0)
        sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        sc = tl.where((n[None, :] <= last[:, None]) & inside[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at zero
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(sc - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + b * sv_b + g * sv_h + n[:, None] * sv_n + d[None, :], mask=inside[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if SPLITS == 1:
        out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
        tl.store(OUT + b * so_b + head[:, None] * so_h + qi[:, None] * so_i + d[None, :],
                 out.to(OUT.dtype.element_ty), mask=used[:, None])
    else:
        part = (b * kv_heads + g) * SPLITS + s
        tl.store(ACC + part * M * D + rows[:, None] * D + d[None, :], acc)
        tl.store(ML + part * 2 * M + rows, m_i)
        tl.store(ML + part * 2 * M + M + rows, l_i)


@triton.jit
def _merge_kernel(ACC, ML, OUT, so_b, so_h, so_i,
                  GROUP: tl.constexpr, QB: tl.constexpr, M: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr):
    # merge_partials for one (slot, kv head) per program
    b, g = tl.program_id(0), tl.program_id(1)
    base = (b * tl.num_programs(1) + g) * SPLITS
    rows = tl.arange(0, M)
    d = tl.arange(0, D)
    m_max = tl.full([M], float("-inf"), tl.float32)
    for s in range(SPLITS):
        m_max = tl.maximum(m_max, tl.load(ML + (base + s) * 2 * M + rows))
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    num = tl.zeros([M, D], tl.float32)
    den = tl.zeros([M], tl.float32)
    for s in range(SPLITS):
        w = tl.exp2(tl.load(ML + (base + s) * 2 * M + rows) - m_max)
        den += w * tl.load(ML + (base + s) * 2 * M + M + rows)
        num += w[:, None] * tl.load(ACC + (base + s) * M * D + rows[:, None] * D + d[None, :])
    out = tl.where(den[:, None] > 0, num / tl.maximum(den, 1e-30)[:, None], 0.0)
    head = g * GROUP + rows // QB
    qi = rows % QB
    tl.store(OUT + b * so_b + head[:, None] * so_h + qi[:, None] * so_i + d[None, :],
             out.to(OUT.dtype.element_ty), mask=(rows < GROUP * QB)[:, None])


def unsupported(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """Why :func:`decode_attention` cannot take queries ``q [slots, heads, q, d]`` over ``k`` (``None``: it can)."""
    slots, heads, q_len, d = q.shape
    if heads % k.shape[1]:
        return f"{heads} query heads are not a multiple of {k.shape[1]} kv heads"
    if d < 16 or d & (d - 1):
        return f"head_dim {d} is not a power of two >= 16"
    if heads // k.shape[1] * q_len > TILE_ROWS:
        return f"{heads // k.shape[1]} heads per kv head x {q_len} query rows exceed one {TILE_ROWS}-row tile"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k.dtype != q.dtype:
        return f"dtype {q.dtype} / {k.dtype}"
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        return "the head dimension is not contiguous"
    return None


def splits_for(slots: int, kv_heads: int, kv_len: int, rows: int, sms: int = 132) -> int:
    """Chunks per slot: about one ``(slot, kv head, chunk)`` program per multiprocessor (a power of two,
    at most 16, at most one per ``BLOCK_N`` keys), half that for tiles of 64 query rows or more. The
    rule follows the kernel probe (``examples/engine_probes``): at one slot it
    matches the fastest measured chunk count, and it does not split from 32 slots up."""
    want = max(1, sms // (slots * kv_heads))
    if rows >= 64:
        want //= 2
    n = 1
    while 2 * n <= want and n < 16 and 2 * n * BLOCK_N <= kv_len:
        n *= 2
    return n


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, scale: float,
                     causal: bool = True, splits: int | None = None) -> torch.Tensor:
    """``q [slots, heads, q_len, d]`` over ``k, v [slots, kv_heads, kv_len, d]``: row ``i`` of slot ``b``
    sees keys ``j <= start[b] + i`` (``causal``) or ``j <= start[b]``; ``start`` int32 ``[slots]``,
    negative for a slot outside the forward (its rows are zeros). Returns ``[slots, heads, q_len, d]``.

    Example:
        >>> out = decode_attention(q, k_cache[layer], v_cache[layer], start, scale=d ** -0.5)  # doctest: +SKIP
    """
    why = unsupported(q, k)
    if why is not None:
        raise ValueError(f"decode_attention: {why}")
    slots, heads, q_len, d = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = heads // kv_heads
    rows = max(16, 1 << (group * q_len - 1).bit_length())
    if splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 132
        splits = splits_for(slots, kv_heads, kv_len, rows, sms)
    out = torch.empty_like(q)
    acc = ml = out  # unused when there is one chunk
    if splits > 1:
        acc = torch.empty(slots * kv_heads * splits * rows * d, dtype=torch.float32, device=q.device)
        ml = torch.empty(slots * kv_heads * splits * 2 * rows, dtype=torch.float32, device=q.device)
    meta = dict(GROUP=group, QB=q_len, M=rows, D=d)
    _split_kernel[(slots, kv_heads, splits)](
        q, k, v, start, acc, ml, out,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2), scale * 1.4426950408889634, kv_len,
        BLOCK=BLOCK_N, SPLITS=splits, CAUSAL=causal, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **meta)
    if splits > 1:
        _merge_kernel[(slots, kv_heads)](acc, ml, out, out.stride(0), out.stride(1), out.stride(2), SPLITS=splits, **meta)
    return out
