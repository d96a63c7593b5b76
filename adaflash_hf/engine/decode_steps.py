"""Plain greedy decoding several steps per device read (``Engine(decode_steps=)``): the ``off`` layout's fast path,
and the ``cost`` policy's plain stretches (rounds where drafting does not pay, :meth:`.verify_lengths.VerifyLengths._plain_stretch`).

While nothing waits for admission and every running request is greedy, up to ``decode_steps`` decode steps are queued
back to back (one graph replay each, launched while the previous runs) and read back once
(:meth:`.graphs.DecodeGraphs.run_greedy`): the host's per-step work, the device read and the exposed launch come once per
``decode_steps`` tokens. Each step is committed as a round of one token, exactly as that many normal rounds would. In a
drafting engine the requests' pending drafter context is stored first and each step's features become the next
context, as plain rounds would leave them (the drafter's cache stays exact).
"""

from __future__ import annotations

from ..speculation.hooks import hooks_for
from .lifecycle import NON_FINITE
from .target import PackedLayout

__all__ = ["DecodeSteps"]


class DecodeSteps:
    """Mixin of :class:`~.engine.Engine` (it owns ``decode_steps``, ``graphs``, ``cache``, ``admission``, the counters
    and the commit / fail / announce / profile methods)."""

    def _greedy_steps(self, running) -> int:
        """How many plain greedy decode steps to queue before the next device read (1: a normal round)."""
        plain = all(r.params.greedy and r.params.raw_rows for r in running)
        if self.decode_steps == 1 or not running or self._queue or not plain:
            return 1
        if self.drafter is not None:
            return self._plain_stretch(running)
        return min(self.decode_steps, min(r.remaining for r in running))

    def _store_pending_context(self, running) -> None:
        """A plain stretch's first act: the requests' pending drafter context stored (what a plain round's skipped
        body stores), so that the steps' features can take its place."""
        pending = [r for r in running if r.pending_ctx is not None]
        if pending:
            with hooks_for(self.drafter).weights_lock:
                self.draft_graphs.run_body([r.slot for r in pending], [r.pending_ctx for r in pending], None)
            for r in pending:
                r.pending_ctx = None

    def _decode_steps(self, running, steps: int) -> bool:
        """``steps`` plain greedy decode steps for every running request, queued back to back, and one
        device read; each step is committed as a round of one token, exactly as ``steps`` normal rounds would."""
        n = len(running)
        layout = PackedLayout.from_cache(self.cache, [r.slot for r in running], [1] * n)
        self._announce(n, 0, n)
        self.admission.observe(1.0, sum(len(r.prompt) + r.max_new for r in running) / n)
        if self.drafter is not None:
            self._store_pending_context(running)
            self.skipped_drafts += steps
        if self.profile:
            self._tick("host")
        new = self.graphs.run_greedy([r.bonus for r in running], layout, steps)
        feats = self.graphs.step_hidden
        self.forward_tokens.extend([n] * steps)
        self.num_steps += steps
        if self.profile:
            self._tick("target")
        rows = new.tolist()  # the replay's one device read
        self.host_syncs += 1
        if self.profile:
            self._tick("accept")
        for i, r in enumerate(running):
            self.cache.advance(r.slot, steps)  # a request that ends inside frees its slot (length reset) on commit
            if feats is not None:  # the fed tokens' features (bonus, then each step's token): the drafter's context
                r.pending_ctx = feats[:steps, i]
            for s in range(steps):
                if rows[s][i] < 0:  # non-finite logits at this step: this request fails, the others go on
                    self._fail(r, NON_FINITE)
                    break
                self._commit(r, [rows[s][i]], verify_len=1)
                if r.output is not None:
                    break
        return True

