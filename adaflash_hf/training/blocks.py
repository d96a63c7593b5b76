"""Anchors, block inputs and block attention masks for offline DFlash training.

Pure tensor functions (no model), so every rule here is unit-tested on CPU.

One training sequence of ``T`` tokens (right padded) carries ``n`` blocks of ``B`` slots, drafted
in one drafter forward. Block ``i`` starts at an *anchor* position ``a_i``:

* slot 0 holds the anchor token ``input_ids[a_i]`` (at inference: the bonus token, the last token
  the target produced, whose own target hidden state does not exist yet);
* slots ``k = 1..B-1`` hold ``mask_token_id`` and are trained to predict ``input_ids[a_i + k]``;
* the slots sit at absolute positions ``a_i + k`` (RoPE), exactly as at inference.

**Attention rule** (keys are ``[context 0..T-1 | block_0 | block_1 | ...]``). A query in block
``i`` may attend to

* context key ``j`` iff ``j < a_i`` (and ``j`` is a real token): the target features of the tokens
  *strictly before* the anchor. The anchor's own target state is not visible, because at inference
  the drafter's context is every verified token before the bonus token, and the bonus token itself
  enters only through slot 0's embedding;
* every slot of its own block ``i`` (bidirectional);
* nothing else: no other block, no context at or after its anchor.

**Anchor rule.** Anchor ``a`` is a candidate iff ``a + 1 < T`` and ``loss_mask[a + 1]`` is true,
i.e. the first token the block predicts is a response token of this sequence. Later slots whose
target ``a + k`` lies past the end of the sequence, or on a non-response token (padding, a later
user turn), get label ``-100``. (``require_full_block=True`` additionally requires
``a + B - 1 < T``, the stricter rule of some DFlash ports; it never trains the first slots on the
last ``B - 1`` tokens of a sequence, so it is off by default.) Up to ``max_anchors`` candidates are
drawn per sequence without replacement and returned sorted by position.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100

__all__ = [
    "IGNORE_INDEX",
    "anchor_candidates",
    "sample_anchors",
    "build_block_inputs",
    "block_attention_mask",
]


def anchor_candidates(loss_mask: torch.Tensor, block_size: int, require_full_block: bool = False) -> torch.Tensor:
    """``bool [b, T]``: positions that may start a block (see the module docstring)."""
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be [b, T], got shape {tuple(loss_mask.shape)}")
    lm = loss_mask.to(torch.bool)
    b, t = lm.shape
    cand = torch.zeros_like(lm)
    if t >= 2:
        cand[:, :-1] = lm[:, 1:]
    if require_full_block:
        last = t - block_size  # a + B - 1 <= T - 1
        cand[:, max(last + 1, 0) :] = False
    return cand


def sample_anchors(
    loss_mask: torch.Tensor,
    block_size: int,
    max_anchors: int = 512,
    generator: torch.Generator | None = None,
    require_full_block: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw up to ``max_anchors`` anchors per sequence, without replacement, inside the response.

    Args:
        loss_mask: ``bool [b, T]``, true on response tokens (padding false).
        block_size: ``B``.
        max_anchors: cap per sequence (512 in DFlash).
        generator: optional ``torch.Generator`` (on ``loss_mask``'s device) for reproducibility.

    Returns:
        ``anchors LongTensor [b, n]`` sorted ascending within a row (invalid entries are 0 and come
        last), ``valid bool [b, n]``; ``n = min(max_anchors, most candidates in any row)`` (at
        least 1, so shapes stay non-empty; a row without candidates has no valid anchor).

    Example:
        >>> lm = torch.tensor([[0, 0, 1, 1, 0]], dtype=torch.bool)
        >>> a, v = sample_anchors(lm, block_size=4)
        >>> a.tolist(), v.tolist()
        ([[1, 2]], [[True, True]])
    """
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    if max_anchors < 1:
        raise ValueError(f"max_anchors must be >= 1, got {max_anchors}")
    cand = anchor_candidates(loss_mask, block_size, require_full_block)
    b, t = cand.shape
    counts = cand.sum(dim=1)
    n = int(min(max_anchors, max(int(counts.max().item()) if b else 0, 1)))
    n = min(n, max(t, 1))
    if t == 0:
        return torch.zeros(b, n, dtype=torch.long, device=cand.device), torch.zeros(b, n, dtype=torch.bool, device=cand.device)
    scores = torch.rand(b, t, generator=generator, device=cand.device)
    scores = scores.masked_fill(~cand, 2.0)  # non-candidates sort last
    picked = torch.topk(scores, n, dim=1, largest=False).indices  # random subset of candidates first
    valid = torch.gather(cand, 1, picked)
    # Sort: valid anchors ascending by position, invalid ones after them.
    key = torch.where(valid, picked, picked + t)
    order = torch.argsort(key, dim=1)
    anchors = torch.gather(picked, 1, order)
    valid = torch.gather(valid, 1, order)
    anchors = anchors.masked_fill(~valid, 0)
    return anchors, valid


def _block_offsets(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[b, n, B]`` absolute positions ``anchor + k``."""
    return anchors.unsqueeze(-1) + torch.arange(block_size, device=anchors.device)


def build_block_inputs(
    input_ids: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    loss_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block token ids, labels and position ids for ``n`` blocks per sequence.

    Returns ``(block_ids, labels, position_ids)``, each ``LongTensor [b, n * B]`` (block ``i``
    occupies columns ``i*B .. i*B + B - 1``):

    * ``block_ids``: slot 0 = ``input_ids[anchor]``, slots 1..B-1 = ``mask_token_id`` (invalid
      blocks are all ``mask_token_id``);
    * ``labels``: slot ``k >= 1`` = ``input_ids[anchor + k]``; ``-100`` for slot 0, invalid blocks,
      targets past the end of the sequence and, when ``loss_mask`` is given, non-response targets;
    * ``position_ids``: ``anchor + k`` (for invalid blocks ``k``; they are masked out anyway).

    Example:
        >>> ids = torch.tensor([[10, 11, 12, 13]])
        >>> blk, lab, pos = build_block_inputs(ids, torch.tensor([[2]]), torch.tensor([[True]]), 3, 99)
        >>> blk.tolist(), lab.tolist(), pos.tolist()
        ([[12, 99, 99]], [[-100, 13, -100]], [[2, 3, 4]])
    """
    b, t = input_ids.shape
    n = anchors.shape[1]
    anchors = anchors.to(device=input_ids.device, dtype=torch.long)
    valid = valid.to(device=input_ids.device, dtype=torch.bool)
    pos = _block_offsets(anchors, block_size)  # [b, n, B]
    in_seq = pos < t
    gathered = torch.gather(input_ids, 1, pos.clamp(max=t - 1).reshape(b, -1)).reshape(b, n, block_size)

    block_ids = torch.full_like(gathered, mask_token_id)
    block_ids[:, :, 0] = torch.where(valid, gathered[:, :, 0], torch.full_like(gathered[:, :, 0], mask_token_id))

    keep = in_seq & valid.unsqueeze(-1)
    keep[:, :, 0] = False
    if loss_mask is not None:
        lm = torch.gather(loss_mask.to(torch.bool), 1, pos.clamp(max=t - 1).reshape(b, -1)).reshape(b, n, block_size)
        keep &= lm
    labels = torch.where(keep, gathered, torch.full_like(gathered, IGNORE_INDEX))
    return block_ids.reshape(b, -1), labels.reshape(b, -1), pos.reshape(b, -1)


def block_attention_mask(
    context_len: int,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``bool [b, 1, n*B, T + n*B]`` "may attend" mask over keys ``[context | blocks]``.

    Query slots of block ``i`` see context keys ``j < anchors[i]`` (and, if ``key_padding_mask
    [b, T]`` is given, only real tokens among them) and every slot of block ``i``; nothing else.
    An invalid block sees only itself (never an empty row, which would give NaNs in attention).

    Example (one block of 2 at anchor 2, context of 3):
        >>> block_attention_mask(3, torch.tensor([[2]]), torch.tensor([[True]]), 2)[0, 0].int().tolist()
        [[1, 1, 0, 1, 1], [1, 1, 0, 1, 1]]
    """
    anchors = anchors.to(torch.long)
    valid = valid.to(device=anchors.device, dtype=torch.bool)
    b, n = anchors.shape
    q = n * block_size
    dev = anchors.device
    ctx_idx = torch.arange(context_len, device=dev)
    ctx = ctx_idx.view(1, 1, -1) < anchors.unsqueeze(-1)  # [b, n, T]
    ctx &= valid.unsqueeze(-1)
    if key_padding_mask is not None:
        ctx &= key_padding_mask.to(device=dev, dtype=torch.bool).unsqueeze(1)
    ctx = ctx.unsqueeze(2).expand(b, n, block_size, context_len).reshape(b, q, context_len)
    blk_of = torch.arange(q, device=dev) // block_size
    own = (blk_of.view(-1, 1) == blk_of.view(1, -1)).unsqueeze(0).expand(b, q, q)
    return torch.cat([ctx, own], dim=-1).unsqueeze(1)
