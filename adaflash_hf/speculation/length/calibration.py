"""How far the length head's ratios are from what the traffic then accepts, learnt from the rounds while serving.

The cost rule reads a row's ratio as a per-draft acceptance ``p`` (:func:`.rules.draft_acceptance`: the conditional
probability that a draft is accepted after the ones before it were). A head trained on other text, or one that
regresses to the mean, under- or over-rates what this traffic accepts, and the rule then verifies too little or too
much. A verified round says what the target accepted of what it verified: each draft up to and including the first
rejected one is a **trial** (accepted: a success; the first rejected: a failure; drafts past it, or never verified:
nothing). A round whose every verified draft was accepted (censored) counts its successes only, so what the traffic
shows is not capped by what the head asked to verify.

:class:`HeadCalibration` fits one shift ``delta`` of the head's per-draft acceptance on the logit scale,
``p' = sigmoid(logit(p) + delta)``, at the maximum of the trials' likelihood under a normal prior on ``delta`` worth
``PRIOR_TRIALS`` trials (a few rounds say little). The trials are kept in bins of the head's ratio and decay like the
traffic's mean acceptance (one factor per verified row); they are folded in and the shift refitted when a round's
ratios are asked for (:meth:`HeadCalibration.ratios`: the ratio of ``p'``, :func:`.rules.ratio_of_acceptance`,
which the cost rule then reads; until a trial is seen, the head's own ratio) and the rows added since make
``REFIT_SHARE`` of those the fit rests on: at most once a round, never for every row a round verifies.
"""

from __future__ import annotations

import numpy as np
import torch

from .rules import draft_acceptance, ratio_of_acceptance

__all__ = ["BINS", "HeadCalibration", "PRIOR_TRIALS", "REFIT_SHARE"]

BINS = 64  # bins of the head's ratio the trials are kept in
PRIOR_TRIALS = 64.0  # the prior's weight: a shift needs about this many trials to move halfway to what they say
GRID = 512  # the calibrated ratio is looked up on this many steps of the head's ratio
_CLIP = 1e-3  # per-draft acceptance kept off 0 and 1, where the logit is infinite
REFIT_SHARE = 1 / 32  # the fit waits until the rows added since make this share of the rows it rests on


class HeadCalibration:
    """The traffic's trials against the head's ratios, and the ratios the cost rule reads (module doc).

    Args:
        block_size: the drafter's block.
        decay: each verified row's weight falls by this factor per row verified after it.

    Example:
        >>> cal = HeadCalibration(16)
        >>> for _ in range(50):  # the head says 0.125 (about one draft); every round accepts all 7 it verified
        ...     cal.add(0.125, accepted=7, drafts=7)
        >>> cal.ratios(torch.tensor([0.125])).item() > 0.3, cal.shift > 1.0, cal.ratio(0.125) > 0.3
        (True, True, True)
    """

    def __init__(self, block_size: int, decay: float = 0.999):
        self.block_size, self.decay = block_size, decay
        centers = (np.arange(BINS) + 0.5) / BINS
        p = np.clip(draft_acceptance(centers, block_size), _CLIP, 1.0 - _CLIP)
        self._logit = np.log(p / (1.0 - p))
        self._grid = np.linspace(0.0, 1.0, GRID + 1)
        grid_p = np.clip(draft_acceptance(self._grid, block_size), _CLIP, 1.0 - _CLIP)
        self._grid_logit = np.log(grid_p / (1.0 - grid_p))
        self.reset()

    def reset(self) -> None:
        """No trials: every ratio is the head's own."""
        self._trials, self._accepted = np.zeros(BINS), np.zeros(BINS)
        self._new_trials, self._new_accepted, self._pending = [0.0] * BINS, [0.0] * BINS, 0
        self._shift, self._table, self._rows = 0.0, None, 0.0

    def add(self, ratio: float, accepted: int, drafts: int) -> None:
        """One verified row: the head's ``ratio`` for its round, ``drafts`` drafts verified, the first ``accepted`` of
        them accepted. Cheap (called for every verified row): the fit waits until a ratio is asked for."""
        if drafts < 1 or not ratio >= 0.0:  # nothing verified, or no (finite) ratio: nothing learnt
            return
        b = min(int(ratio * BINS), BINS - 1)
        self._new_trials[b] += accepted + (accepted < drafts)
        self._new_accepted[b] += accepted
        self._pending += 1

    @property
    def trials(self) -> float:
        """The decayed number of trials the shift rests on."""
        self._fold(force=True)
        return float(self._trials.sum())

    @property
    def shift(self) -> float:
        """``delta``: how far the traffic's per-draft acceptance lies above the head's, on the logit scale."""
        self._fold(force=True)
        return self._shift

    def ratios(self, ratio: torch.Tensor) -> torch.Tensor:
        """The ratios the cost rule reads for the head's ``ratio`` (any shape, float32 on its device): the head's own
        until a trial is seen."""
        self._fold()
        if self._table is None:
            return ratio
        x = ratio.detach().float().cpu().numpy()
        out = np.interp(np.nan_to_num(x, nan=0.0), self._grid, self._table)
        return torch.from_numpy(out.astype(np.float32)).reshape(ratio.shape).to(ratio.device)

    def ratio(self, ratio: float) -> float:
        """:meth:`ratios` of one ratio (host float) as the last fit has it: the trials added since wait for the next
        :meth:`ratios` (once a round), not refitted for every verified row."""
        if self._table is None or not ratio >= 0.0:
            return ratio
        return float(self._table[min(int(round(ratio * GRID)), GRID)])

    def _fold(self, force: bool = False) -> None:
        """The rows added since the last fit into the decayed bins, and the shift fitted again: once they make
        ``REFIT_SHARE`` of the rows the fit rests on (a round of one row refits every few dozen rounds, a round of many
        every round), or ``force``."""
        if not self._pending or (not force and self._pending < REFIT_SHARE * self._rows):
            return
        f = self.decay ** self._pending
        self._rows = self._rows * f + self._pending
        self._trials = self._trials * f + np.asarray(self._new_trials)
        self._accepted = self._accepted * f + np.asarray(self._new_accepted)
        self._new_trials, self._new_accepted, self._pending = [0.0] * BINS, [0.0] * BINS, 0
        self._shift = self._fit()
        p = 1.0 / (1.0 + np.exp(-(self._grid_logit + self._shift)))
        self._table = ratio_of_acceptance(p, self.block_size)

    def _fit(self) -> float:
        """The shift of largest posterior (Newton's method on a concave log-likelihood, from the last shift)."""
        n, s, logit = self._trials, self._accepted, self._logit
        prior = 0.25 * PRIOR_TRIALS  # the prior's precision: PRIOR_TRIALS trials at p = 1/2
        d = self._shift
        for _ in range(50):
            q = 1.0 / (1.0 + np.exp(-(logit + d)))
            step = ((s - n * q).sum() - prior * d) / ((n * q * (1.0 - q)).sum() + prior)
            d += float(np.clip(step, -2.0, 2.0))
            if abs(step) < 1e-6:
                break
        return float(np.clip(d, -10.0, 10.0))
