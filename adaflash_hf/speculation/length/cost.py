"""What one speculative round costs, for the cost-aware verify length (:func:`.rules.cost_aware_verify_length`).

A round of ``n`` requests sends ``T`` packed tokens to the target (each request its bonus token plus the drafts it
verifies) and, when anything is drafted, runs the drafter once for all of them. :class:`RoundCost` gives both
times in units of **one plain decode step of one request** (the target forward of 1 token at batch 1), so the
model is free of the GPU's and the model's absolute speed: only the shape of the curve matters to the rule.

The default is a measured table (Qwen3-8B-shaped target on one GPU, CUDA graphs, flex attention):
verify time per (requests, tokens per request), interpolated piecewise linearly in both (linear past the
largest measured point, flat below the smallest). The drafter's round is ``draft_fraction`` of the target's
whole-block verify at the same batch: its body runs every block position of every request through its few
layers, like a whole-block verify through as many target layers (5 of 36 for the z-lab shape), plus its LM head;
0.2 matches a ~1.3 ms drafter against a ~6.5 ms round at batch 1 on that shape.

A round also costs time outside its forwards: the host's scheduling, packing, device reads and launches, and device
work the graph timings do not see (keeping the target's features for the drafter in a plain round, storing them when
drafting resumes). :class:`RoundCost` carries it as
a per-round **overhead** by row count, one for a round that drafts (``spec_overhead``) and one for a round that
decodes plainly (``plain_overhead``), in the same unit. A cost per round that the model ignores makes the rule
undervalue a longer verify against the whole round, and misjudge when plain decoding is faster (a tiny pair's
drafting round can cost many plain steps of wall time where its graph times say little more than one).

Part of a drafting round's overhead is the read of the length head's ratios between the drafter's body and its LM
head: the host waits for the device, chooses the lengths, packs the verify, and the device idles meanwhile. A round
that verifies every request's whole block need not wait (the engine's whole-block stretches read the ratios with the
round's one read at its end, as ``fixed`` rounds do), so it saves that part, :attr:`RoundCost.read_overhead`: the
cost rule weighs it when it decides a round before drafting (``unread_whole`` of
:func:`.rules.cost_aware_verify_length`), not once the ratios are read (then it is spent).
The default table's overheads were measured by replay on the same GPU (``SPEC_H200_OVERHEAD_MS``); the engine
measures its own (:func:`~adaflash_hf.engine.warmup.measure_round_cost`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["RoundCost", "SPEC_H200_MS", "SPEC_H200_OVERHEAD_MS", "SPEC_ROWS", "SPEC_TOKENS_PER_ROW", "SPEC_UNITS"]

SPEC_ROWS = (1, 16, 32, 64, 128)
SPEC_TOKENS_PER_ROW = (1, 2, 4, 8, 16)
SPEC_H200_MS = (  # flex attention: ms of one verify forward, rows x tokens per row
    (6.0, 6.1, 6.6, 6.8, 7.1),
    (7.4, 7.6, 7.8, 8.5, 11.3),
    (8.4, 8.6, 9.2, 11.5, 18.8),
    (9.2, 9.9, 11.9, 18.4, 33.6),
    (12.3, 14.3, 20.4, 34.3, 66.7),
)
SPEC_UNITS = tuple(tuple(v / SPEC_H200_MS[0][0] for v in r) for r in SPEC_H200_MS)
# ms per round beyond the forwards at SPEC_ROWS, from an acceptance replay (8B shape, CUDA graphs;
# examples/reference_pair/round_overhead_from_replay.py): wall time of a
# full-batch round less the measured graph times. "spec": packed rounds that draft (median of the three traces; 16
# rows interpolated between the measured 8 and 32); "plain": the `off` engine's rounds; "read": the packed drafting
# round's gap less the `fixed` round's at the same rows (0.88, 0.77, 2.26, 4.49, 4.78 ms at c = 1, 8, 32, 64, 128;
# 16 interpolated), at least 0: what reading the ratios mid-round (and the packed path's host work) costs a round
# against one that verifies whole blocks without the read. An estimate from that replay, not a timing of the read.
SPEC_H200_OVERHEAD_MS = {"spec": (2.26, 2.17, 2.77, 2.68, 3.53), "plain": (0.0, 0.09, 0.15, 0.23, 0.46),
                         "read": (1.38, 0.90, 0.51, 0.0, 0.0)}


FAR = 1e6  # the grids are extended to FAR times their last point (``_extend``)


def _extend(xs: np.ndarray, ys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``xs, ys`` (``ys`` along its last axis) with one far point past the measured end, so that ``np.interp`` (flat
    outside its grid) is linear there: a table never caps the cost of a shape larger than it measured. The slope is
    the last segment's or, where it is smaller, the whole grid's (a measured last step that falls, timing noise,
    would make a larger shape cheaper, and far enough out negative), never below flat. Below the first point it
    stays flat."""
    if len(xs) == 1:
        return np.array([xs[0], xs[0] * FAR]), np.stack([ys[..., 0], ys[..., 0]], axis=-1)
    x_far = xs[-1] * FAR
    last = (ys[..., -1] - ys[..., -2]) / (xs[-1] - xs[-2])
    whole = (ys[..., -1] - ys[..., 0]) / (xs[-1] - xs[0])
    slope = np.maximum(np.maximum(last, whole), 0.0)
    return np.append(xs, x_far), np.concatenate([ys, (ys[..., -1] + slope * (x_far - xs[-1]))[..., None]], axis=-1)


def _by_rows(name: str, value, rows: tuple) -> tuple:
    """``value`` (one number, or one per entry of ``rows``) as a tuple of ``len(rows)`` floats, each finite and >= 0."""
    vals = tuple(float(v) for v in (value if isinstance(value, (tuple, list, np.ndarray)) else (value,)))
    if len(vals) == 1:
        vals = vals * len(rows)
    if len(vals) != len(rows) or any(not (math.isfinite(v) and v >= 0) for v in vals):
        raise ValueError(f"RoundCost.{name} must be one number or {len(rows)} (one per rows entry), each finite and "
                         f">= 0, got {value}")
    return vals


@dataclass(frozen=True)
class RoundCost:
    """Time of one round, in plain decode steps at batch 1 (the target's 1-token forward): :meth:`verify_time` of the
    target's packed verify of ``tokens`` tokens over ``rows`` requests, :meth:`draft_time` of the drafter,
    :meth:`overhead` of everything else a round costs, :meth:`round_time` of the whole round (less
    :meth:`read_time` when it verifies whole blocks without reading its ratios first). Default: the measured
    table with the overheads measured beside it (module doc); :meth:`flat` (a verify costs the same whatever it carries) and
    :meth:`from_ms` (a measured table, e.g. the engine's own) build others.

    Args:
        rows: request counts of the table (ascending, >= 1).
        tokens_per_row: tokens per request of the table (ascending, >= 1).
        verify: ``verify[i][j]``: time of ``rows[i]`` requests x ``tokens_per_row[j]`` tokens (finite, > 0).
        draft_fraction: the drafter's round as a fraction of the whole-block verify at the same batch (>= 0).
        spec_overhead: time a round that drafts costs beyond its verify and drafter forwards, one number or one per
            ``rows`` entry (finite, >= 0); ``None``: the default table's overheads with that table, else 0.
        plain_overhead: the same for a round that decodes plainly (its verify carries the bonus tokens only).
        read_overhead: the part of ``spec_overhead`` a drafting round saves when it verifies whole blocks without
            reading its length-head ratios mid-round (module doc); per ``rows`` entry like the others, capped at that
            row count's ``spec_overhead``; ``None``: the default table's estimate with that table, else 0.
        unit_ms: what one unit measured, in ms, where known (reports only: the rule reads ratios of times).

    Example:
        >>> c = RoundCost()
        >>> round(c.verify_time(1, 1), 3), round(c.verify_time(128, 128 * 16), 2)
        (1.0, 11.12)
        >>> round(c.round_time(1, 16, 16), 2), round(c.round_time(1, 1, 16), 2)  # whole block, plain, at batch 1
        (1.8, 1.0)
    """

    rows: tuple = SPEC_ROWS
    tokens_per_row: tuple = SPEC_TOKENS_PER_ROW
    verify: tuple = SPEC_UNITS
    draft_fraction: float = 0.2
    spec_overhead: float | tuple | None = None
    plain_overhead: float | tuple | None = None
    read_overhead: float | tuple | None = None
    unit_ms: float | None = None

    def __post_init__(self):
        for name in ("rows", "tokens_per_row"):
            grid = getattr(self, name)
            if not grid or any(not (math.isfinite(g) and g >= 1) for g in grid) or list(grid) != sorted(set(grid)):
                raise ValueError(f"RoundCost.{name} must be strictly ascending numbers >= 1, got {grid}")
        shape = (len(self.rows), len(self.tokens_per_row))
        table = np.asarray(self.verify, dtype=np.float64)
        if table.shape != shape:
            raise ValueError(f"RoundCost.verify must be {shape[0]} x {shape[1]} (rows x tokens_per_row), got {table.shape}")
        if not (np.isfinite(table).all() and (table > 0).all()):
            raise ValueError("RoundCost.verify times must be finite and > 0")
        if not (math.isfinite(self.draft_fraction) and self.draft_fraction >= 0):
            raise ValueError(f"RoundCost.draft_fraction must be finite and >= 0, got {self.draft_fraction}")
        if self.unit_ms is not None and not (math.isfinite(self.unit_ms) and self.unit_ms > 0):
            raise ValueError(f"RoundCost.unit_ms must be None or finite and > 0, got {self.unit_ms}")
        spec_table = tuple(self.rows) == SPEC_ROWS and tuple(self.tokens_per_row) == SPEC_TOKENS_PER_ROW \
            and np.allclose(table, SPEC_UNITS)
        for name, kind in (("spec_overhead", "spec"), ("plain_overhead", "plain"), ("read_overhead", "read")):
            value = getattr(self, name)
            if value is None:  # the overheads belong to the table they were measured beside: SPEC's, or none
                value = tuple(v / SPEC_H200_MS[0][0] for v in SPEC_H200_OVERHEAD_MS[kind]) if spec_table else 0.0
            object.__setattr__(self, name, _by_rows(name, value, tuple(self.rows)))
        # part of spec_overhead: a round cannot save more than it spends (dataclasses.replace may lower spec alone)
        object.__setattr__(self, "read_overhead", tuple(map(min, self.read_overhead, self.spec_overhead)))
        rgrid, by_rows = _extend(np.asarray(self.rows, np.float64), table.T)  # [Q, R+1]
        qgrid, _ = _extend(np.asarray(self.tokens_per_row, np.float64), table)
        object.__setattr__(self, "_grid", (rgrid, by_rows, qgrid))
        object.__setattr__(self, "_per_rows", {})  # rows -> the verify curve over tokens per row (rounds repeat sizes)

    @classmethod
    def flat(cls, draft_fraction: float = 0.0, spec_overhead: float = 0.0, plain_overhead: float = 0.0,
             read_overhead: float = 0.0) -> "RoundCost":
        """A verify that costs one step whatever it carries (a GPU far from its compute limit), with these overheads."""
        return cls(rows=(1,), tokens_per_row=(1,), verify=((1.0,),), draft_fraction=draft_fraction,
                   spec_overhead=spec_overhead, plain_overhead=plain_overhead, read_overhead=read_overhead)

    @classmethod
    def from_ms(cls, rows, tokens_per_row, ms, draft_fraction: float = 0.2) -> "RoundCost":
        """A measured table (any unit: it is divided by its first entry, the smallest shape); no overheads unless
        it is SPEC's table (``dataclasses.replace`` adds measured ones, as :func:`measure_round_cost` does)."""
        base = float(ms[0][0])
        if not (math.isfinite(base) and base > 0):
            raise ValueError(f"the first measured time must be finite and > 0, got {base}")
        return cls(tuple(rows), tuple(tokens_per_row), tuple(tuple(float(v) / base for v in r) for r in ms), draft_fraction)

    def to_json(self) -> dict:
        """The table as plain JSON values (:meth:`from_json` reads it back).

        Example:
            >>> RoundCost.from_json(RoundCost.flat(0.5).to_json()) == RoundCost.flat(0.5)
            True
        """
        return {"rows": list(self.rows), "tokens_per_row": list(self.tokens_per_row),
                "verify": [list(r) for r in self.verify], "draft_fraction": self.draft_fraction,
                "spec_overhead": list(self.spec_overhead), "plain_overhead": list(self.plain_overhead),
                "read_overhead": list(self.read_overhead), "unit_ms": self.unit_ms}

    @classmethod
    def from_json(cls, data: dict) -> "RoundCost":
        """The table :meth:`to_json` wrote (checked as any table is)."""
        rows = tuple(data["rows"])
        return cls(rows, tuple(data["tokens_per_row"]), tuple(tuple(r) for r in data["verify"]),
                   float(data["draft_fraction"]), *(tuple(data[k]) for k in ("spec_overhead", "plain_overhead",
                                                                             "read_overhead")), data.get("unit_ms"))

    def verify_time(self, rows: int, tokens):
        """Time of one verify forward of ``rows`` requests carrying ``tokens`` tokens in all (an int, or an array of
        candidate totals: an array back)."""
        curve = self._per_rows.get(rows)
        if curve is None:
            if rows < 1:
                raise ValueError(f"rows must be >= 1, got {rows}")
            rgrid, by_rows, qgrid = self._grid
            per_q = np.array([np.interp(rows, rgrid, col) for col in by_rows])  # [len(tokens_per_row)] at this many rows
            curve = self._per_rows[rows] = _extend(qgrid[:-1], per_q)
        out = np.interp(np.asarray(tokens, dtype=np.float64) / rows, *curve)
        return float(out) if np.ndim(out) == 0 else out

    def draft_time(self, rows: int, block_size: int) -> float:
        """Time of the drafter's round for ``rows`` requests with blocks of ``block_size``."""
        return self.draft_fraction * self.verify_time(rows, rows * block_size)

    def overhead(self, rows: int, drafting: bool) -> float:
        """Time a round of ``rows`` requests costs beyond its forwards: a round that drafts (``drafting``) or one
        that decodes plainly. Piecewise linear in ``rows``, flat outside the table (host work measured at the
        engine's own row counts; a noisy slope is not extrapolated).

        Example:
            >>> c = RoundCost(rows=(1, 9), tokens_per_row=(1,), verify=((1.0,), (2.0,)), spec_overhead=(1.0, 3.0))
            >>> c.overhead(5, drafting=True), c.overhead(64, drafting=True), c.overhead(5, drafting=False)
            (2.0, 3.0, 0.0)
        """
        return float(np.interp(rows, self.rows, self.spec_overhead if drafting else self.plain_overhead))

    def read_time(self, rows: int) -> float:
        """What a drafting round of ``rows`` requests saves when it verifies whole blocks without reading its ratios
        mid-round (:attr:`read_overhead`, interpolated like :meth:`overhead`).

        Example:
            >>> RoundCost.flat(spec_overhead=2.0, read_overhead=0.5).read_time(8)
            0.5
        """
        return float(np.interp(rows, self.rows, self.read_overhead))

    def round_time(self, rows: int, tokens, block_size: int, drafted: bool = False):
        """Time of a whole round of ``rows`` requests verifying ``tokens`` tokens in all (an int, or an array of
        candidate totals: an array back): the verify, and, when it carries drafts (``tokens > rows``), the drafter
        and the drafting round's overhead, else the plain round's overhead (no drafter runs). ``drafted``: the
        drafter has run already (a loop that drafts every round and then chooses the lengths): its time and a
        drafting round's overhead are part of the round whatever it verifies.

        Example:
            >>> c = RoundCost.flat(draft_fraction=0.5, spec_overhead=2.0)
            >>> c.round_time(4, 4, 16), c.round_time(4, 5, 16), c.round_time(4, 4, 16, drafted=True)
            (1.0, 3.5, 3.5)
        """
        t = np.asarray(tokens, dtype=np.float64)
        drafting = self.draft_time(rows, block_size) + self.overhead(rows, True)
        extra = np.where((t > rows) | drafted, drafting, self.overhead(rows, False))
        out = self.verify_time(rows, t) + extra
        return float(out) if np.ndim(out) == 0 else out
