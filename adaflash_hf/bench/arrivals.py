"""Open-loop arrivals: requests reach an engine at Poisson times whatever it has finished, at most ``concurrency``
in it at once (a server with that many slots; the others wait, and their wait counts in their latency).

:func:`poisson_arrivals` draws the times, :func:`run_open_loop` drives an :class:`adaflash_hf.engine.Engine`
through them step by step and reports mean latency (arrival to last token), mean time to first token and tok/s.

Example:
    >>> times = poisson_arrivals(4, rate=2.0, seed=0)
    >>> len(times), times == sorted(times), times[0] > 0
    (4, True, True)
    >>> stats = run_open_loop(engine, prompts, 64, times, concurrency=8)  # doctest: +SKIP
"""

from __future__ import annotations

import math
import random
import time
from collections import deque

__all__ = ["poisson_arrivals", "run_open_loop"]


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """``n`` arrival times (seconds from the start) of a Poisson process of ``rate`` requests per second."""
    if n < 1 or not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"need n >= 1 and a finite rate > 0, got n={n}, rate={rate}")
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def run_open_loop(engine, prompts, max_new_tokens: int, arrivals: list[float], concurrency: int,
                  eos_token_id=None, clock=time.perf_counter, sync=lambda: None) -> dict:
    """Submit ``prompts[i]`` (greedy) at ``arrivals[i]`` seconds, or later while ``concurrency`` requests are in the
    engine, stepping it in between (sleeping while it idles). ``sync``: waits for the device before a time is read
    (a request is done when the host has its last token, so this matters only for the end of the run).

    Returns ``latency_s`` (mean over requests: arrival to the step that gave the last token), ``ttft_s`` (mean,
    arrival to the first token), ``tok_per_s`` (every new token over first arrival to last finish), ``span_s``,
    ``offered_rate`` (requests per second, as drawn), ``outputs``, and per request ``submitted_s`` / ``done_s``
    (seconds from the start; in prompt order).
    """
    if len(prompts) != len(arrivals) or not prompts:
        raise ValueError(f"need one arrival time per prompt, got {len(prompts)} prompts and {len(arrivals)} times")
    if concurrency < 1 or any(b < a for a, b in zip(arrivals, arrivals[1:])):
        raise ValueError("concurrency must be >= 1 and the arrival times non-decreasing")
    waiting, live, handles = deque(range(len(prompts))), {}, [None] * len(prompts)
    first, done, submitted = [None] * len(prompts), [None] * len(prompts), [None] * len(prompts)
    t0 = clock()
    while waiting or live:
        now = clock() - t0
        while waiting and arrivals[waiting[0]] <= now and len(live) < concurrency:
            i = waiting.popleft()
            submitted[i] = now
            live[i] = handles[i] = engine.submit(prompts[i], max_new_tokens, eos_token_id=eos_token_id)
        if not live:
            time.sleep(max(0.0, arrivals[waiting[0]] - now))
            continue
        engine.step()
        sync()
        now = clock() - t0
        for i, h in list(live.items()):
            if first[i] is None and h.token_ids:
                first[i] = now
            if h.done:  # a request that failed before its first token: its first is its end
                done[i], first[i] = now, first[i] if first[i] is not None else now
                del live[i]
    outs = [h.result() for h in handles]
    tokens = sum(len(o.token_ids) for o in outs)
    span = max(done) - arrivals[0]
    n = len(prompts)
    return {"latency_s": sum(d - a for d, a in zip(done, arrivals)) / n, "ttft_s": sum(f - a for f, a in zip(first, arrivals)) / n,
            "tok_per_s": tokens / max(span, 1e-9), "span_s": span, "offered_rate": n / max(arrivals[-1], 1e-9),
            "outputs": outs, "submitted_s": submitted, "done_s": done}
