"""The drafter side of the engine: a per-slot cache of the drafter's context K/V.

The AdaFlash drafter attends from a block (bonus token + mask tokens) to the K/V of every verified
token's fused target features. Those context K/V depend only on the features and positions, so
each slot keeps them in a :class:`SlotKVCache` (one layer entry per drafter layer): each round a
request appends the features of its newly verified tokens (bonus + accepted drafts, or the whole
prompt after prefill) and drafts one block, in one padded drafter forward for all requests. The
block's K/V are written past the context and not counted, so they are overwritten next round.

Two paths, like the target's:

- :func:`draft_blocks` (the eager reference, ``cuda_graphs=False``): the drafter's own ``forward``
  over a padded ``[b, max m_i + B]`` batch; :class:`SlotCacheView` is the ``past_key_values`` it
  writes to (per row), and the 4D boolean mask lets each row see its slot's valid keys only.
- :class:`DraftGraphs` (``cuda_graphs=True``): one static, bucketed forward for every running
  request, captured as a CUDA graph per ``(context tokens, rows)`` bucket on CUDA (eager on CPU).
  The new context tokens are *packed* (``sum_i m_i`` rows, no ``max m_i`` padding), the blocks are
  ``[R_b, B]``; K/V are stored with ``index_put_`` and the block attends per slot over the cache
  storage (:class:`~.kernels.attention.SlotAttention`, bidirectional). No per-row Python loop, no host
  synchronisation: the engine reads drafts, lengths and ratios back in one transfer per round.

:func:`append_context` stores context K/V only (no block): what a round that skips drafting (every
verify length would be 1) still owes the drafter cache, so later rounds draft with full context.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .graphs import GraphRunner, copy_to_device, pick_bucket, q_buckets, token_buckets
from .kernels.attention import INACTIVE, SlotAttention, default_backend
from .kernels.elementwise import SlotStore
from .kernels.fused import FusedTarget, fuse_layer_weights
from .kernels.stock_layers import unsupported_drafter_layers
from .kv_cache import SlotKVCache
from .target import fused_layers, repeat, segments

__all__ = ["DraftGraphs", "DraftOutput", "SlotCacheView", "append_context", "draft_blocks", "make_drafter_cache"]


def make_drafter_cache(drafter, num_slots: int, max_len: int, spare_slots: int = 0, len_multiple: int = 1) -> SlotKVCache:
    """Room for ``max_len`` context positions plus one block past them (rounded up to ``len_multiple``;
    ``spare_slots``: padding rows for :class:`DraftGraphs`)."""
    cfg = drafter.config
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
        raise ValueError("the engine does not run drafters with sliding_attention layers yet; use generate() for this drafter")
    param = next(drafter.parameters())
    length = -(-(max_len + cfg.block_size) // len_multiple) * len_multiple
    return SlotKVCache(cfg.num_hidden_layers, num_slots, length, cfg.num_key_value_heads, cfg.head_dim,
                       dtype=param.dtype, device=param.device, spare_slots=spare_slots)


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
    mask = view.key_mask[:, None, None, :].expand(b, 1, B, view.key_mask.shape[1])
    states = drafter.draft_block(bonus, feats, pos, mask, view)
    for slot, m in zip(slots, ctx_lens):
        cache.advance(slot, m)
    return states


# ----------------------------------------------------------------------------- static, batched path
def _store_context(drafter, cache: SlotKVCache, feats: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor) -> None:
    """Fuse raw target features ``feats [C, K*H]`` and store every drafter layer's context K/V at
    ``(slots[t], pos[t])``: the layers' own :meth:`AdaFlashAttention.project_kv`, no host read."""
    ctx = drafter.fuse_context(feats.to(drafter.dtype)[None])  # [1, C, H]
    position_embeddings = drafter.rotary_emb(ctx, pos[None])
    for li, layer in enumerate(drafter.layers):
        k, v = layer.self_attn.project_kv(ctx, position_embeddings)  # [1, kv_heads, C, d]
        cache.k[li][slots, :, pos] = k[0].transpose(0, 1).to(cache.k.dtype)
        cache.v[li][slots, :, pos] = v[0].transpose(0, 1).to(cache.v.dtype)


class _BlockKV:
    """``past_key_values`` of the graphed block forward: each layer's block K/V go to the rows' slots at
    ``pos [R, B]``; the layer's whole slot cache comes back for :class:`SlotAttention`."""

    def __init__(self, cache: SlotKVCache, slots: torch.Tensor, pos: torch.Tensor):
        self.cache, self.slots, self.pos = cache, slots, pos

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions and the mask are given explicitly

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int):
        kc, vc = self.cache.k[layer_idx], self.cache.v[layer_idx]
        kc[self.slots[:, None], :, self.pos] = k.transpose(1, 2).to(kc.dtype)
        vc[self.slots[:, None], :, self.pos] = v.transpose(1, 2).to(vc.dtype)
        return kc, vc


@torch.no_grad()
def append_context(drafter, cache: SlotKVCache, slots: list[int], ctx: list[torch.Tensor]) -> None:
    """Store the context K/V of ``ctx[i]`` (``[m_i, K*H]`` raw target features) at slot ``i``'s next
    positions and advance its length by ``m_i``; no block is drafted. One packed pass, no per-row loop
    over layers (the context K/V of a layer depend on the fused features only, not on earlier layers)."""
    if not slots:
        return
    device = cache.k.device
    lens = [c.shape[0] for c in ctx]
    pos = torch.cat([torch.arange(cache.length(s), cache.length(s) + m) for s, m in zip(slots, lens)])
    if int(pos.max()) >= cache.max_len:
        raise ValueError(f"write past max_len {cache.max_len}")
    tslots = torch.cat([torch.full((m,), s, dtype=torch.long) for s, m in zip(slots, lens)]).to(device)
    _store_context(drafter, cache, torch.cat(list(ctx)), tslots, pos.to(device))
    for s, m in zip(slots, lens):
        cache.advance(s, m)


def head_index(counts: Sequence[int], block_size: int) -> torch.Tensor:
    """Rows of the flattened block states ``[R * B, H]`` the LM head runs on, packed: request ``i``'s draft
    positions ``0 .. counts[i] - 1`` (block columns ``1 .. counts[i]``: column 0 holds the bonus token), in
    request order. Host tensor ``[sum(counts)]``."""
    rows, pos = segments(counts)
    return torch.from_numpy(rows * block_size + 1 + pos)


@dataclass
class DraftOutput:
    """One batched draft, the draft positions of all requests packed (views of static buffers, valid until
    the next draft): request ``i``'s positions ``0 .. counts[i] - 1`` are entries ``offsets[i] ..
    offsets[i + 1] - 1`` of ``tokens [P]`` (argmax, NaN-safe), ``logits [P, V]`` (drafter dtype) and
    ``finite [P]`` (that position's logits are all finite); ``ratio [R]`` float32 or ``None``."""

    tokens: torch.Tensor
    logits: torch.Tensor
    ratio: torch.Tensor | None
    finite: torch.Tensor
    offsets: list[int]


class DraftGraphs(GraphRunner):
    """The drafter step for all running requests at fixed shapes, CUDA graphs per bucket, in two parts.

    ``("body", C_b, R_b)``: store the packed new context's K/V (``C_b`` the token bucket of
    ``sum_i m_i``) and run the drafter layers over ``[R_b, B]`` blocks (``R_b`` the power-of-two
    bucket of the request count) into the static final-normed block states, plus the length head's
    ratios. ``R_b = 0`` stores context only (a round that drafts nothing). ``("head", P_b)``: draft
    logits / argmax tokens for the positions some request verifies, packed (``P_b`` the token bucket of
    ``sum_i k_i``, :func:`head_index`): the LM head, most of a drafter step at small batch, runs over the
    verified positions only (at 128 requests verifying ~6 of 15 each, ~40% of the rows of a full block),
    and not at all when the length policy leaves nothing to verify.

    Padding context tokens and padding block rows write K/V into the cache's spare slot row and query
    from it (``start`` there is :data:`~.kernels.attention.INACTIVE`); their outputs are never read.

    Args:
        drafter: the :class:`AdaFlashDrafter` (bound to the target).
        cache: its :class:`SlotKVCache` with a spare slot row (``make_drafter_cache(..., spare_slots=1)``).
        max_rows: most requests per draft (the engine's ``max_slots``).
        max_ctx: most new context tokens per draft (the engine's token budget: one target forward's tokens).
        max_q: the widest verify of one request (default: the block; wider under the prompt n-gram rule's
            ``max_width``): what a chained body (:meth:`run_chain`) takes as one request's context.
        use_graphs / attention: as :class:`~.graphs.DecodeGraphs`.
        feat_dtype: dtype of the target features (default: the drafter's).
        fused: the target's :class:`~.kernels.fused.FusedTarget`: the drafter's layers then run on the same fused
            projections, elementwise kernels and kernel choices (:func:`~.target.fused_layers`, as the target's
            layers do), the draft logits on the target's LM-head kernel; ``None``, or a drafter whose layers are not
            the stock AdaFlash math (:attr:`fusion_note` says why): through the drafter's modules.
    """

    def __init__(self, drafter, cache: SlotKVCache, max_rows: int, max_ctx: int, use_graphs: bool | None = None,
                 attention: str | None = None, feat_dtype: torch.dtype | None = None, fused: FusedTarget | None = None,
                 max_q: int | None = None):
        device = cache.k.device
        use_graphs = self._init_graphs(cache, use_graphs)
        cfg = drafter.config
        self.drafter, self.cache, self.B = drafter, cache, cfg.block_size
        self.max_q = max(self.B, max_q or self.B)  # the widest verify a chained body takes as context
        self.ctx_buckets, self.row_buckets = token_buckets(max(1, max_ctx)), q_buckets(max(1, max_rows))
        self.pos_buckets = token_buckets(max(1, max_rows * (self.B - 1)))
        self.scratch, self.slot_rows = cache.num_slots, cache.k.shape[1]
        self.attention = SlotAttention(self.slot_rows, cache.max_len, device, attention or default_backend(device),
                                       causal=False)
        C, R, P = self.ctx_buckets[-1], self.row_buckets[-1], self.pos_buckets[-1]
        param = next(drafter.parameters())
        # int inputs: [0] context positions, [1] context slots (C wide); [2] block slots, [3] block starts, [4] bonus (R wide)
        self.inputs = torch.zeros(5, max(C, R), dtype=torch.long, device=device)
        self.inputs[1] = self.inputs[2] = self.scratch
        # the target's features as they come (the forward casts them to the drafter dtype, as draft_blocks does)
        self.feats = torch.zeros(C, len(cfg.target_layer_ids) * cfg.hidden_size, dtype=feat_dtype or param.dtype, device=device)
        self.block_cols = torch.arange(self.B, device=device)
        vocab = drafter._target_ref("lm_head").weight.shape[0]
        self.out = torch.zeros(R, self.B, cfg.hidden_size, dtype=param.dtype, device=device)  # final-normed block states
        self.head_idx = torch.ones(P, dtype=torch.long, device=device)  # head_index, padded with row 0's first position
        self.logits = torch.zeros(P, vocab, dtype=param.dtype, device=device)
        self.tokens = torch.zeros(P, dtype=torch.long, device=device)
        self.finite = torch.zeros(P, dtype=torch.bool, device=device)
        self.ratio = torch.zeros(R, dtype=torch.float32, device=device) if drafter.length_head is not None else None
        # a chained body (:meth:`run_chain`): the verify's features, each row's accepted count and next token
        self.chain_source: torch.Tensor | None = None
        self.chain_acc = torch.zeros(R, dtype=torch.long, device=device)
        self.chain_next = torch.zeros(R, dtype=torch.long, device=device)
        self._chained: tuple | None = None  # (slots, R_b, verify lengths, their offsets) of the chained body not yet taken
        self.padded_tokens = 0
        self._rows = 0  # R_b of the last body run (the head reads its block states)
        self._head_key: tuple[str, int] | None = None  # the last run_head's graph key (replay_head)
        self.fused, self.fusion_note = None, "no fused target" if fused is None else ""
        if fused is not None:
            self.fusion_note = unsupported_drafter_layers(drafter, fused.model) or ""
            if not self.fusion_note:
                self.fused, self.weights = fused, fuse_layer_weights(drafter.layers)
                self.mask_ids = torch.full((R, self.B - 1), cfg.mask_token_id, dtype=torch.long, device=device)
                self.q_out = cache.k.new_zeros(self.slot_rows, cfg.num_attention_heads, self.B, cfg.head_dim)
                self.layer_ids = torch.arange(cfg.num_hidden_layers, device=device)

    def check_current(self) -> None:
        """Raise a clear ``RuntimeError`` if the drafter's projections no longer live in the fused weights."""
        if self.fused is not None and any(layer.self_attn.q_proj.weight.data_ptr() != w.qkv.data_ptr()
                                          or layer.mlp.gate_proj.weight.data_ptr() != w.gate_up.data_ptr()
                                          for layer, w in zip(self.drafter.layers, self.weights)):
            raise RuntimeError("the drafter's weights were replaced after the engine was built (its projections no longer "
                               "live in the fused weights, e.g. after drafter.to(...)); build a new Engine, or update "
                               "weights in place (load_state_dict, copy_)")

    def bucket(self, num_ctx: int, num_rows: int) -> tuple[str, int, int]:
        return "body", pick_bucket(self.ctx_buckets, num_ctx), (pick_bucket(self.row_buckets, num_rows) if num_rows else 0)

    def prepare(self, slots: list[int], ctx: list[torch.Tensor], bonus: list[int] | None) -> tuple[str, int, int]:
        """Fill the static inputs: ``ctx[i]`` the raw features of slot ``i``'s new context tokens (device
        tensors, ``m_i >= 1``), ``bonus[i]`` its bonus token (``None``: context only). One device copy of the
        features, one host-to-device copy of the indices. Returns the body bucket."""
        lens = [c.shape[0] for c in ctx]
        C, R = sum(lens), (len(slots) if bonus is not None else 0)
        bucket = self.bucket(C, R)
        _, Cb, Rb = bucket
        if len(ctx) == 1 or ctx[0].dtype != self.feats.dtype:
            self.feats[:C].copy_(torch.cat(list(ctx)) if len(ctx) > 1 else ctx[0])
        else:
            torch.cat(list(ctx), out=self.feats[:C])
        # The indices are built in numpy: a round's host work before its first launch leaves the GPU idle.
        starts = np.array([self.cache.length(s) for s in slots], dtype=np.int64)
        lens_a, slots_a = np.array(lens, dtype=np.int64), np.array(slots, dtype=np.int64)
        host = np.zeros((5, max(Cb, Rb)), dtype=np.int64)
        # context token t of request i: position starts[i] + (t - first token of i)
        host[0, :C] = repeat(starts, lens) + segments(lens)[1]
        host[0, C:Cb] = np.arange(Cb - C) % self.cache.max_len
        host[1, :C] = repeat(slots_a, lens_a)
        host[1, C:Cb] = self.scratch
        start = np.full(self.slot_rows, INACTIVE, dtype=np.int32)
        if R:
            host[2, :R], host[2, R:Rb] = slots_a, self.scratch
            host[3, :R] = starts + lens_a  # the bonus token's position
            host[4, :R] = bonus
            start[slots_a] = starts + lens_a + self.B - 1  # last visible key: the block's end
        if int((starts + lens_a).max()) + (self.B if R else 0) > self.cache.max_len:
            raise ValueError(f"drafter cache write past max_len {self.cache.max_len}")
        copy_to_device(self.inputs[:, : host.shape[1]], torch.from_numpy(host))
        copy_to_device(self.attention.start, torch.from_numpy(start))
        self.padded_tokens += (Cb - C) + (Rb - R) * self.B
        return bucket

    def _reset_inputs(self) -> None:
        self.inputs.zero_()
        self.inputs[1] = self.inputs[2] = self.scratch
        self.head_idx.fill_(1)
        self.attention.start.fill_(INACTIVE)

    @torch.no_grad()
    def _forward(self, part: str, *sizes: int) -> None:
        if part == "head":
            self._head(*sizes)
        elif part == "chain":
            self._chain(*sizes)
        else:
            self._body(*sizes)

    def _chain(self, Cb: int, Rb: int) -> None:
        """The body of the next round, computed on the device from this round's verify: every row's verified
        positions as context (the first ``a + 1`` are the accepted ones; the block, placed right after them, overwrites
        the K/V of the rest, or lies before what a verify wider than the block left: keys it never sees) and its next
        token as the bonus."""
        m = min(Rb * self.max_q, self.chain_source.shape[0])
        self.feats[:m].copy_(self.chain_source[:m])
        bstart = self.inputs[3, :Rb] + self.chain_acc[:Rb] + 1
        last = torch.where(self.inputs[4, :Rb] > 0, bstart + self.B - 1, torch.full_like(bstart, INACTIVE))  # row 4: live
        self.attention.start.index_copy_(0, self.inputs[2, :Rb], last.to(self.attention.start.dtype))
        self._body(Cb, Rb, bstart, self.chain_next[:Rb])

    def _body(self, Cb: int, Rb: int, bstart: torch.Tensor | None = None, bonus: torch.Tensor | None = None) -> None:
        d = self.drafter
        if self.fused is not None:
            self._store_context_fused(self.feats[:Cb], self.inputs[1, :Cb], self.inputs[0, :Cb])
        else:
            _store_context(d, self.cache, self.feats[:Cb], self.inputs[1, :Cb], self.inputs[0, :Cb])
        if not Rb:
            return
        bslot = self.inputs[2, :Rb]
        bstart = self.inputs[3, :Rb] if bstart is None else bstart
        bonus = self.inputs[4, :Rb] if bonus is None else bonus
        bpos = bstart[:, None] + self.block_cols[None]  # [Rb, B]
        if self.fused is not None:
            out = self._block_fused(bslot, bpos, bonus)
        else:
            out = d.draft_block(bonus, position_ids=bpos, attention_mask=self.attention.mask(self.B),
                                past_key_values=_BlockKV(self.cache, bslot, bpos), attention_fn=self._slot_attention(bslot))
        self.out[:Rb].copy_(out)
        if self.ratio is not None:
            self.ratio[:Rb].copy_(d.predict_accept_ratio(out).float())

    def _store_context_fused(self, feats: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor) -> None:
        """:func:`_store_context` on the fused weights: ``fc`` + norm, then per layer one projection of the context
        to K and V (the k / v rows of the fused q/k/v weight), k-norm + RoPE, the cache writes."""
        d, f, cache = self.drafter, self.fused, self.cache
        ctx = f.rms_norm(F.linear(feats.to(d.dtype), d.fc.weight, d.fc.bias), d.hidden_norm.weight, d.hidden_norm.variance_epsilon)
        cos, sin = d.rotary_emb(ctx[None], pos[None])
        for li, (layer, w) in enumerate(zip(d.layers, self.weights)):
            attn, (nq, nk, nv) = layer.self_attn, w.splits
            kv = F.linear(ctx, w.qkv[nq:], None if w.qkv_bias is None else w.qkv_bias[nq:])
            k, v = (t.view(t.shape[0], -1, attn.head_dim) for t in kv.split([nk, nv], dim=-1))
            k = f.norm_rope(k, attn.k_norm.weight, attn.k_norm.variance_epsilon, cos[0], sin[0])
            cache.k[li][slots, :, pos] = k.to(cache.k.dtype)
            cache.v[li][slots, :, pos] = v.to(cache.v.dtype)

    def _block_fused(self, bslot: torch.Tensor, bpos: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
        """The block forward on the target's fused kernels (:func:`~.target.fused_layers`): block K/V and queries
        stored by the fused RoPE kernel at the rows' slots, attention per slot over the cache. ``[R, B, H]``."""
        d, cache, R = self.drafter, self.cache, bslot.shape[0]
        ids = torch.cat([bonus[:, None], self.mask_ids[:R]], dim=1)
        h = d.embed(ids).to(d.dtype).flatten(0, 1)  # [R * B, H]
        pos, slots = bpos.flatten(), bslot[:, None].expand(R, self.B).flatten()
        rows = self.block_cols[None].expand(R, self.B).flatten()
        cos, sin = d.rotary_emb(h[None], pos[None])
        mask = self.attention.mask(self.B)

        def attend(li, q_out, k, v, scaling):
            return self.attention(q_out, cache.k[li], cache.v[li], mask, scaling)

        attend.slot_store = lambda li: SlotStore(cache.k, cache.v, self.layer_ids[li : li + 1], slots, pos, self.q_out,
                                                 slots, rows)
        _, out, _ = fused_layers(self.fused, d.layers, self.weights, h, cos[0], sin[0], attend, d.norm)
        return out.view(R, self.B, -1)

    def _slot_attention(self, bslot: torch.Tensor):
        """The drafter layers' attention kernel here: the block's queries placed at their slot rows,
        :class:`SlotAttention` over the slot cache (bidirectional within the block)."""

        def attend(module, q, k, v, mask, scaling=None, **_):
            qs = q.new_zeros(self.slot_rows, *q.shape[1:])
            qs[bslot] = q
            return self.attention(qs, k, v, mask, scaling)[bslot].transpose(1, 2), None

        return attend

    def _head(self, Pb: int) -> None:
        states = self.out.view(-1, self.out.shape[-1])[self.head_idx[:Pb]]  # [Pb, H]
        if self.fused is not None:  # the target's LM head on its tuned kernel (draft logits use the target's head)
            logits = self.fused.lm_head(states)
        else:
            logits = self.drafter.compute_logits(states)  # [Pb, V]
        self.logits[:Pb].copy_(logits)
        self.tokens[:Pb].copy_(torch.nan_to_num(logits).argmax(dim=-1))
        self.finite[:Pb].copy_(torch.isfinite(logits).all(dim=-1))

    def _chained_for(self, slots: list[int], ctx: list[torch.Tensor], bonus) -> bool:
        """Whether the chained body was queued for this call: the same slots, and each context the first rows of that
        request's verify segment of :attr:`chain_source` (the features a round commits, a view: checked by address)."""
        if self._chained is None or bonus is None or self._chained[0] != list(slots):
            return False
        src, q, offs = self.chain_source, self._chained[2], self._chained[3]
        return all(c.shape[0] <= q[i] and c.data_ptr() == src[offs[i]].data_ptr() for i, c in enumerate(ctx))

    @torch.no_grad()
    def run_body(self, slots: list[int], ctx: list[torch.Tensor], bonus: list[int] | None) -> torch.Tensor | None:
        """Append each slot's new context and (``bonus`` given) run the drafter over one block per slot;
        advances the slots' drafter lengths by ``m_i``. Returns the ratios ``[R]`` (a view; ``None``
        without a length head or when context only)."""
        if self._chained_for(slots, ctx, bonus):  # run_chain ran this body already: take it
            for s, c in zip(slots, ctx):
                self.cache.advance(s, c.shape[0])
            self._rows, self._chained = self._chained[1], None
            return None if self.ratio is None else self.ratio[: len(slots)]
        self._chained = None  # this body's context writes supersede a chained body's
        bucket = self.prepare(slots, ctx, bonus)
        self.replay(bucket)
        self._rows = bucket[2]
        for s, c in zip(slots, ctx):
            self.cache.advance(s, c.shape[0])
        if bonus is None or self.ratio is None:
            return None
        return self.ratio[: len(slots)]

    def chain_bucket(self, rows: int) -> tuple[str, int, int] | None:
        """The graph key of a chained body over ``rows`` requests, or ``None`` when ``rows`` blocks of context exceed
        the largest context bucket."""
        Rb = pick_bucket(self.row_buckets, rows)
        C = Rb * self.max_q
        return ("chain", pick_bucket(self.ctx_buckets, C), Rb) if C <= self.ctx_buckets[-1] else None

    @torch.no_grad()
    def run_chain(self, slots: list[int], accepted: torch.Tensor, next_tokens: torch.Tensor,
                  q_lens: Sequence[int] | None = None) -> bool:
        """Queue the next round's body before this round's results are read: request ``i`` (slot ``slots[i]``) verified
        ``q_lens[i]`` tokens (default: the whole block) whose features are its segment of :attr:`chain_source` (the
        segments packed in request order), accepted ``accepted[i]`` drafts and goes on from ``next_tokens[i]`` (device
        tensors). Nothing on the host changes: the
        result is the next round's body when that round drafts for the same slots, else it is
        never read (its K/V writes lie past every slot's length). :meth:`run_body` takes it instead of running when called
        for the same slots with those features (the round after). Returns False when no bucket fits."""
        n, B = len(slots), self.B
        q = np.full(n, B, dtype=np.int64) if q_lens is None else np.asarray(q_lens, dtype=np.int64)
        bucket = self.chain_bucket(n)
        if bucket is None or self.chain_source is None or q.shape != (n,) or not ((q >= 1) & (q <= self.max_q)).all():
            return False
        starts = np.array([self.cache.length(s) for s in slots], dtype=np.int64)
        if int(starts.max()) + self.max_q + B > self.cache.max_len:
            return False
        self.lay_chain(slots, q, starts, bucket)
        self.replay_chain(bucket, accepted, next_tokens)
        self.note_chain(slots, bucket[2], q.tolist())
        return True

    def note_chain(self, slots: list[int], rows: int, q_lens: list[int]) -> None:
        """The body replayed last is chained for ``slots`` (``rows``: its row bucket), whose verifies of ``q_lens``
        tokens are its context: :meth:`run_body` takes it for those slots and features."""
        self._chained = (list(slots), rows, list(q_lens), np.concatenate([[0], np.cumsum(q_lens)]).tolist())

    def lay_chain(self, slots: list[int], q: np.ndarray, starts: np.ndarray, bucket: tuple[str, int, int]) -> None:
        """The static inputs of a chained body (:meth:`run_chain`): request ``i``'s ``q[i]`` verified rows are context
        at ``starts[i]``, ``starts[i] + 1``, ...; its block starts after its accepted ones (added on the device)."""
        n, (_, Cb, Rb) = len(slots), bucket
        T = int(q.sum())  # <= n * max_q <= Cb: every verified row is context (the accepted ones first)
        host = np.zeros((5, max(Cb, Rb)), dtype=np.int64)
        host[0, :T] = repeat(starts, q) + segments(q)[1]
        host[0, T:Cb] = np.arange(Cb - T) % self.cache.max_len
        host[1, :T] = repeat(slots, q)
        host[1, T:Cb] = self.scratch
        host[2, :n], host[2, n:Rb] = slots, self.scratch
        host[3, :n] = starts  # the block starts after the accepted context: added on the device
        host[4, :n] = 1  # live rows (the bonus comes from chain_next)
        copy_to_device(self.inputs[:, : host.shape[1]], torch.from_numpy(host))

    def move_chain(self, positions: torch.Tensor, starts: torch.Tensor) -> None:
        """Move :meth:`lay_chain`'s context to ``positions`` and its requests' block starts to ``starts`` (device):
        the next chained body of queued rounds (:mod:`.spec_rounds`), nothing read back."""
        self.inputs[0, : positions.shape[0]].copy_(positions)
        self.inputs[3, : starts.shape[0]].copy_(starts)

    def replay_chain(self, bucket: tuple[str, int, int], accepted: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Replay the chained body laid out last with each request's accepted count and next token (device)."""
        n = accepted.shape[0]
        self.attention.start.fill_(INACTIVE)
        self.chain_acc[:n].copy_(accepted)
        self.chain_next[:n].copy_(next_tokens)
        self.replay(bucket)

    @torch.no_grad()
    def run_head(self, counts: Sequence[int]) -> DraftOutput:
        """Draft logits / tokens of the last body run's blocks: ``counts[i]`` positions of block ``i`` (from its
        first draft position), packed in request order (:class:`DraftOutput`)."""
        counts = [int(c) for c in counts]
        if not 1 <= len(counts) <= self._rows or not all(0 <= c <= self.B - 1 for c in counts) or not sum(counts):
            raise ValueError(f"run_head({counts}) after a body of {self._rows} rows, block {self.B}: one count per "
                             f"block, each in [0, {self.B - 1}], not all zero")
        idx = head_index(counts, self.B)
        P = idx.shape[0]
        Pb = pick_bucket(self.pos_buckets, P)
        copy_to_device(self.head_idx[:Pb], torch.cat([idx, torch.ones(Pb - P, dtype=torch.long)]))
        self._head_key = ("head", Pb)
        self.replay(self._head_key)
        offsets = [0, *itertools.accumulate(counts)]
        return DraftOutput(self.tokens[:P], self.logits[:P], self.ratio[: len(counts)] if self.ratio is not None else None,
                           self.finite[:P], offsets)

    def replay_head(self) -> None:
        """The last :meth:`run_head`'s positions again, over the block states of the body run since (queued rounds:
        :mod:`.spec_rounds`)."""
        self.replay(self._head_key)

    def run(self, slots: list[int], ctx: list[torch.Tensor], bonus: list[int] | None) -> DraftOutput | None:
        """Body, then the full-width head (``None`` when context only)."""
        self.run_body(slots, ctx, bonus)
        return None if bonus is None else self.run_head([self.B - 1] * len(slots))
