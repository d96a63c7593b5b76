"""Continuous-batching speculative decoding engine (issue 6): slotted KV caches, packed verification,
EMA admission. CPU-correct core; CUDA graphs / flex_attention come later (examples/engine_gpu_check.py)."""

from .admission import AdmissionController
from .drafter import SlotCacheView, draft_blocks, make_drafter_cache
from .engine import VERIFY_MODES, Engine, EngineOutput, RequestHandle, RequestRejected, StepInfo
from .kv_cache import SlotKVCache
from .sampling import SamplingParams, processed_probs
from .target import PackedLayout, check_target_supported, make_target_cache, packed_attention, target_forward

__all__ = [
    "AdmissionController", "Engine", "EngineOutput", "PackedLayout", "RequestHandle", "RequestRejected",
    "SamplingParams", "SlotCacheView", "SlotKVCache", "StepInfo", "VERIFY_MODES", "check_target_supported",
    "draft_blocks", "make_drafter_cache", "make_target_cache", "packed_attention", "processed_probs", "target_forward",
]
