"""The drafter side of the engine: a per-slot cache of the drafter's context K/V.

The AdaFlash drafter attends from a block (bonus token + mask tokens) to the K/V of every verified
token's fused target features. Those context K/V depend only on the features and positions, so
each slot keeps them in a :class:`SlotKVCache` (one layer entry per drafter layer): each round a
request appends the features of its newly verified tokens (bonus + accepted drafts, or the whole
prompt after prefill) and drafts one block, in one padded drafter forward for all requests. The
block's K/V are written past the context and not counted, so they are overwritten next round.

The drafter's own ``forward`` does the work; :class:`SlotCacheView` is the ``past_key_values`` it
writes to, and the 4D boolean mask lets each row see its slot's valid keys only.
"""

from __future__ import annotations

import torch

from .kv_cache import SlotKVCache

__all__ = ["SlotCacheView", "draft_blocks", "make_drafter_cache"]


def make_drafter_cache(drafter, num_slots: int, max_len: int) -> SlotKVCache:
    """Room for ``max_len`` context positions plus one block past them."""
    cfg = drafter.config
    param = next(drafter.parameters())
    return SlotKVCache(cfg.num_hidden_layers, num_slots, max_len + cfg.block_size, cfg.num_key_value_heads, cfg.head_dim,
                       dtype=param.dtype, device=param.device)


class SlotCacheView:
    """A transformers-cache stand-in for one padded drafter forward over several slots.

    The drafter calls ``update(k, v, layer)`` with ``[b, kv_heads, M + B, d]`` (padded context,
    then block). Row ``i``'s real columns (its first ``ctx_lens[i]`` and the last ``B``) are
    written to its slot right after its valid length; the slot's keys ``0 .. len + m + B - 1``
    come back padded to the longest row (``key_mask`` marks the real ones).
    """

    def __init__(self, cache: SlotKVCache, slots: list[int], ctx_lens: list[int], pad_ctx: int, block: int):
        self.cache, self.slots, self.ctx_lens, self.pad_ctx, self.block = cache, slots, ctx_lens, pad_ctx, block
        self.starts = [cache.length(s) for s in slots]
        self.key_lens = [p + m + block for p, m in zip(self.starts, ctx_lens)]
        width = max(self.key_lens)
        self.key_mask = torch.arange(width, device=cache.k.device)[None, :] < torch.tensor(self.key_lens, device=cache.k.device)[:, None]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions and the mask are always given explicitly

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int):
        b, heads, _, d = k.shape
        width = max(self.key_lens)
        k_out = k.new_zeros(b, heads, width, d)
        v_out = v.new_zeros(b, heads, width, d)
        cols_block = torch.arange(self.pad_ctx, self.pad_ctx + self.block, device=k.device)
        for i, (slot, start, m) in enumerate(zip(self.slots, self.starts, self.ctx_lens)):
            cols = torch.cat([torch.arange(m, device=k.device), cols_block])
            pos = torch.arange(start, start + m + self.block, device=k.device)
            slots = torch.full_like(pos, slot)
            self.cache.write(layer_idx, slots, pos, k[i][:, cols].transpose(0, 1), v[i][:, cols].transpose(0, 1))
            kk, vv = self.cache.read(layer_idx, slot, self.key_lens[i])
            k_out[i, :, : self.key_lens[i]] = kk
            v_out[i, :, : self.key_lens[i]] = vv
        return k_out, v_out


@torch.no_grad()
def draft_blocks(drafter, cache: SlotKVCache, slots: list[int], bonus: torch.Tensor, ctx: list[torch.Tensor]) -> torch.Tensor:
    """Draft one block per slot; returns the final-normed block states ``[b, B, H]``.

    ``ctx[i]`` (``[m_i, K*H]``, ``m_i >= 1``) are the raw target features of slot ``i``'s tokens
    verified since its last draft; they take positions ``len_i .. len_i + m_i - 1`` (``len_i``
    the slot's drafter length) and the bonus token position ``len_i + m_i``. The slot lengths are
    advanced by ``m_i`` (context kept, block discarded).
    """
    B = drafter.config.block_size
    b = len(slots)
    device = bonus.device
    ctx_lens = [c.shape[0] for c in ctx]
    M = max(ctx_lens)
    feats = ctx[0].new_zeros(b, M, ctx[0].shape[-1])
    pos = torch.zeros(b, M + B, dtype=torch.long, device=device)
    for i, (slot, c) in enumerate(zip(slots, ctx)):
        start = cache.length(slot)
        feats[i, : c.shape[0]] = c
        pos[i, : c.shape[0]] = torch.arange(start, start + c.shape[0], device=device)
        pos[i, M:] = torch.arange(start + c.shape[0], start + c.shape[0] + B, device=device)
    view = SlotCacheView(cache, list(slots), ctx_lens, M, B)
    mask_id = drafter.config.mask_token_id
    noise_ids = torch.cat([bonus[:, None], torch.full((b, B - 1), mask_id, dtype=torch.long, device=device)], dim=1)
    mask = view.key_mask[:, None, None, :].expand(b, 1, B, view.key_mask.shape[1])
    out = drafter(noise_embeds=drafter.embed(noise_ids), context_hidden_states=feats.to(drafter.dtype), position_ids=pos,
                  attention_mask=mask, past_key_values=view)
    for slot, m in zip(slots, ctx_lens):
        cache.advance(slot, m)
    return out.last_hidden_state
