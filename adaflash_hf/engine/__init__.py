"""Continuous-batching speculative decoding engine: slotted KV caches, packed verification, admission by the
token budget; on CUDA the decode forwards are CUDA graphs per bucket over the target's fused layers.

The public names are what a caller needs to run requests: :class:`Engine` (submit, step, generate) and the
:class:`EngineConfig` it is built from, what a request returns and reports (:class:`EngineOutput`, :class:`RequestHandle`, :class:`StepInfo`,
:class:`RequestRejected`), how it samples (:class:`SamplingParams`) and the round layouts an engine is built for
(:data:`LAYOUTS`, :data:`ENGINE_POLICIES`, :func:`layout_args`, :func:`round_layout`). The caches, graphs and
kernels are internals, imported from their modules (``engine.graphs``, ``engine.target``, ``engine.kernels``...)
by the code and tests that need them. Serving (the asyncio :class:`~adaflash_hf.serve.AsyncEngine` and the
OpenAI server) lives beside the engine in :mod:`adaflash_hf.serve`; importing the engine imports no HTTP.

Example::

    from adaflash_hf.engine import Engine, EngineConfig

    engine = Engine(target, drafter, EngineConfig(max_slots=8, max_len=1024))
    out = engine.generate([[1, 2, 3]], max_new_tokens=32)[0]
    print(out.token_ids, out.tau)
"""

from ..speculation.length.names import ENGINE_POLICIES, LAYOUTS, layout_args, round_layout
from .config import EngineConfig
from .engine import Engine
from .requests import EngineOutput, RequestHandle, RequestRejected, StepInfo
from .sampling import SamplingParams

__all__ = [
    "ENGINE_POLICIES", "Engine", "EngineConfig", "EngineOutput", "LAYOUTS", "RequestHandle", "RequestRejected",
    "SamplingParams", "StepInfo", "layout_args", "round_layout",
]
