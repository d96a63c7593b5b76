"""The AdaFlash drafter: a DFlash block-diffusion drafter with an adaptive verify-length head.

Self-contained (torch + transformers only) so it can be uploaded beside a checkpoint as Hub remote
code. Building blocks (RMSNorm, rotary embedding, SwiGLU MLP, attention kernels) are transformers'
Qwen3 ones; what differs from a Qwen3 layer is the KV injection: keys and values are computed from
the fused target context *and* the block, queries from the block only, and the block attends to
itself bidirectionally.
"""

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)

from .atomic_save import save_atomically
from .checkpoint_layouts import embedding_fingerprint_mismatch, load_drafter_state_dict
from .configuration_adaflash import AdaFlashConfig, default_target_layer_ids


def _rope(x, cos, sin):
    """RoPE on `x [b, heads, T, d]` with `cos`, `sin` `[b, T', d]` (their last T positions are `x`'s)."""
    cos, sin = cos.unsqueeze(1)[..., -x.shape[-2] :, :], sin.unsqueeze(1)[..., -x.shape[-2] :, :]
    return x * cos + rotate_half(x) * sin


def sliding_window_mask(base_mask, position_ids, q_len, past_len, window, key_mask=None):
    """`base_mask` restricted to a causal sliding window, as vLLM / SGLang run `sliding_attention` layers.

    Query at position p sees keys at positions (p - window, p]. New keys (context + block) are at
    `position_ids`; cached keys (the drafter cache holds each verified token once, in order) get
    their positions from their rank among the valid keys of the 2D `key_mask`. Returns a boolean
    "may attend" mask `[b, 1, q, keys]`, or an additive one when `base_mask` is additive.
    """
    new_pos = position_ids
    if past_len:
        if base_mask is not None and base_mask.dim() == 4 and key_mask is None:
            raise NotImplementedError("sliding_attention layers with a cache need a 2D key mask (or none), not a 4D mask")
        b, keys = position_ids.shape[0], past_len + position_ids.shape[1]
        valid = key_mask.bool() if key_mask is not None else torch.ones(b, keys, dtype=torch.bool, device=position_ids.device)
        rank = valid.long().cumsum(-1) - 1
        first_new = past_len  # the first new key: its position is known, the cached ones follow by rank
        new_pos = position_ids[:, :1] - rank[:, first_new : first_new + 1] + rank
    q_pos = position_ids[:, -q_len:]
    allowed = (new_pos[:, None, :] <= q_pos[:, :, None]) & (new_pos[:, None, :] > q_pos[:, :, None] - window)
    allowed = allowed[:, None]
    if base_mask is None:
        return allowed
    if base_mask.dtype == torch.bool:
        return base_mask & allowed
    return base_mask.masked_fill(~allowed, torch.finfo(base_mask.dtype).min)


class AdaFlashAttention(nn.Module):
    """Qwen3 attention with KV injection: K/V from [context | block], Q from the block, no causal mask."""

    def __init__(self, config: AdaFlashConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = False
        h, nq, nkv, bias = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.attention_bias
        self.q_proj = nn.Linear(h, nq * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, nkv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, nkv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(nq * self.head_dim, h, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def project_kv(self, x, position_embeddings):
        """Keys (k_norm, RoPE) and values of `x [b, T, H]` at the last T positions of `position_embeddings`:
        `[b, kv_heads, T, d]` each. The fused context's K/V depend on nothing else, so a cache can store them."""
        cos, sin = position_embeddings
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        return _rope(k, cos, sin), v

    def forward(self, hidden_states, context, position_embeddings, attention_mask=None, past_key_values=None,
                attention_fn: Callable | None = None, **kwargs):
        """`attention_fn` (transformers' attention-interface signature) replaces the configured kernel,
        e.g. an engine's attention over its own slotted cache (`past_key_values.update` returns its keys)."""
        bsz, q_len, _ = hidden_states.shape
        # The context is the fused target features: it skips the layer's input norm (as in DFlash).
        kv_input = torch.cat([context, hidden_states], dim=1) if context is not None else hidden_states
        q = self.q_norm(self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim)).transpose(1, 2)
        q = _rope(q, *position_embeddings)
        k, v = self.project_kv(kv_input, position_embeddings)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        attention: Callable = attention_fn or ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        out, _ = attention(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            is_causal=False,
            **kwargs,
        )
        return self.o_proj(out.reshape(bsz, q_len, -1).contiguous())


class AdaFlashDecoderLayer(nn.Module):
    def __init__(self, config: AdaFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = AdaFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, context, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), context, position_embeddings, attention_mask, past_key_values, **kwargs
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class AdaFlashLengthHead(nn.Module):
    """Predicts the fraction of the block the target will accept (the released AdaFlash head's form).

    Feature `concat(mean over block, last slot)`, `Linear(2H, d)` + SiLU, one residual
    `h + SiLU(Linear(d, d)(h))`, `Linear(d, 1)`, sigmoid. Key names `down`, `res.0`, `out` match the
    released AdaFlash `thresh_head_two_model`.
    """

    def __init__(self, hidden_size: int, dim: int):
        super().__init__()
        self.down = nn.Linear(2 * hidden_size, dim)
        self.res = nn.Sequential(nn.Linear(dim, dim), nn.SiLU())
        self.out = nn.Linear(dim, 1)

    def forward(self, block_hidden: torch.Tensor) -> torch.Tensor:
        feature = torch.cat([block_hidden.mean(dim=-2), block_hidden[..., -1, :]], dim=-1)
        h = nn.functional.silu(self.down(feature))
        h = h + self.res(h)
        return torch.sigmoid(self.out(h).squeeze(-1).float())


class AdaFlashPaperLengthHead(nn.Module):
    """The length head as the paper describes it (``length_head_type="paper"``): per block slot
    `Linear(H, d)` + SiLU, mean over the block, `Linear(d, 1)`, sigmoid. Same input and output as
    :class:`AdaFlashLengthHead`."""

    def __init__(self, hidden_size: int, dim: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, dim)
        self.out = nn.Linear(dim, 1)

    def forward(self, block_hidden: torch.Tensor) -> torch.Tensor:
        h = nn.functional.silu(self.proj(block_hidden)).mean(dim=-2)
        return torch.sigmoid(self.out(h).squeeze(-1).float())


def build_length_head(config) -> nn.Module | None:
    """The length head ``config`` asks for (``None`` without one)."""
    if not config.use_length_head:
        return None
    head = AdaFlashPaperLengthHead if getattr(config, "length_head_type", "released") == "paper" else AdaFlashLengthHead
    return head(config.hidden_size, config.length_head_dim)


@dataclass
class AdaFlashDrafterOutput(BaseModelOutputWithPast):
    """`last_hidden_state` holds the final-normed block states `[b, q, H]` (transformers' DFlash contract)."""


class AdaFlashPreTrainedModel(PreTrainedModel):
    config_class = AdaFlashConfig
    config: AdaFlashConfig
    base_model_prefix = "drafter"
    main_input_name = "noise_embeds"
    supports_gradient_checkpointing = False
    _no_split_modules = ["AdaFlashDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = False
    _supports_attention_backend = True

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, Qwen3RMSNorm):
            nn.init.ones_(module.weight)


class AdaFlashDrafter(AdaFlashPreTrainedModel):
    """DFlash drafter conditioned on target hidden states, plus the AdaFlash length head.

    The drafter has no embedding and no LM head: it uses the target's, by reference
    ([`bind_target`]); they are never registered as submodules, so never saved or copied.

    Forward follows transformers' native DFlash contract, so a drafter of ours also works with
    `target.generate(ids, assistant_model=drafter, speculation_type="dflash")` in plain transformers.

    Example:
        >>> from transformers import Qwen3Config, Qwen3ForCausalLM
        >>> target = Qwen3ForCausalLM(Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128,
        ...     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16))
        >>> drafter = AdaFlashDrafter.from_target(target, num_layers=1, block_size=8, mask_token_id=127)
        >>> drafter.config.target_layer_ids
        [2]
    """

    def __init__(self, config: AdaFlashConfig):
        super().__init__(config)
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([AdaFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.length_head = build_length_head(config)
        self._target_refs: dict[str, nn.Module] = {}
        self.post_init()

    # ----------------------------------------------------------------- target binding
    def bind_target(self, target: nn.Module) -> "AdaFlashDrafter":
        """Use `target`'s embedding and LM head (by reference; checked for compatibility first)."""
        self.check_target(target)
        # Plain dict, not submodules: the shared weights must never be saved, moved or trained with us.
        self._target_refs = {"embed": target.get_input_embeddings(), "lm_head": target.get_output_embeddings()}
        return self

    @property
    def has_target(self) -> bool:
        return bool(self._target_refs)

    def is_bound_to(self, target: nn.Module) -> bool:
        """True when the shared embedding / LM head are `target`'s own modules."""
        return bool(self._target_refs) and self._target_refs["embed"] is target.get_input_embeddings()

    def _target_ref(self, name: str) -> nn.Module:
        if not self._target_refs:
            raise RuntimeError("this drafter is not bound to a target: call drafter.bind_target(target) first")
        return self._target_refs[name]

    def embed(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """Embed token ids with the target's (frozen, shared) embedding."""
        return self._target_ref("embed")(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Draft logits from block states with the target's (frozen, shared) LM head."""
        return self._target_ref("lm_head")(hidden_states)

    def check_target(self, target: nn.Module) -> None:
        """Raise a `ValueError` naming every way `target` does not fit this drafter."""
        tc = target.config.get_text_config(decoder=True)
        problems = []
        if tc.hidden_size != self.config.hidden_size:
            problems.append(f"hidden size: target {tc.hidden_size}, drafter {self.config.hidden_size}")
        n_layers = tc.num_hidden_layers
        if n_layers != self.config.num_target_layers and self.config.num_target_layers_known:
            problems.append(f"layer count: target {n_layers}, drafter built for {self.config.num_target_layers}")
        bad_ids = [i for i in self.config.target_layer_ids if not 0 <= i < n_layers]
        if bad_ids:
            problems.append(f"target_layer_ids {bad_ids} do not exist in a {n_layers}-layer target")
        emb = target.get_input_embeddings()
        vocab = emb.weight.shape[0] if emb is not None else tc.vocab_size
        if vocab != self.config.vocab_size:
            problems.append(f"vocabulary: target {vocab}, drafter {self.config.vocab_size}")
        if not 0 <= self.config.mask_token_id < vocab:
            problems.append(f"mask_token_id {self.config.mask_token_id} is outside the target vocabulary ({vocab})")
        mismatch = embedding_fingerprint_mismatch(self.config.embed_tokens_fingerprint, emb)
        if mismatch:
            problems.append(mismatch)
        if problems:
            raise ValueError("drafter does not fit the target: " + "; ".join(problems))

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_target(
        cls,
        target: nn.Module,
        num_layers: int = 1,
        block_size: int = 16,
        target_layer_ids: list[int] | None = None,
        mask_token_id: int | None = None,
        tokenizer=None,
        mask_token: str = "<|mask|>",
        **config_overrides,
    ) -> "AdaFlashDrafter":
        """A fresh (randomly initialised) drafter sized for `target` and bound to it.

        The mask token comes from `mask_token_id`, else from `tokenizer.mask_token`. When the
        tokenizer has none, `mask_token` is added as a special token and the target's embeddings are
        resized to the new vocabulary (`target.resize_token_embeddings`), so the target changes too:
        save both.
        """
        tc = target.config.get_text_config(decoder=True)
        if mask_token_id is None and tokenizer is not None:
            if tokenizer.mask_token_id is None:
                tokenizer.add_special_tokens({"mask_token": mask_token})
                if len(tokenizer) > target.get_input_embeddings().weight.shape[0]:
                    target.resize_token_embeddings(len(tokenizer))
            mask_token_id = tokenizer.mask_token_id
        if mask_token_id is None:
            raise ValueError(
                "no mask token: pass mask_token_id=..., or the target's tokenizer (a mask token is added to it "
                "when it has none)"
            )
        num_heads = tc.num_attention_heads
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // num_heads
        fields = dict(
            vocab_size=target.get_input_embeddings().weight.shape[0],
            hidden_size=tc.hidden_size,
            intermediate_size=tc.intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            hidden_act=getattr(tc, "hidden_act", "silu"),
            max_position_embeddings=tc.max_position_embeddings,
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            rope_parameters=dict(tc.rope_parameters) if getattr(tc, "rope_parameters", None) else None,
            block_size=block_size,
            num_target_layers=tc.num_hidden_layers,
            target_layer_ids=target_layer_ids or default_target_layer_ids(tc.num_hidden_layers, num_layers),
            mask_token_id=mask_token_id,
            bos_token_id=tc.bos_token_id,
            eos_token_id=tc.eos_token_id,
            pad_token_id=getattr(tc, "pad_token_id", None),
        )
        fields.update(config_overrides)
        drafter = cls(AdaFlashConfig(**fields))
        param = next(target.parameters())
        return drafter.to(device=param.device, dtype=param.dtype).bind_target(target)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """Load a drafter saved by us, or a published DFlash (z-lab) / AdaFlash checkpoint.

        Every layout is checked tensor by tensor before loading: missing, unexpected and wrongly
        shaped tensors are named in one error; pickle checkpoints are refused (safetensors only).
        """
        return load_drafter_state_dict(cls, pretrained_model_name_or_path, *args, **kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' `save_pretrained`, all or nothing: written beside `save_directory` first, then
        moved into place (`config.json` last), so a failed save (a full disk) leaves no config without
        weights and an earlier save there stays loadable. Other ranks (`is_main_process=False`) write
        as transformers does.

        Example:
            >>> drafter.save_pretrained("out/my-drafter")  # doctest: +SKIP
        """
        if not kwargs.get("is_main_process", True):
            return super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("push_to_hub"):  # the repository is named after the real folder, not the temporary one
            kwargs.setdefault("repo_id", os.path.basename(os.path.abspath(save_directory)))
        return save_atomically(lambda tmp: super(AdaFlashDrafter, self).save_pretrained(tmp, *args, **kwargs), save_directory)

    # ----------------------------------------------------------------- forward
    def fuse_context(self, context_hidden_states: torch.Tensor) -> torch.Tensor:
        """`hidden_norm(fc(concat of target layer outputs))`: `[b, T, K*H] -> [b, T, H]`."""
        return self.hidden_norm(self.fc(context_hidden_states))

    def select_context(self, target_hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Concatenate the target layers this drafter reads (HF `hidden_states[i + 1]`) on the feature axis."""
        return torch.cat([target_hidden_states[i + 1] for i in self.config.target_layer_ids], dim=-1)

    def _attention_mask(self, noise_embeds, attention_mask, kv_len):
        if attention_mask is not None and attention_mask.dim() == 4:
            if attention_mask.dtype == torch.bool and self.config._attn_implementation == "eager":
                # Eager attention adds the mask: turn "may attend" into an additive bias.
                bias = torch.zeros(attention_mask.shape, dtype=noise_embeds.dtype, device=noise_embeds.device)
                return bias.masked_fill(~attention_mask, torch.finfo(noise_embeds.dtype).min)
            return attention_mask
        # A zero-width stand-in tells the mask builder the key length (context + block + cache).
        kv_shape = noise_embeds.new_empty(noise_embeds.shape[0], kv_len, 0)
        return create_bidirectional_mask(
            config=self.config, inputs_embeds=noise_embeds, attention_mask=attention_mask, encoder_hidden_states=kv_shape
        )

    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden_states: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> AdaFlashDrafterOutput:
        r"""
        noise_embeds (`[b, q, H]`): target embeddings of the block (bonus token, then mask tokens).
        context_hidden_states (`[b, T, K*H]`): raw target features of the T newly verified tokens
            (concatenated layer outputs, see [`select_context`]); fused here with `fc` + `hidden_norm`.
        position_ids (`[b, T + q]`): absolute positions of the new context tokens, then of the block.
        attention_mask: a 2D key padding mask over `cache + T + q` keys, or a 4D `[b, 1, q, keys]`
            mask (boolean "may attend", or additive) used as is.
        past_key_values: a transformers cache; context *and* block K/V are appended to it, the caller
            crops the block afterwards (as transformers' `DFlashTokenCandidateGenerator` does).
        """
        context = self.fuse_context(context_hidden_states) if context_hidden_states is not None else None
        ctx_len = 0 if context is None else context.shape[1]
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        if hasattr(past_key_values, "set_previous_accepted_tokens"):
            past_key_values.set_previous_accepted_tokens(ctx_len)
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + ctx_len + noise_embeds.shape[1], device=noise_embeds.device)
            position_ids = position_ids.unsqueeze(0).expand(noise_embeds.shape[0], -1)
        if kwargs.get("attention_fn") is not None:  # the caller's kernel takes its own mask as is
            mask = attention_mask
        else:
            mask = self._attention_mask(noise_embeds, attention_mask, past_len + ctx_len + noise_embeds.shape[1])
        position_embeddings = self.rotary_emb(noise_embeds, position_ids)
        masks = {"full_attention": mask}
        if "sliding_attention" in self.config.layer_types:  # z-lab sliding-window layers (causal + window)
            if self.config._attn_implementation not in ("sdpa", "eager"):
                raise ValueError("sliding_attention drafter layers need attn_implementation 'sdpa' or 'eager'")
            key_mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
            if mask is not None and mask.dim() != 4:  # a 2D passthrough mask: expand it first
                mask = None if key_mask is None else key_mask.bool()[:, None, None, :].expand(-1, 1, noise_embeds.shape[1], -1)
            sliding = sliding_window_mask(
                mask, position_ids, noise_embeds.shape[1], past_len, self.config.sliding_window, key_mask
            )
            if self.config._attn_implementation == "eager" and sliding.dtype == torch.bool:
                sliding = torch.zeros(sliding.shape, dtype=noise_embeds.dtype, device=noise_embeds.device).masked_fill(
                    ~sliding, torch.finfo(noise_embeds.dtype).min
                )
            masks["sliding_attention"] = sliding
        hidden_states = noise_embeds
        for layer, layer_type in zip(self.layers, self.config.layer_types):
            hidden_states = layer(hidden_states, context, position_embeddings, masks[layer_type], past_key_values, **kwargs)
        return AdaFlashDrafterOutput(last_hidden_state=self.norm(hidden_states), past_key_values=past_key_values)

    def draft_block(
        self,
        bonus_tokens: torch.LongTensor,
        context_hidden_states: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        **kwargs,
    ) -> torch.Tensor:
        r"""Draft one block after each row's bonus token: the final-normed block states `[b, B, H]`.

        The block is `[bonus, mask, ..., mask]` (`config.block_size` slots) embedded with the target's
        (frozen) embedding; `context_hidden_states` (raw target features, `[b, T, K*H]`) are cast to the
        drafter's device and dtype. The other arguments are [`forward`]'s. Draft logits are
        `compute_logits(states[:, 1:])`, the length head's estimate `predict_accept_ratio(states)`.

        Example:
            >>> states = drafter.draft_block(torch.tensor([5]), feats, torch.arange(T + B)[None])  # doctest: +SKIP
        """
        param = next(self.parameters())
        ids = bonus_tokens.new_full((bonus_tokens.shape[0], self.config.block_size), self.config.mask_token_id)
        ids[:, 0] = bonus_tokens
        with torch.no_grad():  # the embedding is the target's, frozen and shared
            noise = self.embed(ids).to(device=param.device, dtype=param.dtype)
        context = None
        if context_hidden_states is not None:
            context = context_hidden_states.to(device=param.device, dtype=param.dtype)
            if context.is_inference() and torch.is_grad_enabled():
                context = context.clone()  # features from an inference-mode target, trained through
        if noise.is_inference() and torch.is_grad_enabled():
            noise = noise.clone()
        out = self(noise_embeds=noise, context_hidden_states=context, position_ids=position_ids,
                   attention_mask=attention_mask, past_key_values=past_key_values, **kwargs)
        return out.last_hidden_state

    def predict_accept_ratio(self, block_hidden: torch.Tensor) -> torch.Tensor:
        """Length-head estimate of the accepted fraction of each block, `[..., B, H] -> [...]` in (0, 1).

        The input is detached: the head's loss never reaches the drafter.
        """
        if self.length_head is None:
            raise ValueError("this drafter has no length head (config.use_length_head is False)")
        return self.length_head(block_hidden.detach())


__all__ = ["AdaFlashDrafter", "AdaFlashPreTrainedModel", "AdaFlashLengthHead", "AdaFlashPaperLengthHead",
           "AdaFlashDrafterOutput"]
