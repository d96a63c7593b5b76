"""AsyncEngine (issue 6): the engine on a background thread, asyncio generate / stream, sync futures,
cancellation that frees slots, close() that drains or cancels, errors surfaced instead of hangs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest
import torch

from adaflash_hf.engine import Engine, RequestRejected, SamplingParams
from adaflash_hf.serve import AsyncEngine, EngineClosed, EngineFailed

from generation_helpers import make_drafter, make_target

SLOTS, MAX_LEN = 3, 96


@pytest.fixture(scope="module")
def pair():
    target = make_target("qwen3", seed=0)
    return target, make_drafter(target, block_size=8)


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 126, (n,), generator=g).tolist() for n in lengths]


def _greedy(target, prompt, n):
    out = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n)
    return out[0, len(prompt):].tolist()


def _engine(pair, delay: float = 0.0, hook=None, **kw):
    """An engine; ``delay`` seconds per step keeps long requests alive long enough to cancel them."""
    target, drafter = pair

    def step_hook(info):
        if hook is not None:
            hook(info)
        if delay:
            time.sleep(delay)

    args = dict(drafter=drafter, length_policy="adaptive", max_slots=SLOTS, max_len=MAX_LEN, token_budget=64)
    args.update(kw)
    return Engine(target, step_hook=step_hook, **args)


def _wait(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


# ---------------------------------------------------------------- results
def test_generate_equals_engine_and_plain_greedy(pair):
    target, _ = pair
    prompts = _prompts([3, 7, 1, 5, 9], seed=1)
    expected = [o.token_ids for o in _engine(pair).generate(prompts, max_new_tokens=10)]
    assert expected == [_greedy(target, p, 10) for p in prompts]
    infos = []
    with AsyncEngine(_engine(pair, hook=infos.append)) as ae:
        async def main():
            return await asyncio.gather(*(ae.generate(p, 10) for p in prompts))

        outs = asyncio.run(main())
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" and o.prompt_ids == p for o, p in zip(outs, prompts))
    assert max(i.slots_in_use for i in infos) > 1  # the requests were batched, not run one by one


def test_sampled_request_equals_engine_with_same_seed(pair):
    prompt = _prompts([6], seed=2)[0]
    params = SamplingParams(temperature=1.0, top_k=20, seed=123)
    eng = _engine(pair)
    expected = eng.submit(prompt, 12, params).result().token_ids
    with AsyncEngine(_engine(pair)) as ae:
        got = asyncio.run(ae.generate(prompt, 12, params)).token_ids
        other = ae.submit(prompt, 12, temperature=1.0, top_k=20, seed=124).result(timeout=10).token_ids
    assert got == expected and other != expected  # the seed decides, per request


def test_stream_yields_exactly_the_final_tokens_in_order(pair):
    target, _ = pair
    prompt = _prompts([4], seed=3)[0]
    first_seen = threading.Event()
    steps = []

    def hold_after_first_round(info):  # the second round waits until the consumer has a token
        steps.append(info)
        if len(steps) == 2:
            first_seen.wait(5)

    with AsyncEngine(_engine(pair, hook=hold_after_first_round)) as ae:
        async def main():
            got, done_at_first = [], None
            stream = ae.stream(prompt, 16)
            async for tok in stream:
                if not got:
                    done_at_first = stream.future.done()
                    first_seen.set()
                got.append(tok)
            return got, done_at_first, stream.output

        got, done_at_first, out = asyncio.run(main())
    assert done_at_first is False  # the first token arrived while the request was still running
    assert got == out.token_ids == _greedy(target, prompt, 16)
    assert out.finish_reason == "length"


def test_concurrent_mixed_requests_from_threads_and_tasks(pair):
    """asyncio tasks (generate + stream) and plain threads (submit) at once: every output exact."""
    target, _ = pair
    prompts = _prompts([2, 6, 3, 8, 5, 4, 7], seed=4)
    refs = [_greedy(target, p, 9) for p in prompts]
    with AsyncEngine(_engine(pair)) as ae:
        pool = concurrent.futures.ThreadPoolExecutor(3)
        thread_futs = [pool.submit(lambda p=p: ae.submit(p, 9).result(timeout=20).token_ids) for p in prompts[:3]]

        async def streamed(p):
            return [t async for t in ae.stream(p, 9)]

        async def main():
            return await asyncio.gather(*(ae.generate(p, 9) for p in prompts[3:5]), *(streamed(p) for p in prompts[5:]))

        outs = asyncio.run(main())
        got = [f.result() for f in thread_futs] + [o.token_ids for o in outs[:2]] + outs[2:]
        pool.shutdown()
    assert got == refs


# ---------------------------------------------------------------- cancellation
def test_breaking_out_of_a_stream_cancels_and_frees_the_slot(pair):
    eng = _engine(pair, delay=0.01, drafter=None, length_policy=None)  # one token per step: steps count tokens
    prompt = _prompts([5], seed=5)[0]
    with AsyncEngine(eng) as ae:
        async def main():
            got = []
            async for tok in ae.stream(prompt, 80):  # no reference kept: leaving the loop drops the stream
                got.append(tok)
                if len(got) == 2:
                    break
            for _ in range(500):  # still inside the loop: the break itself must cancel
                if ae.num_pending == 0 and eng.cache.num_free == SLOTS:
                    break
                await asyncio.sleep(0.01)
            return got, ae.num_pending, eng.cache.num_free, ae.num_steps

        got, pending, free, steps = asyncio.run(main())
    assert len(got) == 2 and pending == 0 and free == SLOTS
    assert steps < 40  # stopped long before its 80 tokens

    with AsyncEngine(_engine(pair, delay=0.01)) as ae:  # `async with` + aclose keeps the partial output
        async def main2():
            n = 0
            async with ae.stream(prompt, 80) as s:
                async for _ in s:
                    n += 1
                    if n == 3:
                        break
            return await asyncio.wrap_future(s.future)

        out = asyncio.run(main2())
        assert out.finish_reason == "cancelled" and 3 <= len(out.token_ids) < 80


def test_cancelling_the_task_cancels_the_request(pair):
    eng = _engine(pair, delay=0.01, drafter=None, length_policy=None)
    with AsyncEngine(eng) as ae:
        async def main():
            task = asyncio.create_task(ae.generate(_prompts([4], seed=6)[0], 80))
            while eng.num_running == 0:
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(main())
        assert _wait(lambda: ae.num_pending == 0 and eng.cache.num_free == SLOTS and eng.idle)
        assert ae.num_steps < 40  # not run to its 80 tokens


def test_sync_cancel_running_and_queued(pair):
    eng = _engine(pair, delay=0.01, max_slots=1, drafter=None, length_policy=None)
    prompts = _prompts([3, 4], seed=7)
    with AsyncEngine(eng) as ae:
        running = ae.submit(prompts[0], 80)
        queued = ae.submit(prompts[1], 80)  # one slot: waits behind the first
        assert running.wait_submitted(5) == 0 and queued.wait_submitted(5) == 1
        assert _wait(lambda: eng.num_running == 1)
        ae.cancel(queued)
        out_q = queued.result(timeout=5)
        assert out_q.finish_reason == "cancelled" and out_q.token_ids == []
        assert running.cancel()  # Future.cancel() also stops the engine request
        assert running.cancelled()
        assert _wait(lambda: eng.idle and eng.cache.num_free == 1 and ae.num_pending == 0)
        assert ae.num_steps < 40  # not run to its 80 tokens
        after = ae.submit(prompts[1], 4).result(timeout=5)  # the slot is usable again
    assert after.finish_reason == "length" and len(after.token_ids) == 4


# ---------------------------------------------------------------- errors
def test_rejected_requests_raise_to_the_caller(pair):
    with AsyncEngine(_engine(pair)) as ae:
        too_long = list(range(MAX_LEN))
        fut = ae.submit(too_long, 4)
        with pytest.raises(RequestRejected, match="can never fit"):
            fut.wait_submitted(5)
        assert isinstance(fut.exception(timeout=5), RequestRejected)
        with pytest.raises(RequestRejected, match="can never fit"):
            asyncio.run(ae.generate(too_long, 4))

        async def consume():
            return [t async for t in ae.stream([1, 2], 0)]

        with pytest.raises(RequestRejected, match="max_new_tokens must be >= 1"):
            asyncio.run(consume())
        with pytest.raises(ValueError, match="top_p"):
            ae.submit([1, 2], 4, top_p=1.5)  # bad sampling parameters: raised at once, on the caller's thread
        assert ae.submit([1, 2], 3).result(timeout=5).finish_reason == "length"  # still serving


def test_failing_on_token_callback_fails_only_its_request(pair):
    def bad(tok):
        raise KeyError("consumer bug")

    with AsyncEngine(_engine(pair)) as ae:
        fut = ae.submit([1, 2, 3], 20, on_token=bad)
        ok = ae.submit([4, 5, 6], 20)
        with pytest.raises(KeyError, match="consumer bug"):
            fut.result(timeout=5)
        assert len(ok.result(timeout=5).token_ids) == 20


def test_engine_thread_failure_surfaces_instead_of_hanging(pair):
    calls = []

    def explode(info):
        calls.append(info)
        if len(calls) == 3:
            raise RuntimeError("kernel exploded")

    ae = AsyncEngine(_engine(pair, hook=explode))
    futs = [ae.submit(p, 30) for p in _prompts([3, 5], seed=8)]
    for f in futs:
        with pytest.raises(EngineFailed, match="kernel exploded") as info:
            f.result(timeout=5)
        assert isinstance(info.value.__cause__, RuntimeError)
    assert isinstance(ae.error, RuntimeError)
    with pytest.raises(EngineClosed, match="engine thread failed"):
        ae.submit([1, 2], 2)
    ae.close(timeout=5)  # does not hang on a dead thread


# ---------------------------------------------------------------- close
def test_close_drains_by_default(pair):
    ae = AsyncEngine(_engine(pair))
    futs = [ae.submit(p, 12) for p in _prompts([2, 3, 4, 5], seed=9)]
    t0 = time.monotonic()
    ae.close(timeout=10)
    assert time.monotonic() - t0 < 10
    assert all(f.done() and f.result().finish_reason == "length" and len(f.result().token_ids) == 12 for f in futs)
    with pytest.raises(EngineClosed, match="closed"):
        ae.submit([1], 1)
    ae.close()  # idempotent
    assert not ae._thread.is_alive()


def test_close_cancel_stops_long_requests(pair):
    eng = _engine(pair, delay=0.01)
    ae = AsyncEngine(eng)
    futs = [ae.submit(p, 80) for p in _prompts([2, 3, 4, 5], seed=10)]  # 3 run, 1 waits
    assert _wait(lambda: eng.num_running > 0)
    t0 = time.monotonic()
    ae.close(cancel=True, timeout=5)
    assert time.monotonic() - t0 < 2
    outs = [f.result(timeout=1) for f in futs]
    assert all(o.finish_reason == "cancelled" and len(o.token_ids) < 80 for o in outs)
    assert eng.idle and eng.cache.num_free == SLOTS
