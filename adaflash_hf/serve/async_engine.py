"""A thread-safe, asyncio-friendly front end for the continuous-batching :class:`Engine`.

:class:`AsyncEngine` owns one background thread that owns the engine: every engine call (``submit``,
``step``, ``cancel``) happens on that thread, so the (not thread-safe) engine is never touched from
two threads at once. Callers on any thread or event loop talk to it through a thread-safe command
queue; the thread steps the engine while there is work and sleeps on the queue when there is none.

Three ways in, all continuously batched together:

* ``await aengine.generate(prompt_ids, max_new_tokens)`` returns the :class:`EngineOutput`;
* ``async for tok in aengine.stream(prompt_ids, max_new_tokens)`` yields token ids as they are committed;
* ``aengine.submit(prompt_ids, max_new_tokens)`` (any thread, no event loop) returns a
  :class:`RequestFuture`, a :class:`concurrent.futures.Future` of the :class:`EngineOutput`.

Cancelling (the consumer stops iterating, the awaiting task is cancelled, ``future.cancel()`` or
``aengine.cancel(future)``) frees the request's engine slot at the next round boundary. A request the
engine rejects raises :class:`RequestRejected` to its caller; an exception inside the engine thread or a
failed engine round (``Engine.healthy`` false) fails every pending request with :class:`EngineFailed`
(nothing hangs) and later submissions raise at once. A request that fails alone (e.g. a non-finite
distribution) resolves with ``finish_reason="error"`` and ``output.error``; the others go on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
from typing import Callable

import torch

from ..engine import Engine, EngineOutput, RequestRejected, SamplingParams

__all__ = ["AsyncEngine", "EngineClosed", "EngineFailed", "RequestFuture", "TokenStream"]

_END = object()  # end-of-stream marker put on a TokenStream's queue


class EngineFailed(RuntimeError):
    """The engine thread raised: every pending request fails with this (``__cause__`` is the original error)."""


class EngineClosed(RuntimeError):
    """A submission to an :class:`AsyncEngine` that is closed (or whose engine thread has failed)."""


class RequestFuture(concurrent.futures.Future):
    """A :class:`concurrent.futures.Future` of one request's :class:`EngineOutput`.

    Besides the usual ``result(timeout)`` / ``cancel()`` / ``add_done_callback``:

    * ``wait_submitted(timeout)`` blocks until the engine has accepted the request (returns its
      ``request_id``) or rejected it (raises :class:`RequestRejected`): useful before committing
      to a response, e.g. sending HTTP headers;
    * ``cancel()`` (while pending) also cancels the engine request and frees its slot; to stop a
      request but still receive its partial :class:`EngineOutput` (``finish_reason="cancelled"``),
      use :meth:`AsyncEngine.cancel` instead.
    """

    def __init__(self):
        super().__init__()
        self._submitted = threading.Event()
        self._submit_error: BaseException | None = None
        self.request_id: int | None = None

    def wait_submitted(self, timeout: float | None = None) -> int:
        if not self._submitted.wait(timeout):
            raise TimeoutError("the engine thread did not take the request in time")
        if self._submit_error is not None:
            raise self._submit_error
        return self.request_id

    def _mark_submitted(self, request_id: int | None, error: BaseException | None = None) -> None:
        self.request_id, self._submit_error = request_id, error
        self._submitted.set()


class _Job:
    __slots__ = ("prompt", "max_new", "params", "on_token", "future", "handle", "callback_error")

    def __init__(self, prompt, max_new, params, on_token, future):
        self.prompt, self.max_new, self.params, self.on_token, self.future = prompt, max_new, params, on_token, future
        self.handle = None
        self.callback_error: BaseException | None = None


class TokenStream:
    """Async iterator over one request's token ids, in commit order (returned by :meth:`AsyncEngine.stream`).

    After the iteration ends, :attr:`output` holds the :class:`EngineOutput` (``finish_reason`` etc.).
    Leaving the loop early (``break``), :meth:`aclose`, or cancelling the task that iterates cancels the
    request and frees its engine slot; ``async with`` closes it on exit.
    """

    def __init__(self, owner: "AsyncEngine", future: RequestFuture, q: asyncio.Queue):
        self._owner, self._future, self._queue, self._finished = owner, future, q, False

    @property
    def future(self) -> RequestFuture:
        return self._future

    @property
    def output(self) -> EngineOutput | None:
        """The final output once the request is done (None before, or if it failed or was cancelled by ``future.cancel``)."""
        f = self._future
        return f.result() if f.done() and not f.cancelled() and f.exception() is None else None

    def __aiter__(self):
        return self

    async def __anext__(self) -> int:
        if self._finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # the iterating task was cancelled
            self.cancel()
            raise
        if item is _END:
            self._finished = True
            if self._future.cancelled():  # `future.cancel()`: the stream just ends
                raise StopAsyncIteration
            exc = self._future.exception()
            if exc is not None:
                raise exc
            raise StopAsyncIteration
        return item

    def cancel(self) -> None:
        """Cancel the request (no-op once done); the stream then ends after the tokens already committed."""
        if not self._future.done():
            self._owner.cancel(self._future)

    async def aclose(self) -> None:
        self._finished = True
        self.cancel()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    def __del__(self):  # the consumer dropped the stream (e.g. `break` out of `async for`)
        try:
            if not self._future.done():
                self._owner.cancel(self._future)
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass


class AsyncEngine:
    """Run an :class:`Engine` on a background thread; submit from threads or asyncio, stream, cancel.

    Args:
        engine: the :class:`Engine` to own. Do not call its methods elsewhere while it is wrapped.

    Example (asyncio)::

        aengine = AsyncEngine(Engine(target, drafter, EngineConfig(max_slots=8, max_len=512)))
        out = await aengine.generate(prompt_ids, max_new_tokens=64)       # EngineOutput
        async for tok in aengine.stream(prompt_ids, max_new_tokens=64):   # token ids as committed
            print(tok)
        outs = await asyncio.gather(*(aengine.generate(p, 32) for p in prompts))  # batched together
        aengine.close()

    Example (threads, no event loop)::

        with AsyncEngine(engine) as aengine:
            fut = aengine.submit(prompt_ids, 64, SamplingParams(temperature=0.7, seed=1))
            print(fut.result().token_ids)
    """

    def __init__(self, engine: Engine, name: str = "adaflash-engine"):
        self.engine = engine
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False  # no new submissions
        self._dead = False  # the thread has exited (closed or failed)
        self._error: BaseException | None = None
        self._jobs: dict[int, _Job] = {}  # submitted to the engine, future not yet resolved
        self._seq = itertools.count()
        self.num_steps = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API
    @property
    def max_len(self) -> int:
        """Positions per KV slot: ``len(prompt) + max_new_tokens`` must not exceed it."""
        return self.engine.max_len

    @property
    def closed(self) -> bool:
        return self._closed or self._dead

    @property
    def error(self) -> BaseException | None:
        """The exception that stopped the engine thread, if any."""
        return self._error

    @property
    def num_pending(self) -> int:
        """Requests submitted and not yet finished (approximate when read from another thread)."""
        return len(self._jobs)

    def submit(self, prompt_ids, max_new_tokens: int, sampling: SamplingParams | None = None, *,
               on_token: Callable[[int], None] | None = None, **sampling_kwargs) -> RequestFuture:
        """Queue a request from any thread; returns a :class:`RequestFuture` of its :class:`EngineOutput`.

        ``on_token(token_id)`` (optional) is called on the engine thread for every committed token: keep
        it cheap (hand the token to a queue); if it raises, the request is cancelled and its future
        fails with that exception. Bad sampling parameters raise ``ValueError`` here; a request the
        engine can never fit fails the future with :class:`RequestRejected`.

            >>> fut = aengine.submit([1, 2, 3], 16, temperature=0.0)  # doctest: +SKIP
            >>> fut.result(timeout=60).token_ids  # doctest: +SKIP
        """
        if sampling is not None and sampling_kwargs:
            raise TypeError("pass either sampling=SamplingParams(...) or sampling keyword arguments, not both")
        prompt = [int(t) for t in (prompt_ids.tolist() if torch.is_tensor(prompt_ids) else prompt_ids)]
        params = sampling if sampling is not None else SamplingParams(**sampling_kwargs)
        fut = RequestFuture()
        job = _Job(prompt, int(max_new_tokens), params, on_token, fut)
        self._post(("submit", job))
        fut.add_done_callback(lambda f, job=job: self._post_cancel(job) if f.cancelled() else None)
        return fut

    def cancel(self, future: RequestFuture) -> None:
        """Stop a request at the next round boundary; its future resolves with ``finish_reason="cancelled"``
        (unless it finished first). Thread-safe; a no-op for a finished request."""
        job = getattr(future, "_adaflash_job", None)
        if job is not None and not future.done():
            self._post_cancel(job)

    async def generate(self, prompt_ids, max_new_tokens: int, sampling: SamplingParams | None = None,
                       **sampling_kwargs) -> EngineOutput:
        """Run one request to completion, batched with everything else in flight.

        Cancelling the awaiting task cancels the request (its slot is freed).

            >>> out = await aengine.generate([1, 2, 3], max_new_tokens=16)  # doctest: +SKIP
            >>> out.token_ids, out.finish_reason  # doctest: +SKIP
        """
        fut = self.submit(prompt_ids, max_new_tokens, sampling, **sampling_kwargs)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self.cancel(fut)
            raise

    def stream(self, prompt_ids, max_new_tokens: int, sampling: SamplingParams | None = None,
               **sampling_kwargs) -> TokenStream:
        """An async iterator of the request's new token ids as they are committed (call inside a running loop).

            >>> async for tok in aengine.stream([1, 2, 3], max_new_tokens=16):  # doctest: +SKIP
            ...     print(tok)

        The tokens yielded are exactly ``output.token_ids``; ``break`` (or cancelling the task)
        cancels the request. A rejected request raises :class:`RequestRejected` on the first ``__anext__``.
        """
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def put(item):
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # the loop is closed: the consumer is gone
                raise _ConsumerGone() from None

        fut = self.submit(prompt_ids, max_new_tokens, sampling, on_token=put, **sampling_kwargs)
        fut.add_done_callback(lambda f: _safe(put, _END))
        return TokenStream(self, fut, q)

    def close(self, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop accepting requests, then finish (``cancel=False``, the default) or cancel every pending one,
        and stop the engine thread. Idempotent; safe to call from any thread except the engine thread."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("AsyncEngine.close() called from the engine thread (an on_token callback?)")
        with self._lock:
            self._closed = True
            if not self._dead:
                self._cmds.put(("close", cancel))
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the engine thread did not stop within {timeout} s")

    async def aclose(self, cancel: bool = False) -> None:
        """:meth:`close` without blocking the event loop."""
        await asyncio.get_running_loop().run_in_executor(None, lambda: self.close(cancel))

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        self.close(cancel=exc_type is not None)

    # ------------------------------------------------------------------ caller side
    def _post(self, cmd) -> None:
        with self._lock:
            if self._dead and self._error is not None:
                raise EngineClosed(f"the engine thread failed: {type(self._error).__name__}: {self._error}") from self._error
            if self._closed or self._dead:
                raise EngineClosed("AsyncEngine is closed: no new requests")
            if cmd[0] == "submit":
                cmd[1].future._adaflash_job = cmd[1]
            self._cmds.put(cmd)

    def _post_cancel(self, job: _Job) -> None:
        with self._lock:
            if not self._dead:  # a closed engine still finishes (and so still cancels) what it holds
                self._cmds.put(("cancel", job))

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        eng = self.engine
        closing = False
        try:
            while True:
                # Take commands: block while there is nothing to step, else just drain what is there.
                block = eng.idle and not closing
                while True:
                    try:
                        cmd = self._cmds.get(block=block)
                    except queue.Empty:
                        break
                    block = False
                    kind, arg = cmd
                    if kind == "submit":
                        self._do_submit(arg)
                    elif kind == "cancel":
                        self._do_cancel(arg)
                    else:  # close
                        closing = True
                        if arg:
                            for job in list(self._jobs.values()):
                                self._do_cancel(job)
                if eng.idle:
                    if closing:
                        return
                    continue
                progressed = eng.step()
                self.num_steps += 1
                if not eng.healthy:  # the round failed as a whole: stop here, every caller gets EngineFailed
                    raise eng.failure
                self._resolve_done()
                if not progressed and not eng.idle:  # the engine cannot make progress: fail, do not spin
                    for job in list(self._jobs.values()):
                        job.handle.cancel()
                        self._fail_job(job, RuntimeError(
                            f"request {job.handle.request_id} cannot progress (engine made no progress)"))
        except BaseException as e:  # noqa: BLE001 - surfaced to every caller below
            self._error = e
            failure = EngineFailed(f"the engine thread failed: {type(e).__name__}: {e}")
            failure.__cause__ = e
            for job in list(self._jobs.values()):
                self._fail_job(job, failure)
        finally:
            with self._lock:
                self._dead = True
                leftovers = []
                while True:
                    try:
                        leftovers.append(self._cmds.get_nowait())
                    except queue.Empty:
                        break
            for kind, arg in leftovers:  # submissions that raced with close / a failure
                if kind == "submit":
                    exc = EngineClosed("AsyncEngine closed before the request started")
                    if self._error is not None:
                        exc = EngineFailed(f"the engine thread failed: {type(self._error).__name__}: {self._error}")
                    arg.future._mark_submitted(None, exc)
                    _set(arg.future, exception=exc)

    def _do_submit(self, job: _Job) -> None:
        fut = job.future
        if fut.cancelled():
            fut._mark_submitted(None, concurrent.futures.CancelledError())
            return
        user = job.on_token
        cb = None
        if user is not None:
            def cb(tok, job=job, user=user):
                if job.callback_error is not None:
                    return
                try:
                    user(tok)
                except BaseException as e:  # noqa: BLE001 - a consumer's bug must not break the engine
                    job.callback_error = e
                    job.handle.cancel()
        try:
            job.handle = self.engine.submit(job.prompt, job.max_new, job.params, on_token=cb)
        except (RequestRejected, ValueError, TypeError) as e:
            fut._mark_submitted(None, e)
            _set(fut, exception=e)
            return
        self._jobs[id(job)] = job
        fut._mark_submitted(job.handle.request_id)

    def _do_cancel(self, job: _Job) -> None:
        if job.handle is None or id(job) not in self._jobs:
            return
        job.handle.cancel()  # between steps: finishes at once and frees the slot
        if job.handle.done:
            self._resolve(job)

    def _resolve_done(self) -> None:
        for job in list(self._jobs.values()):
            if job.handle.done:
                self._resolve(job)

    def _resolve(self, job: _Job) -> None:
        self._jobs.pop(id(job), None)
        if job.callback_error is not None and not isinstance(job.callback_error, _ConsumerGone):
            _set(job.future, exception=job.callback_error)
        else:
            _set(job.future, result=job.handle.result())

    def _fail_job(self, job: _Job, exc: BaseException) -> None:
        self._jobs.pop(id(job), None)
        _set(job.future, exception=exc)


class _ConsumerGone(Exception):
    """Raised by a stream's token callback when its event loop is closed: the request is cancelled quietly."""


def _safe(fn, *args) -> None:
    try:
        fn(*args)
    except _ConsumerGone:
        pass


def _set(fut: concurrent.futures.Future, result=None, exception: BaseException | None = None) -> None:
    """Resolve ``fut`` unless the caller already cancelled it (then there is nobody to tell)."""
    try:
        if exception is not None:
            fut.set_exception(exception)
        else:
            fut.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass
