"""The online adapter's safety net: an update replaces the serving weights only when it
does not lower acceptance on recent traffic held back from its training, and a swap is undone when the
tau served after it falls.

* **Guard** (:class:`UpdateGuard`). Each update holds back ``OnlineConfig.held_back`` of its request samples (a
  seeded draw) from training, with their exact repeats. The adapter measures training's ``accept_len`` (the mean
  greedy accepted length + 1 per block of the drafter's drafts against the target's argmax) on them twice, on the
  worker's side stream, at the same blocks (the served rounds' anchors, or anchors drawn from one seed): with the
  shadow *before* it trains, when it holds the serving weights, and with the trained shadow. So both numbers come
  from one model object in one dtype and attention kernel (a serving drafter running a flash kernel cannot take
  training's block mask), and the serving drafter is never read by the check while it serves. Each request is
  measured alone, so the candidate's gain pairs request by request (:func:`paired_gain`: the gain in accepted drafts
  per block and its standard error across the requests). The update is swapped in only when ``gain -
  guard_confidence x standard error >= -guard_margin`` (by default: ``candidate >= serving - guard_margin``);
  otherwise it is *refused*: nothing serves or is published from it, the shadow is rebuilt from the serving weights,
  and with an ``output_dir`` its weights (in the serving dtype) and ``reason.json`` are kept aside in
  ``output_dir/refused/update-NNNN/`` (numbered in the order of refusal, written atomically, the newest
  ``keep_versions`` kept; never listed as a version, ``reason.json`` names the update).
* **Rollback** (:class:`RollbackWatch`). Every served round updates a window of the last
  ``rollback_rounds`` rounds' tokens. A swap made with a full window keeps a CPU copy of the weights it
  replaced and that window's tau; once ``rollback_rounds`` rounds have been served with the new weights,
  their tau is compared once: below ``(1 - rollback_margin)`` times the tau before, the adapter's worker
  restores the copy under the round lock and publishes it as a new version (so ``LATEST`` names what
  serves); otherwise the copy is dropped. The per-round part is cheap arithmetic under the adapter's
  statistics lock; the restore runs on the worker thread.

Example:
    >>> guard = UpdateGuard(OnlineConfig(samples_per_update=128))  # doctest: +SKIP
    >>> train, held = guard.split(samples, update_index=3)  # 112 to train on, 16 to judge with  # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import os
import random
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from ..atomic_io import TMP_PREFIX, remove_temporaries, write_dir_atomic
from .config import OnlineConfig
from .worker import mean_accept_len

__all__ = ["REFUSED_DIR", "Judgement", "RollbackWatch", "UpdateGuard", "paired_gain"]

REFUSED_DIR = "refused"
REASON_FILE = "reason.json"
_REFUSED_RE = re.compile(r"^update-(\d{4,})$")


def _sequence(sample) -> bytes | int:
    """What makes two request samples the same: their token ids (a round sample is only ever itself)."""
    ids = getattr(sample, "input_ids", None)
    return ids.numpy().tobytes() if ids is not None else id(sample)


@dataclass(frozen=True)
class Judgement:
    """The guard's view of one candidate (all None: the guard is off): the serving weights' and the candidate's
    ``accept_len`` on the held-back requests, the candidate's paired gain and its standard error, and the reason to
    refuse it (None: swap it in)."""

    serving: float | None = None
    candidate: float | None = None
    gain: float | None = None
    gain_se: float | None = None
    refusal: dict | None = None


def paired_gain(serving: list[tuple[float, int]], candidate: list[tuple[float, int]]) -> tuple[float, float]:
    """The candidate's gain in accepted drafts per block over the serving weights on the same requests and blocks,
    and its standard error across requests (a ratio estimator: each request weighs by its blocks; 0 with one request).

    Example:
        >>> paired_gain([(4.0, 2), (2.0, 2)], [(5.0, 2), (3.0, 2)])
        (0.5, 0.0)
    """
    blocks = [n for _, n in serving]
    if blocks != [n for _, n in candidate]:
        raise ValueError("the serving weights and the candidate must be measured on the same blocks")
    total = sum(blocks)
    if total == 0:
        return 0.0, 0.0
    diff = [c - s for (s, _), (c, _) in zip(serving, candidate)]
    gain = sum(diff) / total
    m = len(diff)
    if m < 2:
        return gain, 0.0
    spread = sum((d - gain * n) ** 2 for d, n in zip(diff, blocks)) * m / (m - 1)
    return gain, math.sqrt(spread) / total


class UpdateGuard:
    """Holds back samples, judges a trained shadow against the serving weights, keeps refused ones aside."""

    def __init__(self, config: OnlineConfig):
        self.config = config

    def _seed(self, update_index: int) -> int:
        return self.config.seed * 1_000_003 + update_index

    def split(self, samples: list, update_index: int) -> tuple[list, list]:
        """``(to train on, held back)``: ``held_back`` of a full update's samples, the same share (rounded
        down) of a smaller one; a seeded draw, not the newest, so the check sees the update's whole mix.

        A held-back request's exact repeats (a prompt served again answers the same under greedy decoding) are
        left out of training too: trained on, they would let the guard judge the candidate on what it learnt by
        heart. When nothing else is left to train on, nothing is held back (the rollback watch still judges)."""
        k = self.config.held_back * len(samples) // self.config.samples_per_update
        if k == 0:
            return samples, []
        held = set(random.Random(f"guard-{self._seed(update_index)}").sample(range(len(samples)), k))
        held_sequences = {_sequence(samples[i]) for i in held}
        train = [s for i, s in enumerate(samples) if i not in held and _sequence(s) not in held_sequences]
        if not train:
            return samples, []
        return train, [samples[i] for i in sorted(held)]

    def measure(self, worker, held: list, update_index: int) -> list[tuple[float, int]] | None:
        """The shadow's ``(accepted drafts, blocks)`` on each of ``held`` at this update's blocks (None when nothing
        is held back)."""
        if not held:
            return None
        shadow, _ = worker.ensure_shadow()
        return worker.request_acceptance(shadow, held, seed=self._seed(update_index))

    def judge(self, serving: list[tuple[float, int]] | None, candidate: list[tuple[float, int]] | None) -> "Judgement":
        """The guard's decision on a candidate from both models' per-request measures (:meth:`measure`, the same
        held-back requests and blocks): refused when its paired gain less ``guard_confidence`` standard errors of it
        falls below ``-guard_margin`` (with ``guard_confidence`` 0: when its accept_len falls by more than the
        margin)."""
        if serving is None or candidate is None:
            return Judgement()
        gain, se = paired_gain(serving, candidate)
        before, after = mean_accept_len(serving), mean_accept_len(candidate)
        margin, z = self.config.guard_margin, self.config.guard_confidence
        if gain - z * se >= -margin:
            return Judgement(before, after, gain, se)
        held = len(serving)
        if z:  # the gain itself may be positive: what fell short is its lower bound
            reason = (f"on {held} held-back requests the candidate's gain in accept_len ({before:.4f} serving, "
                      f"{after:.4f} candidate) is {gain:+.4f} ± {se:.4f}; less {z:g} standard errors it falls below "
                      f"minus the margin ({margin:g})")
        else:
            reason = (f"accept_len on {held} held-back requests fell from {before:.4f} (serving) to {after:.4f} "
                      f"(candidate), more than the margin {margin:g}")
        return Judgement(before, after, gain, se, {
            "reason": reason,
            "serving_accept_len": before,
            "candidate_accept_len": after,
            "gain_standard_error": se,
            "guard_confidence": z,
            "guard_margin": margin,
            "held_back": held,
        })  # fmt: skip

    def keep_aside(self, shadow, dtype: torch.dtype, reason: dict) -> Path:
        """Write ``shadow`` (cast to ``dtype``) and ``reason.json`` atomically as the next
        ``output_dir/refused/update-NNNN``; prune to the newest ``keep_versions``. Returns the folder."""
        from ..training.checkpoint import save_drafter

        root = Path(self.config.output_dir) / REFUSED_DIR
        root.mkdir(parents=True, exist_ok=True)
        remove_temporaries(root)
        taken = _refused(root)
        final = root / f"update-{(taken[-1][0] + 1 if taken else 1):04d}"

        def fill(tmp: Path) -> None:
            save_drafter(shadow, tmp, dtype=dtype)
            (tmp / REASON_FILE).write_text(json.dumps(reason, indent=2, sort_keys=True, default=str), encoding="utf-8")

        write_dir_atomic(final, fill)
        for _, old in _refused(root)[: -self.config.keep_versions]:
            os.replace(old, root / f"{TMP_PREFIX}{old.name}-pruned")  # renamed first: never half-deleted under its name
        remove_temporaries(root)
        return final


def _refused(root: Path) -> list[tuple[int, Path]]:
    """The ``update-NNNN`` folders under ``root``, oldest first."""
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _REFUSED_RE.match(p.name)) and p.is_dir()]
    return sorted(found)


class RollbackWatch:
    """Served tau before and after the newest swap; judges each swap once (module doc). Not locked itself:
    the adapter calls it under its statistics lock."""

    def __init__(self, rounds: int, margin: float):
        self.rounds, self.margin = int(rounds), float(margin)
        self._window: deque[int] = deque(maxlen=max(self.rounds, 1))  # tokens of the newest rounds
        self._window_sum = 0
        self._armed: dict | None = None  # the swap being judged

    @property
    def can_judge(self) -> bool:
        """Whether a swap now would be judged: rollback on and a full window of rounds served before it."""
        return self.rounds > 0 and len(self._window) == self.rounds

    def arm(self, previous: dict[str, torch.Tensor] | None, update: int) -> None:
        """Judge the swap just made (it supersedes any swap still being judged): ``previous`` are the weights
        it replaced (None: not kept, nothing to judge), ``update`` its number."""
        self._armed = None
        if previous is not None and self.can_judge:
            self._armed = {"update": update, "previous": previous, "tau_before": self._window_sum / self.rounds,
                           "sum": 0, "n": 0}  # fmt: skip

    def reset(self) -> None:
        """Forget the window and any swap being judged (after a rollback: those rounds judge nothing more)."""
        self._window.clear()
        self._window_sum = 0
        self._armed = None

    def observe(self, tokens: int) -> dict | None:
        """Count one served round of ``tokens`` (accepted + 1). Returns the rollback to make (``update``,
        ``previous``, ``tau_before``, ``tau_after``, ``rounds``) at the round that decides it, else None."""
        if not self.rounds:
            return None
        if len(self._window) == self.rounds:
            self._window_sum -= self._window[0]
        self._window.append(tokens)
        self._window_sum += tokens
        armed = self._armed
        if armed is None:
            return None
        armed["sum"] += tokens
        armed["n"] += 1
        if armed["n"] < self.rounds:
            return None
        self._armed = None  # judged once; the copy of the previous weights goes with it unless returned
        tau_after = armed["sum"] / armed["n"]
        if tau_after >= armed["tau_before"] * (1.0 - self.margin):
            return None
        return {"update": armed["update"], "previous": armed["previous"], "tau_before": armed["tau_before"],
                "tau_after": tau_after, "rounds": armed["n"]}  # fmt: skip
