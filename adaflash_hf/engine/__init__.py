"""Continuous-batching speculative decoding engine: slotted KV caches, packed verification,
EMA admission; on CUDA the decode forwards are CUDA graphs per bucket with flex_attention
(``graphs.py``, ``attention.py``) over the target's fused layers (``fused.py``; checked and measured by examples/engine_gpu_check.py)."""

from .admission import AdmissionController
from .kernels.attention import SlotAttention, slot_block_mask, slot_mask_mod
from .serve.async_engine import AsyncEngine, EngineClosed, EngineFailed, RequestFuture, TokenStream
from .drafter import DraftGraphs, DraftOutput, SlotCacheView, append_context, draft_blocks, make_drafter_cache
from ..speculation.length.names import ENGINE_POLICIES, LAYOUTS, layout_args, round_layout
from .engine import Engine, EngineOutput, RequestHandle, RequestRejected, StepInfo
from .kernels.fused import FusedTarget
from .graphs import DecodeGraphs, GraphRunner, pick_bucket, q_buckets, token_buckets
from .kv_cache import SlotKVCache
from .sampling import SamplingParams, processed_probs
from .serve.server import OpenAIServer, make_server
from .target import (
    PackedLayout,
    check_target_supported,
    decoder_forward,
    make_target_cache,
    packed_attention,
    target_forward,
)

__all__ = [
    "AdmissionController", "AsyncEngine", "Engine", "EngineClosed", "EngineFailed", "OpenAIServer", "RequestFuture",
    "TokenStream", "make_server", "EngineOutput", "PackedLayout", "RequestHandle", "RequestRejected",
    "SamplingParams", "SlotCacheView", "SlotKVCache", "StepInfo", "ENGINE_POLICIES", "LAYOUTS", "check_target_supported", "layout_args", "round_layout",
    "draft_blocks", "make_drafter_cache", "make_target_cache", "packed_attention", "processed_probs", "target_forward",
    # the CUDA-graph decode path
    "DecodeGraphs", "SlotAttention", "decoder_forward", "pick_bucket", "q_buckets", "slot_block_mask", "slot_mask_mod",
    "token_buckets", "GraphRunner", "FusedTarget",
    # the batched drafter step
    "DraftGraphs", "DraftOutput", "append_context",
]
