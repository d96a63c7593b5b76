"""The HTTP server's limits, timeouts and API key, in one place (the ``adaflash serve`` flags set them)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["EXIT_ENGINE_FAILED", "ServeSettings"]

# The process exit status after an engine failure (a supervisor restarts the server); 2 is a usage error.
EXIT_ENGINE_FAILED = 3


@dataclass(frozen=True)
class ServeSettings:
    """How much the server takes on, and how long it waits.

    Args:
        max_concurrent_requests: completion requests in flight (queued in the engine or generating);
            one more gets a 429 with ``Retry-After`` instead of waiting. ``/health`` and ``/v1/models``
            are never limited.
        max_body_bytes: the largest request body (a 413 above it).
        body_timeout_s: the longest wait for the next piece of a request body (a 408 after it).
        timeout_keep_alive_s: how long an idle keep-alive connection stays open.
        header_timeout_s: the longest a connection may take to send a request's headers, counted from
            its opening (or its previous answer); past it, a 408 and the connection is closed (a client
            that sends part of its headers and stalls would otherwise hold its socket for ever).
        max_connections: open connections at once; one more is answered 503 and closed at once, so
            stalled clients cannot exhaust the process's file descriptors (the server raises its soft
            file limit to fit this many, where the hard limit allows).
        backlog: the listen backlog (connections the kernel queues before ``accept``).
        disconnect_poll_s: how often a non-streaming request checks whether its client is still there.
        exit_after_failure_s: after an engine failure, answer ``/health`` with 503 for this long, then stop
            serving with :data:`EXIT_ENGINE_FAILED` (``None``: keep answering 503, never stop).
        drain_timeout_s: on SIGTERM, how long the requests in flight may still run (new ones get a 503) before
            those left are cancelled and the server stops.
        api_key: when set, every route but ``/health`` needs ``Authorization: Bearer <api_key>`` (a 401
            otherwise); left out of ``repr`` so that it is never printed or logged. An empty key, or one with
            whitespace at either end (no client could send it: the header's value is stripped), is refused.

    Example::

        make_server(engine, tok, port=0, settings=ServeSettings(max_concurrent_requests=64))
    """

    max_concurrent_requests: int = 256
    max_body_bytes: int = 8 * 1024 * 1024
    body_timeout_s: float = 30.0
    timeout_keep_alive_s: float = 5.0
    backlog: int = 2048
    disconnect_poll_s: float = 0.1
    exit_after_failure_s: float | None = None
    header_timeout_s: float = 10.0
    max_connections: int = 1024
    drain_timeout_s: float = 20.0
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key
                                         or self.api_key != self.api_key.strip()):
            raise ValueError("api_key must be None or a non-empty string without whitespace at either end")
        for name in ("max_concurrent_requests", "max_body_bytes", "backlog", "max_connections"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("body_timeout_s", "timeout_keep_alive_s", "header_timeout_s", "disconnect_poll_s", "exit_after_failure_s",
                     "drain_timeout_s"):
            v = getattr(self, name)
            if v is None and name == "exit_after_failure_s":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")
