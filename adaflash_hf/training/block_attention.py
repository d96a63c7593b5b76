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
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

__all__ = ["FlexBlockAttention", "flex_available"]


def flex_available(device: torch.device) -> bool:
    """Whether the sparse rule can train here: CUDA (flex attention ships with every supported torch, but its
    backward and its compiled kernel are CUDA's; elsewhere the dense mask is used)."""
    return device.type == "cuda"


@functools.cache
def _compiled_flex():
    """flex attention compiled once per process (dynamic shapes: every batch differs in ``T`` and ``n``)."""
    return torch.compile(flex_attention, dynamic=True)


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
        T, B = context_len, block_size

        def mask_mod(bi, h, q, kv):
            blk = q // B
            ctx = (kv < limit[bi, blk]) & real[bi, kv]
            own = (kv >= T) & ((kv - T) // B == blk)
            return ctx | own

        mask = create_block_mask(mask_mod, b, None, q_len, context_len + q_len, device=dev, _compile=compiled)
        return cls(mask, compiled)

    def __call__(self, module, query, key, value, attention_mask=None, dropout: float = 0.0, scaling=None,
                 is_causal: bool = False, **kwargs):
        if dropout:
            raise ValueError("flex block attention has no dropout: set the drafter's attention_dropout to 0")
        kernel = _compiled_flex() if self.compiled else flex_attention
        out = kernel(query, key, value, block_mask=self.block_mask, scale=scaling,
                     enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2).contiguous(), None
