"""The engine's device kernels: slot attention (flex_attention / split-KV Triton), the target's fused
layers and their Triton pieces (few-row projections, q/k norm + RoPE + cache store)."""
