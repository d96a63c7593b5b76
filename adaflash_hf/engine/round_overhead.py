"""What an engine round costs beyond its forwards, timed end to end (for :func:`~.warmup.measure_round_cost`).

:func:`~.warmup.measure_round_cost` times the decode and drafter graphs alone; a real round also pays the host
(scheduling, packing, the verify lengths' and the acceptance's reads, launches) and device work outside those graphs
(a plain round stores the drafter's context). :func:`measure_overheads` runs real rounds of ``n`` requests on the
idle engine, a plain round (the drafter's body skipped, as the ``cost`` policy skips it) and a round that verifies
whole blocks, times each kind by wall clock over consecutive rounds (the device synchronised before and after only:
the host overlaps the device as it does in a run), subtracts what the measured graphs account for and keeps the
remainder, in the table's unit: :attr:`RoundCost.spec_overhead` and :attr:`RoundCost.plain_overhead`.
:func:`quiet` is how both this and :func:`~.warmup.warmup` borrow an engine without its sinks or counters seeing it.
"""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager

import torch

from ..speculation.policy import LengthPolicy
from ..speculation.round_cost import RoundCost
from .verify_lengths import PLAIN_PROBE_ROUNDS

__all__ = ["measure_overheads", "quiet"]

_SAVED = ("on_round", "on_request", "step_hook", "num_steps", "skipped_drafts", "host_syncs", "forward_tokens",
          "admission", "whole_rounds", "wide_rounds")
WHOLE = RoundCost.flat()  # a verify token costs nothing: the cost rule verifies every whole block
PLAIN = RoundCost.flat(spec_overhead=1e9)  # a drafting round costs forever: the cost rule decodes plainly


@contextmanager
def quiet(engine, **overrides):
    """``engine`` with no round sink, request sink or step hook, its counters and admission state restored after,
    and ``overrides`` (attribute: value) in force meanwhile.

    Example:
        >>> with quiet(engine, round_cost=RoundCost.flat()):  # doctest: +SKIP
        ...     engine.generate([[1, 2, 3]], max_new_tokens=4)
    """
    saved = {k: getattr(engine, k) for k in _SAVED + tuple(overrides)}
    engine.on_round = engine.on_request = engine.step_hook = None
    engine.forward_tokens, engine.admission = [], copy.deepcopy(engine.admission)
    for k, v in overrides.items():
        setattr(engine, k, v)
    try:
        yield engine
    finally:
        for k, v in saved.items():
            setattr(engine, k, v)


def _timed_rounds(engine, rounds: int, before=None) -> tuple[float, list[int]]:
    """Seconds per round of ``rounds`` consecutive engine rounds (graph captures inside subtracted; ``before()`` runs
    ahead of each) and each target forward's tokens."""
    graphs = [g for g in (engine.graphs, engine.draft_graphs) if g is not None]
    sync = (lambda: torch.cuda.synchronize(engine.device)) if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0, c0, f0 = time.perf_counter(), sum(g.capture_seconds for g in graphs), len(engine.forward_tokens)
    for _ in range(rounds):
        if before is not None:
            before()
        engine.step()
    sync()
    spent = time.perf_counter() - t0 - (sum(g.capture_seconds for g in graphs) - c0)
    return spent / rounds, engine.forward_tokens[f0:]


def _plain_round(engine, cost: RoundCost, base_s: float, n: int, reps: int) -> float:
    """Overhead of a plain round of ``n`` requests, per target forward: the cost rule's plain rounds skip the drafter's
    body until a probe (in steady plain text every ``PLAIN_PROBE_ROUNDS + 1``-th round), ``decode_steps`` of them
    behind one read (:mod:`.decode_steps`); ``reps`` engine steps, each as after a steady-state probe, are timed."""
    def after_a_probe():
        engine._plain_rounds, engine._plain_limit = 0, PLAIN_PROBE_ROUNDS

    engine.round_cost, engine._drafted_plain = PLAIN, True
    after_a_probe()
    engine.step()  # warm: the plain round's own buckets
    skipped = engine.skipped_drafts
    wall, tokens = _timed_rounds(engine, reps, before=after_a_probe)
    if engine.skipped_drafts - skipped != len(tokens) or set(tokens) != {n}:
        raise RuntimeError(f"measure_round_cost: the timed plain rounds were not plain ({tokens} tokens)")
    return wall * reps / len(tokens) / base_s - cost.verify_time(n, n)


def _drafting_round(engine, cost: RoundCost, base_s: float, n: int, reps: int) -> float:
    """Overhead of a round of ``n`` requests verifying whole blocks, in the engine's own layout."""
    B = engine.block_size
    engine.round_cost, engine._drafted_plain = WHOLE, False
    for _ in range(2):  # warm: the first round drafts afresh, the next takes the body chained behind its read
        engine.step()
    rounds = min(reps, (min(r.remaining for r in engine._running) - 1) // B)  # no request may finish inside
    if rounds < 1:
        raise ValueError("measure_round_cost: max_len leaves no room for a timed drafting round; lower context")
    wall, tokens = _timed_rounds(engine, rounds)
    return wall / base_s - sum(cost.verify_time(n, t) + cost.draft_time(n, B) for t in tokens) / rounds


def measure_overheads(engine, cost: RoundCost, base_s: float, context: int, reps: int) -> tuple[tuple, tuple]:
    """``(spec_overhead, plain_overhead)`` per entry of ``cost.rows``: the wall time of real rounds of that many
    requests, prompts of ``context`` tokens (fewer where ``max_len`` needs the room; in a short slot, fewer than ``reps``
    timed rounds), less the graph times ``cost`` gives (``base_s``: the seconds of its unit), in its unit, each at
    least 0 (a remainder below 0 is timing noise).
    Plain rounds are timed where the engine's layout can decode plainly (``packed``, ``rectangular``), else 0. The
    engine must be idle and is left idle; its sinks, counters, policy and cost are restored.

    Example:
        >>> spec, plain = measure_overheads(engine, cost, base_s=0.004, context=256, reps=5)  # doctest: +SKIP
    """
    B, vocab = engine.block_size, engine.target.get_input_embeddings().weight.shape[0]
    # prefill, warm-up and timed rounds of each kind (a plain one queues up to decode_steps steps)
    room = lambda rounds: engine.max_len - (rounds + 3) * (B + 1) - (rounds + 1) * engine.decode_steps  # noqa: E731
    while reps > 1 and room(reps) < 1:  # a short slot: fewer timed rounds rather than none
        reps -= 1
    prompt_len = min(context, engine.token_budget, room(reps))
    if prompt_len < 1:
        raise ValueError(f"measure_round_cost: max_len {engine.max_len} leaves no room for a prompt and a timed round "
                         f"of each kind at block {B} (it must exceed {4 * (B + 1) + 2 * engine.decode_steps})")
    plain_ok = engine.layout in ("packed", "rectangular")
    spec, plain = [], []
    # Drafting rounds are timed as the cost rule must assume them when it weighs lengths: reading their ratios
    # mid-round (whole-block stretches, which skip that read, off).
    with quiet(engine, policy=LengthPolicy.COST if plain_ok else engine.policy, length_min=1, draft_replay=None,
               round_cost=PLAIN, _drafted_plain=False, _plain_rounds=0, _plain_limit=0, whole_block_stretches=False):
        for n in cost.rows:
            handles = [engine.submit([(7 * i + j) % vocab for j in range(prompt_len)], engine.max_len - prompt_len)
                       for i in range(n)]
            try:
                while not all(h.token_ids for h in handles):  # prefill (rounds admitted before decode plainly)
                    engine.step()
                plain.append(_plain_round(engine, cost, base_s, n, reps) if plain_ok else 0.0)
                spec.append(_drafting_round(engine, cost, base_s, n, reps))
                if engine.num_running != n:
                    raise RuntimeError("measure_round_cost: a request ended inside the timed rounds")
            finally:
                for h in handles:
                    h.cancel()
    return tuple(max(v, 0.0) for v in spec), tuple(max(v, 0.0) for v in plain)
