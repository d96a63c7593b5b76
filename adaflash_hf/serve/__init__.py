"""Serving on top of :class:`~adaflash_hf.engine.Engine`, beside it: the asyncio face of an engine
(:class:`AsyncEngine`: one thread steps the engine, coroutines submit and await requests) and the
OpenAI-compatible HTTP server over it (:func:`make_server`, :class:`OpenAIServer`, limits in :class:`ServeSettings`).

The engine imports nothing of this package. It needs the ``serve`` extra (``pip install 'adaflash-hf[serve]'``:
prometheus-client when imported, FastAPI and uvicorn when a server is made).

Example::

    from adaflash_hf.engine import Engine, EngineConfig
    from adaflash_hf.serve import make_server

    with make_server(Engine(target, drafter, EngineConfig(max_slots=8, max_len=1024)), tok, port=0).start() as server:
        print(server.url)
"""

from .async_engine import AsyncEngine, EngineClosed, EngineFailed, RequestFuture, TokenStream
from .server import OpenAIServer, ServeSettings, make_server

__all__ = ["AsyncEngine", "EngineClosed", "EngineFailed", "OpenAIServer", "RequestFuture", "ServeSettings", "TokenStream",
           "make_server"]
