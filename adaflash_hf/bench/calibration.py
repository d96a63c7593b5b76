"""The length head's calibration: its predicted verify length against the realised acceptance.

Input: whole-block rounds (``fixed`` policy, so an accepted count ``L`` is never cut by a verify length), each with
the head's predicted ratio ``a`` (:class:`adaflash_hf.bench.replay.RecordedTrace` records them). The head is
trained on the label ``(L + 1) / B``, so ``a * B`` is its predicted ``k`` (accepted drafts + the bonus slot):

- :func:`by_bucket`: rounds grouped by predicted ``k``: mean predicted ``k`` against mean realised ``L + 1``
  (a reliability table);
- :func:`by_position`: per draft slot ``j``, the head's predicted ``P(L >= j)`` (``clamp(a * B - j, 0, 1)``: a
  predicted ``k`` of 5.4 says slots 1-4 accepted and slot 5 with 0.4) against the realised fraction, and
  what the floor rule ``k_hat = clamp(floor(a * B * rate), min_len, B)`` at ``rate`` verifies of slot ``j``;
- :func:`fitted_scale`: the one factor ``s`` on ``a * B`` that best predicts ``L + 1`` (least squares);
- :func:`rule_outcome`: tau and mean verify length the floor rule keeps at a rate, against the whole block.

Example:
    >>> from adaflash_hf.bench.replay import TraceRound
    >>> rounds = [TraceRound(3, 2 / 16), TraceRound(1, 2 / 16)]
    >>> by_bucket(rounds, 16)[0]["realised_k"], round(fitted_scale(rounds, 16), 2)
    (3.0, 1.5)
"""

from __future__ import annotations

import math

import torch

from ..speculation.length.rules import adaptive_verify_length
from ..speculation.rounds import mean_tokens_per_round, position_counts

__all__ = ["BUCKET_EDGES", "by_bucket", "by_position", "fitted_scale", "k_hats", "rule_outcome"]

# Predicted-k buckets: one per k where most rounds fall, wider where few do.
BUCKET_EDGES = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 11.0, math.inf)


def _check(rounds, block_size: int) -> None:
    if not rounds:
        raise ValueError("calibration needs at least one round")
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    bad = [r for r in rounds if not 0 <= r.accepted < block_size or not 0.0 <= r.ratio <= 1.0]
    if bad:
        raise ValueError(f"{len(bad)} rounds outside accepted in [0, {block_size - 1}] / ratio in [0, 1], e.g. {bad[0]}")


def k_hats(rounds, block_size: int, rate: float, min_len: int = 1) -> list[int]:
    """Each round's ``k_hat`` under the paper's floor rule at ``rate`` (``speculation.length.rules.adaptive_verify_length``)."""
    ratios = torch.tensor([r.ratio for r in rounds], dtype=torch.float32)
    return adaptive_verify_length(ratios, block_size, rate=rate, min_len=min_len).tolist()


def by_bucket(rounds, block_size: int, rate: float = 1.0, edges=BUCKET_EDGES) -> list[dict]:
    """Rounds grouped by predicted ``k = a * B``: ``count``, ``predicted_k`` and ``realised_k`` (mean ``L + 1``),
    ``ratio`` (realised / predicted: > 1 under-predicts), and for the floor rule at ``rate``: ``cut`` (share of
    rounds whose ``k_hat < L + 1``: accepted drafts left unverified) and ``k_hat`` (mean)."""
    _check(rounds, block_size)
    out = []
    for lo, hi in zip(edges, edges[1:]):
        sel = [r for r in rounds if lo <= max(r.ratio * block_size, 1.0) < hi]
        if not sel:
            continue
        pred = sum(r.ratio * block_size for r in sel) / len(sel)
        real = sum(r.accepted + 1 for r in sel) / len(sel)
        khat = k_hats(sel, block_size, rate)
        out.append({"bucket": f"[{lo:g}, {hi:g})", "count": len(sel), "predicted_k": pred, "realised_k": real,
                    "ratio": real / pred if pred else math.inf,
                    "cut": sum(k < r.accepted + 1 for k, r in zip(khat, sel)) / len(sel), "k_hat": sum(khat) / len(sel)})
    return out


def by_position(rounds, block_size: int, rate: float = 1.0) -> list[dict]:
    """Per draft slot ``j`` (1 .. B-1): ``predicted`` ``P(L >= j)`` (mean of ``clamp(a * B - j, 0, 1)``),
    ``realised`` ``P(L >= j)``, ``ratio`` (realised / predicted: > 1 under-predicts), the realised conditional
    acceptance ``cond`` (``P(L >= j | L >= j - 1)``), and for the floor rule at ``rate``: ``verified`` (share of
    rounds whose ``k_hat > j``) and ``lost`` (share of rounds that would accept slot ``j`` but do not verify it)."""
    _check(rounds, block_size)
    n, out = len(rounds), []
    acc, khat = [r.accepted for r in rounds], k_hats(rounds, block_size, rate)
    whole = position_counts(acc, [block_size] * n, block_size - 1)  # [n, rounds accepting slot j] per slot
    ruled = position_counts(acc, khat, block_size - 1)  # [rounds verifying slot j, of them accepting it]
    prev = 1.0
    for j in range(1, block_size):
        pred = sum(min(max(r.ratio * block_size - j, 0.0), 1.0) for r in rounds) / n
        real = whole[j - 1][1] / n
        out.append({"position": j, "predicted": pred, "realised": real,
                    "ratio": real / pred if pred else (math.inf if real else 1.0),
                    "cond": real / prev if prev else 0.0, "verified": ruled[j - 1][0] / n,
                    "lost": (whole[j - 1][1] - ruled[j - 1][1]) / n})
        prev = real
    return out


def fitted_scale(rounds, block_size: int) -> float:
    """The factor ``s`` minimising ``sum((s * a * B - (L + 1))^2)``: where a stored scale on the head's ratio
    would put its predictions on average (``s > 1``: the head under-predicts)."""
    _check(rounds, block_size)
    num = sum(r.ratio * block_size * (r.accepted + 1) for r in rounds)
    den = sum((r.ratio * block_size) ** 2 for r in rounds)
    return num / den if den else math.inf


def rule_outcome(rounds, block_size: int, rate: float, min_len: int = 1) -> dict:
    """What the floor rule at ``rate`` keeps of these rounds: ``tau`` (tokens per round when each round verifies
    ``k_hat``: ``min(L, k_hat - 1) + 1``), ``tau_share`` of the whole block's tau, ``verify_len`` (mean
    ``k_hat``). Each round scored on its own (a cut round's next anchors are not replayed: a guide, not a run)."""
    _check(rounds, block_size)
    khat = k_hats(rounds, block_size, rate, min_len)
    kept = [min(r.accepted, k - 1) for r, k in zip(rounds, khat)]
    tau, whole = mean_tokens_per_round(kept), mean_tokens_per_round([r.accepted for r in rounds])
    return {"rate": rate, "tau": tau, "tau_share": tau / whole, "verify_len": sum(khat) / len(khat)}
