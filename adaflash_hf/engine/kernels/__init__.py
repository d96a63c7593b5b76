"""The engine's device kernels: slot attention (flex_attention / split-KV Triton), the target's fused
layers and their Triton pieces (few-row projections, q/k norm + RoPE + cache store)."""

TILE_ROWS = 128  # the Triton decode attention's query rows per kv head in one program: heads per kv head x rows per slot
