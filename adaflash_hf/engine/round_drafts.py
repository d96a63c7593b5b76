"""One engine round's drafts, kept on the device from the drafter to the acceptance.

The drafter's head returns the drafted positions packed (:meth:`.drafter.DraftGraphs.run_head`);
:func:`unpack_drafts` lays them out as ``[n, B-1]`` on the device, and :meth:`RoundDrafts.verify_inputs` says
where they go in the target's packed input and what the acceptance compares them with. Nothing here reads
the device: the round's one read (acceptance results and the drafts together) comes after the target's verify
forward, so the host never waits for the drafter's head before queuing the target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from .graphs import to_device
from .target import segments

__all__ = ["DraftSource", "OWN_DRAFTS", "OwnDrafts", "RoundDrafts", "SampledDrafts", "late_bits", "take_late_ratios", "unpack_drafts", "unpack_read"]


class DraftSource(Protocol):
    """Where a round's length-head ratios and drafted tokens come from, after the drafter's real forward: the seam an
    engine is given (``EngineConfig.draft_replay``) to replay a trace in their place (benchmarks:
    :class:`adaflash_hf.bench.replay.DraftReplay`). ``own_drafts``: the drafts are the drafter's own (the prompt n-gram
    rule and the chained next body build on them only then)."""

    own_drafts: bool

    def ratios(self, running, ratio: torch.Tensor, block_size: int) -> torch.Tensor:
        """This round's ratios ``[n]`` (on ``ratio``'s device) for ``running``, given the head's ``ratio``."""

    def drafts(self, running, draft: torch.Tensor, block_size: int) -> torch.Tensor:
        """This round's drafts ``[n, block_size - 1]`` (on ``draft``'s device), given the drafter's ``draft``."""


class OwnDrafts:
    """The drafter's own ratios and drafts, as they come: an engine's default :class:`DraftSource`.

    Example:
        >>> OWN_DRAFTS.ratios([], torch.ones(2), 16).tolist(), OWN_DRAFTS.own_drafts
        ([1.0, 1.0], True)
    """

    own_drafts = True

    def ratios(self, running, ratio: torch.Tensor, block_size: int) -> torch.Tensor:
        return ratio

    def drafts(self, running, draft: torch.Tensor, block_size: int) -> torch.Tensor:
        return draft


OWN_DRAFTS = OwnDrafts()


def unpack_drafts(tokens: torch.Tensor, finite: torch.Tensor, counts: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens, finite [P]`` (request ``i``'s first ``counts[i]`` draft positions, packed in request order) ->
    ``drafts [n, width]`` (zeros past each request's count) and ``finite [n]`` (every drafted position of the
    request finite), both on ``tokens``' device, queued without a device read (``drafts`` is a view of ``tokens``
    when every count is ``width``).

    Example:
        >>> d, ok = unpack_drafts(torch.tensor([5, 6, 7]), torch.tensor([True, True, False]), [2, 0, 1], 3)
        >>> d.tolist(), ok.tolist()
        ([[5, 6, 0], [0, 0, 0], [7, 0, 0]], [True, True, False])
    """
    n, device = len(counts), tokens.device
    if all(c == width for c in counts):  # every request drafted the whole width (the fixed policy): laid out already
        return tokens.view(n, width), finite.view(n, width).all(dim=1)
    rows, col = segments(counts)
    idx = to_device(torch.from_numpy(np.concatenate([rows * width + col, rows])), device)
    drafts = torch.zeros(n * width, dtype=torch.long, device=device).index_copy_(0, idx[: rows.shape[0]], tokens)
    not_finite = torch.zeros(n, device=device).index_add_(0, idx[rows.shape[0] :], (~finite).float())
    return drafts.view(n, width), not_finite == 0


@dataclass
class SampledDrafts:
    """A round's sampled draft distributions: the requests at ``index`` (positions in the round's running list) own
    rows ``offsets[s] .. offsets[s + 1]`` of ``probs [R, V]`` (processed, safe to sample: uniform where the drafter's
    logits were not finite, see :func:`sample_drafts`); ``bad [n]`` (device) flags the running requests whose draft
    distribution was not finite."""

    index: list[int]
    offsets: np.ndarray
    probs: torch.Tensor
    bad: torch.Tensor

    def padded_rows(self, which: list[int], width: int, lengths) -> np.ndarray:
        """Rows of :attr:`probs` laying out requests ``which`` (indices into :attr:`index`) as ``[len(which), width]``:
        row ``j`` of request ``s`` is its own ``min(j, lengths[s] - 1)`` (row 0 of ``probs`` when it has none)."""
        j = np.arange(width)[None, :]
        lengths = np.asarray(lengths, dtype=np.int64)[:, None]
        return np.where(lengths > 0, self.offsets[which][:, None] + np.minimum(j, lengths - 1), 0).ravel()


@dataclass
class RoundDrafts:
    """One round's drafts: ``tokens [n, B-1]`` and ``finite [n]`` (the request's draft logits were finite; ``None``
    when nothing was drafted) stay on the device until the round's one read; ``draft_len [n]``, verify lengths
    ``q_lens`` (host); the drafted positions' raw ``logits``, packed (:meth:`row_logits`), and length-head ``ratio``
    (device, ``None`` when nothing was drafted); the sampled requests' processed draft distributions and fault flags,
    all requests packed together (:class:`SampledDrafts`, made by :func:`~.sampled_rows.sample_drafts`; ``None``: no sampled request drafted).
    Under the prompt n-gram rule's ``max_width`` ``tokens`` may be wider than the block and ``wide_len`` replaces
    ``draft_len`` on the device (``q_lens`` are then the widest verifies planned)."""

    tokens: torch.Tensor
    finite: torch.Tensor | None
    draft_len: torch.Tensor
    q_lens: list[int]
    logits: torch.Tensor | None
    logit_offsets: list[int] | None
    ratio: torch.Tensor | None
    sampled: SampledDrafts | None = None
    wide_len: torch.Tensor | None = None  # device draft lengths when the prompt n-gram rule widened rows (round_ngrams)
    late_ratio: bool = False  # whole blocks chosen on the last ratios: this round's come with its one read (verify_lengths)

    def row_logits(self, i: int, like: torch.Tensor) -> torch.Tensor:
        """Request ``i``'s draft logits ``[>= draft_len[i], V]`` (``like.new_zeros(0, V)`` when nothing was drafted)."""
        if self.logits is None:
            return like.new_zeros(0, like.shape[-1])
        return self.logits[self.logit_offsets[i] : self.logit_offsets[i + 1]]

    def verify_inputs(self, greedy: list[bool], base: int, device):
        """Acceptance inputs on the device in one host-to-device copy, no stream sync: the packed logits row of
        each request's verify positions ``vidx [n, kmax + 1]`` (``base`` prefill rows come first; past its own
        ``q_i``: its last one), its drafts ``[n, kmax]``, draft lengths ``[n]`` (0 for a ``greedy`` request whose
        draft logits were not finite: it verifies its bonus token only, as if nothing was drafted; a sampled one
        verifies drafts from a uniform proposal, see :func:`~.sampled_rows.sample_drafts`), and where the
        drafts go in the target's input, ``fill = (positions in the verify segments, draft tokens)``. ``None``
        when nothing is verified."""
        n = len(self.q_lens)
        if not n:
            return None
        kmax, w = max(self.q_lens) - 1, self.tokens.shape[1]
        ql = np.asarray(self.q_lens, dtype=np.int64)  # host index arrays in numpy: this runs between two launches
        starts = np.cumsum(ql) - ql
        vidx = base + starts[:, None] + np.minimum(np.arange(kmax + 1)[None, :], ql[:, None] - 1)
        rows, col = segments(ql - 1)  # the drafts: request rows[j]'s draft col[j]
        host = np.concatenate([vidx.ravel(), self.draft_len.numpy(), np.asarray(greedy, dtype=np.int64),
                               starts[rows] + 1 + col, rows * w + col])
        vidx, dl, is_greedy, dst, src = to_device(torch.from_numpy(host), device).split(
            [n * (kmax + 1), n, n, rows.shape[0], rows.shape[0]])
        if self.wide_len is not None:
            dl = self.wide_len
        if self.finite is not None:
            dl = torch.where(self.finite if all(greedy) else self.finite | (is_greedy == 0), dl, 0)
        full = rows.shape[0] == self.tokens.numel()  # every request drafted the whole width: the drafts in order
        return vidx.view(n, kmax + 1), self.tokens[:, :kmax], dl, (dst, self.tokens.view(-1) if full else self.tokens.view(-1)[src])


def late_bits(drafts: RoundDrafts) -> list[torch.Tensor]:
    """A whole-block round's ratios for its one read, as int64 of their float32 bits (exact, NaN included)."""
    return [drafts.ratio.float().reshape(-1).view(torch.int32).long()] if drafts.late_ratio else []


def take_late_ratios(planner, running, drafts: RoundDrafts, packed: list[int]) -> list[int]:
    """The round's read less the ratios :func:`late_bits` put at its end, which become the requests' last ratios
    (``planner``: the engine's :class:`~adaflash_hf.speculation.length.planner.LengthPlanner`)."""
    if not drafts.late_ratio:
        return packed
    bits = np.array(packed[-len(running) :], dtype=np.int64).astype(np.int32).view(np.float32)
    planner.note_ratios(running, torch.from_numpy(bits.copy()))
    return packed[: -len(running)]


def unpack_read(packed: list[int], base: int, n: int, w: int) -> tuple:
    """The round's read as :meth:`.Engine._commit_round` takes it, from ``packed`` (``base`` prefills' first tokens,
    ``n`` accepted counts and next tokens, ``base + n`` fault flags, ``n`` draft lengths, ``[n, w]`` drafts): first
    tokens and fault flags of the prefills, then accepted counts, next tokens, fault flags, draft lengths and drafts
    (a list each) of the verifies.

    Example:
        >>> unpack_read([9, 2, 7, 0, 0, 2, 5, 6], 1, 1, 2)
        ([9], [0], [2], [7], [0], [2], [[5, 6]])
    """
    bad, dl = packed[base + 2 * n : 2 * base + 3 * n], packed[2 * base + 3 * n : 2 * base + 4 * n]
    rows = [packed[2 * base + 4 * n + i * w : 2 * base + 4 * n + (i + 1) * w] for i in range(n)]
    return packed[:base], bad[:base], packed[base : base + n], packed[base + n : base + 2 * n], bad[base:], dl, rows
