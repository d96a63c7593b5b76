"""Slot-layout attention: the decode path's attention over the slotted KV cache, fixed shapes.

The eager path (:func:`.target.packed_attention`) concatenates every request's keys and masks a
``[T, K]`` boolean matrix; its shapes change every round, so it cannot be a CUDA graph, and
boolean-mask SDPA falls off at large batch. Here each request's new queries are
scattered into a ``[slot_rows, heads, q_len, d]`` tensor (row ``b`` = cache slot ``b``, ``q_len``
the round's per-request token bucket) that attends to the cache's own ``[slot_rows, kv_heads,
max_len, d]`` storage for that layer: no key gather, and every shape is fixed by the bucket.

What a query may see is one number per slot, ``start[b]``, the position of the slot's first new
token: query row ``i`` of slot ``b`` attends key position ``j`` iff ``j <= start[b] + i``. Slots
that are not in the forward hold :data:`INACTIVE` (nothing visible, the rows come out as zeros).
Query rows past a request's own tokens see a few stale positions; their outputs are discarded.

Backends (:func:`default_backend` picks the first available): ``"triton"``, the split-KV kernel of
:mod:`.decode_attention`, which reads ``start`` itself; ``"flex"``, ``flex_attention`` with a
:class:`BlockMask` built on the device from ``start`` (no host synchronisation, so it is rebuilt
inside the CUDA graph every replay; only the KV blocks up to a slot's last visible key are computed);
``"sdpa"`` (CPU), the same mask as booleans.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["BACKENDS", "BLOCK", "INACTIVE", "SlotAttention", "default_backend", "slot_block_mask", "slot_mask_mod"]

INACTIVE = -(2 ** 30)  # start of a slot outside the forward: far below any key position, no int32 overflow
BLOCK = 128  # flex_attention's sparse block size (query and key)

BACKENDS = ("triton", "flex", "sdpa")
_compiled_flex = None


def default_backend(device) -> str:
    """``"triton"`` on CUDA when Triton is importable, else ``"flex"`` on CUDA, else ``"sdpa"``."""
    if torch.device(device).type != "cuda":
        return "sdpa"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "flex"
    return "triton"


def _flex():
    """``torch.compile(flex_attention)``, built once: uncompiled flex materialises the full scores."""
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        from .fused import allow_shape_recompiles

        allow_shape_recompiles()  # flex is specialised per shape (slot rows x q bucket x heads x dtype)
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def slot_mask_mod(start: torch.Tensor, causal: bool = True):
    """flex_attention ``mask_mod``: batch row ``b`` (a slot), query row ``q_idx`` sees ``kv_idx <= start[b] + q_idx``
    (``causal``) or, for a bidirectional block (the drafter), every ``kv_idx <= start[b]``."""

    if causal:
        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= start[b] + q_idx
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= start[b]

    return mask_mod


def slot_block_mask(start: torch.Tensor, q_len: int, kv_len: int, mask_mod=None, block: int = BLOCK, causal: bool = True):
    """The :class:`BlockMask` of :func:`slot_mask_mod`, computed with tensor ops only (capturable).

    A KV block is listed for a query block iff it holds a key some row of that query block may see:
    blocks ``0 .. (start + last row) // block`` (``0 .. start // block`` when not ``causal``). None is
    marked "full" (mask_mod skipped), as ``create_block_mask`` does when ``q_len`` is below the block size.
    """
    from torch.nn.attention.flex_attention import BlockMask

    n_q, n_kv = -(-q_len // block), -(-kv_len // block)
    # Device ops only (a host list -> tensor copy is not allowed while a CUDA graph is being captured).
    last_row = ((torch.arange(n_q, dtype=torch.int32, device=start.device) + 1) * block).clamp(max=q_len) - 1
    if not causal:
        last_row = torch.zeros_like(last_row)
    num = ((start[:, None] + last_row[None, :]).div(block, rounding_mode="floor") + 1).clamp(0, n_kv).to(torch.int32)
    indices = torch.arange(n_kv, dtype=torch.int32, device=start.device).expand(start.shape[0], 1, n_q, n_kv).contiguous()
    # compute_q_blocks=False: the transposed (query-side) indices only serve the backward pass.
    return BlockMask.from_kv_blocks(num[:, None, :], indices, BLOCK_SIZE=block, mask_mod=mask_mod or slot_mask_mod(start, causal),
                                    seq_lengths=(q_len, kv_len), compute_q_blocks=False)


class SlotAttention:
    """Per-slot attention for one cache: ``start`` (int32 ``[slot_rows]``) is the static input the
    caller fills before each forward; :meth:`mask` once per forward, then ``self(q, k, v, mask, scale)``
    per layer. ``backend``: one of :data:`BACKENDS` (see the module docstring).
    ``causal=False`` (the drafter's bidirectional block): ``start[b]`` is the slot's last visible key
    for every query row."""

    def __init__(self, slot_rows: int, kv_len: int, device, backend: str, causal: bool = True):
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
        self.kv_len, self.backend, self.causal = kv_len, backend, causal
        self.start = torch.full((slot_rows,), INACTIVE, dtype=torch.int32, device=device)
        self._mask_mod = slot_mask_mod(self.start, causal)  # one function object: compiled flex guards on it

    def mask(self, q_len: int, slot_rows: int | None = None):
        """The mask of the first ``slot_rows`` slot rows (default: all) for ``q_len`` query rows each."""
        start = self.start if slot_rows is None else self.start[:slot_rows]
        if self.backend == "triton":
            return start  # the kernel reads each slot's start itself
        if self.backend == "flex":
            return slot_block_mask(start, q_len, self.kv_len, self._mask_mod, causal=self.causal)
        keys = torch.arange(self.kv_len, device=start.device)
        rows = torch.arange(q_len, device=start.device) * int(self.causal)
        return (keys[None, None, :] <= start[:, None, None] + rows[None, :, None])[:, None]  # [slots, 1, q, K]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float) -> torch.Tensor:
        """``q [slots, heads, q_len, d]`` over ``k, v [slots, kv_heads, kv_len, d]`` -> ``[slots, heads, q_len, d]``."""
        if self.backend == "triton":
            from .decode_attention import decode_attention  # needs Triton: imported only when this backend runs

            return decode_attention(q, k, v, mask, scale, causal=self.causal)
        gqa = q.shape[1] != k.shape[1]
        if self.backend == "flex":
            return _flex()(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
