"""Draft-verify rounds queued back to back behind one device read (``EngineConfig.spec_rounds``): the ``fixed`` verify
length's round with the host taken out of the loop, as :mod:`.decode_steps` does for plain steps.

A round of the ``fixed`` layout needs nothing from the host once the last round's verdict is on the device: every
request verifies its bonus token and a whole block of drafts, its prefix grows by its accepted drafts + 1, the next
bonus is the verdict's next token, and the next drafter body is the chained one (:meth:`.drafter.DraftGraphs.run_chain`:
the verify's features as context, on the device). So :class:`SpecRounds` queues ``k`` rounds, each the drafter's
head, the target's verify with greedy acceptance inside its replay, and the next chained body, with the prefix lengths
kept on the device, and reads all ``k`` verdicts at once. The host then commits them in order, exactly as ``k`` normal
rounds would: a request that ends inside (EOS, its token limit) drops its later rounds, whose writes lie past its
length. What differs from ``k`` normal rounds: the prompt n-gram rule sits them out (it needs the host), and a
request's last rounds verify a whole block even past its token limit (the commit stops where plain decoding would).
"""

from __future__ import annotations

import numpy as np
import torch

from ..speculation.hooks import hooks_for
from .graphs import to_device
from .lifecycle import NON_FINITE
from .target import PackedLayout, leading_rows

__all__ = ["SpecRounds", "raw_greedy"]


def raw_greedy(running) -> bool:
    """Every request greedy, with nothing that changes or reads its rows but the acceptance (no penalty, grammar or
    logprobs): what greedy acceptance inside a graph replay and queued steps need."""
    return all(r.params.greedy and r.params.raw_rows for r in running)


class SpecRounds:
    """Queued ``fixed`` rounds (module doc) for an engine's requests.

    Handed what it works on: the target's ``graphs`` (:class:`.graphs.DecodeGraphs`) and ``cache``, the drafter's
    ``draft_graphs`` (:class:`.drafter.DraftGraphs`) and ``drafter``, the ``lifecycle`` that commits, the engine's
    ``stats`` and ``planner`` (each round's acceptance is observed as a normal round's is), and ``rounds``: the most
    rounds one read covers.

    Example:
        >>> loop = SpecRounds(engine.graphs, engine.cache, engine.draft_graphs, engine.drafter, engine.lifecycle,
        ...                   engine.stats, engine.planner, rounds=4)  # doctest: +SKIP
        >>> loop.run(engine.lifecycle.running, loop.rounds_for(engine.lifecycle.running))  # doctest: +SKIP
    """

    def __init__(self, graphs, cache, draft_graphs, drafter, lifecycle, stats, planner, rounds: int):
        self.graphs, self.cache, self.draft_graphs, self.drafter = graphs, cache, draft_graphs, drafter
        self.lifecycle, self.stats, self.planner, self.rounds = lifecycle, stats, planner, rounds
        self.block = draft_graphs.B

    def rounds_for(self, running, sink: bool = False) -> int:
        """How many rounds to queue for ``running`` (0 or 1: a normal round): none while a request waits for a slot,
        one is not :func:`raw_greedy` or a round ``sink`` reads the rounds; else while every request's caches have room
        for them, a chained body fits, and the request with the most tokens left cannot be done before them."""
        if (self.rounds < 2 or not running or sink or self.lifecycle.queue or not raw_greedy(running)
                or self.draft_graphs.chain_bucket(len(running)) is None):
            return 0
        B, dg = self.block, self.draft_graphs
        pending = [0 if r.pending_ctx is None else r.pending_ctx.shape[0] for r in running]
        longest = max(max(self.cache.length(r.slot), dg.cache.length(r.slot) + p) for r, p in zip(running, pending))
        room = (min(self.cache.max_len, dg.cache.max_len) - longest - dg.max_q - B) // B  # the last chain's block too
        # no round past what the request with the most tokens left needs at the very least (a whole block accepted
        # every round): the batch never runs a forward that one read a round would not
        needed = max(-(-r.remaining // B) for r in running)
        return max(0, min(self.rounds, room, needed))

    @torch.no_grad()
    def run(self, running, rounds: int) -> None:
        """``rounds`` queued rounds of every running request, one device read, then ``rounds`` commits."""
        graphs, dg, B, n = self.graphs, self.draft_graphs, self.block, len(running)
        W, T, device = B - 1, n * B, graphs.inputs.device
        slots = [r.slot for r in running]
        with hooks_for(self.drafter).weights_lock:
            dg.run_body(slots, [r.pending_ctx for r in running], [r.bonus for r in running])  # the chained body, if any
            for r in running:
                r.pending_ctx = None
            dg.run_head([W] * n)
            layout = PackedLayout.from_cache(self.cache, slots, [B] * n)
            starts_host = np.asarray(layout.prefix_lens, dtype=np.int64)
            bucket = graphs.prepare([t for r in running for t in [r.bonus] + [0] * W], layout) + ("accept",)
            graphs.verify_len[:n].fill_(W)
            chain = dg.chain_bucket(n)
            dg.lay_chain(slots, np.full(n, B, dtype=np.int64), starts_host, chain)
            # one queued host-to-device copy (a plain one would wait for the chained body still running)
            starts, slot_rows, bonus = to_device(torch.from_numpy(np.stack(
                [starts_host, np.asarray(slots), np.asarray([r.bonus for r in running])])), device)
            cols, bins = torch.arange(B, device=device), graphs.requests
            width = 4 * bins + T
            out = torch.empty(rounds, width, dtype=torch.long, device=device)
            for k in range(rounds):
                if k:
                    dg.replay_head()  # the drafts of the body the last round chained
                positions = (starts[:, None] + cols).flatten()  # the verify's rows, then the next body's context
                graphs.move_verify(torch.cat([bonus[:, None], dg.tokens[: n * W].view(n, W)], dim=1).flatten(), positions,
                                   starts, slot_rows)
                graphs.replay(bucket)
                out[k].copy_(graphs.verdict_rows(T))
                accepted, bonus = out[k, :n], out[k, bins : bins + n]
                dg.move_chain(positions, starts)
                dg.replay_chain(chain, accepted, bonus)
                starts = starts + accepted + 1
            host = out.tolist()  # the rounds' one device read
        self.stats.host_syncs += 1
        self.stats.num_steps += rounds
        self.stats.forward_tokens.extend([T] * rounds)
        self._commit(running, host, slots, chain[2])

    def _commit(self, running, host: list[list[int]], slots: list[int], chain_rows: int) -> None:
        """Commit each round in order (as :meth:`.engine.Engine._commit_round` does a verify-only round), advance the
        drafter's lengths over the context the queued bodies stored, and leave the last round's features and chained
        body to the next round."""
        graphs, dg, B, n = self.graphs, self.draft_graphs, self.block, len(running)
        commit, fail, advance, observe = self.lifecycle.commit, self.lifecycle.fail, self.cache.advance, self.planner.observe
        last = None
        for k, row in enumerate(host):
            accepted, nxt, bad, dl, drafts = graphs.read_verdict(row, [B] * n)
            for i, r in enumerate(running):
                if r.state != "running":
                    continue
                if bad[i]:
                    fail(r, NON_FINITE)
                    continue
                if k:  # this round took the body the last one chained: its context is stored
                    dg.cache.advance(r.slot, host[k - 1][i] + 1)
                advance(r.slot, accepted[i] + 1)
                emitted = commit(r, drafts[i][: accepted[i]] + [nxt[i]], verify_len=dl[i] + 1)
                if emitted:
                    observe(r, emitted - 1, dl[i] + 1)
            last = accepted
        ctx = leading_rows(graphs.hidden, [i * B for i in range(n + 1)], [a + 1 for a in last])
        for i, r in enumerate(running):
            if r.state == "running":
                r.pending_ctx = ctx[i]
        dg.note_chain(slots, chain_rows, [B] * n)
