"""The verify-length rules: how many block slots each row sends to the target, one class per rule
with its own knobs (:class:`FixedRule`, :class:`FloorRule`, :class:`CostRule`, :class:`ExpectedGainRule`), each
reading one round's :class:`RoundInputs`, and the functions they compute with.

A verify length ``k_hat`` always counts the bonus slot (slot 0, the last verified token), so a
row verifies ``k_hat - 1`` draft tokens and ``k_hat`` lies in ``[1, B]`` for block size ``B``.
Every rule returns ``LongTensor[b]`` so the engine can pack ``sum(k_hat)`` tokens per verify. Loops do not call the
rules themselves: :class:`~.planner.LengthPlanner` does, round by round, for generate and the engine alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from .cost import RoundCost
from .names import LengthPolicy, LengthSettings

__all__ = [
    "CostRule",
    "ExpectedGainRule",
    "FixedRule",
    "FloorRule",
    "RoundInputs",
    "adaptive_verify_length",
    "cost_aware_verify_length",
    "draft_acceptance",
    "expected_gain_verify_length",
    "fixed_verify_length",
    "load_scaled_rate",
    "make_rule",
    "ratio_of_acceptance",
    "survival_curve",
]


@dataclass(frozen=True)
class RoundInputs:
    """What one round offers a rule: ``rows`` requests with blocks of ``block_size``; the length head's ``ratio [rows]``
    (``None``: no head, or not read); the draft logits ``[rows, B-1, V]`` (``expected_gain``); ``max_len [rows]``, the
    longest verify each row may take (e.g. the tokens it has left); ``unread_whole``: decided before the drafter runs,
    whole blocks would spare the round its mid-round read; ``drafted``: the drafter has run for this round already."""

    rows: int
    block_size: int
    ratio: torch.Tensor | None = None
    draft_logits: torch.Tensor | None = None
    max_len: torch.Tensor | None = None
    unread_whole: bool = False
    drafted: bool = False


@dataclass(frozen=True)
class FixedRule:
    """DFlash: every row verifies its whole block.

    Example:
        >>> FixedRule().lengths(RoundInputs(2, 16)).tolist()
        [16, 16]
    """

    policy = LengthPolicy.FIXED

    def lengths(self, x: RoundInputs) -> torch.Tensor:
        return fixed_verify_length(x.rows, x.block_size)

    def most(self, rows: int, block_size: int) -> int:
        """The longest verify this rule gives any row of a round of ``rows`` requests."""
        return block_size


@dataclass(frozen=True)
class FloorRule:
    """The paper's rule on the length head: ``k_hat = clamp(floor(a * B * rate), min_len, B)``, the rate fixed or, with
    ``halving_batch``, shrinking with the batch (:func:`load_scaled_rate`).

    Example:
        >>> FloorRule(rate=0.5).lengths(RoundInputs(2, 16, ratio=torch.tensor([0.5, 1.0]))).tolist()
        [4, 8]
    """

    rate: float = 1.0
    min_len: int = 1
    halving_batch: int | None = None
    policy = LengthPolicy.ADAPTIVE

    def rate_at(self, rows: int) -> float:
        """The rate for a round of ``rows`` requests."""
        return self.rate if self.halving_batch is None else load_scaled_rate(self.rate, rows, self.halving_batch)

    def lengths(self, x: RoundInputs) -> torch.Tensor:
        return adaptive_verify_length(x.ratio, x.block_size, rate=self.rate_at(x.rows), min_len=self.min_len)

    def most(self, rows: int, block_size: int) -> int:
        """The longest verify of a round of ``rows`` (the rule is monotone in the ratio: a ratio of 1 gives it)."""
        return int(adaptive_verify_length(torch.ones(1), block_size, rate=self.rate_at(rows), min_len=self.min_len))


@dataclass(frozen=True)
class CostRule:
    """Every row's length chosen together against the round's cost (:func:`cost_aware_verify_length`), reading the
    head's ratio as its training label (no rate: the floor rule's scale would double the acceptance it expects).

    Example:
        >>> CostRule(RoundCost.flat()).lengths(RoundInputs(2, 16, ratio=torch.tensor([0.5, 1.0]))).tolist()
        [16, 16]
    """

    cost: RoundCost = RoundCost()
    min_len: int = 1
    policy = LengthPolicy.COST

    def lengths(self, x: RoundInputs) -> torch.Tensor:
        return cost_aware_verify_length(x.ratio, x.block_size, self.cost, min_len=self.min_len, max_len=x.max_len,
                                        unread_whole=x.unread_whole, drafted=x.drafted)

    def most(self, rows: int, block_size: int) -> int:
        return block_size


@dataclass(frozen=True)
class ExpectedGainRule:
    """DSpark-style: the draft's own top-1 probability stands in for each slot's conditional acceptance, and the prefix
    with most expected tokens per verify cost wins (:func:`expected_gain_verify_length`).

    Example:
        >>> logits = torch.tensor([[[9.0, 0.0], [9.0, 0.0]]])  # one row, two sure drafts
        >>> ExpectedGainRule(0.1).lengths(RoundInputs(1, 3, draft_logits=logits)).tolist()
        [3]
    """

    verify_token_cost: float = 0.05
    min_len: int = 1
    policy = LengthPolicy.EXPECTED_GAIN

    def lengths(self, x: RoundInputs) -> torch.Tensor:
        top1 = torch.nan_to_num(x.draft_logits).float().softmax(dim=-1).amax(dim=-1)
        return expected_gain_verify_length(top1, cost_per_token=self.verify_token_cost, min_len=self.min_len).cpu()

    def most(self, rows: int, block_size: int) -> int:
        return block_size


def make_rule(settings: LengthSettings, round_cost: RoundCost | None = None):
    """The rule ``settings`` (resolved: :meth:`LengthSettings.resolved`) name, with its own knobs; ``round_cost`` is
    the cost rule's (default :class:`RoundCost`).

    Example:
        >>> make_rule(LengthSettings("adaptive", rate=2.0, min_len=1))
        FloorRule(rate=2.0, min_len=1, halving_batch=None)
    """
    policy = LengthPolicy(settings.policy)
    if policy is LengthPolicy.COST:
        return CostRule(round_cost if round_cost is not None else RoundCost(), settings.min_len)
    if policy is LengthPolicy.ADAPTIVE:
        return FloorRule(settings.rate, settings.min_len, settings.halving_batch)
    if policy is LengthPolicy.EXPECTED_GAIN:
        return ExpectedGainRule(settings.verify_token_cost, settings.min_len)
    return FixedRule()


def _check_len_bounds(block_size: int, min_len: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not 1 <= min_len <= block_size:
        raise ValueError(f"min_len must be in [1, block_size={block_size}], got {min_len}")


def adaptive_verify_length(
    accept_ratio: torch.Tensor,
    block_size: int,
    rate: float = 1.0,
    min_len: int = 1,
) -> torch.Tensor:
    """Length-head policy, the paper's: ``k_hat = clamp(floor(a * B * rate), min_len, B)``.

    ``a`` is the head's predicted acceptance ratio per row (``[b]`` or ``[b, 1]``); ``rate`` is a
    fixed scale (1.0 in the paper's ablation; :func:`load_scaled_rate` shrinks it with the batch on
    request). Floor, not round: a head that predicts ``(accepted + 1) / B`` exactly (its training
    label) verifies exactly the accepted drafts plus the bonus. A NaN prediction maps to
    ``min_len``: the shortest verify is always lossless, so a broken head costs speed, never
    correctness or a crash.

    Example:
        >>> adaptive_verify_length(torch.tensor([0.0, 0.4, 1.0]), block_size=16).tolist()
        [1, 6, 16]
    """
    _check_len_bounds(block_size, min_len)
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite number > 0, got {rate}")
    a = accept_ratio.detach().float()
    if a.dim() == 2 and a.shape[1] == 1:
        a = a.squeeze(1)
    if a.dim() != 1:
        raise ValueError(f"accept_ratio must be [b] or [b, 1], got shape {tuple(accept_ratio.shape)}")
    a = torch.nan_to_num(a, nan=0.0)
    k_hat = torch.floor(a * (block_size * rate)).clamp(min_len, block_size)
    return k_hat.long()


@lru_cache(maxsize=8)
def _power_sum_table(width: int) -> tuple[np.ndarray, np.ndarray]:
    """``(p, f(p))`` on a fine grid of ``p`` in ``[0, 1]``, ``f(p) = sum_{m=1..width} p^m`` (increasing in ``p``)."""
    p = np.linspace(0.0, 1.0, 2049)
    return p, (p[:, None] ** np.arange(1, width + 1)[None, :]).sum(axis=1)


def survival_curve(accept_ratio, block_size: int, rate: float = 1.0) -> np.ndarray:
    """The length head's estimate per row as a per-position survival curve ``[b, B-1]``: entry ``m-1`` is the
    probability that the first ``m`` drafts are all accepted, which is also the expected tokens draft slot
    ``m`` adds to the round when verified.

    The model: the head predicts ``a ~ (accepted + 1) / B`` (its training label), so with ``rate`` as a
    calibration scale (1.0: the label's meaning; :class:`CostRule` always passes 1.0, the drafter
    config's ``length_rate`` being the floor rule's) the expected accepted length is
    ``L = clamp(a * B * rate - 1, 0, B - 1)``. Drafts are taken to be accepted one by one with the same
    conditional probability ``p`` (a geometric accepted length, truncated at the block), ``p`` solving
    ``sum_{m=1..B-1} p^m = L``; the survival of position ``m`` is ``p^m``. A point estimate says nothing of
    the spread, and a geometric tail keeps some worth in positions past ``L`` (rounds that accept more than
    predicted), so a cheap verify still reaches them. NaN ratios read as 0.

    Example:
        >>> survival_curve(torch.tensor([0.0, 1.0]), block_size=4).tolist()
        [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    """
    p = draft_acceptance(accept_ratio, block_size, rate)
    return p[:, None] ** np.arange(1, block_size)[None, :]


def draft_acceptance(accept_ratio, block_size: int, rate: float = 1.0) -> np.ndarray:
    """The per-draft acceptance ``p`` of :func:`survival_curve`'s model, per row (``[b]``): the conditional probability
    that a draft is accepted after the ones before it were, ``sum_{m=1..B-1} p^m`` being the accepted length the
    ratio predicts. :func:`ratio_of_acceptance` is its inverse.

    Example:
        >>> draft_acceptance([1 / 16, 1.0], 16).tolist()
        [0.0, 1.0]
    """
    width = block_size - 1
    a = np.asarray(accept_ratio, dtype=np.float64).reshape(-1)
    target = np.minimum(np.maximum(np.where(np.isnan(a), 0.0, a) * (block_size * rate) - 1.0, 0.0), width)
    p_grid, f_grid = _power_sum_table(width)
    return np.interp(target, f_grid, p_grid)


def ratio_of_acceptance(p, block_size: int) -> np.ndarray:
    """The ratio ``(1 + sum_{m=1..B-1} p^m) / B`` a row of per-draft acceptance ``p`` expects: the inverse of
    :func:`draft_acceptance` at rate 1.

    Example:
        >>> ratio_of_acceptance([0.0, 1.0], 16).tolist()
        [0.0625, 1.0]
    """
    p = np.asarray(p, dtype=np.float64).reshape(-1)
    width = block_size - 1
    q = np.minimum(p, 1.0 - 1e-12)  # the geometric sum in closed form; p = 1 is its limit, width
    length = np.where(p >= 1.0, float(width), q * (1.0 - q**width) / (1.0 - q))
    return (1.0 + length) / block_size


def cost_aware_verify_length(
    accept_ratio: torch.Tensor,
    block_size: int,
    round_cost: RoundCost | None = None,
    rate: float = 1.0,
    min_len: int = 1,
    max_len: torch.Tensor | None = None,
    unread_whole: bool = False,
    drafted: bool = False,
) -> torch.Tensor:
    """The round's verify lengths that maximise expected committed tokens per unit of round time (``LongTensor[b]``,
    on the CPU).

    Each row's length-head ratio becomes a survival curve (:func:`survival_curve`): verifying draft slot ``m``
    of row ``i`` adds ``s[i, m]`` expected tokens. The round's time is shared by all its rows,
    ``round_cost.round_time(b, b + slots, B)``: the verify, the drafter and a drafting round's overhead when any slot
    is verified, the verify and a plain round's overhead when none is (plain decoding: the drafter need not run).
    A large overhead per round makes each verified slot cheap against the round (longer verifies), and one that a
    drafting round pays more than a plain one counts against drafting. Slots are handed out
    greedily, most valuable first (the curves fall along each row, so each row's slots come in order), and the
    number of slots that gives the best ``(b + sum of their s) / time`` wins; among equal rates the most slots
    (a verify that costs nothing extra may accept more than predicted). A row never gets more than
    ``max_len[i]`` (``[b]``) nor fewer than ``min_len`` slots in all (the bonus one included), when ``max_len``
    allows. A flat cost verifies every row's whole block; a steep one, fewer tokens; a drafter that costs more
    than the expected acceptance earns, plain decoding (every ``k_hat`` 1). ``unread_whole``: the round is decided
    before its drafter runs, and verifying every row's whole block (all ``max_len`` allows) spares it the read of
    its ratios mid-round, ``round_cost.read_time(b)`` less time (the engine's whole-block stretches); once the
    ratios are read, that time is spent and the flag is off. ``drafted``: the drafter has run for the round already
    (a loop that drafts every round, then chooses): its time and the drafting overhead stay in the round's time
    whatever the lengths, so a plain verify saves only the verify's slots: drafts the rule would not have drafted for
    are verified where their slots pay.

    Example:
        >>> ratio = torch.tensor([0.1, 0.25])
        >>> cost_aware_verify_length(ratio, 16, RoundCost.flat()).tolist()
        [16, 16]
        >>> cost_aware_verify_length(ratio, 16, RoundCost.flat(draft_fraction=5.0)).tolist()  # drafting cannot pay
        [1, 1]
        >>> cost_aware_verify_length(ratio, 16, RoundCost.flat(spec_overhead=5.0)).tolist()  # nor a dear round
        [1, 1]
        >>> cost_aware_verify_length(torch.tensor([0.2]), 16, RoundCost()).tolist()  # SPEC at batch 1: the tail not worth it
        [13]
        >>> cost_aware_verify_length(torch.tensor([0.2]), 16, RoundCost(), unread_whole=True).tolist()  # unless it spares the read
        [16]
        >>> cost_aware_verify_length(torch.tensor([0.1]), 16, RoundCost()).tolist()  # a drafter not worth running
        [1]
        >>> cost_aware_verify_length(torch.tensor([0.1]), 16, RoundCost(), drafted=True).tolist()  # once it has run
        [5]
    """
    _check_len_bounds(block_size, min_len)
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite number > 0, got {rate}")
    a = accept_ratio.detach().float().cpu()
    if a.dim() == 2 and a.shape[1] == 1:
        a = a.squeeze(1)
    if a.dim() != 1:
        raise ValueError(f"accept_ratio must be [b] or [b, 1], got shape {tuple(accept_ratio.shape)}")
    b, width = a.shape[0], block_size - 1
    cap = np.full(b, block_size, dtype=np.int64)
    if max_len is not None:
        cap = np.asarray(torch.as_tensor(max_len).cpu(), dtype=np.int64).reshape(-1)
        if cap.shape != (b,) or (cap < 1).any():
            raise ValueError(f"max_len must be [b={b}] lengths >= 1, got {cap.tolist()}")
    cost = round_cost if round_cost is not None else RoundCost()
    if b == 0 or width == 0:
        return torch.ones(b, dtype=torch.long)
    surv = survival_curve(a.numpy(), block_size, rate)  # [b, W]
    m = np.arange(1, width + 1)[None, :]
    allowed = m < np.minimum(cap, block_size)[:, None]  # slot m verifies draft m: k_hat = m + 1 <= cap
    forced = allowed & (m < min_len)
    key = np.where(forced, 2.0, np.where(allowed, surv, -1.0))
    # Slot-major order (all rows' slot 1, then slot 2, ...) and a stable sort: equal values keep slots in order.
    flat_key, flat_surv = key.T.reshape(-1), surv.T.reshape(-1)
    order = np.argsort(-flat_key, kind="stable")[: int(allowed.sum())]
    gain = b + np.concatenate([[0.0], np.cumsum(flat_surv[order])])
    t = np.arange(order.shape[0] + 1)
    time = cost.round_time(b, b + t, block_size, drafted)  # the whole round's: its overhead makes its slots cheaper
    if unread_whole and t[-1] > 0:  # every allowed slot is every row's whole block: no mid-round read
        time[-1] -= cost.read_time(b)
    rate_of = np.where(t >= int(forced.sum()), gain / time, -np.inf)
    best = int(np.flatnonzero(rate_of >= rate_of.max() * (1 - 1e-9))[-1])  # the most slots among the best
    k_hat = 1 + np.bincount(order[:best] % b, minlength=b)
    return torch.from_numpy(k_hat).long()


def fixed_verify_length(batch: int, block_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """DFlash baseline: every row verifies its full block.

    Example:
        >>> fixed_verify_length(2, 16).tolist()
        [16, 16]
    """
    _check_len_bounds(block_size, 1)
    if batch < 0:
        raise ValueError(f"batch must be >= 0, got {batch}")
    return torch.full((batch,), block_size, dtype=torch.long, device=device)


def expected_gain_verify_length(
    position_accept_probs: torch.Tensor,
    cost_per_token: float | torch.Tensor,
    base_cost: float = 1.0,
    min_len: int = 1,
) -> torch.Tensor:
    """DSpark-style policy: pick the draft prefix with most expected tokens per unit verify cost.

    ``position_accept_probs[i, j-1] = c_j`` is row ``i``'s probability that draft position ``j``
    is accepted given positions ``< j`` were (``[b, B-1]``, so ``B`` is inferred). Verifying
    ``k`` draft tokens then yields, in expectation,
    ``gain(k) = 1 + sum_{m=1..k} prod_{j<=m} c_j`` tokens (the 1 is the target's own token), and
    costs ``cost(k) = base_cost + cost_per_token * (k + 1)``: a fixed per-round cost (weights
    read, launch) plus a per-verified-token cost for the ``k + 1`` slots sent (bonus included),
    matching the shape of a measured verify latency table. ``cost_per_token`` may be a float or a
    ``[b]`` tensor (e.g. larger under load). The ``k`` maximising ``gain / cost`` wins, ties to
    the shortest (same speed, less compute); returns ``clamp(k + 1, min_len, B)``.

    Example:
        >>> c = torch.tensor([[0.9, 0.9, 0.1], [0.05, 0.05, 0.05]])
        >>> expected_gain_verify_length(c, cost_per_token=0.1).tolist()
        [3, 1]
    """
    if position_accept_probs.dim() != 2:
        raise ValueError(
            f"position_accept_probs must be [b, B-1], got shape {tuple(position_accept_probs.shape)}"
        )
    block_size = position_accept_probs.shape[1] + 1
    _check_len_bounds(block_size, min_len)
    cpt = torch.as_tensor(cost_per_token, dtype=torch.float32, device=position_accept_probs.device)
    if bool((cpt < 0).any()) or base_cost < 0:
        raise ValueError(f"costs must be >= 0, got cost_per_token={cost_per_token}, base_cost={base_cost}")
    if bool((cpt + base_cost <= 0).any()):
        raise ValueError("base_cost + cost_per_token must be > 0 (a verify cannot be free)")

    c = torch.nan_to_num(position_accept_probs.detach().float(), nan=0.0).clamp(0.0, 1.0)
    b = c.shape[0]
    # survive[:, m] = P(first m drafts all accepted); gain[:, k] = sum_{m=0..k} survive[:, m].
    survive = torch.cat([c.new_ones(b, 1), torch.cumprod(c, dim=1)], dim=1)  # [b, B]
    gain = torch.cumsum(survive, dim=1)
    k = torch.arange(block_size, dtype=torch.float32, device=c.device)
    cost = base_cost + cpt.reshape(-1, 1) * (k + 1)[None, :]
    # argmax returns the first maximum, i.e. the shortest k among ties.
    best_k = torch.argmax(gain / cost, dim=1)
    return (best_k + 1).clamp(min_len, block_size).long()


def load_scaled_rate(
    base_rate: float,
    batch_size: int,
    halving_batch: int = 64,
    min_rate: float = 0.25,
) -> float:
    """Shrink the verify-length ``rate`` as the batch grows (monotone non-increasing in batch).

    ``rate = max(floor, base_rate / (1 + log2(batch) / log2(halving_batch)))`` with
    ``floor = min(min_rate, base_rate)``: ``base_rate`` at batch ``<= 1``, half of it at
    ``halving_batch``. Why log-shaped: a verify of ``q`` tokens per request
    stays near the cost of a plain step at small batch and grows steeply once the target is
    compute-bound (~5x for 16 tokens at 128 requests), so long verifies should get rarer
    gradually, not at a cliff. The floor keeps the head able to verify a few tokens even at huge
    batch (``k_hat`` is also clamped to ``>= min_len`` downstream).

    Example:
        >>> load_scaled_rate(1.0, 1), load_scaled_rate(1.0, 64)
        (1.0, 0.5)
    """
    if not (math.isfinite(base_rate) and base_rate > 0):
        raise ValueError(f"base_rate must be a finite number > 0, got {base_rate}")
    if halving_batch < 2:
        raise ValueError(f"halving_batch must be >= 2, got {halving_batch}")
    if not min_rate > 0:
        raise ValueError(f"min_rate must be > 0, got {min_rate}")
    if batch_size <= 1:
        return float(base_rate)
    rate = base_rate / (1.0 + math.log2(batch_size) / math.log2(halving_batch))
    return float(max(min(min_rate, base_rate), rate))
