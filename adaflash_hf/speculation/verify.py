"""One verify-and-accept step, shared by ``generate`` and the engine.

After the target's verify forward, :func:`accept_block` decides for every row how many of its drafts
survive and which token the target appends: greedy rows by :func:`~.acceptance.greedy_accept_ids` on
the target's argmax, sampled rows by :func:`~.acceptance.speculative_accept` on the *processed*
distributions. Sampled rows come in groups (:class:`SampledRows`), one ``speculative_accept`` call
each: ``generate`` and the engine each put all their sampled rows in one group (one random stream).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from .acceptance import AcceptResult, greedy_accept_ids, speculative_accept

__all__ = ["SampledRows", "accept_block"]


@dataclass
class SampledRows:
    """Rows verified by speculative sampling: ``rows`` (indices into the block, a list or a device tensor, or
    ``None`` for all), ``draft_probs`` q ``[r, k, V]``, ``target_probs`` p ``[r, k+1, V]`` (both processed), their
    ``draft_len [r]`` (``None``: ``k``; on the device it is trusted, not read back) and the ``generator`` their
    randomness comes from."""

    rows: list[int] | torch.Tensor | None
    draft_probs: torch.Tensor
    target_probs: torch.Tensor
    draft_len: torch.Tensor | None = None
    generator: torch.Generator | None = None


def accept_block(
    draft_tokens: torch.Tensor,
    draft_len: torch.Tensor,
    target_top: torch.Tensor | None = None,
    sampled: Iterable[SampledRows] = (),
) -> AcceptResult:
    """Accepted drafts and the next token of each row of one verified block.

    Args:
        draft_tokens: ``LongTensor[b, k]`` as verified (sampled ones for sampled rows).
        draft_len: ``LongTensor[b]``, real drafts per row (positions past it are padding).
        target_top: ``LongTensor[b, k+1]``, the target's argmax at each verify position; greedy rows
            are accepted on it without reading the device back. ``None`` when every row is sampled.
        sampled: groups of rows accepted by the speculative sampling rule instead.

    Example:
        >>> r = accept_block(torch.tensor([[5, 1]]), torch.tensor([2]), torch.tensor([[5, 6, 7]]))
        >>> r.num_accepted.tolist(), r.next_tokens.tolist()
        ([1], [6])
    """
    if target_top is not None:
        result = greedy_accept_ids(draft_tokens, target_top, draft_len)
    else:
        zeros = draft_len.new_zeros(draft_tokens.shape[0])
        result = AcceptResult(num_accepted=zeros, next_tokens=zeros.clone())
    for group in sampled:
        rows = slice(None) if group.rows is None else group.rows
        k = group.target_probs.shape[1] - 1
        drafts = draft_tokens[rows, :k].to(group.target_probs.device)
        res = speculative_accept(drafts, group.draft_probs, group.target_probs, group.draft_len, generator=group.generator)
        if group.rows is None and target_top is None:
            result = res
        else:
            result.num_accepted[rows] = res.num_accepted.to(result.num_accepted.device)
            result.next_tokens[rows] = res.next_tokens.to(result.next_tokens.device)
    return result
