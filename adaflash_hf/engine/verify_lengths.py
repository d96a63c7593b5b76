"""Each engine round's verify lengths: the one place the engine calls :func:`~adaflash_hf.speculation.length_policy.choose_verify_length`,
and when a round may skip the drafter's body because nothing it drafts would be verified, or skip reading the ratios
because every request would verify its whole block.

Under the ``cost`` policy the verify lengths come from the length head's ratios, which need the drafter's body.
Before running it, the round is decided on a **guess** of each request's acceptance (:meth:`VerifyLengths._guess`: its
rounds' mean acceptance shrunk toward the traffic's; a round's ratio says little of the next round's): when the guesses
say every request decodes plainly,
the body is skipped (only the new context is stored, which keeps the drafter's cache exact). A probe round drafts
anyway, so the ratios, and a return to drafting, follow the text: after as many plain rounds as cost four times what a
probe adds (``FIRST_PROBE_SHARE``: probing takes at most a fifth of the time from the first plain decision on; 2
rounds at batch 1, 9 at 128 requests on the H200's measured 8B cost), then twice as many, ...
doubling while the probes keep saying plain (one low ratio amid drafting text costs one plain round, not eight: on the reference
pair's RAG prompts at c=1 a fixed cadence of 8 lost 8% tau against a probe every round,
``docs/logs/stretches_cpu_1204``), up to the cap of :meth:`~VerifyLengths._probe_holds`: at least ``PLAIN_PROBE_ROUNDS``, and
as many as keep the probes' extra time (the drafter's body and a drafting round's overhead, by ``round_cost`` at this
batch) within ``PROBE_SHARE`` of the plain rounds' between them. A probe costs a fraction of a plain step at batch 1
but several at 128 requests (the body runs every block position of every request): a fixed cadence of 8 would spend
a quarter of the time there probing for drafts that cannot pay.

The mirror case, **whole-block stretches**: when the guesses say every request verifies its whole block (a flat
cost, at small batches), the round does not wait for this round's ratios in the middle (a device read between the
drafter's body and its LM head, during which the GPU idles): it verifies whole blocks, as ``fixed`` does, and reads the
ratios with the round's one read at its end, for the next round's decision. The guess counts what skipping the read
saves (:attr:`~adaflash_hf.speculation.round_cost.RoundCost.read_overhead`): at a batch where a verify slot costs
little, a tail of drafts worth less than the slots it occupies but more than the read becomes a whole block, where
the packed round would otherwise pay the read to save the slots (issue 35: at c <= 8 on the H200 the packed round cost
1.1-1.4 ms more than ``fixed``'s at equal length). Lossless like any verify length.

A **probe**, or any drafting round whose ratios say every request should decode plainly, has paid for its drafter's
body by the time the ratios are read: the plain decision holds for the rounds after it, priced with the body, but the
round itself verifies what pays with the body spent (``drafted=True``), so a probe commits the drafts the head
under-rated and its rounds' acceptance reaches the guess (on the reference pair's Spec-Bench summarization at c=1, the
projection of ``docs/logs/spent_probe_cpu_1205``: tau 0.963 -> 0.997 of ``fixed``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..speculation.length_policy import LengthPolicy, choose_verify_length, load_scaled_rate

__all__ = ["FIRST_PROBE_SHARE", "GUESS_PRIOR_ROUNDS", "PLAIN_PROBE_ROUNDS", "PROBE_SHARE", "TRAFFIC_DECAY",
           "VerifyLengths"]

PLAIN_PROBE_ROUNDS = 8  # the fewest plain rounds between probes once the back-off has grown
PROBE_SHARE = 0.02  # the most of the plain rounds' time that probing them may add
FIRST_PROBE_SHARE = 0.25  # the first probe after a plain decision waits until the plain rounds have cost 4x what it adds
PROBE_CAP = 1024  # the most plain rounds between probes whatever the cost (text can turn draftable)
GUESS_PRIOR_ROUNDS = 8.0  # the guess before a round: a request's mean acceptance, shrunk by this many traffic rounds
TRAFFIC_DECAY = 0.999  # the traffic's mean acceptance weighs its last ~1,000 rounds that verified drafts


class VerifyLengths:
    """Mixin of :class:`~.engine.Engine` (it owns ``policy``, ``layout``, ``block_size``, ``round_cost``,
    ``length_rate``, ``length_min``, ``halving_batch``, ``on_round``, ``whole_block_stretches``, ``_plain_rounds``,
    ``_plain_limit`` and ``_drafted_plain``). ``traffic_seen``: what the traffic's rounds accepted (a decayed sum of
    :meth:`_observe_round`'s ratios and its weight), the prior of every guess; an engine that replaces another for the
    same pair may start from it (``generate``'s fast path does)."""

    def _reset_verify_state(self) -> None:
        """The cost policy's state between rounds, as a new engine has it."""
        self._plain_rounds = 0  # rounds in a row whose drafter body the cost policy skipped
        self._plain_limit = 0  # how many it may skip before the next probe
        self._drafted_plain = False  # the cost policy's last drafted round's ratios said: decode every request plainly
        self._late_ratio = False  # this round verifies whole blocks chosen on the guesses
        self.traffic_seen = (0.0, 0.0)  # the traffic's acceptance: decayed sum and count of rounds that verified drafts

    def _guessed_lengths(self, running, unread_whole: bool | None = None) -> torch.Tensor:
        """The verify lengths the policy gives the requests' guesses (:meth:`_guess`), which decide a round before its
        drafter body runs. Where the
        round may verify whole blocks without reading its ratios (``unread_whole``; ``None``: :meth:`_may_skip_read`
        says), the rule counts the read that choice saves."""
        if unread_whole is None:
            unread_whole = self._may_skip_read(running)
        guess = torch.tensor([self._guess(r) for r in running])
        return self._verify_lengths(running, guess, guess=True, unread_whole=unread_whole)

    def _guess(self, r) -> float:
        """``r``'s expected acceptance ratio in its next round, before its drafter runs. Rounds hardly predict each
        other (on the reference pair the next round's acceptance correlates with the last ratio at -0.08 to 0.11,
        ``docs/logs/c1_guess_cpu_1205``): the best guess is the request's own level. It is the mean of what its rounds
        that verified drafts accepted, shrunk toward the traffic's mean by ``GUESS_PRIOR_ROUNDS`` rounds (a new
        request's first rounds say little), so a request yet to draft is guessed at the traffic's mean: where the
        traffic says this batch decodes plainly, its first round does not run the drafter for nothing (on the
        reference pair's own cost at batch 1, modelled time 0.946 -> 0.975 of plain decoding on gsm8k,
        ``docs/logs/new_request_cpu_1205``).
        Until any round has been seen: the last ratio, and a request yet to draft counts as accepting everything (its
        first round drafts). ``GUESS_PRIOR_ROUNDS`` 0: that, whatever was seen (the rule before)."""
        if GUESS_PRIOR_ROUNDS <= 0 or self.traffic_seen[1] == 0:
            return 1.0 if r.head_ratio is None else r.head_ratio
        prior = self.traffic_seen[0] / self.traffic_seen[1]
        return (GUESS_PRIOR_ROUNDS * prior + r.seen[0]) / (GUESS_PRIOR_ROUNDS + r.seen[1])

    def _observe_round(self, r, accepted: int, verify_len: int) -> None:
        """Count what a round that verified drafts says of ``r``'s acceptance, as a ratio like the head's, into the
        request's and the traffic's sums (the traffic's decayed, so it follows a change of the prompt mix):
        ``(accepted + 1) / B``; where every verified draft was accepted short of the block (a censored count: it would
        have accepted at least that many), at least the head's ratio of the round."""
        if self.policy is not LengthPolicy.COST or verify_len <= 1:
            return
        seen = (accepted + 1) / self.block_size
        if accepted >= verify_len - 1 and verify_len < self.block_size and r.head_ratio is not None:
            seen = max(seen, r.head_ratio)
        r.seen = (r.seen[0] + seen, r.seen[1] + 1)
        self.traffic_seen = (TRAFFIC_DECAY * self.traffic_seen[0] + seen, TRAFFIC_DECAY * self.traffic_seen[1] + 1)

    def _may_skip_read(self, running) -> bool:
        """Whether a drafting round of ``running`` may verify whole blocks without this round's ratios: under ``cost``
        with ``whole_block_stretches``, in the packed layout, with no round sink (it is promised each round's own
        prediction), every request having drafted before (none yet: read them)."""
        return (self.whole_block_stretches and self.policy is LengthPolicy.COST and self.layout == "packed"
                and self.on_round is None and all(r.head_ratio is not None for r in running))

    def _plain_by_guess(self, running) -> bool:
        """Whether the cost rule, on the requests' guesses, decodes every request plainly."""
        return bool((self._guessed_lengths(running) <= 1).all())

    def _plain_stretch(self, running) -> int:
        """How many plain rounds in a row (1: none beyond this one) the ``cost`` policy may queue as greedy decode
        steps behind one read (:mod:`.decode_steps`, ``decode_steps`` at most), as ``off`` does: its last drafted
        round's ratios said plain (priced with the body), the guesses say so, and no probe falls inside."""
        if self.policy is not LengthPolicy.COST or self.layout != "packed" or self.on_round is not None \
                or not self._drafted_plain:
            return 1
        steps = min(self.decode_steps, self._plain_limit - self._plain_rounds, min(r.remaining for r in running))
        if steps <= 1 or not self._plain_by_guess(running):  # the cheap bounds first: the rule runs on the host
            return 1
        self._plain_rounds += steps
        return steps

    def _whole_blocks(self, running) -> bool:
        """True when this drafting round verifies whole blocks without reading its ratios first: it may
        (:meth:`_may_skip_read`), and the cost rule on the requests' guesses, counting the read this saves,
        chooses every request's whole block, or all it has left."""
        if not self._may_skip_read(running):
            return False
        whole = torch.tensor([min(self.block_size, r.remaining) for r in running])
        return bool((self._guessed_lengths(running, unread_whole=True) >= whole).all())

    def _skip_drafting(self, running) -> bool:
        """True when no request would verify more than its bonus token this round: every request has one token
        left; under ``adaptive`` the load-scaled length rate caps every ``k_hat`` at 1; under ``cost`` the round
        decodes plainly by the requests' guesses (:meth:`_guessed_lengths`),
        but for a probe (after ``_plain_limit`` such rounds in a row), which drafts to refresh the ratios.
        Skipping is lossless (a 1-token verify is plain decoding). Not while a round sink is attached: it is
        promised the length head's prediction for every round."""
        if self.on_round is not None:
            return False
        if all(r.remaining <= 1 for r in running):
            return True
        if self.layout not in ("packed", "rectangular"):
            return False
        if self.policy is LengthPolicy.COST:
            if not self._drafted_plain:  # the round's own ratios asked for drafts: no need to guess again
                return False
            plain = self._plain_by_guess(running)
            self._plain_rounds = self._plain_rounds + 1 if plain else 0
            if self._plain_rounds > self._plain_limit:
                self._plain_rounds = 0
                return False
            return plain
        rate = self._length_rate(len(running))
        most = choose_verify_length(LengthPolicy.ADAPTIVE, 1, self.block_size, ratio=torch.ones(1), rate=rate,
                                    min_len=self.length_min)
        return int(most) <= 1  # the policy is monotone in the ratio: a ratio of 1 gives the largest k_hat

    @staticmethod
    def _late_bits(drafts) -> list[torch.Tensor]:
        """A whole-block round's ratios for its one read, as int64 of their float32 bits (exact, NaN included)."""
        return [drafts.ratio.float().reshape(-1).view(torch.int32).long()] if drafts.late_ratio else []

    @staticmethod
    def _take_late_ratios(running, drafts, packed: list[int]) -> list[int]:
        """The round's read less the ratios :meth:`_late_bits` put at its end, which become the requests' last ratios."""
        if not drafts.late_ratio:
            return packed
        bits = np.array(packed[-len(running) :], dtype=np.int64).astype(np.int32).view(np.float32)
        for r, a in zip(running, bits.tolist()):
            r.head_ratio = a
        return packed[: -len(running)]

    def _verify_lengths(self, running, ratio: torch.Tensor | None, guess: bool = False,
                        unread_whole: bool = False) -> torch.Tensor:
        """Each running request's ``k_hat`` (host ``[n]``) under the engine's policy from the length head's ``ratio``
        (``None``: the whole block). The one place the engine calls :func:`choose_verify_length`. Unless this is a
        ``guess`` (before drafting), the cost policy keeps the ratios and whether the rounds after this one decode
        plainly (priced with the drafter's body, which they would spare); a round so judged has spent its body and
        verifies what pays with it spent (``drafted=True``). ``unread_whole``: whole blocks would spare the round its
        mid-round read (a guess's only)."""
        n, B = len(running), self.block_size
        if ratio is None or self.layout == "fixed":
            return choose_verify_length(LengthPolicy.FIXED, n, B)
        ratio = ratio.float().cpu().view(-1)  # read 1 of the round (the cost rule and the floor rule run on the host)

        left = torch.tensor([r.remaining for r in running])

        def choose(drafted: bool) -> torch.Tensor:
            return choose_verify_length(self.policy, n, B, ratio=ratio, rate=self._length_rate(n),
                                        min_len=self.length_min, device="cpu", round_cost=self.round_cost,
                                        max_len=left, unread_whole=unread_whole, drafted=drafted)

        k_hat = choose(False)
        if self.policy is LengthPolicy.COST and not guess:
            for r, a in zip(running, ratio.tolist()):
                r.head_ratio = a
            self._drafted_plain = bool((k_hat <= 1).all())
            if self._drafted_plain:  # plain rounds before the next probe: the first hold, then doubling up to the cap
                k_hat = choose(True)  # this round's body is spent: it verifies what pays all the same
                first, cap = self._probe_holds(n)
                self._plain_limit = min(max(first, 2 * self._plain_limit), cap)
            else:
                self._plain_limit = 0
        return k_hat

    def _probe_holds(self, n: int) -> tuple[int, int]:
        """The plain rounds of ``n`` requests before the first probe after a plain decision, and the most between two
        probes, from a probe's extra time against a plain round (``round_cost``: the drafter's body, a drafting
        round's overhead over a plain one's, the same 1-token verify): the first waits until the plain rounds have cost
        1 / ``FIRST_PROBE_SHARE`` times what the probe adds (3 on SPEC's table up to 32 requests, 6 at 128; 2 at batch 1
        and 9 at 128 on the H200's measured 8B cost of 2026-12-05; 24 at batch 1 on the reference pair, whose drafter
        costs more than its target's step), the most keeps the probes within ``PROBE_SHARE`` of the plain rounds' time,
        at least ``PLAIN_PROBE_ROUNDS``, both at most ``PROBE_CAP``."""
        c = self.round_cost
        extra = c.draft_time(n, self.block_size) + c.overhead(n, True) - c.overhead(n, False)
        plain = c.verify_time(n, n) + c.overhead(n, False)
        cap = int(min(max(PLAIN_PROBE_ROUNDS, math.ceil(extra / (PROBE_SHARE * plain))), PROBE_CAP))
        return int(min(max(1, math.ceil(extra / (FIRST_PROBE_SHARE * plain))), cap)), cap

    def _length_rate(self, batch: int) -> float:
        """The length head's rate for a round of ``batch`` requests (fixed unless ``halving_batch`` is set)."""
        if self.halving_batch is None:
            return self.length_rate
        return load_scaled_rate(self.length_rate, batch, self.halving_batch)
