"""``bench.md``'s per-set summary: each set's turns pooled, tau and mean verify length beside
wall-clock against plain and prompt lookup, tau against prompt lookup at its default and at its best.

A multi-turn set's turns (`.multiturn`) are pooled: tokens, rounds and wall time summed over the turns, tau
from those totals (`speculation.rounds.tau_from_totals`, the one convention). Ratios are taken within one
concurrency: ``x plain`` / ``x prompt lookup`` are tok/s over ``plain`` / ``prompt_lookup`` (timed, batch 1
only); ``tau / PL default`` is over ``prompt_lookup_exact`` (else the timed ``prompt_lookup``) and
``tau / PL best`` over ``prompt_lookup_grid`` (else ``prompt_lookup_tuned``).

Example:
    >>> lines = summary_table(result)  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass

from ..speculation.rounds import tau_from_totals
from .multiturn import base_label


def fmt(x, spec=".2f"):
    """A figure of the report, ``-`` for none."""
    return "-" if x is None else format(x, spec)


PL_DEFAULT = ("prompt_lookup_exact", "prompt_lookup")
PL_BEST = ("prompt_lookup_grid", "prompt_lookup_tuned")


@dataclass
class Pooled:
    """One (set, concurrency, method) over the set's turns."""

    turns: int
    tau: float | None
    mean_verify_length: float | None
    tokens_per_s: float | None
    settings: dict | None


def pool(cells) -> Pooled:
    """The cells of one method on one set's turns (one concurrency) as one row."""
    cells = [c for c in cells if not c.skipped and not c.error]
    if not cells:
        return Pooled(0, None, None, None, None)
    if len(cells) == 1:
        c = cells[0]
        return Pooled(1, c.tau, c.mean_verify_length, c.tokens_per_s, c.settings)
    rounds = [c.rounds for c in cells]
    tau = verify = None
    if all(r for r in rounds):
        tau = tau_from_totals(sum(c.new_tokens for c in cells), sum(c.num_prompts for c in cells), sum(rounds))
        if all(c.mean_verify_length is not None for c in cells):
            verify = sum(c.mean_verify_length * c.rounds for c in cells) / sum(rounds)
    walls = [c.wall_time_s for c in cells]
    tps = sum(c.new_tokens for c in cells) / sum(walls) if all(walls) else None
    return Pooled(len(cells), tau, verify, tps, cells[0].settings)


def _ratio(a, b) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def _pooled_groups(result) -> dict:
    """(set, concurrency) -> method -> `Pooled`, in the order the cells ran."""
    cells: dict = {}
    for c in result.cells:
        key = (base_label(c.dataset)[0], c.concurrency)
        cells.setdefault(key, {}).setdefault(c.method, []).append(c)
    return {key: {m: pool(cs) for m, cs in methods.items()} for key, methods in cells.items()}


def _first(rows: dict, names, field: str):
    return next((getattr(rows[n], field) for n in names if n in rows and getattr(rows[n], field) is not None), None)


def summary_table(result) -> list[str]:
    """The per-set summary lines of ``bench.md`` (empty when no cell has a tau or a speed)."""
    groups = _pooled_groups(result)
    lines = ["", "## Per set (turns pooled)", "",
             "| set | turns | concurrency | method | tau | mean verify len | tok/s | x plain | x prompt lookup | "
             "tau / PL default | tau / PL best |", "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    grid_lines = []
    for (label, conc), rows in groups.items():
        plain_tps, pl_tps = _first(rows, ("plain",), "tokens_per_s"), _first(rows, ("prompt_lookup",), "tokens_per_s")
        pl_tau, best_tau = _first(rows, PL_DEFAULT, "tau"), _first(rows, PL_BEST, "tau")
        for m, r in rows.items():
            if r.turns == 0:
                continue
            lines.append(f"| {label} | {r.turns} | {conc} | {m} | {fmt(r.tau)} | {fmt(r.mean_verify_length)} | "
                         f"{fmt(r.tokens_per_s, '.1f')} | {_ratio(r.tokens_per_s, plain_tps)} | "
                         f"{_ratio(r.tokens_per_s, pl_tps)} | {_ratio(r.tau, pl_tau)} | {_ratio(r.tau, best_tau)} |")  # fmt: skip
        grid_lines += _grid_lines(result, label, conc)
    if len(lines) == 4:
        return []
    if grid_lines:
        lines += ["", "Prompt-lookup grid (tau per tokens x n-gram, computed; chosen setting in bold):", "", *grid_lines]
    return lines


def _grid_lines(result, label: str, conc: int) -> list[str]:
    """One line per turn of a set: every grid point's tau and the chosen one, with where it was chosen."""
    out = []
    for c in result.cells:
        s = c.settings or {}
        if c.method != "prompt_lookup_grid" or base_label(c.dataset)[0] != label or c.concurrency != conc or "grid_tau" not in s:
            continue
        chosen = f"{s['num_tokens']}x{s['max_ngram']}"
        pts = ", ".join(f"**{k}: {v:.2f}**" if k == chosen else f"{k}: {v:.2f}" for k, v in s["grid_tau"].items())
        out.append(f"- {c.dataset} (concurrency {conc}): {pts}; chosen on {s['chosen_on']}")
    return out
