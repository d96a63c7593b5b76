"""Which layers are the stock math the fused kernels reproduce (:mod:`.fused`), and which hooks do not count.

The fused path re-implements a layer's operations (RMSNorm, gated MLP, RoPE, plain projections); it may
only run where the modules would compute exactly that. These checks compare code, not class names, so
a subclass with a changed ``forward`` or an adapter (PEFT LoRA) on a projection is refused with a reason.
"""

from __future__ import annotations

import types

from torch import nn
from transformers.models.llama import modeling_llama
from transformers.models.qwen3 import modeling_qwen3

__all__ = ["foreign_hooks", "unsupported_drafter_layers", "unsupported_layers"]


def _same_code(fn, ref) -> bool:
    a, b = getattr(fn, "__code__", None), ref.__code__
    return a is not None and a.co_code == b.co_code and a.co_names == b.co_names and a.co_consts == b.co_consts


_RMSNORMS = (modeling_qwen3.Qwen3RMSNorm.forward, modeling_llama.LlamaRMSNorm.forward)
_MLPS = (modeling_qwen3.Qwen3MLP.forward, modeling_llama.LlamaMLP.forward)
_ROPES = (modeling_qwen3.apply_rotary_pos_emb, modeling_llama.apply_rotary_pos_emb)


def _output_capturing_code():
    """The code object of the forward hook transformers installs to collect ``hidden_states`` /
    ``attentions`` (``transformers.utils.output_capturing``: a closure made per module, so it is
    recognised by its code; ``None`` if this transformers has no such function: every hook then counts)."""
    from transformers.utils import output_capturing

    for name in ("install_output_capuring_hook", "install_output_capturing_hook"):  # 5.23 spells it without the t
        install = getattr(output_capturing, name, None)
        if install is not None:
            for const in install.__code__.co_consts:
                if isinstance(const, types.CodeType) and const.co_name == "output_capturing_hook":
                    return const
    return None


_RECORDING_HOOK = _output_capturing_code()


def foreign_hooks(module: nn.Module) -> list[str]:
    """Names of ``module``'s forward (pre-)hooks that may change what its forward computes.

    transformers' own output-capturing hooks (installed on a model the first time hidden states or
    attentions are requested, and left there) only append to a collector that is active during an HF
    forward; they never change an output, and the engine's layer loop never activates the collector,
    so they do not count. The one place adaflash-hf recognises them (``tests/test_engine_fused.py``
    fails loudly if transformers changes them)."""
    hooks = list(module._forward_pre_hooks.values()) + list(module._forward_hooks.values())
    return [getattr(h, "__qualname__", type(h).__name__) for h in hooks
            if _RECORDING_HOOK is None or getattr(h, "__code__", None) is not _RECORDING_HOOK]


def unsupported_layers(model) -> str | None:
    """Why ``model``'s layers are not the stock math :class:`FusedTarget` reproduces (``None``: they are)."""
    family = model.config.get_text_config(decoder=True).model_type
    rope = {"qwen3": modeling_qwen3, "llama": modeling_llama}.get(family)
    if rope is None:
        return f"model_type {family!r}"
    if not any(_same_code(getattr(rope.apply_rotary_pos_emb, "__wrapped__", rope.apply_rotary_pos_emb), r) for r in _ROPES):
        return "apply_rotary_pos_emb is not the stock function"
    base = model.model
    for li, layer in enumerate(base.layers):
        why = _layer_refusal(li, layer)
        if why is not None:
            return why
    if not any(_same_code(type(base.norm).forward, r) for r in _RMSNORMS):
        return "the final norm is not the stock RMSNorm"
    return None


def _layer_refusal(li: int, layer) -> str | None:
    """Why decoder ``layer`` (number ``li``) is not the stock math: hooks, adapters, norms, MLP (``None``: it is)."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    norms = [layer.input_layernorm, layer.post_attention_layernorm] + [n for n in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if n is not None]
    for m in linears + norms + [attn, mlp, layer]:
        foreign = foreign_hooks(m)
        if foreign:
            return f"layer {li}: {type(m).__name__} has forward hooks ({', '.join(foreign)})"
    for m in linears:
        if type(m) is not nn.Linear or type(m.weight) is not nn.Parameter:
            return f"layer {li}: {type(m).__name__} is not a plain nn.Linear (an adapter or a quantised layer)"
    if not all(any(_same_code(type(n).forward, r) for r in _RMSNORMS) for n in norms):
        return f"layer {li}: a norm is not the stock RMSNorm"
    if not any(_same_code(type(mlp).forward, r) for r in _MLPS):
        return f"layer {li}: {type(mlp).__name__} is not the stock gated MLP"
    return None


def unsupported_drafter_layers(drafter, target) -> str | None:
    """Why ``drafter``'s block cannot run on the target's fused kernels (``None``: it can).

    Its layers must be the stock AdaFlash layer (:mod:`modeling`'s code: a Qwen3 layer with K/V injection),
    all ``full_attention``, with the target's head size (the fused RoPE + store kernel is the target's)."""
    from ...modeling.modeling_adaflash import AdaFlashAttention, AdaFlashDecoderLayer

    cfg = drafter.config
    if any(t != "full_attention" for t in cfg.layer_types):
        return "sliding_attention layers"
    target_head = target.model.layers[0].self_attn.head_dim
    if cfg.head_dim != target_head:
        return f"head_dim {cfg.head_dim} differs from the target's {target_head}"
    for m in (drafter, drafter.fc, drafter.hidden_norm, drafter.norm):
        if foreign_hooks(m):
            return f"{type(m).__name__} has forward hooks ({', '.join(foreign_hooks(m))})"
    if type(drafter.fc) is not nn.Linear or not all(any(_same_code(type(n).forward, r) for r in _RMSNORMS)
                                                     for n in (drafter.hidden_norm, drafter.norm)):
        return "fc is not a plain nn.Linear or a norm is not the stock RMSNorm"
    if type(drafter.layers[0].mlp.act_fn) is not type(target.model.layers[0].mlp.act_fn):
        return "the drafter's MLP activation differs from the target's (the fused activation is the target's)"
    for li, layer in enumerate(drafter.layers):
        if not (_same_code(type(layer).forward, AdaFlashDecoderLayer.forward)
                and _same_code(type(layer.self_attn).forward, AdaFlashAttention.forward)
                and _same_code(type(layer.self_attn).project_kv, AdaFlashAttention.project_kv)):
            return f"layer {li}: {type(layer).__name__} is not the stock AdaFlash layer"
        why = _layer_refusal(li, layer)
        if why is not None:
            return why
    return None
