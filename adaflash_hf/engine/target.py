"""The target's forward over a *packed* batch, driven through the HF model's own submodules.

All requests' new tokens (prompt chunks at prefill, bonus + drafts at verify) are concatenated
into one sequence of ``sum_i q_i`` tokens. Token ``t`` of request ``i`` attends to the cached
prefix of request ``i``'s slot and, causally, to request ``i``'s own new tokens: a block-diagonal
mask with a per-block prefix. Weights are the HF model's (``embed_tokens``, each layer's norms,
``q/k/v/o_proj``, Qwen3's ``q_norm``/``k_norm``, ``rotary_emb``, ``mlp``, final ``norm``,
``lm_head``): nothing is copied, so the engine follows whatever the model holds.

The layer loop (:func:`decoder_forward`) takes the K/V write + attention as a callback:
:func:`target_forward` (the eager reference, any shapes) writes through :meth:`SlotKVCache.write`
and attends with :func:`packed_attention`; the CUDA-graph decode path (:mod:`.graphs`) writes with
static indices and attends per slot (:mod:`.kernels.attention`, flex_attention on CUDA). Both run the
layers either through the HF modules or, given a :class:`~.kernels.fused.FusedTarget`, with fused
projections and elementwise kernels (the engine's default; same math).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from .kernels.fused import FusedTarget
from .kv_cache import SlotKVCache

__all__ = ["PackedLayout", "check_target_supported", "decoder_forward", "fused_layers", "leading_rows",
           "make_target_cache", "packed_attention", "repeat", "RoundForward", "segments", "target_forward"]

SUPPORTED = ("qwen3", "llama")


def repeat(values, counts) -> np.ndarray:
    """``values[i]`` repeated ``counts[i]`` times, a host ``int64`` array (numpy: torch's CPU
    ``repeat_interleave`` enters its thread pool on every call, and stalled the engine's host for milliseconds per
    call at large batches; the engine's per-round index arrays are
    built in numpy, where an op costs a few microseconds instead of tens).

    Example:
        >>> repeat([7, 8, 9], [2, 0, 1]).tolist()
        [7, 7, 9]
    """
    return np.repeat(np.asarray(values, dtype=np.int64), np.asarray(counts, dtype=np.int64))


def segments(lengths) -> tuple[np.ndarray, np.ndarray]:
    """Segments of ``lengths[i]`` entries laid end to end: each entry's segment and its index inside it (host
    ``int64`` arrays).

    Example:
        >>> [t.tolist() for t in segments([2, 0, 3])]
        [[0, 0, 2, 2, 2], [0, 1, 0, 1, 2]]
    """
    q = np.asarray(lengths, dtype=np.int64)
    owner = repeat(np.arange(q.shape[0]), q)
    return owner, np.arange(owner.shape[0]) - repeat(np.cumsum(q) - q, q)


def leading_rows(rows: torch.Tensor, offsets, counts) -> tuple[torch.Tensor, ...]:
    """Views of the first ``counts[k]`` rows of each packed segment ``k`` (``rows[offsets[k] : offsets[k + 1]]``),
    from one ``split`` (a slice per segment costs the host microseconds each, every round, for every request).

    Example:
        >>> [v.tolist() for v in leading_rows(torch.arange(6), [0, 2, 6], [1, 3])]
        [[0], [2, 3, 4]]
    """
    sizes = []
    for k, n in enumerate(counts):
        sizes += (n, offsets[k + 1] - offsets[k] - n)
    return rows[offsets[0] : offsets[len(counts)]].split(sizes)[::2]


@dataclass(frozen=True)
class PackedLayout:
    """Where each request's new tokens sit in the packed sequence.

    ``slots[i]``: request ``i``'s cache slot; ``q_lens[i]``: its new tokens (consecutive in the
    packed sequence, in request order); ``prefix_lens[i]``: its cached positions before them (the
    new tokens take positions ``prefix_lens[i] .. prefix_lens[i] + q_lens[i] - 1``).
    """

    slots: tuple[int, ...]
    q_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...]

    @classmethod
    def from_cache(cls, cache: SlotKVCache, slots, q_lens) -> "PackedLayout":
        slots, q_lens = tuple(int(s) for s in slots), tuple(int(q) for q in q_lens)
        if len(slots) != len(q_lens) or len(set(slots)) != len(slots):
            raise ValueError("slots must be distinct, one per q_len")
        return cls(slots, q_lens, tuple(cache.length(s) for s in slots))

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def offsets(self) -> list[int]:
        """Start of each request's tokens in the packed sequence (plus the total at the end)."""
        out = [0]
        for q in self.q_lens:
            out.append(out[-1] + q)
        return out

    def split(self, n: int) -> tuple["PackedLayout", "PackedLayout"]:
        """The first ``n`` requests and the rest, as two layouts."""
        return (PackedLayout(self.slots[:n], self.q_lens[:n], self.prefix_lens[:n]),
                PackedLayout(self.slots[n:], self.q_lens[n:], self.prefix_lens[n:]))

    def rows(self) -> np.ndarray:
        """Each token's index within its request's new tokens (``0 .. q_i - 1``), host array."""
        return segments(self.q_lens)[1]

    def host_positions(self, rows: np.ndarray | None = None) -> np.ndarray:
        """Each token's cache position (host array; ``rows``: :meth:`rows`, when the caller has it already)."""
        return repeat(self.prefix_lens, self.q_lens) + (self.rows() if rows is None else rows)

    def positions(self, device=None) -> torch.Tensor:
        return torch.from_numpy(self.host_positions()).to(device)

    def token_slots(self, device=None) -> torch.Tensor:
        return torch.from_numpy(repeat(self.slots, self.q_lens)).to(device)

    def token_requests(self, device=None) -> torch.Tensor:
        return torch.from_numpy(segments(self.q_lens)[0]).to(device)

    def attention_mask(self, device=None) -> torch.Tensor:
        """Boolean ``[T, K]`` "may attend": queries = packed tokens, keys = each request's slot
        positions ``0 .. prefix + q - 1`` concatenated in request order."""
        q_req, q_pos = self.token_requests(device), self.positions(device)
        k_req = torch.cat([torch.full((p + q,), i, dtype=torch.long) for i, (p, q) in enumerate(zip(self.prefix_lens, self.q_lens))]).to(device)
        k_pos = torch.cat([torch.arange(p + q) for p, q in zip(self.prefix_lens, self.q_lens)]).to(device)
        return (q_req[:, None] == k_req[None, :]) & (k_pos[None, :] <= q_pos[:, None])


def _family(model) -> str:
    return model.config.get_text_config(decoder=True).model_type


def check_target_supported(model) -> None:
    """Raise a clear ``ValueError`` unless ``model`` is a plain Qwen3 / Llama causal LM."""
    cfg = model.config.get_text_config(decoder=True)
    if cfg.model_type not in SUPPORTED:
        raise ValueError(f"the engine drives {' / '.join(SUPPORTED)} targets; got model_type={cfg.model_type!r}")
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
        raise ValueError("the engine does not support sliding-window attention layers yet")
    if getattr(cfg, "rope_parameters", None) and cfg.rope_parameters.get("rope_type", "default") not in ("default", "llama3", "linear"):
        # dynamic/longrope scale with the sequence length the HF model sees: not reproducible per slot.
        raise ValueError(f"unsupported rope_type {cfg.rope_parameters.get('rope_type')!r}")


def make_target_cache(model, num_slots: int, max_len: int, dtype=None, device=None, spare_slots: int = 0,
                      len_multiple: int = 1) -> SlotKVCache:
    """A :class:`SlotKVCache` shaped for ``model``; ``max_len`` is rounded up to ``len_multiple``
    (flex_attention's KV block size on the decode path, so slots are whole blocks)."""
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    param = next(model.parameters())
    max_len = -(-max_len // len_multiple) * len_multiple
    return SlotKVCache(cfg.num_hidden_layers, num_slots, max_len, cfg.num_key_value_heads, head_dim,
                       dtype=dtype or param.dtype, device=device or param.device, spare_slots=spare_slots)


def packed_attention(q: torch.Tensor, cache: SlotKVCache, layer: int, layout: PackedLayout, mask: torch.Tensor,
                     scaling: float) -> torch.Tensor:
    """Attention of packed queries ``[heads, T, d]`` over each request's slot (new K/V already written).

    ``mask`` is :meth:`PackedLayout.attention_mask`. Returns ``[T, heads, d]``. The eager reference;
    the decode path on CUDA attends per slot instead (:mod:`.kernels.attention`).
    """
    keys, values = zip(*(cache.read(layer, s, p + n) for s, p, n in zip(layout.slots, layout.prefix_lens, layout.q_lens)))
    k, v = torch.cat(keys, dim=1), torch.cat(values, dim=1)  # [kv_heads, K, d]
    out = F.scaled_dot_product_attention(q[None], k[None].to(q.dtype), v[None].to(q.dtype), attn_mask=mask[None, None],
                                         scale=scaling, enable_gqa=q.shape[0] != k.shape[0])
    return out[0].transpose(0, 1)


# attend(layer, q [heads, T, d] after RoPE, k [T, kv_heads, d] after RoPE, v [T, kv_heads, d], scaling) -> [T, heads, d];
# it also stores k / v wherever the caller keeps its cache. An attend with a ``slot_store(layer) -> SlotStore``
# attribute (the static decode path) lets the fused layers write K/V and lay out the queries themselves, in
# the RoPE kernel; it is then called as attend(layer, q_out, None, None, scaling) and returns attention's output in
# the slot layout, ``[slot rows, heads, q, d]`` (the fused o_proj gathers each token's row).
AttendFn = Callable[[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None, float], torch.Tensor]


def decoder_forward(model, tokens: torch.Tensor, positions: torch.Tensor, attend: AttendFn,
                    hidden_layers: list[int] | None = None, logits_index: torch.Tensor | None = None,
                    fused: FusedTarget | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The HF model's layers over ``T`` packed tokens, attention delegated to ``attend``.

    ``fused`` (a :class:`~.kernels.fused.FusedTarget` of ``model``): the same math with fused projections and
    elementwise kernels; ``None``: through the HF modules (the reference).
    Returns ``(logits [T', V] in the model dtype, hidden [T, len(hidden_layers) * H] or None)``.
    No host synchronisation: the CUDA-graph path captures exactly this function.
    """
    family = _family(model)
    rope = importlib.import_module(f"transformers.models.{family}.modeling_{family}").apply_rotary_pos_emb
    base = model.model
    h = base.embed_tokens(tokens)  # [T, H]
    cos, sin = base.rotary_emb(h[None], positions[None])
    wanted = set(hidden_layers or [])
    captured: dict[int, torch.Tensor] = {}
    if fused is None:
        for li, layer in enumerate(base.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q, k, v = (p(x).view(1, -1, p.out_features // attn.head_dim, attn.head_dim) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [1, heads, T, d]
            o = attend(li, q[0], k[0].transpose(0, 1), v[0], attn.scaling)  # [T, heads, d]
            h = h + attn.o_proj(o.flatten(1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if li in wanted:
                captured[li] = h
        out = base.norm(h)
    else:
        h, out, captured = fused_layers(fused, base.layers, fused.layers, h, cos[0], sin[0], attend, base.norm, wanted)
    if len(base.layers) - 1 in captured:  # HF's last hidden_states entry is after the final norm
        captured[len(base.layers) - 1] = out
    hidden = torch.cat([captured[i] for i in hidden_layers], dim=-1) if hidden_layers else None
    if logits_index is not None:
        out = out[logits_index]
    return (model.lm_head(out) if fused is None else fused.lm_head(out)), hidden


def fused_layers(fused: FusedTarget, layers, weights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 attend: AttendFn, final_norm, wanted=frozenset()) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """Qwen3-style decoder ``layers`` over ``h [T, H]`` with ``fused``'s kernels: the target's layers, and the
    drafter's block (its layers have the same modules; its context K/V are in the cache ``attend`` reads).

    ``weights``: the layers' :func:`~.kernels.fused.fuse_layer_weights`; ``cos, sin [T, d]``; ``final_norm``: the
    RMSNorm after the last layer. Returns ``(h, final_norm(h), {layer: its output for each layer in wanted})``.
    """
    store = getattr(attend, "slot_store", None)
    captured: dict[int, torch.Tensor] = {}
    x, delta = fused.rms_norm(h, layers[0].input_layernorm.weight, layers[0].input_layernorm.variance_epsilon), None
    for li, (layer, w) in enumerate(zip(layers, weights)):
        attn = layer.self_attn
        if delta is not None:  # the previous layer's MLP residual, added with this layer's input norm
            norm = layer.input_layernorm
            h, x = fused.add_rms_norm(h, delta, norm.weight, norm.variance_epsilon)
            if li - 1 in wanted:
                captured[li - 1] = h
        q, k, v = (t.view(t.shape[0], -1, attn.head_dim) for t in fused.qkv(x, w).split(w.splits, dim=-1))
        qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        norms = (qn.weight if qn is not None else None, kn.weight if kn is not None else None,
                 qn.variance_epsilon if qn is not None else 0.0)
        if store is not None:  # attention output stays in the slot layout; o_proj gathers each token's row
            s = store(li)
            out = attend(li, fused.qk_norm_rope_store(q, k, v, *norms, cos, sin, *s), None, None, attn.scaling)
            o = fused.o_proj_slots(out, s.q_slots, s.q_rows, attn)
        else:
            q, k = fused.qk_norm_rope(q, k, *norms, cos, sin)
            o = fused.o_proj(attend(li, q, k, v, attn.scaling).flatten(1), attn)
        norm = layer.post_attention_layernorm
        h, x = fused.add_rms_norm(h, o, norm.weight, norm.variance_epsilon)
        delta = fused.mlp(x, w, layer.mlp)
    h, out = fused.add_rms_norm(h, delta, final_norm.weight, final_norm.variance_epsilon)
    if len(layers) - 1 in wanted:
        captured[len(layers) - 1] = h
    return h, out, captured


@torch.no_grad()
def target_forward(model, cache: SlotKVCache, tokens: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                   seq_layout: PackedLayout, hidden_layers: list[int] | None = None,
                   logits_index: torch.Tensor | None = None,
                   fused: FusedTarget | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One eager forward over a packed batch (any shapes); writes every new token's K/V into its slot.

    Args:
        tokens, slots, positions: ``[T]`` token ids, their cache slots and absolute positions
            (``seq_layout.token_slots()`` / ``.positions()``).
        seq_layout: request boundaries (see :class:`PackedLayout`).
        hidden_layers: decoder-layer indices whose outputs to return, concatenated on the feature
            axis (the drafter's ``target_layer_ids``; HF ``hidden_states[i + 1]``).
        logits_index: packed indices to compute logits for (default: all tokens).
        fused: run the layers through this :class:`~.kernels.fused.FusedTarget` (default: the HF modules).

    Returns:
        ``(logits [T' , V] float32, hidden [T, len(hidden_layers) * H] or None)``. Cache lengths
        are not changed: the caller advances them by what it accepts.
    """
    mask = seq_layout.attention_mask(tokens.device)

    def attend(li, q, k, v, scaling):
        cache.write(li, slots, positions, k, v)
        return packed_attention(q, cache, li, seq_layout, mask, scaling)

    logits, hidden = decoder_forward(model, tokens, positions, attend, hidden_layers, logits_index, fused)
    return logits.float(), hidden


@dataclass(eq=False)  # holds modules and caches: compared by identity
class RoundForward:
    """A round's target forward over the engine's slotted cache: the new prompts (prefill) and every running request's
    bonus + drafts (verify), packed. One eager :func:`target_forward` (no ``graphs``, or a prefill-only round), or an
    eager prefill forward beside the ``graphs``' decode replay (:class:`~.graphs.DecodeGraphs`; distinct slots: order
    is free).

    Example:
        >>> forward = RoundForward(target, cache, graphs, [1, 3], fused=None, device=torch.device("cuda"))  # doctest: +SKIP
        >>> logits, hidden = forward(segs, layout, num_prefill=1, verify_inputs=None)  # doctest: +SKIP
    """

    target: torch.nn.Module
    cache: SlotKVCache
    graphs: object | None  # a DecodeGraphs (CUDA graphs on) or None: everything eager
    hidden_layers: list[int] | None
    fused: FusedTarget | None
    device: torch.device

    def __call__(self, segs, layout: PackedLayout, num_prefill: int, verify_inputs, accept: bool = False):
        """Logits of each prefill's last token, then of every verify token; hidden states of every token, in
        ``layout``'s packed order. ``segs``: ``(slot, tokens)`` per segment, prefills first; ``verify_inputs``'
        fill copies the drafts into the verify segments on the device. With graphs, a decode-only round returns views
        of the static buffers in the model dtype (read them before the next replay: the drafter consumes the features
        at the start of the next round); ``accept``: the replay accepts greedily too (``verify_inputs``' acceptance
        inputs)."""
        offs, device = layout.offsets, self.device
        dec_start = offs[num_prefill]
        if self.graphs is None or num_prefill == len(segs):
            logits_index = [offs[j + 1] - 1 for j in range(num_prefill)] + list(range(dec_start, layout.num_tokens))
            tokens = torch.tensor([t for _, toks in segs for t in toks], dtype=torch.long, device=device)
            if verify_inputs is not None:
                dst, drafted = verify_inputs[3]
                tokens.index_copy_(0, dst + dec_start, drafted)
            return target_forward(self.target, self.cache, tokens, layout.token_slots(device), layout.positions(device),
                                  layout, self.hidden_layers, torch.tensor(logits_index, device=device), self.fused)
        pre_layout, dec_layout = layout.split(num_prefill)
        logits, hidden = self.graphs.run([t for _, toks in segs[num_prefill:] for t in toks], dec_layout, copy=False,
                                         fill=verify_inputs[3] if verify_inputs is not None else None,
                                         accept=verify_inputs[2] if accept else None)
        if num_prefill:
            tokens = torch.tensor([t for _, toks in segs[:num_prefill] for t in toks], dtype=torch.long, device=device)
            last = torch.tensor([offs[j + 1] - 1 for j in range(num_prefill)], device=device)
            pre_logits, pre_hidden = target_forward(self.target, self.cache, tokens, pre_layout.token_slots(device),
                                                    pre_layout.positions(device), pre_layout, self.hidden_layers, last,
                                                    self.fused)
            logits = torch.cat([pre_logits, logits.float()])
            hidden = torch.cat([pre_hidden, hidden]) if hidden is not None else None
        return logits, hidden
