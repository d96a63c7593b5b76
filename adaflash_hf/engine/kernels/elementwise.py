"""The decoder layer's elementwise math as plain torch functions: the HF modules' ops (RMSNorm, the residual add,
Qwen3's per-head norm and RoPE, the K/V cache writes of the static decode path, ``act(gate) * up``), which
:class:`~.fused.FusedTarget` compiles or replaces with :mod:`.norms`' Triton kernels, and those kernels are checked
against."""

from typing import Callable, NamedTuple

import torch

__all__ = ["SlotStore", "add_rms_norm", "elementwise_functions", "norm_rope", "qk_norm_rope", "qk_norm_rope_store",
           "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``Qwen3RMSNorm`` / ``LlamaRMSNorm``: statistics in float32, scale in the input dtype."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add (in the model dtype, as the HF layer does) and the next RMSNorm: ``(h + delta, norm(h + delta))``."""
    h = h + delta
    return h, rms_norm(h, weight, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 eps: float, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorm (skipped when the weights are ``None``, as for Llama) and RoPE, on
    ``q [T, heads, d]`` and ``k [T, kv_heads, d]`` together; ``cos, sin [T, d]``.
    Returns ``q [heads, T, d]`` and ``k [T, kv_heads, d]`` (the layouts attention and the cache take)."""
    nq = q.shape[1]
    x = torch.cat([q, k], dim=1)
    weight = None if q_weight is None else torch.cat([q_weight.expand(nq, -1), k_weight.expand(k.shape[1], -1)])
    x = norm_rope(x, weight, eps, cos, sin)
    return x[:, :nq].transpose(0, 1), x[:, nq:]


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Per-head RMSNorm (``weight [d]`` or ``[heads, d]``; skipped when ``None``) and RoPE of ``x [T, heads, d]``
    (``cos, sin [T, d]``): the keys alone, e.g. the drafter's context keys."""
    if weight is not None:
        x = rms_norm(x, weight, eps)
    cos, sin = cos[:, None], sin[:, None]
    return (x * cos) + (_rotate_half(x) * sin)


class SlotStore(NamedTuple):
    """Where the static decode forward keeps one layer's new K/V and queries (see :mod:`.graphs`):
    token ``t`` stores its K/V at ``k_cache[layer, slots[t], :, positions[t]]`` (``layer``: a one-element
    index tensor, so one compiled kernel serves every layer) and its query at
    ``q_out[q_slots[t], :, q_rows[t]]`` (``[slot rows, heads, q bucket, d]``, attention's layout)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    layer: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    q_out: torch.Tensor
    q_slots: torch.Tensor
    q_rows: torch.Tensor


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                       k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                       *store: torch.Tensor) -> torch.Tensor:
    """:func:`qk_norm_rope`, then the cache writes and the query layout of a :class:`SlotStore` (its
    fields, positionally): on CUDA one compiled function instead of a RoPE kernel, three scatters and a
    fill. Returns ``store.q_out``."""
    s = SlotStore(*store)
    q, k = qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin)
    s.k_cache[s.layer, s.slots, :, s.positions] = k.to(s.k_cache.dtype)
    s.v_cache[s.layer, s.slots, :, s.positions] = v.to(s.v_cache.dtype)
    s.q_out[s.q_slots, :, s.q_rows] = q.transpose(0, 1)
    return s.q_out


def _act_mul(act: Callable) -> Callable:
    def act_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return act(gate) * up

    return act_mul


def elementwise_functions(act: Callable) -> dict[str, Callable]:
    """The elementwise math as the torch functions above (eager), by the names :class:`FusedTarget` serves them under."""
    return {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "qk_norm_rope": qk_norm_rope,
            "qk_norm_rope_store": qk_norm_rope_store, "act_mul": _act_mul(act), "norm_rope": norm_rope}
