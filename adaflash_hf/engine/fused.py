"""The target's decoder layers with fewer, larger kernels: fused projections, fused elementwise math.

At batch 1 a decoder layer reads seven weight matrices and, through the HF modules, launches ~45
tiny elementwise kernels (RMSNorm alone is six). In a CUDA graph each still costs a few
microseconds, which is why the engine's 8B-shape decode ran at 34% of the bandwidth floor
(BENCHMARKS.md section 4). :class:`FusedTarget` changes two things and nothing else:

* **projections**: each layer's ``q/k/v_proj`` and ``gate/up_proj`` weights (and biases) are
  re-stored as row blocks of one tensor, and the HF modules' parameters become views into it: no
  extra memory, the model's own forward is unchanged, and each group is one GEMM;
* **elementwise math**: residual add + RMSNorm, Qwen3's q/k RMSNorm + RoPE, and ``act(gate) * up``
  are one function each, compiled with ``torch.compile`` on CUDA (one kernel each) and run eagerly
  elsewhere. They do the HF modules' operations in the same order and dtypes (``tests/test_engine_fused.py``
  checks bit equality on CPU); ``emulate_precision_casts`` keeps Inductor's rounding at the casts.

:meth:`FusedTarget.build` returns ``None`` with a reason (the engine then keeps the modules' path)
when a layer is not the stock Qwen3 / Llama math: adapters such as PEFT LoRA on a projection,
module hooks, another norm, MLP or RoPE. Weights are read by address, like the CUDA graphs do:
update them in place (``load_state_dict``, ``copy_``), not by assigning new parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama import modeling_llama
from transformers.models.qwen3 import modeling_qwen3

__all__ = ["FusedTarget", "add_rms_norm", "qk_norm_rope", "rms_norm"]


# ------------------------------------------------------------------ elementwise math (the HF modules' ops)
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
    if q_weight is not None:
        x = rms_norm(x, torch.cat([q_weight.expand(nq, -1), k_weight.expand(k.shape[1], -1)]), eps)
    cos, sin = cos[:, None], sin[:, None]
    x = (x * cos) + (_rotate_half(x) * sin)
    return x[:, :nq].transpose(0, 1), x[:, nq:]


def _act_mul(act: Callable) -> Callable:
    def act_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return act(gate) * up

    return act_mul


# ------------------------------------------------------------------ fused projections
def _fuse_rows(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One ``[sum out_features, in]`` weight (and bias) whose row blocks the modules' parameters become
    views of. Already fused (an engine built earlier on the same model): the existing storage is reused."""

    def fused(tensors: list[torch.Tensor]) -> torch.Tensor:
        rows = sum(t.shape[0] for t in tensors)
        first = tensors[0]
        step = first[0].numel() if first.dim() == 2 else 1
        offsets = [first.storage_offset() + step * sum(t.shape[0] for t in tensors[:i]) for i in range(len(tensors))]
        if all(t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() and t.is_contiguous()
               and t.storage_offset() == o for t, o in zip(tensors, offsets)):
            return first.detach().as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())
        with torch.no_grad():
            out = torch.cat([t.detach() for t in tensors])
            start = 0
            for t in tensors:
                t.data = out[start : start + t.shape[0]]
                start += t.shape[0]
        return out

    weight = fused([m.weight for m in linears])
    biases = [m.bias for m in linears]
    if all(b is None for b in biases):
        return weight, None
    if any(b is None for b in biases):
        raise ValueError("some projections of a group have a bias and others do not")
    return weight, fused(biases)


def _same_code(fn, ref) -> bool:
    a, b = getattr(fn, "__code__", None), ref.__code__
    return a is not None and a.co_code == b.co_code and a.co_names == b.co_names and a.co_consts == b.co_consts


_RMSNORMS = (modeling_qwen3.Qwen3RMSNorm.forward, modeling_llama.LlamaRMSNorm.forward)
_MLPS = (modeling_qwen3.Qwen3MLP.forward, modeling_llama.LlamaMLP.forward)
_ROPES = (modeling_qwen3.apply_rotary_pos_emb, modeling_llama.apply_rotary_pos_emb)


def _unsupported(model) -> str | None:
    """Why ``model``'s layers are not the stock math :class:`FusedTarget` reproduces (``None``: they are)."""
    family = model.config.get_text_config(decoder=True).model_type
    rope = {"qwen3": modeling_qwen3, "llama": modeling_llama}.get(family)
    if rope is None:
        return f"model_type {family!r}"
    if not any(_same_code(getattr(rope.apply_rotary_pos_emb, "__wrapped__", rope.apply_rotary_pos_emb), r) for r in _ROPES):
        return "apply_rotary_pos_emb is not the stock function"
    base = model.model
    for li, layer in enumerate(base.layers):
        attn, mlp = layer.self_attn, layer.mlp
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        norms = [layer.input_layernorm, layer.post_attention_layernorm] + [n for n in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if n is not None]
        for m in linears + norms + [attn, mlp, layer]:
            if m._forward_hooks or m._forward_pre_hooks:
                return f"layer {li}: {type(m).__name__} has forward hooks"
        for m in linears:
            if type(m) is not nn.Linear or type(m.weight) is not nn.Parameter:
                return f"layer {li}: {type(m).__name__} is not a plain nn.Linear (an adapter or a quantised layer)"
        if not all(any(_same_code(type(n).forward, r) for r in _RMSNORMS) for n in norms + [base.norm]):
            return f"layer {li}: a norm is not the stock RMSNorm"
        if not any(_same_code(type(mlp).forward, r) for r in _MLPS):
            return f"layer {li}: {type(mlp).__name__} is not the stock gated MLP"
    return None


@dataclass(frozen=True)
class _Layer:
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    splits: tuple[int, int, int]  # q, k, v output features


class FusedTarget:
    """A Qwen3 / Llama target's layers for :func:`.target.decoder_forward`: fused projections and
    fused elementwise kernels (see the module docstring).

    Example:
        >>> fused = FusedTarget.build(target, compile=False)  # doctest: +SKIP
        >>> logits, _ = decoder_forward(target, tokens, positions, attend, fused=fused)  # doctest: +SKIP
    """

    def __init__(self, model, compile: bool):
        self.model, self.compiled = model, compile
        self.layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, qkv_bias = _fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj])
            gate_up, gate_up_bias = _fuse_rows([mlp.gate_proj, mlp.up_proj])
            splits = (attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features)
            self.layers.append(_Layer(qkv, qkv_bias, gate_up, gate_up_bias, splits))
        fns = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "qk_norm_rope": qk_norm_rope,
               "act_mul": _act_mul(model.model.layers[0].mlp.act_fn)}
        if compile:
            # One kernel per function; the first call per shape class compiles (a few seconds), shapes then
            # become dynamic on their own (one more compile), so every token bucket reuses the kernels.
            fns = {k: torch.compile(f, fullgraph=True, options={"emulate_precision_casts": True}) for k, f in fns.items()}
        self.rms_norm, self.add_rms_norm, self.qk_norm_rope, self.act_mul = (
            fns["rms_norm"], fns["add_rms_norm"], fns["qk_norm_rope"], fns["act_mul"])

    def check_current(self) -> None:
        """Raise a clear ``RuntimeError`` if the model's projections no longer live in the fused
        weights (e.g. ``model.to(...)`` or a parameter assigned anew after the engine was built):
        the fused path would otherwise compute with the old weights."""
        for li, (layer, w) in enumerate(zip(self.model.model.layers, self.layers)):
            if (layer.self_attn.q_proj.weight.data_ptr() != w.qkv.data_ptr()
                    or layer.mlp.gate_proj.weight.data_ptr() != w.gate_up.data_ptr()):
                raise RuntimeError(
                    f"the target's weights were replaced after the engine was built (layer {li}'s projections no "
                    "longer live in the fused weights, e.g. after model.to(...)); build a new Engine, or update "
                    "weights in place (load_state_dict, copy_)")

    @classmethod
    def build(cls, model, compile: bool | None = None) -> tuple["FusedTarget | None", str]:
        """``(FusedTarget, "")``, or ``(None, why)`` when the model's layers are not the stock math.
        ``compile``: compile the elementwise functions (default: when the model is on CUDA)."""
        why = _unsupported(model)
        if why is not None:
            return None, why
        on_cuda = next(model.parameters()).device.type == "cuda"
        return cls(model, on_cuda if compile is None else compile), ""
