"""`speculation.capture.capturing`: what must hold around a CUDA graph capture (the lock, and no garbage collection)."""

import gc
import threading

import pytest

from adaflash_hf.speculation.capture import CAPTURE_LOCK, capturing


class _Cycle:
    freed = 0

    def __init__(self):
        self.me = self  # only a collection frees it (as an engine's graphs held in a reference cycle)

    def __del__(self):
        _Cycle.freed += 1


def _allocate_past_the_collection_threshold():
    return [[] for _ in range(20 * gc.get_threshold()[0])]


def test_no_collection_inside_a_capture():
    gc.collect()
    _Cycle.freed = 0
    _Cycle()
    _allocate_past_the_collection_threshold()
    assert _Cycle.freed == 1  # control: outside a capture, allocating collects the cycle
    with capturing():
        _Cycle()
        _allocate_past_the_collection_threshold()
        assert _Cycle.freed == 1  # inside: nothing is freed until the capture ends
    gc.collect()
    assert _Cycle.freed == 2


@pytest.mark.parametrize("enabled_before", [True, False])
def test_collector_state_is_restored(enabled_before):
    (gc.enable if enabled_before else gc.disable)()
    try:
        with capturing():
            assert not gc.isenabled()
        assert gc.isenabled() == enabled_before
        with pytest.raises(RuntimeError):
            with capturing():
                raise RuntimeError("a failed capture")
        assert gc.isenabled() == enabled_before  # restored after a failure too
    finally:
        gc.enable()


def test_capturing_holds_the_capture_lock():
    took = []
    with capturing():
        t = threading.Thread(target=lambda: took.append(CAPTURE_LOCK.acquire(timeout=0.1)))
        t.start()
        t.join()
    assert took == [False]  # another thread cannot take it during a capture
    assert CAPTURE_LOCK.acquire(timeout=1)  # and can after (released)
    CAPTURE_LOCK.release()
