"""Serving on top of :class:`~adaflash_hf.engine.Engine`: the asyncio wrapper and the OpenAI-compatible server."""
