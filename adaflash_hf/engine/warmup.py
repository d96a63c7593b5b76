"""Everything a workload compiles or captures, done before its first request (:meth:`.Engine.warmup`).

An engine captures a CUDA graph the first time a round needs a new bucket (tokens, tokens per
request, slot rows; for the drafter: context tokens, rows, draft width) and compiles its fused
functions on their first shapes. Left to the first requests, that puts seconds of captures into their
first tokens. :func:`workload_buckets` lists every bucket a workload of up to ``concurrency`` running
requests can reach (each request verifying 1 .. ``engine.max_q`` tokens: the block, wider under the prompt n-gram rule's ``max_width``; the drafted positions packed, slots ``0 .. concurrency - 1``,
prompts of the given lengths, those admitted in one round of one length); :func:`warmup` runs one short request per prompt length (the eager
prefill's compiles) and captures the rest. :func:`measure_round_cost` times the captured buckets and real rounds into the
engine's own :class:`~adaflash_hf.speculation.length.cost.RoundCost` (what the ``cost`` verify-length policy weighs).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Sequence

import torch

from ..speculation.length.cost import RoundCost
from .graphs import pick_bucket
from .round_overhead import measure_overheads, quiet
from .target import PackedLayout

__all__ = ["measure_round_cost", "monotone_table", "warmup", "workload_buckets"]


def _target_buckets(engine, concurrency: int) -> set[tuple]:
    g = engine.graphs
    most_q = 1 if engine.layout == "off" else engine.max_q  # near its end a request verifies fewer
    # verify rounds of greedy requests accept inside the replay (a graph of its own); rounds with prefills do not
    variants = [()] if engine.layout == "off" else [(), ("accept",)]
    out = set()
    for n in range(1, concurrency + 1):
        rows = {pick_bucket(g.row_buckets, m) for m in range(n, concurrency + 1)}  # highest slot in use + 1
        for q in range(1, most_q + 1):  # the round's longest verify; the others verify 1 .. q tokens
            totals = [n * q] if engine.layout == "rectangular" else range(q + n - 1, n * q + 1)
            for T in totals:
                if T <= g.token_buckets[-1]:
                    out |= {(pick_bucket(g.token_buckets, T), pick_bucket(g.q_buckets, q), Rb, *v) for Rb in rows
                            for v in variants}
        if engine.decode_steps > 1:
            out |= {(pick_bucket(g.token_buckets, n), 1, Rb, "greedy") for Rb in rows}
    return out


def _draft_buckets(engine, concurrency: int, prompt_lens: Sequence[int]) -> set[tuple]:
    d, B, Q = engine.draft_graphs, engine.block_size, engine.max_q
    out = set()
    for n in range(1, concurrency + 1):
        Rb = pick_bucket(d.row_buckets, n)
        # new context per request: its accepted tokens + 1 (1 .. max_q), or, just admitted, its prompt's features
        spans = [(n, n * Q)] + [(j * L + n - j, j * L + (n - j) * Q) for L in prompt_lens for j in range(1, n + 1)]
        for lo, hi in spans:
            for C in range(lo, min(hi, d.ctx_buckets[-1]) + 1):
                Cb = pick_bucket(d.ctx_buckets, C)
                out |= {("body", Cb, Rb), ("body", Cb, 0)}
    if engine.layout != "off":  # the next round's body, queued before the read (DraftGraphs.run_chain)
        out |= {d.chain_bucket(n) for n in range(1, concurrency + 1)} - {None}
    most = pick_bucket(d.pos_buckets, concurrency * (B - 1))  # drafted positions, packed: 1 .. B - 1 per request
    return out | {("head", Pb) for Pb in d.pos_buckets if Pb <= most}


def workload_buckets(engine, concurrency: int = 1, prompt_lens: Sequence[int] = ()) -> dict[str, set[tuple]]:
    """The graph buckets of the target (``"target"``) and drafter (``"drafter"``) runners that rounds of
    up to ``concurrency`` running requests with prompts of ``prompt_lens`` tokens can use."""
    if not 1 <= concurrency <= engine.max_slots:
        raise ValueError(f"concurrency must be in [1, max_slots={engine.max_slots}], got {concurrency}")
    longest = min(engine.token_budget, engine.max_len - 1)
    if any(not 1 <= L <= longest for L in prompt_lens):
        raise ValueError(f"prompt lengths must be in [1, {longest}] (token_budget, max_len - 1), got {list(prompt_lens)}")
    out = {"target": set(), "drafter": set()}
    if engine.graphs is not None:
        out["target"] = _target_buckets(engine, concurrency)
    if engine.draft_graphs is not None:
        out["drafter"] = _draft_buckets(engine, concurrency, prompt_lens)
    return out


def warmup(engine, concurrency: int = 1, prompt_lens: Sequence[int] = ()) -> float:
    """Compile and capture what the workload needs now; returns the seconds it took. The engine must be
    idle. Round sinks, step hooks and the engine's counters see nothing of it."""
    if not engine.idle:
        raise RuntimeError("warmup() needs an idle engine (no running or queued request)")
    buckets = workload_buckets(engine, concurrency, prompt_lens)
    t0 = time.perf_counter()
    with quiet(engine):
        vocab = engine.target.get_input_embeddings().weight.shape[0]
        for L in sorted(set(prompt_lens)):  # the eager prefill at this length, and a first round after it
            engine.generate([[i % vocab for i in range(L)]], max_new_tokens=min(2, engine.max_len - L))
        if engine.graphs is not None:
            engine.graphs.precapture(sorted(buckets["target"], key=str))
        if engine.draft_graphs is not None:
            engine.draft_graphs.precapture(sorted(buckets["drafter"], key=str))
    return time.perf_counter() - t0


def _time_replays(runner, bucket: tuple, device, reps: int) -> float:
    """Median seconds of one replay of ``bucket`` on ``runner`` (its inputs prepared), after one untimed replay."""
    runner.replay(bucket)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            runner.replay(bucket)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            runner.replay(bucket)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def monotone_table(ms) -> list[list[float]]:
    """``ms`` (rows x tokens per row, both ascending) with each entry lowered to the least of it and every entry at as
    many or more rows and tokens: a verify cannot cost more than a larger one, so an entry above a larger shape's is a
    timing spike (a GPU's noise is mostly upward), and a rule that believed it would find a larger verify cheaper.

    Example:
        >>> monotone_table([[1.0, 3.4], [2.0, 2.1]])
        [[1.0, 2.1], [2.0, 2.1]]
    """
    out = [list(map(float, r)) for r in ms]
    for i in reversed(range(len(out))):
        for j in reversed(range(len(out[i]))):
            if i + 1 < len(out):
                out[i][j] = min(out[i][j], out[i + 1][j])
            if j + 1 < len(out[i]):
                out[i][j] = min(out[i][j], out[i][j + 1])
    return out


def measure_round_cost(engine, rows: Sequence[int] | None = None, tokens_per_row: Sequence[int] | None = None,
                       context: int = 256, reps: int = 5) -> RoundCost:
    """This engine's own :class:`RoundCost`: its decode forward (the CUDA graph of each bucket; eager off CUDA) timed
    for ``rows`` requests x ``tokens_per_row`` tokens each over ``context`` cached tokens (CUDA events), the
    drafter's body + head at each row count against the whole-block verify (the median ratio is ``draft_fraction``;
    the table made monotone: :func:`monotone_table`),
    and, at each row count, real engine rounds timed end to end, a plain one and one verifying whole blocks (with and
    without the mid-round read of its ratios), less what those graphs account for: the overheads
    (:func:`.round_overhead.measure_overheads`, ``reps`` rounds each).
    Needs an idle engine with the graph path (``cuda_graphs`` on); what it borrows is freed after. Defaults:
    powers of two up to ``max_slots`` and the block size. Pass the result as ``EngineConfig(round_cost=...)`` or set
    ``engine.round_cost``.

    Example:
        >>> engine.round_cost = measure_round_cost(engine)  # doctest: +SKIP
    """
    if not engine.idle or engine.graphs is None or engine.draft_graphs is None:
        raise RuntimeError("measure_round_cost needs an idle engine with a drafter on the graph path (cuda_graphs on)")
    B, g, d = engine.block_size, engine.graphs, engine.draft_graphs
    most = g.token_buckets[-1]  # tokens one decode forward may carry: every row count is also timed at a whole block
    rows = sorted(set(rows or [r for r in (1, 2, 4, 8, 16, 32, 64, 128, 256) if r <= engine.max_slots and r * B <= most]))
    tokens_per_row = sorted(set(tokens_per_row or [q for q in (1, 2, 4, 8, 16, 32) if q <= B]))
    if not rows or rows[0] < 1 or rows[-1] > engine.max_slots or not 1 <= tokens_per_row[0] <= tokens_per_row[-1] <= B \
            or rows[-1] * B > most:
        raise ValueError(f"rows must be in [1, max_slots={engine.max_slots}] with rows x block {B} <= {most} tokens, "
                         f"tokens_per_row in [1, {B}]; got rows {rows}, tokens_per_row {tokens_per_row}")
    if not 0 < context <= engine.max_len - 2 * B:
        raise ValueError(f"context must be in [1, max_len - 2 * block = {engine.max_len - 2 * B}], got {context}")
    slots = [engine.cache.alloc() for _ in range(rows[-1])]
    try:
        for s in slots:
            engine.cache.advance(s, context)
            engine.dcache.alloc(s)
            engine.dcache.advance(s, context)
        ms, fractions = [], []
        feat = d.feats.shape[1]
        for n in rows:
            row = []
            for q in tokens_per_row:
                layout = PackedLayout.from_cache(engine.cache, slots[:n], [q] * n)
                row.append(_time_replays(g, g.prepare([0] * (n * q), layout), engine.device, reps))
            ms.append(row)
            body = d.prepare(slots[:n], [torch.zeros(B // 2, feat, dtype=d.feats.dtype, device=engine.device)] * n, [0] * n)
            drafter_s = _time_replays(d, body, engine.device, reps)
            d._rows = body[2]
            d.run_head([B - 1] * n)  # fills the head's inputs for the whole width
            drafter_s += _time_replays(d, ("head", pick_bucket(d.pos_buckets, n * (B - 1))), engine.device, reps)
            whole = _time_replays(g, g.prepare([0] * (n * B), PackedLayout.from_cache(engine.cache, slots[:n], [B] * n)),
                                  engine.device, reps)
            fractions.append(drafter_s / whole)
    finally:
        for s in slots:
            engine.cache.free(s)
            engine.dcache.free(s)
    ms = monotone_table(ms)
    cost = RoundCost.from_ms(rows, tokens_per_row, ms, draft_fraction=statistics.median(fractions))
    spec, plain, read = measure_overheads(engine, cost, ms[0][0], context, reps)
    return dataclasses.replace(cost, spec_overhead=spec, plain_overhead=plain, read_overhead=read, unit_ms=ms[0][0] * 1e3)
