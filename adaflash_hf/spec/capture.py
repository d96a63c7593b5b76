"""CUDA graph capture beside other threads' CUDA work: the capture mode and one process-wide lock.

The engine captures CUDA graphs when a round first needs a shape, so a capture can begin while another thread
of the process runs CUDA work (an online adapter training on its side stream). Captures use the
``thread_local`` error mode, so that thread's work on its own streams is allowed meanwhile. Work on the legacy
default stream, or a device-wide synchronize, is not: it would make the legacy stream wait on the capturing
stream, which invalidates the capture (and, in the default global mode, every later one: on an H200 the engine
then failed each round with "beginAllocateToPool: already recording"). The engine holds :data:`CAPTURE_LOCK`
while it captures; a thread that may touch the legacy stream while the engine serves (the adapter swapping
weights in) holds it too.

Example:
    >>> with CAPTURE_LOCK:  # no engine capture runs in this block
    ...     pass
"""

from __future__ import annotations

import threading

__all__ = ["CAPTURE_LOCK", "CAPTURE_MODE"]

CAPTURE_MODE = "thread_local"
CAPTURE_LOCK = threading.RLock()
