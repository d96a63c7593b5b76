"""CUDA graph capture beside other threads' CUDA work: the capture mode and one process-wide lock.

The engine captures CUDA graphs when a round first needs a shape, so a capture can begin while another thread
of the process runs CUDA work (an online adapter training on its side stream). Captures use the
``thread_local`` error mode, so that thread's work on its own streams is allowed meanwhile. Work on the legacy
default stream, or a device-wide synchronize, is not: it would make the legacy stream wait on the capturing
stream, which invalidates the capture (and, in the default global mode, every later one: the engine
then fails each round with "beginAllocateToPool: already recording"). The engine holds :data:`CAPTURE_LOCK`
while it captures; a thread that may touch the legacy stream while the engine serves (the adapter swapping
weights in) holds it too.

Python's garbage collector must not run inside a capture either: a collection that frees an unreachable CUDA graph
(an evicted engine's, held in a reference cycle) calls ``cudaGraphExecDestroy`` on the capturing thread, which
invalidates the capture ("operation not permitted when stream is capturing (function reset)", then "operation failed
due to a previous error during capture": as in a bench where each method builds its own engine and evicts an
older one). ``torch.cuda.graph`` no longer collects before capturing (only under
``torch.compiler.config.force_cudagraph_gc``, as a full collection per capture is slow). :func:`capturing` keeps the
collector off until the capture ends: garbage waits for the next collection after it.

Example:
    >>> with CAPTURE_LOCK:  # no engine capture runs in this block
    ...     pass
    >>> import gc
    >>> with capturing():
    ...     gc.isenabled()
    False
"""

from __future__ import annotations

import contextlib
import gc
import threading

__all__ = ["CAPTURE_LOCK", "CAPTURE_MODE", "capturing"]

CAPTURE_MODE = "thread_local"
CAPTURE_LOCK = threading.RLock()


@contextlib.contextmanager
def capturing():
    """Hold :data:`CAPTURE_LOCK` with Python's garbage collector off (restored on exit)."""
    with CAPTURE_LOCK:
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            if was_enabled:
                gc.enable()
