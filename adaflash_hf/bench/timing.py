"""Timing one batch of one method: wall time, time to first token, the generated ids up to EOS."""

from __future__ import annotations

import time

import torch

from .methods import MethodOutput


class FirstTokenTimer:
    """A streamer that timestamps the first `put` after the prompt (generate puts the prompt first)."""

    def __init__(self, sync: bool):
        self.sync, self.puts, self.first = sync, 0, None

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            if self.sync:
                torch.cuda.synchronize()
            self.first = time.perf_counter()

    def end(self):
        pass


def trim(generated: torch.Tensor, eos_ids: set[int]) -> list[int]:
    """The generated ids up to and including the first EOS."""
    ids = generated.tolist()
    for j, t in enumerate(ids):
        if t in eos_ids:
            return ids[: j + 1]
    return ids


def as_output(ret) -> MethodOutput:
    if isinstance(ret, MethodOutput):
        return ret
    if isinstance(ret, tuple):
        return MethodOutput(ret[0], stats=ret[1] if len(ret) > 1 else None)
    if hasattr(ret, "sequences"):
        return MethodOutput(ret.sequences)
    return MethodOutput(ret)


def run_batch(method, ctx, ids, mask, eos_ids, seed, sync):
    """``(output, generated rows, wall seconds, time to first token or None)`` of one batch."""
    torch.manual_seed(seed)
    streamer = FirstTokenTimer(sync)
    if sync:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = as_output(method.run(ctx, ids, mask, streamer))
    if sync:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    p = ids.shape[1]
    rows = [trim(out.sequences[i, p:], eos_ids) for i in range(ids.shape[0])]
    ttft = (streamer.first - t0) if streamer.first is not None else None
    return out, rows, wall, ttft
