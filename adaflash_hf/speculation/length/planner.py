"""Each round's plan: whether it drafts at all, whether it waits for its length-head ratios, and each row's verify
length. :class:`LengthPlanner` is the one object generate's eager loop and the engine ask, with the per-round state
it keeps between rounds (built and tested alone: it reads rows, never a loop).

Under the ``cost`` policy the verify lengths come from the length head's ratios, which need the drafter's body.
Before running it, the round is decided on a **guess** of each row's acceptance (:meth:`LengthPlanner.guess`: its
rounds' mean acceptance shrunk toward the traffic's; a round's ratio says little of the next round's): when the guesses
say every row decodes plainly, the round is a **plain** plan (:attr:`Plan.draft` False): the drafter's body does not
run, the loop decodes one token per row as plain decoding does (the engine as its ``off`` layout's step). A probe
round drafts anyway, so the ratios, and a return to drafting, follow the text: after as many plain rounds as cost
four times what a probe adds (``FIRST_PROBE_SHARE``: probing takes at most a fifth of the time from the first plain
decision on), then twice as many, ... doubling while the probes keep saying plain (one low ratio amid drafting text
costs one plain round, not eight), up to the cap of :meth:`LengthPlanner.probe_holds`: at least
``PLAIN_PROBE_ROUNDS``, and as many as keep the probes' extra time (the drafter's body and a drafting round's
overhead, by the round cost at this batch) within ``PROBE_SHARE`` of the plain rounds' between them. Where the
traffic's own mean acceptance decodes this batch plainly (:meth:`LengthPlanner.traffic_plain`: plain is the norm, not
a dip), the probes wait the cap from the first. Where even a
round whose every draft were accepted would not pay (:meth:`LengthPlanner.never_pays`: a small pair on a fast GPU),
no round drafts at that batch, not the first nor a probe: nothing the text does could make drafting pay. A plain round
is priced as the loop runs it: in the engine's stretches, ``plain_steps`` rounds share one read.

The mirror case, **whole-block plans** (:attr:`Plan.whole`): when the guesses say every row verifies its whole block
(a flat cost, at small batches), the round does not wait for this round's ratios in the middle (a device read between
the drafter's body and its LM head, during which the GPU idles): it verifies whole blocks, as ``fixed`` does, and
reads the ratios with the round's one read at its end, for the next round's decision. The guess counts what skipping
the read saves (:attr:`~.cost.RoundCost.read_overhead`). Lossless like any verify length.

A **probe**, or any drafting round whose ratios say every row should decode plainly, has paid for its drafter's
body by the time the ratios are read: the plain decision holds for the rounds after it, priced with the body, but the
round itself verifies what pays with the body spent (``drafted=True``), so a probe commits the drafts the head
under-rated and its rounds' acceptance reaches the guess.

The ``cost`` rule reads the head's ratios as the traffic **calibrates** them (:class:`~.calibration.HeadCalibration`):
every verified draft up to and including the first rejected one is a trial, censored rounds included, and one shift
of the head's per-draft acceptance is fitted to them. A head that under-rates this traffic (trained on other text)
would otherwise keep the planner plain for good: its probes verify what the head asks for, and a round that accepts
all of it says no more than the head did.

Rows are any objects with ``head_ratio`` (the last ratio read, ``None`` before the first), ``seen`` (sum and count of
the acceptance ratios its drafting rounds showed) and ``remaining`` (tokens it may still emit): the engine's requests,
generate's :class:`RowState`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .calibration import HeadCalibration
from .cost import RoundCost
from .names import LengthPolicy, LengthSettings
from .rules import CostRule, FixedRule, RoundInputs, make_rule

__all__ = ["FIRST_PROBE_SHARE", "GUESS_PRIOR_ROUNDS", "LengthPlanner", "PLAIN_PROBE_ROUNDS", "PROBE_SHARE", "Plan",
           "RowState", "TRAFFIC_DECAY"]

PLAIN_PROBE_ROUNDS = 8  # the fewest plain rounds between probes once the back-off has grown
PROBE_SHARE = 0.02  # the most of the plain rounds' time that probing them may add
FIRST_PROBE_SHARE = 0.25  # the first probe after a plain decision waits until the plain rounds have cost 4x what it adds
PROBE_CAP = 1024  # the most plain rounds between probes whatever the cost (text can turn draftable)
GUESS_PRIOR_ROUNDS = 8.0  # the guess before a round: a row's mean acceptance, shrunk by this many traffic rounds
TRAFFIC_DECAY = 0.999  # the traffic's mean acceptance weighs its last ~1,000 rounds that verified drafts


@dataclass
class RowState:
    """One row's part of the planner's state, for a loop without request objects of its own (generate's).

    Example:
        >>> RowState(remaining=5).head_ratio is None
        True
    """

    remaining: int = 1
    head_ratio: float | None = None
    seen: tuple = (0.0, 0)


@dataclass(frozen=True)
class Plan:
    """What a round does before its drafter runs: ``draft`` (run the drafter's body; False: a plain round, one token
    per row, no drafter) and ``whole`` (verify whole blocks without waiting for the ratios, read at the round's end)."""

    draft: bool
    whole: bool = False

    @property
    def plain(self) -> bool:
        return not self.draft


class LengthPlanner:
    """The verify-length decisions of a loop, round by round, and the state they keep (module doc).

    Args:
        settings: the policy and its knobs (resolved for the drafter: :meth:`LengthSettings.resolved`).
        block_size: the drafter's block.
        round_cost: what the ``cost`` rule weighs (default :class:`~.cost.RoundCost`).
        layout: the engine's round layout (``packed``, ``rectangular``, ``fixed``); generate's loop is ``packed``.
        plain_steps: how many plain rounds share one device read (:attr:`plain_steps`; the engine's ``decode_steps``).

    ``whole_block_stretches`` (default on) lets ``cost`` rounds skip their mid-round read when whole; ``calibrate_head``
    (default on) makes the ``cost`` rule read the head's ratios as the traffic's trials calibrate them
    (:attr:`calibration`, :mod:`.calibration`); ``traffic_seen``
    is what the traffic's rounds accepted (a decayed sum and its weight), the prior of every guess: a planner that
    replaces another for the same pair may start from it.

    Example:
        >>> planner = LengthPlanner(LengthSettings("cost", 1.0, 1), 8, RoundCost.flat())
        >>> rows = [RowState(remaining=20, head_ratio=0.5)]
        >>> planner.plan(rows), planner.lengths(rows, torch.tensor([0.5])).tolist()
        (Plan(draft=True, whole=True), [8])
    """

    def __init__(self, settings: LengthSettings, block_size: int, round_cost: RoundCost | None = None,
                 layout: str = "packed", plain_steps: int = 1):
        self.block_size, self.layout = block_size, layout
        self.whole_block_stretches = True
        self.calibrate_head = True
        self._settings, self._cost = settings, round_cost if round_cost is not None else RoundCost()
        self.reset()
        self.plain_steps = plain_steps  # prices the cost and makes the rule

    # ------------------------------------------------------------------ settings
    @property
    def settings(self) -> LengthSettings:
        return self._settings

    @settings.setter
    def settings(self, value: LengthSettings) -> None:
        self._settings = value
        self._reprice()

    @property
    def round_cost(self) -> RoundCost:
        return self._cost

    @round_cost.setter
    def round_cost(self, value: RoundCost) -> None:
        self._cost = value
        self._reprice()

    @property
    def plain_steps(self) -> int:
        """How many plain rounds share one device read (the engine's plain stretches, its ``decode_steps``; 1 for a
        loop that reads every round): a plain round is priced with that share of the cost's ``plain_overhead``."""
        return self._plain_steps

    @plain_steps.setter
    def plain_steps(self, value: int) -> None:
        self._plain_steps = max(1, int(value))
        self._reprice()

    def _reprice(self) -> None:
        """The cost as this loop's plain rounds pay it, and the rule made with it; every verdict is asked again."""
        c = self._cost
        self._priced = replace(c, plain_overhead=tuple(o / self._plain_steps for o in c.plain_overhead))
        self._rule = make_rule(self._settings, self._priced) if self._settings.policy is not None else FixedRule()
        self._never = {}  # never_pays by row count
        self._epoch += 1

    @property
    def policy(self) -> LengthPolicy:
        return LengthPolicy(self._settings.policy)

    @property
    def rule(self):
        """The rule the settings name, with its own knobs (:mod:`.rules`)."""
        return self._rule

    @property
    def cost_rule(self) -> bool:
        """Whether this planner's rule is ``cost`` (the only one with guesses, probes and whole-block plans)."""
        return isinstance(self._rule, CostRule)  # asked for every plain round: no enum lookup

    def reset(self) -> None:
        """The state between rounds, as a new loop has it."""
        self.plain_rounds = 0  # rounds in a row whose drafter body the cost policy skipped
        self.plain_limit = 0  # how many it may skip before the next probe
        self.drafted_plain = False  # the cost policy's last drafted round's ratios said: decode every row plainly
        self.traffic_seen = (0.0, 0.0)  # the traffic's acceptance: decayed sum and count of rounds that verified drafts
        self._epoch = 0  # bumped whenever a guess may change: ratios read, rounds observed, settings or cost set
        self._verdict = None  # the last plain-by-guess verdict, for the same rows and epoch (plain rounds repeat it)
        self.calibration = HeadCalibration(self.block_size, TRAFFIC_DECAY)  # the head against the traffic's trials

    # ------------------------------------------------------------------ guesses
    def guess(self, r) -> float:
        """``r``'s expected acceptance ratio in its next round, before its drafter runs. Rounds hardly predict each
        other: the best guess is the row's own level, the mean of what its rounds that verified drafts accepted, shrunk
        toward the traffic's mean by ``GUESS_PRIOR_ROUNDS`` rounds (a new row's first rounds say little), so a row yet
        to draft is guessed at the traffic's mean: where the traffic says this batch decodes plainly, its first round
        does not run the drafter for nothing. Until any round has been seen: the last ratio, and a row yet to draft
        counts as accepting everything (its first round drafts). ``GUESS_PRIOR_ROUNDS`` 0: that, whatever was seen."""
        if GUESS_PRIOR_ROUNDS <= 0 or self.traffic_seen[1] == 0:
            return 1.0 if r.head_ratio is None else r.head_ratio
        prior = self.traffic_seen[0] / self.traffic_seen[1]
        return (GUESS_PRIOR_ROUNDS * prior + r.seen[0]) / (GUESS_PRIOR_ROUNDS + r.seen[1])

    def observe(self, r, accepted: int, verify_len: int) -> None:
        """Count what a round that verified drafts says of ``r``'s acceptance, as a ratio like the head's, into the
        row's and the traffic's sums (the traffic's decayed, so it follows a change of the prompt mix):
        ``(accepted + 1) / B``; where every verified draft was accepted short of the block (a censored count: it would
        have accepted at least that many), at least the head's ratio of the round."""
        if verify_len <= 1 or not self.cost_rule:  # the cheap test first: plain steps call this for every token
            return
        seen = (accepted + 1) / self.block_size
        if r.head_ratio is not None:
            calibrated = r.head_ratio
            if self.calibrate_head:
                self.calibration.add(r.head_ratio, accepted, verify_len - 1)
                calibrated = self.calibration.ratio(r.head_ratio)
            if accepted >= verify_len - 1 and verify_len < self.block_size:
                seen = max(seen, calibrated)
        r.seen = (r.seen[0] + seen, r.seen[1] + 1)
        self.traffic_seen = (TRAFFIC_DECAY * self.traffic_seen[0] + seen, TRAFFIC_DECAY * self.traffic_seen[1] + 1)
        self._epoch += 1

    def guessed_lengths(self, rows, unread_whole: bool | None = None, sink: bool = False) -> torch.Tensor:
        """The verify lengths the rule gives the rows' guesses, which decide a round before its drafter body runs.
        Where the round may verify whole blocks without reading its ratios (``unread_whole``; ``None``:
        :meth:`may_skip_read` says), the rule counts the read that choice saves."""
        if unread_whole is None:
            unread_whole = self.may_skip_read(rows, sink)
        guess = torch.tensor([self.guess(r) for r in rows])
        return self._choose(rows, guess, unread_whole=unread_whole, drafted=False)

    def may_skip_read(self, rows, sink: bool = False) -> bool:
        """Whether a drafting round of ``rows`` may verify whole blocks without this round's ratios: under ``cost``
        with ``whole_block_stretches``, in the packed layout, with no round sink (``sink``: it is promised each round's
        own prediction), every row having drafted before (none yet: read them)."""
        return (self.whole_block_stretches and self.cost_rule and self.layout == "packed" and not sink
                and all(r.head_ratio is not None for r in rows))

    def never_pays(self, n: int) -> bool:
        """Whether the cost rule decodes ``n`` rows plainly even if every draft were accepted (each ratio 1, whole
        blocks): on this round cost no drafter pays for a round at this batch, so no round drafts, not even a first
        round or a probe (acceptance cannot rise above all)."""
        never = self._never.get(n)
        if never is None:
            never = self._never[n] = self._plain_at(n, 1.0)
        return never

    def _plain_at(self, n: int, ratio: float) -> bool:
        """Whether the cost rule decodes ``n`` rows plainly, each with a whole block left and this acceptance ratio, as
        rows that drafted before (a whole block may spare its read)."""
        rows = [RowState(remaining=self.block_size) for _ in range(n)]
        unread = self.whole_block_stretches and self.layout == "packed"
        return bool((self._choose(rows, torch.full((n,), float(ratio)), unread_whole=unread) <= 1).all())

    def plain_by_guess(self, rows, sink: bool = False) -> bool:
        """Whether the cost rule, on the rows' guesses, decodes every row plainly. The verdict is kept for the same rows
        until a guess may change (a ratio read, a round observed, new settings) or a row's tokens left fall below its
        block: a run of plain rounds runs the rule once, not every round."""
        key = (self._epoch, sink, tuple(min(r.remaining, self.block_size) for r in rows))
        if self._verdict is not None and self._verdict[0] == key and len(self._verdict[1]) == len(rows) \
                and all(a is b for a, b in zip(self._verdict[1], rows)):
            return self._verdict[2]
        plain = bool((self.guessed_lengths(rows, sink=sink) <= 1).all())
        self._verdict = (key, list(rows), plain)
        return plain

    # ------------------------------------------------------------------ the plan
    def plan(self, rows, sink: bool = False) -> Plan:
        """The round's plan before its drafter runs (``sink``: a round sink is attached, promised every round's
        prediction: the round always drafts and reads its ratios): :meth:`drafts`, then :meth:`whole_blocks`."""
        if not self.drafts(rows, sink):
            return Plan(draft=False)
        return Plan(draft=True, whole=self.whole_blocks(rows, sink))

    def drafts(self, rows, sink: bool = False) -> bool:
        """The plan's first half: whether the round runs the drafter's body (a loop that launches the body
        asynchronously asks :meth:`whole_blocks` while it runs: nothing the body does changes that answer)."""
        return not self._skip_drafting(rows, sink)

    def plain_stretch(self, rows, most: int, sink: bool = False) -> int:
        """How many plain rounds in a row the ``cost`` policy decodes next behind one read, as ``off`` does (``most`` at
        most; 0: the next round is not plain by this test, the loop asks :meth:`plan`): drafting never pays at this
        batch (:meth:`never_pays`), or its last drafted round's ratios said plain (priced with the body), the guesses
        say so, and a probe is not due. A stretch is never cut short for a probe due inside it (a short stretch costs a
        whole read): the probe waits for its end; nor for a row that ends inside it (the loop drops that row's steps
        past its end): it lasts until the row with the most left is done. Counts them toward the next probe (none where
        drafting never pays)."""
        if not self.cost_rule or self.layout != "packed" or sink or not rows:
            return 0
        steps = min(most, max(r.remaining for r in rows))
        if self.never_pays(len(rows)):
            return steps
        if not self.drafted_plain or self.plain_rounds >= self.plain_limit or not self.plain_by_guess(rows, sink):
            return 0
        self.plain_rounds += steps
        return steps

    def whole_blocks(self, rows, sink: bool = False) -> bool:
        """The plan's second half, for a round that drafts: True when it verifies whole blocks without reading its
        ratios first: it may (:meth:`may_skip_read`), and the cost rule on the rows' guesses, counting the read this
        saves, chooses every row's whole block, or all it has left."""
        if not self.may_skip_read(rows, sink):
            return False
        whole = torch.tensor([min(self.block_size, r.remaining) for r in rows])
        return bool((self.guessed_lengths(rows, unread_whole=True, sink=sink) >= whole).all())

    def _skip_drafting(self, rows, sink: bool) -> bool:
        """True when no row would verify more than its bonus token this round: every row has one token left; under
        ``adaptive`` the (load-scaled) rate caps every ``k_hat`` at 1; under ``cost`` the round decodes plainly by the
        rows' guesses, but for a probe (after ``plain_limit`` such rounds in a row), which drafts to refresh the
        ratios. Lossless (a 1-token verify is plain decoding). Never while a round sink is attached."""
        if sink:
            return False
        if all(r.remaining <= 1 for r in rows):
            return True
        if self.layout not in ("packed", "rectangular"):
            return False
        if self.cost_rule:
            if self.never_pays(len(rows)):
                return True
            if not self.drafted_plain:  # the last round's own ratios asked for drafts: no need to guess again
                return False
            plain = self.plain_by_guess(rows, sink)
            self.plain_rounds = self.plain_rounds + 1 if plain else 0
            if self.plain_rounds > self.plain_limit:
                self.plain_rounds = 0
                return False
            return plain
        return self._rule.most(len(rows), self.block_size) <= 1

    # ------------------------------------------------------------------ lengths
    def lengths(self, rows, ratio: torch.Tensor | None, draft_logits: torch.Tensor | None = None) -> torch.Tensor:
        """Each row's ``k_hat`` (host ``LongTensor[n]``) from the round's length-head ``ratio`` (``None``: the whole
        block, as a whole-block plan or ``fixed`` verifies), after its drafter ran. Under ``cost`` the planner keeps the
        ratios and whether the rounds after this one decode plainly (priced with the drafter's body, which they would
        spare); a round so judged has spent its body and verifies what pays with it spent (``drafted=True``)."""
        n, B = len(rows), self.block_size
        if (ratio is None and draft_logits is None) or self.layout == "fixed":
            return FixedRule().lengths(RoundInputs(n, B))
        if ratio is not None:
            ratio = ratio.float().cpu().view(-1)  # the rules run on the host
        read = self.calibration.ratios(ratio) if self.calibrate_head and self.cost_rule and ratio is not None else ratio
        k_hat = self._choose(rows, read, draft_logits=draft_logits)
        if self.cost_rule:
            self.note_ratios(rows, ratio)  # the head's own: the calibration bins the trials by them
            self.drafted_plain = bool((k_hat <= 1).all())
            if self.drafted_plain:  # plain rounds before the next probe: the first hold, then doubling up to the cap
                k_hat = self._choose(rows, read, drafted=True)  # this round's body is spent: verify what pays all the same
                first, cap = self.probe_holds(n)
                self.plain_limit = cap if self.traffic_plain(n) else min(max(first, 2 * self.plain_limit), cap)
            else:
                self.plain_limit = 0
        return k_hat

    def traffic_plain(self, n: int) -> bool:
        """Whether ``n`` rows accepting the traffic's mean (none seen yet: False) decode plainly by the cost rule: a
        plain decision then is the traffic's norm at this batch, not a dip in drafting text, and its probes wait the
        cap of :meth:`probe_holds` from the first (a short first hold pays for a dip's quick return)."""
        return self.traffic_seen[1] > 0 and self._plain_at(n, self.traffic_seen[0] / self.traffic_seen[1])

    def note_ratios(self, rows, ratio) -> None:
        """The rows' last ratios (read with the round, or at its end after a whole-block plan)."""
        for r, a in zip(rows, torch.as_tensor(ratio).float().reshape(-1).tolist()):
            r.head_ratio = a
        self._epoch += 1

    def _choose(self, rows, ratio, draft_logits=None, unread_whole: bool = False, drafted: bool = False) -> torch.Tensor:
        left = torch.tensor([r.remaining for r in rows])
        return self._rule.lengths(RoundInputs(len(rows), self.block_size, ratio, draft_logits, left, unread_whole,
                                              drafted))

    def probe_holds(self, n: int) -> tuple[int, int]:
        """The plain rounds of ``n`` rows before the first probe after a plain decision, and the most between two
        probes, from a probe's extra time against a plain round (the round cost: the drafter's body, a drafting
        round's overhead over a plain one's, the same 1-token verify): the first waits until the plain rounds have
        cost 1 / ``FIRST_PROBE_SHARE`` times what the probe adds, the most keeps the probes within ``PROBE_SHARE`` of
        the plain rounds' time, at least ``PLAIN_PROBE_ROUNDS``, both at most ``PROBE_CAP``.

        Example:
            >>> LengthPlanner(LengthSettings("cost", 1.0, 1), 16, RoundCost.flat()).probe_holds(8)
            (1, 8)
        """
        c = self._priced
        extra = c.draft_time(n, self.block_size) + c.overhead(n, True) - c.overhead(n, False)
        plain = c.verify_time(n, n) + c.overhead(n, False)
        cap = int(min(max(PLAIN_PROBE_ROUNDS, math.ceil(extra / (PROBE_SHARE * plain))), PROBE_CAP))
        return int(min(max(1, math.ceil(extra / (FIRST_PROBE_SHARE * plain))), cap)), cap
