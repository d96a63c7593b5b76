"""Training losses as pure functions: block cross-entropy, OPD / forward-KL distillation, the length head's MSE.

Shapes: logits ``[b, k, V]`` (one row per verified / training block, one column per draft
position), ``mask [b, k]`` bool with ``True`` = a real position (padding and positions beyond a
row's verify length are ``False``; see :func:`length_mask`). Every loss is a (weighted) mean over
the valid positions only; masked positions are dropped before any arithmetic, so whatever they
hold (even NaN) reaches neither the value nor the gradient. Softmaxes run in fp32 whatever the
logits' dtype (fp64 stays fp64), so bf16 logits are safe.

Position weighting convention: with per-position weights ``w`` (e.g. :func:`position_weights`),
a loss is ``sum_i w_i * l_i / sum_i w_i`` over valid positions, i.e. a weighted mean; with
``w = 1`` it is the plain mean.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "block_ce_loss",
    "default_gamma",
    "forward_kl_loss",
    "length_head_loss",
    "length_mask",
    "opd_loss",
    "position_weights",
]

# Floor for log-probabilities. Processed logits (top-k / top-p) carry -inf, and q * log(q / p)
# with p = 0 is inf with a NaN gradient; a floor of e^-10000 is zero probability for every
# practical purpose but keeps values and gradients finite (the clip then caps such entries).
_LOGPROB_FLOOR = -1e4


def position_weights(
    block_len: int,
    gamma: float,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """DFlash position weights ``exp(-(i - 1) / gamma)`` for ``i = 1..block_len``.

    Early draft positions matter most (a rejection there discards everything after it), so they
    get the largest weight.

    Example:
        >>> position_weights(3, gamma=1.0)
        tensor([1.0000, 0.3679, 0.1353])
    """
    if block_len < 0:
        raise ValueError(f"block_len must be >= 0, got {block_len}")
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    i = torch.arange(block_len, device=device, dtype=torch.float64)
    return torch.exp(-i / gamma).to(dtype)


def default_gamma(block_size: int) -> float:
    """The DFlash decay ``gamma`` for a block size: 7 for 16, 5 for 10, 4 for 8 (DFlash's settings).

    Other sizes: ``B / 2`` up to 10 (which also passes through 8 -> 4 and 10 -> 5), then linear
    through 16 -> 7 (slope 1/3), extended with that slope past 16. Continuous and increasing, so
    a bigger block always spreads its weight over more positions.

    Example:
        >>> default_gamma(16), default_gamma(12), default_gamma(4)
        (7.0, 5.666666666666667, 2.0)
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if block_size <= 10:
        return block_size / 2.0
    return 5.0 + (block_size - 10) / 3.0


def length_mask(lengths: torch.Tensor, k: int) -> torch.Tensor:
    """``BoolTensor[b, k]``: ``True`` at positions ``< lengths[i]`` (e.g. within the verify length).

    Example:
        >>> length_mask(torch.tensor([0, 2]), 3).tolist()
        [[False, False, False], [True, True, False]]
    """
    return torch.arange(k, device=lengths.device)[None, :] < lengths.reshape(-1, 1)


def _valid_and_weights(
    shape: tuple[int, int],
    mask: torch.Tensor | None,
    weights: torch.Tensor | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean ``valid [b, k]`` and the weights of the valid positions, flattened ``[n]``."""
    valid = torch.ones(shape, dtype=torch.bool, device=device)
    if mask is not None:
        valid = valid & mask.to(device=device, dtype=torch.bool)  # broadcast errors surface here
    if weights is None:
        w = torch.ones(shape, dtype=torch.float32, device=device)
    else:
        w = torch.as_tensor(weights, device=device).float().expand(shape)
    return valid, w[valid]


def _weighted_mean(per_pos: torch.Tensor, w: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    # With no valid position the loss is 0 but stays attached to the graph (``anchor`` is an
    # empty selection of the inputs), so a training step on an all-padding batch just no-ops.
    if per_pos.numel() == 0:
        return _upcast(anchor).sum() * 0.0
    return (per_pos * w).sum() / w.sum().clamp_min(torch.finfo(torch.float32).tiny)


def _check_logits(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> None:
    if draft_logits.dim() != 3:
        raise ValueError(f"logits must be [b, k, V], got shape {tuple(draft_logits.shape)}")
    if target_logits.shape != draft_logits.shape:
        raise ValueError(
            f"draft and target logits differ in shape: {tuple(draft_logits.shape)} vs "
            f"{tuple(target_logits.shape)}"
        )


def _upcast(x: torch.Tensor) -> torch.Tensor:
    # fp32 at least (bf16/fp16 softmaxes lose the small probabilities KL terms live on); fp64
    # stays fp64 so the losses can be gradchecked.
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _log_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    return F.log_softmax(_upcast(logits) / temperature, dim=-1).clamp_min(_LOGPROB_FLOOR)


def block_ce_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Offline DFlash loss: position-weighted cross-entropy over valid block positions.

    Args:
        logits: ``[b, k, V]`` draft logits for block slots 1..k.
        labels: ``LongTensor[b, k]``; ``ignore_index`` entries count as masked.
        weights: ``[k]`` or ``[b, k]``, e.g. ``position_weights(k, default_gamma(k + 1))``.
        mask: ``BoolTensor[b, k]``, ``True`` = valid.

    Example:
        >>> logits = torch.zeros(1, 2, 4)
        >>> round(block_ce_loss(logits, torch.tensor([[1, -100]])).item(), 4)  # log(4)
        1.3863
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"need logits [b, k, V] and labels [b, k], got {tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    label_ok = labels != ignore_index
    mask = label_ok if mask is None else (mask.to(torch.bool) & label_ok)
    valid, w = _valid_and_weights(labels.shape, mask, weights, logits.device)
    sel = logits[valid]  # [n, V]
    per_pos = F.cross_entropy(_upcast(sel), labels[valid].long(), reduction="none")
    return _weighted_mean(per_pos, w, sel)


def opd_loss(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    alpha: float = 0.8,
    clip: float | None = 0.01,
    temperature: float = 1.0,
    position_weights: torch.Tensor | None = None,
    clip_mode: str = "entry",
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """AdaFlash on-policy distillation loss ``alpha * l_hard + (1 - alpha) * l_rkl_clip``.

    - ``l_hard``: cross-entropy of the draft (temperature 1) against the target's top-1 token,
      the hard label, not the sampled token.
    - ``l_rkl``: reverse KL ``sum_y q(y) log(q(y) / p(y))`` with both distributions at
      ``temperature`` and the result scaled by ``T^2`` (so gradients keep their size as T
      changes).
    - ``clip_mode="entry"`` (default, the paper): each ``(position, vocab entry)`` term is capped
      at ``clip`` before summing over the vocabulary, so a few tokens with ``p ~ 0`` cannot
      dominate the gradient.
    - ``clip_mode="token"`` (the released code): the per-position reverse KL (unclipped sum over
      the vocabulary) is first divided by the token count, i.e. multiplied by its normalised
      weight ``w_i / sum(w)`` (``1 / n`` unweighted), then each token's contribution is capped at
      ``clip`` and the capped contributions are summed.
    - ``clip=None`` disables clipping in either mode.

    The target is a frozen teacher: ``target_logits`` is detached here. Means over positions are
    weighted means over ``mask``ed-in positions (module docstring).

    Example (log-probs are valid logits):
        >>> q = torch.tensor([[[0.55, 0.30, 0.10, 0.05]]]).log()
        >>> p = torch.tensor([[[0.80, 0.15, 0.04, 0.01]]]).log()
        >>> round(opd_loss(q, p).item(), 3), round(opd_loss(q, p, clip=None).item(), 3)
        (0.443, 0.513)
    """
    _check_logits(draft_logits, target_logits)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if clip_mode not in ("entry", "token"):
        raise ValueError(f"clip_mode must be 'entry' or 'token', got {clip_mode!r}")
    valid, w = _valid_and_weights(draft_logits.shape[:2], mask, position_weights, draft_logits.device)
    draft = draft_logits[valid]  # [n, V]
    target = target_logits[valid].detach()
    if draft.shape[0] == 0:
        return _weighted_mean(draft.new_zeros(0), w, draft)

    hard_label = target.argmax(dim=-1)
    l_hard = _weighted_mean(F.cross_entropy(_upcast(draft), hard_label, reduction="none"), w, draft)

    lq = _log_probs(draft, temperature)
    lp = _log_probs(target, temperature)
    entries = lq.exp() * (lq - lp)  # [n, V] reverse-KL terms q log(q/p)
    if clip is not None and clip_mode == "entry":
        l_rkl = _weighted_mean(entries.clamp(max=clip).sum(dim=-1), w, draft)
    elif clip is not None:  # "token"
        share = w / w.sum().clamp_min(torch.finfo(torch.float32).tiny)
        l_rkl = (share * entries.sum(dim=-1)).clamp(max=clip).sum()
    else:
        l_rkl = _weighted_mean(entries.sum(dim=-1), w, draft)
    return alpha * l_hard + (1.0 - alpha) * temperature**2 * l_rkl


def forward_kl_loss(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    position_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """OSD baseline: ``T^2 * KL(p || q)`` at temperature ``T``, mean over valid positions.

    Mass-covering (``p`` weights the log ratio), unlike OPD's mode-seeking reverse KL; no hard
    label, no clipping. The target is detached.

    Example:
        >>> x = torch.randn(2, 3, 5)
        >>> forward_kl_loss(x, x).abs().item() < 1e-6
        True
    """
    _check_logits(draft_logits, target_logits)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    valid, w = _valid_and_weights(draft_logits.shape[:2], mask, position_weights, draft_logits.device)
    draft = draft_logits[valid]
    lq = _log_probs(draft, temperature)
    lp = _log_probs(target_logits[valid].detach(), temperature)
    per_pos = (lp.exp() * (lp - lq)).sum(dim=-1)
    return temperature**2 * _weighted_mean(per_pos, w, draft)


def length_head_loss(
    pred_ratio: torch.Tensor,
    num_accepted: torch.Tensor,
    block_size: int,
    mask: torch.Tensor | None = None,
    verify_len: torch.Tensor | None = None,
) -> torch.Tensor:
    """MSE of the length head against the label ``(accepted + 1) / B``.

    ``pred_ratio`` is the head's sigmoid output per verified block (``[b]`` or ``[b, 1]``),
    ``num_accepted`` the draft tokens accepted in that block, ``mask [b]`` drops blocks (e.g.
    padding rows). The caller feeds the head *detached* drafter features, so this loss only
    trains the head.

    ``verify_len [b]`` (slots verified, bonus included) marks *censored* labels: when every
    verified draft was accepted and the block was cut short (``accepted == verify_len - 1 < B - 1``)
    the true acceptance is only known to be at least the label, so the loss penalises predictions
    below it and not above. Without this, a head trained online on its own short verifications
    learns its own cut-off and can only shrink (a feedback loop down to ``k_hat = 1``).

    Example:
        >>> length_head_loss(torch.tensor([0.5]), torch.tensor([7]), block_size=16).item()
        0.0
        >>> length_head_loss(torch.tensor([0.5]), torch.tensor([1]), 16, verify_len=torch.tensor([2])).item()
        0.0
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    pred = pred_ratio.reshape(-1)
    acc = num_accepted.reshape(-1)
    if pred.shape != acc.shape:
        raise ValueError(f"pred_ratio and num_accepted sizes differ: {pred.shape[0]} vs {acc.shape[0]}")
    valid = torch.ones_like(acc, dtype=torch.bool) if mask is None else mask.reshape(-1).to(torch.bool)
    sel = _upcast(pred[valid])
    label = (acc[valid].to(sel.dtype) + 1.0) / block_size
    err = sel - label
    if verify_len is not None:
        vl = verify_len.reshape(-1)[valid].to(acc.device)
        censored = (acc[valid] >= vl - 1) & (vl < block_size)
        err = torch.where(censored, err.clamp(max=0.0), err)
    return _weighted_mean(err**2, torch.ones_like(label), sel)
