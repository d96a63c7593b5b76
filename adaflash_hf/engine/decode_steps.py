"""Plain greedy decoding, up to several steps per device read (``EngineConfig.decode_steps``): the ``off`` layout's step,
and the one a ``cost`` round the planner makes plain runs (rounds where drafting does not pay,
:meth:`~adaflash_hf.speculation.length.planner.LengthPlanner.plain_stretch`): the same function, so a plain plan does
the work of ``off``'s step, plus what resuming drafting needs (module doc of the planner): the target's features of the
decoded tokens are kept for the drafter, and the drafter's context is stored only when drafting resumes (or a request
joins, or :meth:`.DecodeGraphs.kept_steps` is reached), not per step, per stretch nor when a request ends.

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

__all__ = ["PlainDecoder"]


class PlainDecoder:
    """Plain greedy decode steps, queued back to back behind one device read (:meth:`run`), for an engine's requests.

    Handed what it works on: the target's ``graphs`` (:class:`.graphs.DecodeGraphs`, static path) and slotted ``cache``,
    the ``lifecycle`` that commits (:class:`.lifecycle.Lifecycle`), the engine's ``stats`` and phase ``timer``
    (:mod:`.stats`); with a drafter, the ``drafter`` and its ``draft_graphs``, whose context the steps' features become,
    and (CUDA) the ``prompt_ngrams`` rule with an ``ngram_event``: the host indexes the requests' n-grams while the
    stretch's replays run (:func:`.round_ngrams.index_while`) instead of only waiting for the read.
    Between calls it keeps :attr:`kept`: the requests (and step count) whose features ``graphs.step_hidden`` holds,
    until a drafting round stores them (:meth:`forget`).

    Example:
        >>> decoder = PlainDecoder(engine.graphs, engine.cache, engine.lifecycle, engine.stats, engine.timer)  # doctest: +SKIP
        >>> decoder.run(engine.lifecycle.running, steps=4)  # doctest: +SKIP
    """

    def __init__(self, graphs, cache, lifecycle, stats, timer, drafter=None, draft_graphs=None, prompt_ngrams=None,
                 ngram_event=None):
        self.graphs, self.cache, self.lifecycle, self.stats, self.timer = graphs, cache, lifecycle, stats, timer
        self.drafter, self.draft_graphs = drafter, draft_graphs
        self.prompt_ngrams, self.ngram_event = prompt_ngrams, ngram_event
        self.kept = None  # the requests and step count whose features plain steps keep

    def forget(self) -> None:
        """A drafting round's body stores what the last stretches kept (handed over first: :meth:`_hand_over`): the
        next stretch starts its rows afresh."""
        self._hand_over()
        self.kept = None

    def _hand_over(self) -> None:
        """The kept features made the running requests' pending drafter context, one view each (one ``unbind``). Done
        when something is about to store them, not after every stretch: a batch that stays plain never pays for it."""
        if self.kept is not None:
            rows, k = self.kept
            for r, ctx in zip(rows, self.graphs.kept_features(len(rows), k).unbind(1)):
                if r.state == "running":  # a request that ended dropped its context
                    r.pending_ctx = ctx

    def _kept_offset(self, running, steps: int) -> int:
        """Where this stretch's features go in ``step_hidden``: after the last stretch's, when it ran these requests (or
        more: the rows of those that ended are dropped and the rest close up, on the device), no round came between,
        and ``steps`` more fit the kept rows and the drafter's context buckets (the next body stores them all); else 0,
        the pending context stored first."""
        if self.kept is not None:
            rows, k = self.kept
            n = len(running)
            if k + steps <= self.graphs.kept_steps(n) and (k + steps) * n <= self.draft_graphs.ctx_buckets[-1]:
                if len(rows) == n and all(a is b for a, b in zip(rows, running)):
                    return k  # the usual case: the same requests
                place = {id(r): i for i, r in enumerate(rows)}
                idx = [place.get(id(r)) for r in running]
                if None not in idx:
                    self.graphs.keep_rows(len(rows), k, idx)
                    return k
        self._hand_over()
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

    def run(self, running, steps: int) -> None:
        """``steps`` plain greedy decode steps for every running request, queued back to back, and one
        device read; each step is committed as a round of one token, exactly as ``steps`` normal rounds would."""
        n, graphs, stats, mark = len(running), self.graphs, self.stats, self.timer.mark
        layout = PackedLayout.from_cache(self.cache, [r.slot for r in running], [1] * n)
        offset = 0
        if self.drafter is not None:
            offset = self._kept_offset(running, steps)
            stats.skipped_drafts += steps
        mark("host")
        new = graphs.run_greedy([r.bonus for r in running], layout, steps, offset)
        event = self.ngram_event
        if event is not None:  # the host would only wait for the read: index n-grams meanwhile
            event.record()
            index_while(self.prompt_ngrams, running, lambda: not event.query())
        self.kept = (list(running), offset + steps) if graphs.step_hidden is not None else None  # handed over later
        ctx = None  # one step without kept rows: the plain bucket's features, the requests' context now
        if graphs.step_hidden is None and graphs.hidden is not None:
            ctx = graphs.hidden[:n].unbind(0)
        stats.forward_tokens.extend([n] * steps)
        stats.num_steps += steps
        mark("target")
        rows = new.tolist()  # the replay's one device read
        stats.host_syncs += 1
        mark("accept")
        commit, fail, advance = self.lifecycle.commit, self.lifecycle.fail, self.cache.advance
        for i, r in enumerate(running):
            advance(r.slot, steps)  # a request that ends inside frees its slot (length reset) on commit
            if ctx is not None:
                r.pending_ctx = ctx[i][None]
            for s in range(steps):
                if rows[s][i] < 0:  # non-finite logits at this step: this request fails, the others go on
                    fail(r, NON_FINITE)
                    break
                commit(r, [rows[s][i]], verify_len=1)
                if r.output is not None:
                    break
