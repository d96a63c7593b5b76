"""Prompt lookup at its best: a small grid of transformers' two knobs, the setting chosen
on the validation split and reported on the test split.

The grid is ``prompt_lookup_num_tokens`` 10 / 15 / 20 x ``max_matching_ngram_size`` 2 / 3 / 4
(`GRID`; transformers' default, 10 x 2, is its first point). Every setting's rounds follow from plain's
outputs (`.prompt_lookup_tau`), so the whole grid costs no model time once
plain has run: :func:`grid_rounds`. The best setting is the one with the highest tau, ties going to the
earlier grid point (the smaller window): :func:`best_setting`.

The mechanism, two runs of `adaflash bench`:

1. ``--split validation --methods plain,prompt_lookup_grid``: the ``prompt_lookup_grid`` cell of each set
   records every grid point's tau and the best one (``settings`` in ``bench.json``);
2. ``--split test --prompt-lookup-choice VALIDATION/bench.json --methods ...,prompt_lookup_grid,prompt_lookup_tuned``:
   :func:`read_choice` reads each set's chosen setting; ``prompt_lookup_grid`` then reports the test slice's
   rounds at that setting (computed, untimed; the whole grid still recorded), ``prompt_lookup_tuned`` runs
   transformers' prompt lookup at it (timed, batch 1), and the two are cross-checked like
   ``prompt_lookup_exact`` and ``prompt_lookup``.

Example:
    >>> from adaflash_hf.bench.prompt_lookup_tau import PromptLookupSettings
    >>> best_setting({PromptLookupSettings(10, 2): 2.0, PromptLookupSettings(15, 3): 2.5})
    PromptLookupSettings(num_tokens=15, max_ngram=3)
"""

from __future__ import annotations

import json
from pathlib import Path

from .prompt_lookup_tau import PromptLookupSettings, as_generation_stats, prompt_lookup_rounds

__all__ = ["GRID", "best_setting", "grid_rounds", "read_choice", "setting_key"]

GRID_NUM_TOKENS = (10, 15, 20)
GRID_MAX_NGRAM = (2, 3, 4)
GRID = tuple(PromptLookupSettings(t, n) for t in GRID_NUM_TOKENS for n in GRID_MAX_NGRAM)
GRID_METHOD = "prompt_lookup_grid"


def setting_key(s: PromptLookupSettings) -> str:
    """``"<num_tokens>x<max_ngram>"``: a grid point as ``bench.json`` names it."""
    return f"{s.num_tokens}x{s.max_ngram}"


def grid_rounds(prompts, rows, max_new_tokens: int, eos_ids, grid=GRID, forbidden=frozenset()) -> dict:
    """Every grid point's `GenerationStats` over the prompts, computed from plain's ``rows`` (``forbidden``: as
    `.prompt_lookup_tau.prompt_lookup_rounds` takes it)."""
    return {
        s: as_generation_stats([prompt_lookup_rounds(p, r, max_new_tokens, eos_ids, s, forbidden)
                                for p, r in zip(prompts, rows)], s)  # fmt: skip
        for s in grid
    }


def best_setting(taus: dict) -> PromptLookupSettings:
    """The setting of highest tau (``taus``: setting -> tau, or -> stats with ``.tau``); ties: the first listed."""
    tau = {s: (v if isinstance(v, (int, float)) else v.tau) for s, v in taus.items()}
    return max(tau, key=lambda s: (tau[s], -list(tau).index(s)))


def grid_record(stats: dict, chosen: PromptLookupSettings, chosen_on: str) -> dict:
    """What a ``prompt_lookup_grid`` cell records as its ``settings``: the chosen point, where it was chosen,
    and every point's tau on these prompts."""
    return {"num_tokens": chosen.num_tokens, "max_ngram": chosen.max_ngram, "chosen_on": chosen_on,
            "grid_tau": {setting_key(s): st.tau for s, st in stats.items()}}  # fmt: skip


def read_choice(path) -> dict[str, PromptLookupSettings]:
    """Each set's chosen setting from a validation run's ``bench.json``: set label -> `PromptLookupSettings`
    (the ``prompt_lookup_grid`` cell of the smallest concurrency). Refuses a file that is not a greedy
    ``--split validation`` run or that holds no grid cell.

    Example:
        >>> read_choice("runs/val/bench.json")["gsm8k"]  # doctest: +SKIP
        PromptLookupSettings(num_tokens=15, max_ngram=3)
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--prompt-lookup-choice: no such file {p}")
    data = json.loads(p.read_text(encoding="utf-8"))
    split = data.get("config", {}).get("split")
    if split != "validation":
        raise ValueError(f"--prompt-lookup-choice {p}: the setting must be chosen on the validation split, "
                         f"but that run's split is {split!r}")  # fmt: skip
    out: dict[str, tuple[int, PromptLookupSettings]] = {}
    for c in data.get("results", []):
        s = c.get("settings")
        if c.get("method") != GRID_METHOD or not s or c.get("skipped") or c.get("error"):
            continue
        if c["dataset"] not in out or c["concurrency"] < out[c["dataset"]][0]:
            out[c["dataset"]] = (c["concurrency"], PromptLookupSettings(s["num_tokens"], s["max_ngram"]))
    if not out:
        raise ValueError(f"--prompt-lookup-choice {p}: no {GRID_METHOD} cell (run it with --methods plain,{GRID_METHOD})")
    return {label: settings for label, (_, settings) in out.items()}


def check_choice(choice: dict | None, labels: list[str], methods: list[str], split: str) -> None:
    """Refuse, before any work, a run whose tuned prompt lookup has no held-out choice for one of its sets."""
    if choice is None:
        if split == "test" and GRID_METHOD in methods:
            raise ValueError(f"{GRID_METHOD} on the test split reports the setting chosen on validation: give "
                             "--prompt-lookup-choice VALIDATION_RUN/bench.json")  # fmt: skip
        if "prompt_lookup_tuned" in methods:
            raise ValueError("prompt_lookup_tuned runs the setting chosen on validation: give --prompt-lookup-choice "
                             "VALIDATION_RUN/bench.json (a --split validation run with prompt_lookup_grid)")  # fmt: skip
        return
    missing = [label for label in labels if label not in choice]
    if missing:
        raise ValueError(f"--prompt-lookup-choice holds no chosen setting for {', '.join(missing)} "
                         f"(it has {', '.join(sorted(choice))})")  # fmt: skip
