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
static indices and attends per slot (:mod:`.attention`, flex_attention on CUDA).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb as _qwen3_rope
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as _llama_rope
from transformers.models.qwen3.modeling_qwen3 import rotate_half as _rotate_half

from .kv_cache import SlotKVCache

_RMSNORM_FORWARD = Qwen3RMSNorm.forward
_ROPE_CODES = {getattr(f, "__wrapped__", f).__code__ for f in (_qwen3_rope, _llama_rope)}  # the same stock function

__all__ = ["PackedLayout", "check_target_supported", "decoder_forward", "make_target_cache", "packed_attention",
           "target_forward"]

SUPPORTED = ("qwen3", "llama")


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

    def rows(self) -> torch.Tensor:
        """Each token's index within its request's new tokens (``0 .. q_i - 1``), host tensor."""
        q = torch.tensor(self.q_lens, dtype=torch.long)
        return torch.arange(int(q.sum())) - torch.repeat_interleave(torch.cumsum(q, 0) - q, q)

    def positions(self, device=None) -> torch.Tensor:
        q = torch.tensor(self.q_lens, dtype=torch.long)
        return (torch.repeat_interleave(torch.tensor(self.prefix_lens, dtype=torch.long), q) + self.rows()).to(device)

    def token_slots(self, device=None) -> torch.Tensor:
        return torch.repeat_interleave(torch.tensor(self.slots, dtype=torch.long), torch.tensor(self.q_lens)).to(device)

    def token_requests(self, device=None) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(len(self.q_lens)), torch.tensor(self.q_lens)).to(device)

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
    the decode path on CUDA attends per slot instead (:mod:`.attention`).
    """
    keys, values = zip(*(cache.read(layer, s, p + n) for s, p, n in zip(layout.slots, layout.prefix_lens, layout.q_lens)))
    k, v = torch.cat(keys, dim=1), torch.cat(values, dim=1)  # [kv_heads, K, d]
    out = F.scaled_dot_product_attention(q[None], k[None].to(q.dtype), v[None].to(q.dtype), attn_mask=mask[None, None],
                                         scale=scaling, enable_gqa=q.shape[0] != k.shape[0])
    return out[0].transpose(0, 1)


def _qk_norm_rope(attn, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope):
    """``q [1, T, heads, d]``, ``k [1, T, kv_heads, d]`` (projections) -> ``[1, heads, T, d]``, ``[1, kv_heads, T, d]``
    after Qwen3's per-head RMSNorm (if any) and RoPE.

    The HF modules' exact elementwise math (``Qwen3RMSNorm.forward``, ``apply_rotary_pos_emb``), run once on
    ``cat([q, k])`` instead of once per tensor: ~11 fewer kernels per decoder layer (each row's values and
    operations are unchanged; ``tests/test_engine_graphs.py`` checks bit equality with the modules). Models whose
    norm or RoPE is not the stock one take the modules' own path.
    """
    qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    stock_norm = qn is None or (type(qn).forward is _RMSNORM_FORWARD and type(kn).forward is _RMSNORM_FORWARD
                                and qn.variance_epsilon == kn.variance_epsilon)
    if not stock_norm or getattr(rope, "__wrapped__", rope).__code__ not in _ROPE_CODES:
        if qn is not None:
            q, k = qn(q), kn(k)
        return rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    nq = q.shape[2]
    qk = torch.cat([q, k], dim=2)
    if qn is not None:
        dtype = qk.dtype
        x = qk.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + qn.variance_epsilon)
        qk = torch.cat([qn.weight.expand(nq, -1), kn.weight.expand(k.shape[2], -1)]) * x.to(dtype)
    qk = qk.transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    qk = (qk * cos) + (_rotate_half(qk) * sin)
    return qk[:, :nq], qk[:, nq:]


# attend(layer, q [heads, T, d] after RoPE, k [T, kv_heads, d] after RoPE, v [T, kv_heads, d], scaling) -> [T, heads, d];
# it also stores k / v wherever the caller keeps its cache.
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def decoder_forward(model, tokens: torch.Tensor, positions: torch.Tensor, attend: AttendFn,
                    hidden_layers: list[int] | None = None,
                    logits_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The HF model's layers over ``T`` packed tokens, attention delegated to ``attend``.

    Returns ``(logits [T', V] in the model dtype, hidden [T, len(hidden_layers) * H] or None)``.
    No host synchronisation: the CUDA-graph path captures exactly this function.
    """
    family = _family(model)
    rope = importlib.import_module(f"transformers.models.{family}.modeling_{family}").apply_rotary_pos_emb
    base = model.model
    h = base.embed_tokens(tokens)[None]  # [1, T, H]
    cos, sin = base.rotary_emb(h, positions[None])
    wanted = set(hidden_layers or [])
    captured: dict[int, torch.Tensor] = {}
    T = tokens.shape[0]
    for li, layer in enumerate(base.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(1, T, -1, attn.head_dim)
        k = attn.k_proj(x).view(1, T, -1, attn.head_dim)
        v = attn.v_proj(x).view(1, T, -1, attn.head_dim)
        q, k = _qk_norm_rope(attn, q, k, cos, sin, rope)  # Qwen3's per-head norm, RoPE: [1, heads, T, d]
        o = attend(li, q[0], k[0].transpose(0, 1), v[0], attn.scaling)  # [T, heads, d]
        h = h + attn.o_proj(o.reshape(1, T, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        if li in wanted:
            captured[li] = h[0]
    out = base.norm(h[0])
    if len(base.layers) - 1 in captured:  # HF's last hidden_states entry is after the final norm
        captured[len(base.layers) - 1] = out
    hidden = torch.cat([captured[i] for i in hidden_layers], dim=-1) if hidden_layers else None
    if logits_index is not None:
        out = out[logits_index]
    return model.lm_head(out), hidden


@torch.no_grad()
def target_forward(model, cache: SlotKVCache, tokens: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                   seq_layout: PackedLayout, hidden_layers: list[int] | None = None,
                   logits_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One eager forward over a packed batch (any shapes); writes every new token's K/V into its slot.

    Args:
        tokens, slots, positions: ``[T]`` token ids, their cache slots and absolute positions
            (``seq_layout.token_slots()`` / ``.positions()``).
        seq_layout: request boundaries (see :class:`PackedLayout`).
        hidden_layers: decoder-layer indices whose outputs to return, concatenated on the feature
            axis (the drafter's ``target_layer_ids``; HF ``hidden_states[i + 1]``).
        logits_index: packed indices to compute logits for (default: all tokens).

    Returns:
        ``(logits [T' , V] float32, hidden [T, len(hidden_layers) * H] or None)``. Cache lengths
        are not changed: the caller advances them by what it accepts.
    """
    mask = seq_layout.attention_mask(tokens.device)

    def attend(li, q, k, v, scaling):
        cache.write(li, slots, positions, k, v)
        return packed_attention(q, cache, li, seq_layout, mask, scaling)

    logits, hidden = decoder_forward(model, tokens, positions, attend, hidden_layers, logits_index)
    return logits.float(), hidden
