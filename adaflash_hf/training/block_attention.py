"""The training blocks' attention rule as a sparse flex-attention kernel.

:func:`~adaflash_hf.training.blocks.block_attention_mask` spells the rule out as a dense boolean mask
``[b, 1, n*B, T + n*B]``; SDPA then scores every query against every key, although a block sees only
the context before its anchor and its own ``B`` slots. With ``n`` blocks per sequence that is about
``n*B / (T_anchor + B)`` times the work that counts (~5-8x for the reference pair's ~120 anchors per
sequence). :class:`FlexBlockAttention` states the same rule as a ``mask_mod`` and lets flex attention
skip the tiles no query may see. Same rule, same outputs up to kernel rounding (tested against the
dense mask).

Example:
    >>> attn = FlexBlockAttention.build(T, anchors, valid, 16, attention_mask)  # doctest: +SKIP
    >>> drafter(noise_embeds=..., context_hidden_states=..., position_ids=..., attention_fn=attn)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

__all__ = ["FlexBlockAttention", "block_sparsity", "flex_available"]

TILE = 128  # flex attention's query and key tile


def flex_available(device: torch.device) -> bool:
    """Whether the sparse rule can train here: CUDA (flex attention ships with every supported torch, but its
    backward and its compiled kernel are CUDA's; elsewhere the dense mask is used)."""
    return device.type == "cuda"


@functools.cache
def _compiled_flex():
    """flex attention compiled once per process (dynamic shapes: every batch differs in ``T`` and ``n``)."""
    return torch.compile(flex_attention, dynamic=True)


def block_sparsity(context_len: int, anchors: torch.Tensor, valid: torch.Tensor, block_size: int,
                   tile: int = TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """The key tiles each query tile may need under the training rule, as ``BlockMask.from_kv_blocks`` takes
    them: ``(kv_num_blocks [b, 1, nq], kv_indices [b, 1, nq, nkv])``. Computed from the rule's two parts with
    a few tensor ops: the context keys before the largest anchor of the tile's blocks, and the tiles of the
    tile's own blocks. A superset of the tiles with a visible key (padding is left to the ``mask_mod``, which
    runs on every listed tile), so no tile is marked full. ``create_block_mask`` would find the exact set by
    evaluating the mask everywhere, compiled per batch shape, which costs minutes per training run.

    Example:
        >>> anchors = torch.tensor([[40] * 8 + [900] * 8])  # 16 blocks of 16: two query tiles
        >>> num, idx = block_sparsity(1000, anchors, torch.ones(1, 16, dtype=torch.bool), 16)
        >>> num.tolist()  # query tile 0: context tile 0 + its blocks' tiles 7-8; tile 1: context 0-7 + blocks 8-9
        [[[3, 10]]]
    """
    b, n = anchors.shape
    dev = anchors.device
    q_len, kv_len = n * block_size, context_len + n * block_size
    nq, nkv = -(-q_len // tile), -(-kv_len // tile)
    limit = torch.where(valid.to(dev, torch.bool), anchors.to(torch.long), 0)  # block i sees context keys < limit
    starts = torch.arange(n, device=dev) * block_size
    ctx_end = torch.zeros(b, nq, dtype=torch.long, device=dev)
    for edge in (starts, starts + block_size - 1):  # a block may straddle two query tiles
        ctx_end.scatter_reduce_(1, (edge // tile).expand(b, -1), limit, "amax")
    first_q = torch.arange(nq, device=dev) * tile
    last_q = torch.clamp(first_q + tile, max=q_len) - 1
    own_lo = (context_len + first_q // block_size * block_size) // tile  # the tile's blocks' own keys
    own_hi = (context_len + (last_q // block_size + 1) * block_size - 1) // tile
    kv = torch.arange(nkv, device=dev)
    needed = (kv * tile < ctx_end[:, :, None]) | ((kv >= own_lo[:, None]) & (kv <= own_hi[:, None]))[None]
    order = torch.sort((~needed).to(torch.int8), dim=-1, stable=True).indices  # listed tiles first, ascending
    return needed.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]


@dataclass
class FlexBlockAttention:
    """An ``attention_fn`` for the drafter's layers (transformers' attention-interface signature) that
    applies the training block rule through a flex-attention ``BlockMask``; build it with :meth:`build`."""

    block_mask: object
    compiled: bool = True

    @classmethod
    def build(cls, context_len: int, anchors: torch.Tensor, valid: torch.Tensor, block_size: int,
              key_padding_mask: torch.Tensor | None = None, compiled: bool = True) -> "FlexBlockAttention":
        """The rule of :func:`~adaflash_hf.training.blocks.block_attention_mask` for keys ``[context | blocks]``."""
        b, n = anchors.shape
        q_len = n * block_size
        dev = anchors.device
        if dev.type == "cpu" and torch.is_grad_enabled():
            raise ValueError("block_attention='flex' trains on CUDA only (flex attention has no backward on CPU): "
                             "use 'dense' there")
        limit = torch.where(valid.to(dev, torch.bool), anchors.to(torch.long), 0)  # context keys j < limit
        real = torch.ones(b, context_len + q_len, dtype=torch.bool, device=dev)
        if key_padding_mask is not None:
            real[:, :context_len] = key_padding_mask.to(dev, torch.bool)
        # The context length as a tensor: an int here would be a constant of the compiled kernel, one compile per length.
        T, B = torch.tensor(context_len, device=dev), block_size

        def mask_mod(bi, h, q, kv):
            blk = q // B
            ctx = (kv < limit[bi, blk]) & real[bi, kv]
            own = (kv >= T) & ((kv - T) // B == blk)
            return ctx | own

        num, idx = block_sparsity(context_len, anchors, valid, block_size)
        mask = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=TILE, mask_mod=mask_mod, seq_lengths=(q_len, context_len + q_len))
        return cls(mask, compiled)

    def __call__(self, module, query, key, value, attention_mask=None, dropout: float = 0.0, scaling=None,
                 is_causal: bool = False, **kwargs):
        if dropout:
            raise ValueError("flex block attention has no dropout: set the drafter's attention_dropout to 0")
        kernel = _compiled_flex() if self.compiled else flex_attention
        out = kernel(query, key, value, block_mask=self.block_mask, scale=scaling,
                     enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2).contiguous(), None
