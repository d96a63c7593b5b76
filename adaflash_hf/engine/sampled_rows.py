"""An engine round's sampled requests, processed and drawn all at once.

Every sampled row of a round goes through one :class:`~.sampling.RowSampling` pass (each row with its request's
temperature / top-k / top-p; the rows of seeded requests position-keyed), then one ``multinomial`` and one
speculative-acceptance call (:func:`~adaflash_hf.speculation.verify.accept_block`, the step ``generate``'s eager loop uses
too), whatever the number of requests or the mix of their parameters. The host builds index arrays and sends
them in one copy per phase; nothing is read back (the round's one read comes after the acceptance).

- :func:`sample_drafts`: the draft positions (each request's drafts drawn from its processed draft distribution);
- :func:`agree_sampled`: the prompt n-gram rule for sampled requests (one-hot proposals at the candidate's positions);
- :func:`sample_round`: after the target, the first tokens of admitted requests and the acceptance group of the
  running ones.

Faults stay per request: a row that is not a distribution flags its own request only (failed after the round).
Randomness: a seeded request samples one-hot distributions, so the draws decide nothing for it (its text is a
function of seed, position and prefix); unseeded requests share one stream (:class:`RoundRandom`).
"""

from __future__ import annotations

import numpy as np
import torch

from ..speculation.prompt_ngrams import agree_with_drafts
from ..speculation.verify import SampledRows
from .graphs import arrays_to_device
from .round_drafts import RoundDrafts, SampledDrafts
from .sampling import RowSampling, checked_probs
from .target import segments

__all__ = ["RoundRandom", "agree_sampled", "sample_drafts", "sample_round"]


class RoundRandom:
    """The random stream of unseeded sampled requests: one generator on the engine's device, reseeded from torch's
    global generator in each phase that draws for an unseeded request, so ``torch.manual_seed`` makes a run
    repeatable (as the per-request generators seeded at submit did) while a round draws for all requests at once.

    Example:
        >>> gen = RoundRandom("cpu").draw([])  # no unseeded request: the stream as it is
    """

    def __init__(self, device):
        self.generator = torch.Generator(device=device)

    def draw(self, requests) -> torch.Generator:
        if any(r.params.seed is None and not r.params.greedy for r in requests):
            self.generator.manual_seed(int(torch.randint(2**62, ())))
        return self.generator


def _any_per(flags: torch.Tensor, owner: torch.Tensor, n: int) -> torch.Tensor:
    """``[n]`` device flags: some row of ``flags`` owned by ``owner`` (per row, in ``0 .. n-1``) is set."""
    return torch.zeros(n, dtype=torch.int32, device=flags.device).index_add_(0, owner, flags.int()) > 0


def sample_drafts(running, drafts: RoundDrafts, draft_len: list[int], random: RoundRandom) -> SampledDrafts | None:
    """Draw the drafts of every sampled request that drafts this round (``draft_len[i] > 0``; ``q_lens[i] - 1``
    positions) from its processed draft distribution, in place in ``drafts.tokens``; ``None`` when there is none.

    A request whose draft logits were not finite (``drafts.finite``: the drafter's fault) proposes from a uniform
    distribution instead: speculative sampling keeps the target's distribution for any proposal.

    Example:
        >>> drafts.sampled = sample_drafts(running, drafts, draft_len, RoundRandom(device))  # doctest: +SKIP
    """
    index = [i for i, r in enumerate(running) if not r.params.greedy and draft_len[i] > 0]
    if not index:
        return None
    requests, counts = [running[i] for i in index], [drafts.q_lens[i] - 1 for i in index]
    vocab, device = drafts.logits.shape[-1], drafts.tokens.device
    rows = RowSampling.build([r.params for r in requests], counts, [len(r.tokens) for r in requests], vocab, device)
    owner, col = segments(counts)
    req = np.asarray(index)[owner]
    dev = arrays_to_device({"src": np.asarray(drafts.logit_offsets)[req] + col, "req": req, "col": col}, np.int64, device)
    q, bad = checked_probs(rows.sampling_rows(rows.probs(drafts.logits.index_select(0, dev["src"]))))
    if drafts.finite is not None:
        finite = drafts.finite.index_select(0, dev["req"])
        q = torch.where(finite[:, None], q, torch.full_like(q, 1.0 / vocab))
        bad = bad & finite
    drafts.tokens.index_put_((dev["req"], dev["col"]), torch.multinomial(q, 1, generator=random.draw(requests)).squeeze(1))
    offsets = np.concatenate([[0], np.cumsum(counts)])
    return SampledDrafts(index, offsets, q, _any_per(bad, dev["req"], len(running)))


def agree_sampled(drafts: RoundDrafts, candidates: list[list[list[int]]]) -> torch.Tensor | None:
    """The prompt n-gram rule (:func:`~adaflash_hf.speculation.prompt_ngrams.agree_with_drafts`) for every sampled request
    with candidates (``candidates[i]``: running request ``i``'s, in order of preference), in one call: drafts and draft distributions are
    rewritten in place; returns which of them took their candidate (``None``: no sampled request has one).

    Example:
        >>> used = agree_sampled(drafts, [[], [[7, 8], [7, 9]]])  # doctest: +SKIP
    """
    sd = drafts.sampled
    which = [s for s, i in enumerate(sd.index) if candidates[i]] if sd is not None else []
    if not which:
        return None
    lengths = np.diff(sd.offsets)[which]
    width, vocab = int(lengths.max()), sd.probs.shape[-1]
    owner, col = segments(lengths)  # the real rows; the padding past a request's own rows is never written back
    req = np.asarray(sd.index)[which]
    dev = arrays_to_device({"pad": sd.padded_rows(which, width, lengths), "req": req, "real": owner * width + col,
                            "dst": sd.offsets[which][owner] + col}, np.int64, sd.probs.device)
    q = sd.probs.index_select(0, dev["pad"]).view(len(which), width, vocab)
    tokens, q, used = agree_with_drafts(drafts.tokens.index_select(0, dev["req"])[:, :width],
                                        [candidates[sd.index[s]] for s in which], q)
    drafts.tokens[:, :width].index_copy_(0, dev["req"], tokens)
    sd.probs.index_copy_(0, dev["dst"], q.reshape(-1, vocab).index_select(0, dev["real"]))
    return used


def sample_round(logits: torch.Tensor, admitted, running, drafts: RoundDrafts, random: RoundRandom,
                 first: torch.Tensor, bad: torch.Tensor) -> SampledRows | None:
    """After the target: every sampled request's processed distributions in one pass (``logits``: each prefill's
    last row, then every verify row, packed), the first tokens of the sampled ``admitted`` requests drawn into
    ``first``, their fault flags and those of the sampled ``running`` requests (target rows, draft distributions)
    or-ed into ``bad [len(admitted) + len(running)]``; returns the speculative-sampling group of the sampled running
    requests for :func:`~adaflash_hf.speculation.verify.accept_block` (``None``: none).

    Example:
        >>> group = sample_round(logits, admitted, running, drafts, random, first, bad)  # doctest: +SKIP
        >>> res = accept_block(draft, draft_len, top, [group] if group is not None else [])  # doctest: +SKIP
    """
    pre = [r for r in admitted if not r.params.greedy]
    ver = [r for r in running if not r.params.greedy]
    if not pre and not ver:
        return None
    counts, host, width = _round_rows(admitted, running, drafts)
    rows = RowSampling.build([r.params for r in pre + ver], counts, [len(r.tokens) for r in pre + ver],
                             logits.shape[-1], logits.device)
    dev = arrays_to_device(host, np.int64, logits.device)
    p, bad_rows = checked_probs(rows.sampling_rows(rows.probs(logits.index_select(0, dev["src"]))))
    bad |= _any_per(bad_rows, dev["flag"], bad.shape[0])
    generator = random.draw(pre + ver)
    if pre:  # one row each, first in `p`
        first.index_copy_(0, dev["pre"], torch.multinomial(p[: len(pre)], 1, generator=generator).squeeze(1))
    if not ver:
        return None
    if drafts.sampled is not None:
        bad[len(admitted) :] |= drafts.sampled.bad
    vocab = p.shape[-1]
    target = p.index_select(0, dev["p_pad"]).view(len(ver), width + 1, vocab)
    if width:
        draft = drafts.sampled.probs.index_select(0, dev["q_pad"]).view(len(ver), width, vocab)
    else:
        draft = p.new_zeros(len(ver), 0, vocab)
    return SampledRows(dev["ver"], draft, target, dev["dl"], generator)


def _round_rows(admitted, running, drafts: RoundDrafts) -> tuple[np.ndarray, dict[str, np.ndarray], int]:
    """Host index arrays of :func:`sample_round`, sampled admitted requests first (one row each), then sampled running
    ones (``draft_len + 1`` rows each): rows per request, ``src`` (rows of the packed logits), ``flag`` (each row's
    request in the fault flags), ``pre`` (the admitted ones' places); with running ones, ``ver`` (their places),
    ``dl`` (their draft lengths), ``p_pad`` / ``q_pad`` (target / draft distributions laid out ``[b, width (+ 1)]``,
    padded with a request's own last row), and ``width``, the longest draft."""
    na = len(admitted)
    pre = np.asarray([j for j, r in enumerate(admitted) if not r.params.greedy], dtype=np.int64)
    ver = np.asarray([i for i, r in enumerate(running) if not r.params.greedy], dtype=np.int64)
    dl = drafts.draft_len.numpy()[ver]  # a host tensor: no device read
    counts = np.concatenate([np.ones(len(pre), dtype=np.int64), dl + 1])
    ql = np.asarray(drafts.q_lens, dtype=np.int64)
    start = np.concatenate([pre, (na + np.cumsum(ql) - ql)[ver]])  # each request's first row in the logits
    owner, col = segments(counts)
    host = {"src": start[owner] + col, "flag": np.concatenate([pre, na + ver])[owner], "pre": pre}
    width = int(dl.max(initial=0))
    if len(ver):
        offsets = (np.cumsum(counts) - counts)[len(pre) :]
        host.update(ver=ver, dl=dl, p_pad=(offsets[:, None] + np.minimum(np.arange(width + 1), dl[:, None])).ravel())
    if width:  # every sampled request that drafted is in drafts.sampled (sample_drafts)
        at = {i: s for s, i in enumerate(drafts.sampled.index)}
        host["q_pad"] = drafts.sampled.padded_rows([at[i] if d else 0 for i, d in zip(ver.tolist(), dl.tolist())], width, dl)
    return counts, host, width
