"""Configuration of the AdaFlash drafter (a DFlash block-diffusion drafter plus a length head).

Self-contained: imports torch / transformers / huggingface_hub only, so this file can travel
beside a checkpoint as Hub remote code.
"""

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers whose outputs feed the drafter, spread evenly as in the released DFlash code.

    `round(1 + i * (L - 4) / (n - 1))` for i in 0..n-1; a one-layer drafter reads `[L // 2]`.

    Example:
        >>> default_target_layer_ids(36, 5)
        [1, 9, 17, 25, 33]
    """
    if num_target_layers < 1 or num_draft_layers < 1:
        raise ValueError(
            f"need at least one target and one drafter layer, got num_target_layers={num_target_layers}, "
            f"num_draft_layers={num_draft_layers}"
        )
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    ids = [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]
    # Very shallow targets (L < 5) make the formula leave the valid range; clamp rather than fail.
    return [min(max(i, 0), num_target_layers - 1) for i in ids]


LENGTH_HEAD_TYPES = ("released", "paper")


@strict
class AdaFlashConfig(PreTrainedConfig):
    r"""
    Configuration of [`AdaFlashDrafter`]. The decoder fields follow `Qwen3Config` (the drafter is a
    stack of Qwen3-style layers with the target's hidden size); the defaults describe the released
    Qwen3-8B DFlash drafter.

    block_size (`int`, defaults to 16):
        Tokens per drafted block: slot 0 holds the last verified token, slots 1..B-1 are predicted.
    num_target_layers (`int`, defaults to 36):
        Number of decoder layers of the target this drafter was built for.
    num_target_layers_known (`bool`, defaults to `True`):
        False when a DFlash checkpoint did not say (vLLM never reads it): `num_target_layers` is then the
        smallest depth the ids fit, and `check_target` accepts any target at least that deep.
    target_layer_ids (`list[int]`, *optional*):
        Zero-indexed target layers whose outputs (HF `hidden_states[i + 1]`) are fused into the context.
        Defaults to [`default_target_layer_ids`].
    mask_token_id (`int`):
        Token id embedded in the masked block slots; must exist in the target's vocabulary.
    use_length_head (`bool`, defaults to `True`):
        Whether the drafter carries the adaptive verify-length head.
    length_head_dim (`int`, defaults to 256):
        Bottleneck width of the length head.
    length_head_type (`str`, defaults to `"released"`):
        `"released"`: the released checkpoints' head (concat of block mean and last slot, a residual
        MLP); `"paper"`: the paper's description (per-slot Linear + SiLU, mean over the block, Linear).
    length_head_trained (`bool`, defaults to `False`):
        Set once the head has been trained; the `adaptive` policy is the default only then.
    length_rate (`float`, defaults to 1.0) / length_min (`int`, defaults to 1):
        `k_hat = clamp(floor(a * block_size * length_rate), length_min, block_size)` (the paper's).
    layer_types (`list[str]`, *optional*) / sliding_window (`int`, *optional*):
        Per drafter layer `"full_attention"` (default: the block sees all context and itself
        bidirectionally) or `"sliding_attention"`, as z-lab DFlash checkpoints declare it and vLLM /
        SGLang run it: causal, each query sees the last `sliding_window` positions (itself included).
    embed_tokens_fingerprint (`dict`, *optional*):
        Set by the reader when a checkpoint ships its own `embed_tokens.weight`: the drafter still
        uses the target's embedding, and `check_target` refuses a target whose embedding differs.

    Example:
        >>> config = AdaFlashConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        ...     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=100,
        ...     num_target_layers=4, mask_token_id=99, block_size=8)
        >>> config.target_layer_ids
        [1, 1]
    """

    model_type = "adaflash"
    keys_to_ignore_at_inference = ["past_key_values"]
    default_theta = 1_000_000.0

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 5
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 40960
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    attention_dropout: float | int = 0.0
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    block_size: int = 16
    num_target_layers: int = 36
    num_target_layers_known: bool = True
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = 151669

    use_length_head: bool = True
    length_head_dim: int = 256
    length_head_type: str = "released"
    length_head_trained: bool = False
    length_rate: float = 1.0
    length_min: int = 1
    embed_tokens_fingerprint: dict | None = None

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.layer_types is None:
            # Full attention unless a checkpoint declares sliding-window layers (z-lab layout).
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if self.target_layer_ids is None:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self._check_drafter_fields()
        super().__post_init__(**kwargs)

    def _check_drafter_fields(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (one verified slot plus drafted slots), got {self.block_size}")
        if self.mask_token_id is None:
            raise ValueError(
                "mask_token_id is missing: the drafter embeds it in the masked block slots. Add a mask token to "
                "the target's tokenizer (AdaFlashDrafter.from_target does this) and pass its id."
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary (size {self.vocab_size})")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty: the drafter needs at least one target layer as context")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(
                f"target_layer_ids {bad} out of range for a target with num_target_layers={self.num_target_layers} "
                f"(valid ids are 0..{self.num_target_layers - 1})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers (one per layer)"
            )
        unknown = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"layer_types {unknown} unsupported: use 'full_attention' or 'sliding_attention'")
        if "sliding_attention" in self.layer_types and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError(f"sliding_attention layers need sliding_window >= 1, got {self.sliding_window}")
        if not 1 <= self.length_min <= self.block_size:
            raise ValueError(f"length_min must be in 1..block_size={self.block_size}, got {self.length_min}")
        if self.length_rate <= 0:
            raise ValueError(f"length_rate must be > 0, got {self.length_rate}")
        if self.length_head_type not in LENGTH_HEAD_TYPES:
            raise ValueError(f"length_head_type must be one of {LENGTH_HEAD_TYPES}, got {self.length_head_type!r}")
        if self.length_head_dim < 1:
            raise ValueError(f"length_head_dim must be >= 1, got {self.length_head_dim}")


__all__ = ["AdaFlashConfig", "LENGTH_HEAD_TYPES", "default_target_layer_ids"]
