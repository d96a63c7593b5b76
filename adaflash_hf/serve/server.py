"""An OpenAI-compatible HTTP server over the continuous-batching engine: FastAPI on uvicorn.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the tokenizer's chat template),
``GET /v1/models``, ``GET /health``. Every request is a request of one :class:`AsyncEngine`, so
concurrent HTTP requests are decoded together (continuous batching); the fields and answers are
:class:`CompletionService`'s, the limits :class:`ServeSettings`'. Needs the ``serve`` extra
(``pip install 'adaflash-hf[serve]'``); the rest of the package works without it.

Example::

    from adaflash_hf import load_reference_pair
    from adaflash_hf.engine import Engine, EngineConfig
    from adaflash_hf.serve import make_server

    target, drafter, tok = load_reference_pair()
    server = make_server(Engine(target, drafter, EngineConfig(max_slots=8, max_len=1024)), tok, port=8000)
    server.serve_forever()   # or server.start() for a background thread; server.close() stops both

    # curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
    #      -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32, "temperature": 0}'

The server logs one line per request to the ``adaflash_hf.server`` logger (status, token counts,
finish reason, time; never prompt or completion text). Guards (:class:`ServeSettings`): an API key on every
route but ``/health``, a header deadline and a connection cap (``uvicorn_server.py``), body limits and a
concurrency limit (``app.py``), a prompt length cap checked before tokenizing (``service.py``). After an engine failure ``/health`` answers
503; with ``ServeSettings.exit_after_failure_s`` set, serving then stops and :attr:`OpenAIServer.exit_code`
is :data:`EXIT_ENGINE_FAILED` (``adaflash serve`` exits with it, so a supervisor restarts the server).

Stopping (SIGTERM / Ctrl-C, or :meth:`OpenAIServer.drain`) drains first: new completion requests get a 503 with
``Retry-After`` and ``/health`` a 503, the requests in flight finish for up to ``ServeSettings.drain_timeout_s``,
then those left are cancelled (each client gets a 503 error, in band when streaming) and serving stops. A second
signal cancels what is left at once; a third stops as uvicorn does.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from .async_engine import AsyncEngine
from .service import APIError, CompletionService
from .settings import EXIT_ENGINE_FAILED, ServeSettings
from ..engine import Engine

__all__ = ["APIError", "CompletionService", "EXIT_ENGINE_FAILED", "OpenAIServer", "ServeSettings", "make_server"]

log = logging.getLogger("adaflash_hf.server")


def require_serve_extra():
    """Import uvicorn, prometheus_client and the app (FastAPI); a clear error naming the extra when they are missing."""
    try:
        import prometheus_client  # noqa: F401 - GET /metrics
        import uvicorn

        from . import app, uvicorn_server
    except ImportError as e:
        raise ImportError(f"the HTTP server needs the `serve` extra ({e.name} is missing): "
                          "pip install 'adaflash-hf[serve]'", name=e.name) from e
    return uvicorn, app, uvicorn_server


class OpenAIServer:
    """The OpenAI endpoints over a :class:`CompletionService`, served by uvicorn on a socket bound at once.

    ``service`` may be set after binding (requests get a 503 until then). ``serve_forever()`` serves on
    this thread (Ctrl-C / SIGTERM stop it); ``start()`` on a background thread; ``close()`` cancels the
    requests in flight, stops serving and stops the engine thread.

    Example::

        with make_server(engine, tok, port=0).start() as server:
            print(server.url)   # http://127.0.0.1:PORT
    """

    def __init__(self, address: tuple[str, int], service: CompletionService | None = None,
                 settings: ServeSettings | None = None):
        self._uvicorn, app_mod, self._runner = require_serve_extra()
        self.service, self.settings = service, settings or ServeSettings()
        self.exit_code = 0
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind(address)
            self.socket.listen(self.settings.backlog)
        except OSError:
            self.socket.close()
            raise
        self.app = app_mod.build_app(lambda: self.service, self.settings)
        _fit_file_limit(self.settings.max_connections)
        self._server = None
        self._thread: threading.Thread | None = None
        self._failed_at: float | None = None
        self._drain_deadline: float | None = None  # set when draining starts
        self._cancelled_at: float | None = None  # when the requests left at the deadline were cancelled

    @property
    def server_address(self) -> tuple[str, int]:
        return self.socket.getsockname()[:2]

    @property
    def url(self) -> str:
        host, port = self.server_address
        return f"http://{host}:{port}"

    def serve_forever(self) -> None:
        """Serve until :meth:`close`, a signal, or (``exit_after_failure_s``) an engine failure."""
        config = self._uvicorn.Config(self.app, http=self._runner.guarded_h11(self.settings, self._count_refusal),
                                      lifespan="off",
                                      log_config=None, access_log=False,
                                      timeout_keep_alive=self.settings.timeout_keep_alive_s,
                                      timeout_graceful_shutdown=5, backlog=self.settings.backlog)
        self._server = self._runner.TickServer(config, self._tick, on_signal=self.drain)
        self._server.run(sockets=[self.socket])

    def _count_refusal(self, status: int) -> None:
        if self.service is not None:
            self.service.metrics.reject(status)

    def drain(self) -> None:
        """Start stopping (module docstring): refuse new completion requests, let those in flight finish for up to
        ``drain_timeout_s``, cancel the rest, then stop serving. Called again while draining, it cuts the drain
        short: what is left is cancelled at the next tick. Safe to call from a signal handler."""
        if self._drain_deadline is not None:
            self._drain_deadline = time.monotonic()
            log.info("stopping now: cancelling what is still in flight")
            return
        self._drain_deadline = time.monotonic() + self.settings.drain_timeout_s
        if self.service is not None:
            self.service.begin_drain()
        log.info("stopping: no new requests; draining those in flight for up to %g s", self.settings.drain_timeout_s)

    def _drained(self) -> bool:
        """While draining, on each tick: whether serving may stop (nothing left in flight, or the deadline passed
        and what it cancelled has been answered, or has had a second to be)."""
        svc = self.service
        if svc is None or (svc.in_flight() == 0 and self.app.in_flight == 0):
            return True
        now = time.monotonic()
        if self._cancelled_at is None and now >= self._drain_deadline:
            self._cancelled_at = now
            log.info("stopping: drain deadline passed; cancelling %d request(s) still in flight", svc.cancel_all())
        return self._cancelled_at is not None and now - self._cancelled_at > 1.0

    def _tick(self) -> bool:
        """Every 0.1 s on the server loop: whether to stop (a drain done, or an engine failure once its grace is
        over)."""
        if self._drain_deadline is not None and self._drained():
            return True
        failure = None if self.service is None else self.service.failure()
        if failure is None or self.settings.exit_after_failure_s is None:
            return False
        if self._failed_at is None:
            self._failed_at = time.monotonic()
            log.error("the engine failed (%s); /health answers 503; stopping in %g s with exit code %d",
                      failure, self.settings.exit_after_failure_s, EXIT_ENGINE_FAILED)
        if time.monotonic() - self._failed_at < self.settings.exit_after_failure_s:
            return False
        self.exit_code = EXIT_ENGINE_FAILED
        return True

    def start(self, timeout: float = 30.0) -> "OpenAIServer":
        """Serve on a background thread; returns once the server accepts requests."""
        self._thread = threading.Thread(target=self.serve_forever, name="adaflash-http", daemon=True)
        self._thread.start()
        end = time.monotonic() + timeout
        while not (self._server is not None and self._server.started):
            if not self._thread.is_alive() or time.monotonic() > end:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def close(self) -> None:
        """Cancel the requests in flight (their clients get an error), stop serving and the engine thread."""
        if self.service is not None:
            self.service.close(cancel=True)
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.socket.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _fit_file_limit(max_connections: int, spare: int = 256) -> None:
    """Raise the soft limit on open files to fit ``max_connections`` sockets and ``spare`` other files (model
    shards, pipes), as far as the hard limit allows: the connection cap must bind before the file limit does."""
    try:
        import resource
    except ImportError:  # not on Unix: no such limit to raise
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + spare
    if soft != resource.RLIM_INFINITY and soft < need:
        soft = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        if soft < need:
            log.warning("the open-file limit (%d) is below max_connections (%d) + %d: lower max_connections or "
                        "raise the hard limit (ulimit -Hn)", soft, max_connections, spare)


def make_server(engine, tokenizer, host: str = "127.0.0.1", port: int = 8000, model_name: str = "adaflash",
                default_max_tokens: int = 256, settings: ServeSettings | None = None) -> OpenAIServer:
    """Bind an :class:`OpenAIServer` (``port=0``: any free port, see ``server.url``) over ``engine``
    (an :class:`Engine` or :class:`AsyncEngine`); call ``serve_forever()`` or ``start()``."""
    if not isinstance(engine, (Engine, AsyncEngine)):
        raise TypeError(f"engine must be an Engine or AsyncEngine, got {type(engine).__name__}")
    server = OpenAIServer((host, port), settings=settings)
    server.service = CompletionService(engine, tokenizer, model_name, default_max_tokens)
    return server
