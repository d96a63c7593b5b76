"""What one speculative round costs, for the cost-aware verify length (:func:`.length_policy.cost_aware_verify_length`).

A round of ``n`` requests sends ``T`` packed tokens to the target (each request its bonus token plus the drafts it
verifies) and, when anything is drafted, runs the drafter once for all of them. :class:`RoundCost` gives both
times in units of **one plain decode step of one request** (the target forward of 1 token at batch 1), so the
model is free of the GPU's and the model's absolute speed: only the shape of the curve matters to the rule.

The default follows SPEC section 6's measured H200 table (Qwen3-8B-shaped target, CUDA graphs, flex attention):
verify time per (requests, tokens per request), interpolated piecewise linearly in both (linear past the
largest measured point, flat below the smallest). The drafter's round is ``draft_fraction`` of the target's
whole-block verify at the same batch: its body runs every block position of every request through its few
layers, like a whole-block verify through as many target layers (5 of 36 for the z-lab shape), plus its LM head;
0.2 matches the ~1.3 ms drafter against the ~6.5 ms round measured at batch 1 (BENCHMARKS, engine ``fixed``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["RoundCost", "SPEC_H200_MS", "SPEC_ROWS", "SPEC_TOKENS_PER_ROW"]

SPEC_ROWS = (1, 16, 32, 64, 128)
SPEC_TOKENS_PER_ROW = (1, 2, 4, 8, 16)
SPEC_H200_MS = (  # SPEC section 6, flex attention column: ms of one verify forward, rows x tokens per row
    (6.0, 6.1, 6.6, 6.8, 7.1),
    (7.4, 7.6, 7.8, 8.5, 11.3),
    (8.4, 8.6, 9.2, 11.5, 18.8),
    (9.2, 9.9, 11.9, 18.4, 33.6),
    (12.3, 14.3, 20.4, 34.3, 66.7),
)


FAR = 1e6  # the grids are extended to FAR times their last point along the last segment's slope


def _extend(xs: np.ndarray, ys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``xs, ys`` (``ys`` along its last axis) with one far point on the last segment's line, so that
    ``np.interp`` (flat outside its grid) is linear past the measured end: a table never caps the cost of a
    shape larger than it measured. Below the first point it stays flat."""
    if len(xs) == 1:
        return np.array([xs[0], xs[0] * FAR]), np.stack([ys[..., 0], ys[..., 0]], axis=-1)
    x_far = xs[-1] * FAR
    slope = (ys[..., -1] - ys[..., -2]) / (xs[-1] - xs[-2])
    return np.append(xs, x_far), np.concatenate([ys, (ys[..., -1] + slope * (x_far - xs[-1]))[..., None]], axis=-1)


@dataclass(frozen=True)
class RoundCost:
    """Time of one round, in plain decode steps at batch 1: :meth:`verify_time` of the target's packed verify of
    ``tokens`` tokens over ``rows`` requests, :meth:`draft_time` of the drafter. Default: SPEC section 6's H200
    table; :meth:`flat` (a verify costs the same whatever it carries) and :meth:`from_ms` (a measured table,
    e.g. the engine's own) build others.

    Args:
        rows: request counts of the table (ascending, >= 1).
        tokens_per_row: tokens per request of the table (ascending, >= 1).
        verify: ``verify[i][j]``: time of ``rows[i]`` requests x ``tokens_per_row[j]`` tokens (finite, > 0).
        draft_fraction: the drafter's round as a fraction of the whole-block verify at the same batch (>= 0).

    Example:
        >>> c = RoundCost()
        >>> round(c.verify_time(1, 1), 3), round(c.verify_time(128, 128 * 16), 2)
        (1.0, 11.12)
    """

    rows: tuple = SPEC_ROWS
    tokens_per_row: tuple = SPEC_TOKENS_PER_ROW
    verify: tuple = tuple(tuple(v / SPEC_H200_MS[0][0] for v in r) for r in SPEC_H200_MS)
    draft_fraction: float = 0.2

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
        rgrid, by_rows = _extend(np.asarray(self.rows, np.float64), table.T)  # [Q, R+1]
        qgrid, _ = _extend(np.asarray(self.tokens_per_row, np.float64), table)
        object.__setattr__(self, "_grid", (rgrid, by_rows, qgrid))
        object.__setattr__(self, "_per_rows", {})  # rows -> the verify curve over tokens per row (rounds repeat sizes)

    @classmethod
    def flat(cls, draft_fraction: float = 0.0) -> "RoundCost":
        """A verify that costs one step whatever it carries (a GPU far from its compute limit)."""
        return cls(rows=(1,), tokens_per_row=(1,), verify=((1.0,),), draft_fraction=draft_fraction)

    @classmethod
    def from_ms(cls, rows, tokens_per_row, ms, draft_fraction: float = 0.2) -> "RoundCost":
        """A measured table (any unit: it is divided by its first entry, the smallest shape)."""
        base = float(ms[0][0])
        if not (math.isfinite(base) and base > 0):
            raise ValueError(f"the first measured time must be finite and > 0, got {base}")
        return cls(tuple(rows), tuple(tokens_per_row), tuple(tuple(float(v) / base for v in r) for r in ms), draft_fraction)

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
