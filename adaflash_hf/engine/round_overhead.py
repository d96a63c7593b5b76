"""What an engine round costs beyond its forwards, timed end to end (for :func:`~.warmup.measure_round_cost`).

:func:`~.warmup.measure_round_cost` times the decode and drafter graphs alone; a real round also pays the host
(scheduling, packing, the verify lengths' and the acceptance's reads, launches) and device work outside those graphs
(a plain round stores the drafter's context). :func:`measure_overheads` runs real rounds of ``n`` requests on the
idle engine, a plain round (the drafter's body skipped, as the ``cost`` policy skips it) and a round that verifies
whole blocks, reading its ratios mid-round as the rule's packed rounds do, times each kind by wall clock over
consecutive rounds (the device synchronised before and after only: the host overlaps the device as it does in a
run), subtracts what the measured graphs account for and keeps the remainder, in the table's unit:
:attr:`RoundCost.spec_overhead` and :attr:`RoundCost.plain_overhead`. In the packed layout the whole-block rounds are
timed again as whole-block stretches (no mid-round read): what they save is :attr:`RoundCost.read_overhead`.
:func:`quiet` is how both this and :func:`~.warmup.warmup` borrow an engine without its sinks or counters seeing it.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from contextlib import contextmanager

import torch

from ..speculation.length import LengthPolicy, RoundCost
from ..speculation.length.planner import PLAIN_PROBE_ROUNDS
from .round_drafts import OWN_DRAFTS

__all__ = ["measure_overheads", "measure_room", "quiet"]

_SAVED = ("on_round", "on_request", "step_hook", "num_steps", "skipped_drafts", "host_syncs", "forward_tokens",
          "admission", "whole_rounds", "wide_rounds")
WHOLE = RoundCost.flat()  # a verify token costs nothing: the cost rule verifies every whole block
PLAIN = RoundCost.flat(spec_overhead=1e9)  # a drafting round costs forever: the cost rule decodes plainly


@contextmanager
def quiet(engine, **overrides):
    """``engine`` with no round sink, request sink or step hook, its counters, admission state and verify-length
    planner restored after (the rounds run meanwhile teach its planner nothing), and ``overrides`` (engine attribute:
    value) in force meanwhile.

    Example:
        >>> with quiet(engine, draft_source=OWN_DRAFTS):  # doctest: +SKIP
        ...     engine.generate([[1, 2, 3]], max_new_tokens=4)
    """
    saved = {k: getattr(engine, k) for k in _SAVED + ("planner",) + tuple(overrides)}
    engine.on_round = engine.on_request = engine.step_hook = None
    engine.forward_tokens, engine.admission = [], copy.deepcopy(engine.admission)
    engine.planner = copy.copy(engine.planner)
    for k, v in overrides.items():
        setattr(engine, k, v)
    try:
        yield engine
    finally:
        for k, v in saved.items():
            setattr(engine, k, v)


def measure_room(block_size: int, decode_steps: int, packed: bool = True, reps: int = 1) -> int:
    """Tokens each request's slot needs beyond its prompt for :func:`measure_overheads`' rounds: its prefill token, the
    warm-up and ``reps`` timed rounds of each drafting kind (two where the layout is ``packed``: with and without the
    mid-round read), each committing up to a block and a bonus, and those of the plain kind (``decode_steps`` each).

    Example:
        >>> measure_room(16, 8)
        119
    """
    return 1 + (2 if packed else 1) * (reps + 2) * (block_size + 1) + (reps + 1) * decode_steps


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
    body until a probe (in steady plain text at least ``PLAIN_PROBE_ROUNDS`` rounds apart), ``decode_steps`` of them
    behind one read (:mod:`.decode_steps`); ``reps`` engine steps, each as after a steady-state probe, are timed (the
    probes' own time is the drafting rounds')."""
    planner = engine.planner

    def after_a_probe():
        planner.plain_rounds, planner.plain_limit = 0, PLAIN_PROBE_ROUNDS

    planner.round_cost, planner.drafted_plain = PLAIN, True
    after_a_probe()
    engine.step()  # warm: the plain round's own buckets
    skipped = engine.skipped_drafts
    wall, tokens = _timed_rounds(engine, reps, before=after_a_probe)
    if engine.skipped_drafts - skipped != len(tokens) or set(tokens) != {n}:
        raise RuntimeError(f"measure_round_cost: the timed plain rounds were not plain ({tokens} tokens)")
    return wall * reps / len(tokens) / base_s - cost.verify_time(n, n)


def _drafting_round(engine, cost: RoundCost, base_s: float, n: int, reps: int, stretches: bool) -> float:
    """Overhead of a round of ``n`` requests verifying whole blocks, in the engine's own layout: reading its ratios
    mid-round, or as a whole-block stretch (``stretches``: every timed round must be one)."""
    B = engine.block_size
    planner = engine.planner
    planner.round_cost, planner.drafted_plain, planner.whole_block_stretches = WHOLE, False, stretches
    for _ in range(2):  # warm: the first round drafts afresh, the next takes the body chained behind its read
        engine.step()
    rounds = min(reps, (min(r.remaining for r in engine._running) - 1) // B)  # no request may finish inside
    if rounds < 1:
        raise ValueError("measure_round_cost: max_len leaves no room for a timed drafting round; lower context")
    whole = engine.whole_rounds
    wall, tokens = _timed_rounds(engine, rounds)
    if engine.whole_rounds - whole != (rounds if stretches else 0):
        raise RuntimeError(f"measure_round_cost: {engine.whole_rounds - whole} of {rounds} timed rounds were whole-block "
                           f"stretches, expected {rounds if stretches else 0}")
    return wall / base_s - sum(cost.verify_time(n, t) + cost.draft_time(n, B) for t in tokens) / rounds


def measure_overheads(engine, cost: RoundCost, base_s: float, context: int, reps: int) -> tuple[tuple, tuple, tuple]:
    """``(spec_overhead, plain_overhead, read_overhead)`` per entry of ``cost.rows``: the wall time of real rounds of
    that many requests, prompts of ``context`` tokens (fewer where ``max_len`` needs the room; in a short slot, fewer
    than ``reps`` timed rounds), less the graph times ``cost`` gives (``base_s``: the seconds of its unit), in its unit,
    each at least 0 (a remainder below 0 is timing noise); the read's, what a whole-block stretch saves against the
    drafting round, at most that round's overhead.
    Plain rounds are timed where the engine's layout can decode plainly (``packed``, ``rectangular``), stretches
    where it has them (``packed``), else 0. The engine must be idle and is left idle; its sinks, counters, policy and
    cost are restored.

    Example:
        >>> spec, plain, read = measure_overheads(engine, cost, base_s=0.004, context=256, reps=5)  # doctest: +SKIP
    """
    B, vocab = engine.block_size, engine.target.get_input_embeddings().weight.shape[0]
    plain_ok, kinds = engine.layout in ("packed", "rectangular"), 2 if engine.layout == "packed" else 1
    room = lambda rounds: engine.max_len - measure_room(B, engine.decode_steps, kinds == 2, rounds)  # noqa: E731
    while reps > 1 and room(reps) < 1:  # a short slot: fewer timed rounds rather than none
        reps -= 1
    prompt_len = min(context, engine.token_budget, room(reps))
    if prompt_len < 1:
        raise ValueError(f"measure_round_cost: max_len {engine.max_len} leaves no room for a prompt and a timed round "
                         f"of each kind at block {B} (it must exceed {measure_room(B, engine.decode_steps, kinds == 2)})")
    spec, plain, unread = [], [], []
    # Drafting rounds are timed as the cost rule must assume them when it weighs lengths (reading their ratios
    # mid-round), then as whole-block stretches (skipping that read).
    with quiet(engine, draft_source=OWN_DRAFTS):
        planner = engine.planner  # the copy quiet lends
        policy = LengthPolicy.COST if plain_ok else planner.policy
        planner.settings = dataclasses.replace(planner.settings, policy=policy, min_len=1)
        planner.round_cost, planner.whole_block_stretches = PLAIN, False
        planner.reset()
        for n in cost.rows:
            handles = [engine.submit([(7 * i + j) % vocab for j in range(prompt_len)], engine.max_len - prompt_len)
                       for i in range(n)]
            try:
                while not all(h.token_ids for h in handles):  # prefill (rounds admitted before decode plainly)
                    engine.step()
                plain.append(_plain_round(engine, cost, base_s, n, reps) if plain_ok else 0.0)
                spec.append(_drafting_round(engine, cost, base_s, n, reps, stretches=False))
                unread.append(_drafting_round(engine, cost, base_s, n, reps, stretches=True) if kinds == 2 else spec[-1])
                if engine.num_running != n:
                    raise RuntimeError("measure_round_cost: a request ended inside the timed rounds")
            finally:
                for h in handles:
                    h.cancel()
    spec = tuple(max(v, 0.0) for v in spec)
    read = tuple(min(max(s - u, 0.0), s) for s, u in zip(spec, unread))
    return spec, tuple(max(v, 0.0) for v in plain), read
