"""What a run measured: one `BenchCell` per (method, dataset, concurrency), gathered in a `BenchResult`."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field


@dataclass
class BenchCell:
    """One (method, dataset, concurrency) measurement. Every field is present; None means n/a."""

    method: str
    dataset: str
    concurrency: int
    skipped: bool = False
    skip_reason: str | None = None
    error: str | None = None
    num_prompts: int = 0
    num_batches: int = 0
    new_tokens: int = 0
    wall_time_s: float | None = None
    tokens_per_s: float | None = None
    speedup: dict = field(default_factory=dict)
    tau: float | None = None
    tau_estimated: bool = False
    tau_histogram: dict | None = None
    rounds: int | None = None
    mean_verify_length: float | None = None
    position_acceptance: list | None = None
    draft_time_s: float | None = None
    verify_time_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    peak_memory_bytes: int | None = None
    floor_ms_per_token: float | None = None
    floor_share: float | None = None
    identical: bool | None = None
    settings: dict | None = None  # the method's knobs where it has some (prompt lookup's), see MethodOutput
    mismatched_prompts: list = field(default_factory=list)
    notes: list = field(default_factory=list)


@dataclass
class BenchResult:
    """Everything one run measured; ``to_dict()`` is what ``bench.json`` holds.

    ``online`` holds one record per (online method, dataset, concurrency, weights version) when the
    cell's stream triggered at least one update: ``{"method", "dataset", "concurrency", "update",
    "tau", "rounds"}``, where ``tau`` is the mean tokens per round served with the weights after
    ``update`` updates (``update`` 0: the drafter as given), i.e. the adapter's ``tau_before`` of
    each update and the last one's ``tau_after``. Plotted as tau over online updates.
    """

    config: dict
    environment: dict
    hardware: dict
    cells: list[BenchCell] = field(default_factory=list)
    failures: list[dict] = field(default_factory=list)
    online: list[dict] = field(default_factory=list)
    files: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def cell(self, method: str, dataset: str, concurrency: int) -> BenchCell:
        for c in self.cells:
            if (c.method, c.dataset, c.concurrency) == (method, dataset, concurrency):
                return c
        raise KeyError((method, dataset, concurrency))

    def to_dict(self) -> dict:
        return json_safe(
            {
                "config": self.config,
                "environment": self.environment,
                "hardware": self.hardware,
                "results": [asdict(c) for c in self.cells],
                "failures": self.failures,
                "online": online_records(self.online),
                "ok": self.ok,
            }
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False)


def online_records(online) -> list[dict]:
    """``BenchResult.online`` as dicts (bare ``(update, tau)`` pairs are accepted too)."""
    return [dict(r) if isinstance(r, dict) else {"update": r[0], "tau": r[1]} for r in online]


def json_safe(x):
    import torch

    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, torch.dtype):
        return str(x).replace("torch.", "")
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    return repr(x)
