"""Plain greedy decoding, up to several steps per device read (``Engine(decode_steps=)``): the ``off`` layout's step,
and the one a ``cost`` round the planner makes plain runs (rounds where drafting does not pay,
:meth:`~adaflash_hf.speculation.length.planner.LengthPlanner.plain_stretch`): the same function, so a plain plan does
the work of ``off``'s step, plus what resuming drafting needs (module doc of the planner): the target's features of the
decoded tokens are kept for the drafter, and the drafter's context is stored only when drafting resumes (or the
rows change, or :attr:`.DecodeGraphs.kept_steps` is reached), not per step nor per stretch.

While nothing waits for admission and every running request is greedy, up to ``decode_steps`` decode steps are queued
back to back (one graph replay each, launched while the previous runs) and read back once
(:meth:`.graphs.DecodeGraphs.run_greedy`): the host's per-step work, the device read and the exposed launch come once per
``decode_steps`` tokens. Each step is committed as a round of one token, exactly as that many normal rounds would. In a
drafting engine each step's features join the requests' pending drafter context, kept in the graphs'
``step_hidden`` rows from one stretch to the next while the same requests run, and stored by the next drafting round's
body (or first, when the requests or the room change): the drafter's cache ends exactly as plain rounds would leave it.
"""

from __future__ import annotations

from ..speculation.hooks import hooks_for
from .lifecycle import NON_FINITE
from .round_ngrams import index_while
from .target import PackedLayout

__all__ = ["DecodeSteps"]


class DecodeSteps:
    """Mixin of :class:`~.engine.Engine` (it owns ``decode_steps``, ``graphs``, ``cache``, ``admission``, the counters
    and the commit / fail / announce / profile methods)."""

    def _greedy_steps(self, running) -> int:
        """How many plain greedy decode steps to queue before the next device read (0: a normal round). Needs the
        graphs' static path, an empty queue (admission needs a normal round) and greedy requests only."""
        if self.graphs is None or not running or self._queue or not all(r.params.greedy and r.params.raw_rows for r in running):
            return 0
        if self.drafter is not None:
            return self.planner.plain_stretch(running, self.decode_steps, sink=self.on_round is not None)
        return min(self.decode_steps, min(r.remaining for r in running))

    def _kept_offset(self, running, steps: int) -> int:
        """Where this stretch's features go in ``step_hidden``: after the last stretch's, when it ran the same requests
        in the same order, no round came between, and ``steps`` more fit the kept rows and the drafter's context
        buckets (the next body stores them all); else 0, the pending context stored first."""
        kept = self._kept_stretch
        if kept is not None and len(kept[0]) == len(running) and all(a is b for a, b in zip(kept[0], running)):
            offset = kept[1]
            if offset + steps <= self.graphs.kept_steps and (offset + steps) * len(running) <= self.draft_graphs.ctx_buckets[-1]:
                return offset
        self._store_pending_context(running)
        return 0

    def _store_pending_context(self, running) -> None:
        """The requests' pending drafter context stored (what a plain round's skipped body stores), so that new steps'
        features can take its place."""
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
        offset = 0
        if self.drafter is not None:
            offset = self._kept_offset(running, steps)
            self.skipped_drafts += steps
        if self.profile:
            self._tick("host")
        new = self.graphs.run_greedy([r.bonus for r in running], layout, steps, offset)
        if self._ngram_event is not None:  # the host would only wait for the read: index n-grams meanwhile
            self._ngram_event.record()
            index_while(self.prompt_ngrams, running, lambda: not self._ngram_event.query())
        feats = self.graphs.step_hidden
        if feats is None and self.graphs.hidden is not None:  # one step without kept rows: the plain bucket's
            feats = self.graphs.hidden[:n][None]
        self._kept_stretch = (list(running), offset + steps) if self.graphs.step_hidden is not None else None
        self.forward_tokens.extend([n] * steps)
        self.num_steps += steps
        if self.profile:
            self._tick("target")
        rows = new.tolist()  # the replay's one device read
        self.host_syncs += 1
        if self.profile:
            self._tick("accept")
        # the fed tokens' features (bonus, then each step's token): the drafter's context, one view per request
        ctx = feats[: offset + steps, :n].unbind(1) if feats is not None else None  # one call, not one slice each
        for i, r in enumerate(running):
            self.cache.advance(r.slot, steps)  # a request that ends inside frees its slot (length reset) on commit
            if ctx is not None:
                r.pending_ctx = ctx[i]
            for s in range(steps):
                if rows[s][i] < 0:  # non-finite logits at this step: this request fails, the others go on
                    self._fail(r, NON_FINITE)
                    break
                self._commit(r, [rows[s][i]], verify_len=1)
                if r.output is not None:
                    break
        return True

