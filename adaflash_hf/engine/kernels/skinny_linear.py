"""Linear layers over a few rows (1-16 tokens: a decode step, a verify block) in Triton.

At one to sixteen rows a projection is a pass over its weight: what matters is reading it at full
bandwidth. cuBLAS and Inductor's tuned reduction leave some of it on the table at Qwen3-8B shapes
(the kernel probe, ``examples/engine_probes``).
No kernel wins everywhere, so :class:`~.fused.FusedTarget`
times the candidates on the model's own weights and keeps the fastest per projection.

* one row: a matrix-vector product, ``block_n`` weight rows per program, the input read in ``block_k``
  slices, products accumulated in float32;
* 2-16 rows: a ``tl.dot`` tile of 16 rows by ``block_n`` weight rows (tensor cores), rows past ``M``
  masked.

``gather=(slots, rows)`` reads row ``m`` of the input from an attention output in the slot layout
``[slot rows, heads, q, d]`` at ``[slots[m], :, rows[m]]`` (the ``o_proj`` of :mod:`.graphs`), so the
gather costs no kernel of its own.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK_CONFIGS", "MAX_ROWS", "ROW_CONFIGS", "SkinnyConfig", "fitting", "skinny_linear"]

MAX_ROWS = 16


class SkinnyConfig(NamedTuple):
    """A tile shape: ``block_n`` weight rows per program, ``block_k`` input columns per step."""

    block_n: int
    block_k: int
    warps: int
    stages: int = 2


# The tile shapes the kernel probe found fastest (one row: per projection of Qwen3-8B; 16 rows: the same).
ROW_CONFIGS = (SkinnyConfig(8, 512, 4), SkinnyConfig(16, 512, 4), SkinnyConfig(16, 1024, 8))
BLOCK_CONFIGS = (SkinnyConfig(32, 256, 4, 4), SkinnyConfig(64, 256, 4, 4), SkinnyConfig(64, 128, 4, 3),
                 SkinnyConfig(64, 256, 4, 3))


def fitting(configs, weight_shape, rows: int) -> list[SkinnyConfig]:
    """The tiles of ``configs`` that divide a ``[N, K]`` weight; if none does (a small model), the largest
    power-of-two tile that does, or none (``N`` or ``K`` without a power-of-two factor of 16)."""
    N, K = weight_shape
    fits = [c for c in configs if N % c.block_n == 0 and K % c.block_k == 0]
    if fits:
        return fits

    def largest(n, lo, hi):
        size = hi
        while size >= lo and n % size:
            size //= 2
        return size if size >= lo else None

    bn, bk = largest(N, 8 if rows == 1 else 16, 16 if rows == 1 else 64), largest(K, 16, 512)
    return [SkinnyConfig(bn, bk, 4)] if bn and bk else []


@triton.jit
def _row_offsets(X, SLOTS, ROWS, m, k, sx_m, s0, s1, s2, D: tl.constexpr, GATHER: tl.constexpr):
    """Addresses of input row ``m`` (a scalar or a column of rows), columns ``k``."""
    if GATHER:
        slot = tl.load(SLOTS + m)
        row = tl.load(ROWS + m)
        return X + slot * s0 + row * s2 + (k // D) * s1 + k % D
    return X + m * sx_m + k


@triton.jit
def _gemv_kernel(X, W, B, Y, SLOTS, ROWS, K, sw, sx_m, s0, s1, s2,
                 D: tl.constexpr, GATHER: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(_row_offsets(X, SLOTS, ROWS, 0, rk, sx_m, s0, s1, s2, D, GATHER))
        w = tl.load(W + rn[:, None] * sw + rk[None, :], eviction_policy="evict_first")
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(B + rn).to(tl.float32)
    tl.store(Y + rn, y.to(Y.dtype.element_ty))


@triton.jit
def _block_kernel(X, W, B, Y, SLOTS, ROWS, M, K, sw, sx_m, s0, s1, s2, sy,
                  D: tl.constexpr, GATHER: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    rm = tl.arange(0, 16)
    live = rm < M
    m = tl.where(live, rm, 0)  # rows past M read row 0 (in bounds); their results are not stored
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(_row_offsets(X, SLOTS, ROWS, m[:, None], rk[None, :], sx_m, s0, s1, s2, D, GATHER))
        w = tl.load(W + rn[:, None] * sw + rk[None, :], eviction_policy="evict_first")
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(B + rn).to(tl.float32)[None, :]
    tl.store(Y + rm[:, None] * sy + rn[None, :], acc.to(Y.dtype.element_ty), mask=live[:, None])


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: SkinnyConfig,
                  gather: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [M, K]``, ``1 <= M <= 16`` (one row: the matrix-vector kernel).
    With ``gather=(slots, rows)``, ``x`` is an attention output ``[slot rows, heads, q, d]`` and input row
    ``m`` is ``x[slots[m], :, rows[m]].flatten()``. ``weight``'s rows must be a multiple of ``config.block_n``
    and its columns of ``config.block_k``.

    Example:
        >>> y = skinny_linear(x, layer.weight, layer.bias, ROW_CONFIGS[0])  # doctest: +SKIP
    """
    N, K = weight.shape
    if gather is None:
        M, D, strides = x.shape[0], 1, (0, 0, 0)
        sx_m, slots, rows = x.stride(0), x, x  # slots / rows unused
        if x.stride(-1) != 1:
            raise ValueError("skinny_linear: the input's last dimension must be contiguous")
    else:
        slots, rows = gather
        M, D, strides, sx_m = slots.shape[0], x.shape[-1], (x.stride(0), x.stride(1), x.stride(2)), 0
        if x.stride(3) != 1 or x.shape[1] * D != K:
            raise ValueError(f"skinny_linear: a gathered input [slot rows, heads, q, d] of {K} features per row, got {tuple(x.shape)}")
    if not 1 <= M <= MAX_ROWS or N % config.block_n or K % config.block_k or weight.stride(1) != 1:
        raise ValueError(f"skinny_linear: {M} rows of a [{N}, {K}] weight do not fit tile {tuple(config)}")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    b = bias if bias is not None else weight
    common = dict(D=D, GATHER=gather is not None, HAS_BIAS=bias is not None, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                  num_warps=config.warps, num_stages=config.stages)
    grid = (N // config.block_n,)
    if M == 1:
        _gemv_kernel[grid](x, weight, b, y, slots, rows, K, weight.stride(0), sx_m, *strides, **common)
    else:
        _block_kernel[grid](x, weight, b, y, slots, rows, M, K, weight.stride(0), sx_m, *strides, y.stride(0),
                           PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **common)
    return y
