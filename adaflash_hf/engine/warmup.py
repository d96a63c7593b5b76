"""Everything a workload compiles or captures, done before its first request (:meth:`.Engine.warmup`).

An engine captures a CUDA graph the first time a round needs a new bucket (tokens, tokens per
request, slot rows; for the drafter: context tokens, rows, draft width) and compiles its fused
functions on their first shapes. Left to the first requests, that puts seconds of captures into their
first tokens. :func:`workload_buckets` lists every bucket a workload of up to ``concurrency`` running
requests can reach (each request verifying 1 .. block size tokens, the drafted positions packed, slots ``0 .. concurrency - 1``,
prompts of the given lengths, those admitted in one round of one length); :func:`warmup` runs one short request per prompt length (the eager
prefill's compiles) and captures the rest.
"""

from __future__ import annotations

import copy
import time
from typing import Sequence

from .graphs import pick_bucket

__all__ = ["warmup", "workload_buckets"]


def _target_buckets(engine, concurrency: int) -> set[tuple]:
    g = engine.graphs
    most_q = 1 if engine.layout == "off" else engine.block_size  # near its end a request verifies fewer
    out = set()
    for n in range(1, concurrency + 1):
        rows = {pick_bucket(g.row_buckets, m) for m in range(n, concurrency + 1)}  # highest slot in use + 1
        for q in range(1, most_q + 1):  # the round's longest verify; the others verify 1 .. q tokens
            totals = [n * q] if engine.layout == "rectangular" else range(q + n - 1, n * q + 1)
            for T in totals:
                if T <= g.token_buckets[-1]:
                    out |= {(pick_bucket(g.token_buckets, T), pick_bucket(g.q_buckets, q), Rb) for Rb in rows}
        if engine.decode_steps > 1:
            out |= {(pick_bucket(g.token_buckets, n), 1, Rb, "greedy") for Rb in rows}
    return out


def _draft_buckets(engine, concurrency: int, prompt_lens: Sequence[int]) -> set[tuple]:
    d, B = engine.draft_graphs, engine.block_size
    out = set()
    for n in range(1, concurrency + 1):
        Rb = pick_bucket(d.row_buckets, n)
        # new context per request: its accepted tokens + 1 (1 .. B), or, just admitted, its prompt's features
        spans = [(n, n * B)] + [(j * L + n - j, j * L + (n - j) * B) for L in prompt_lens for j in range(1, n + 1)]
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
    saved = {k: getattr(engine, k) for k in ("on_round", "on_request", "step_hook", "num_steps", "skipped_drafts",
                                               "host_syncs", "forward_tokens", "admission")}
    engine.on_round = engine.on_request = engine.step_hook = None
    engine.forward_tokens, engine.admission = [], copy.deepcopy(engine.admission)
    try:
        vocab = engine.target.get_input_embeddings().weight.shape[0]
        for L in sorted(set(prompt_lens)):  # the eager prefill at this length, and a first round after it
            engine.generate([[i % vocab for i in range(L)]], max_new_tokens=min(2, engine.max_len - L))
        if engine.graphs is not None:
            engine.graphs.precapture(sorted(buckets["target"], key=str))
        if engine.draft_graphs is not None:
            engine.draft_graphs.precapture(sorted(buckets["drafter"], key=str))
    finally:
        for k, v in saved.items():
            setattr(engine, k, v)
    return time.perf_counter() - t0
