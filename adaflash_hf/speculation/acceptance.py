"""Acceptance math for speculative verification.

Pure torch functions, no model code: given the drafter's proposal and the target's verify
forward, decide how many draft tokens survive and which token the target appends. Everything is
vectorised over the batch (rows may have different draft lengths), so the batched loop and the
engine can call the same code.

Index convention (shared with the rest of the package): for a row with draft tokens
``x_1..x_k`` (stored at indices ``0..k-1``), the target distribution at index ``i`` is the one that
predicts draft index ``i``; index ``k`` (or ``draft_len`` for a shorter row) predicts the bonus
token after a fully accepted draft. Hence ``target_* [b, k+1, V]`` against ``draft_* [b, k, V]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "AcceptResult",
    "accepted_prefix_len",
    "acceptance_probability",
    "expected_accepted_tokens",
    "expected_speedup",
    "greedy_accept",
    "greedy_accept_ids",
    "residual_distribution",
    "speculative_accept",
]


@dataclass(frozen=True)
class AcceptResult:
    """Outcome of verifying one draft block per row.

    Attributes:
        num_accepted: ``LongTensor[b]``, accepted draft tokens per row (0..draft_len).
        next_tokens: ``LongTensor[b]``, the target's token appended after the accepted prefix
            (the correction at the first rejection, or the bonus token if all were accepted).
            Each row therefore advances by ``num_accepted + 1`` tokens.
    """

    num_accepted: torch.Tensor
    next_tokens: torch.Tensor


def _check_shapes(draft_tokens: torch.Tensor, target: torch.Tensor, name: str) -> tuple[int, int]:
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [b, k], got shape {tuple(draft_tokens.shape)}")
    b, k = draft_tokens.shape
    if target.dim() != 3 or target.shape[0] != b or target.shape[1] != k + 1:
        raise ValueError(
            f"{name} must be [b, k+1, V] = [{b}, {k + 1}, V], got shape {tuple(target.shape)}"
        )
    return b, k


def _resolve_draft_len(draft_len: torch.Tensor | None, b: int, k: int, device) -> torch.Tensor:
    if draft_len is None:
        return torch.full((b,), k, dtype=torch.long, device=device)
    draft_len = torch.as_tensor(draft_len).long().reshape(-1)
    if draft_len.shape[0] != b:
        raise ValueError(f"draft_len must have one entry per row ({b}), got {draft_len.shape[0]}")
    # Checked on the host only: a device tensor (the engine's on CUDA) is trusted, as reading it would wait for the device.
    if b and draft_len.device.type == "cpu" and (int(draft_len.min()) < 0 or int(draft_len.max()) > k):
        raise ValueError(f"draft_len entries must lie in [0, {k}], got {draft_len.tolist()}")
    return draft_len.to(device)


def accepted_prefix_len(accept: torch.Tensor, draft_len: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of ``True`` in ``accept [b, k]``, ignoring padding positions.

    Example:
        >>> accepted_prefix_len(torch.tensor([[True, True, False], [True, True, True]]), torch.tensor([3, 1])).tolist()
        [2, 1]
    """
    k = accept.shape[1]
    valid = torch.arange(k, device=accept.device)[None, :] < draft_len[:, None]
    # cumprod turns "accepted so far" into a 1 until the first rejection (or padding), then 0s;
    # its sum is the prefix length without a Python loop over positions.
    return torch.cumprod((accept & valid).long(), dim=1).sum(dim=1)


def greedy_accept(
    draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    draft_len: torch.Tensor | None = None,
) -> AcceptResult:
    """Greedy verification: keep the longest draft prefix equal to the target's argmax.

    Args:
        draft_tokens: ``LongTensor[b, k]``; positions ``>= draft_len[i]`` are padding.
        target_logits: ``FloatTensor[b, k+1, V]`` from the verify forward (processed or raw:
            only the argmax matters).
        draft_len: ``LongTensor[b]`` of real draft tokens per row (default ``k`` for all rows).

    Returns:
        :class:`AcceptResult` with ``next_tokens = argmax(target_logits[i, num_accepted[i]])``.

    Example:
        >>> logits = torch.nn.functional.one_hot(torch.tensor([[5, 6, 7]]), 8).float()
        >>> r = greedy_accept(torch.tensor([[5, 1]]), logits)
        >>> r.num_accepted.tolist(), r.next_tokens.tolist()
        ([1], [6])
    """
    b, k = _check_shapes(draft_tokens, target_logits, "target_logits")
    draft_len = _resolve_draft_len(draft_len, b, k, draft_tokens.device)
    return greedy_accept_ids(draft_tokens, target_logits.argmax(dim=-1), draft_len)


def greedy_accept_ids(
    draft_tokens: torch.Tensor,
    target_top: torch.Tensor,
    draft_len: torch.Tensor | None = None,
) -> AcceptResult:
    """:func:`greedy_accept` on the target's argmax ids ``target_top [b, k+1]`` (no logits needed).

    Never reads the device back (the engine queues it behind its target forward): ``draft_len``
    (default ``k``) is trusted, not range-checked.

    Example:
        >>> r = greedy_accept_ids(torch.tensor([[5, 1]]), torch.tensor([[5, 6, 7]]))
        >>> r.num_accepted.tolist(), r.next_tokens.tolist()
        ([1], [6])
    """
    b, k = draft_tokens.shape
    if draft_len is None:
        draft_len = torch.full((b,), k, dtype=torch.long, device=draft_tokens.device)
    num_accepted = accepted_prefix_len(draft_tokens == target_top[:, :k], draft_len)
    next_tokens = target_top.gather(1, num_accepted[:, None]).squeeze(1)
    return AcceptResult(num_accepted=num_accepted, next_tokens=next_tokens)


def acceptance_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """Probability of keeping a draft token: ``min(1, p(x) / q(x))`` (Leviathan et al.).

    ``q(x) == 0`` cannot happen for a token sampled from ``q``; if a caller passes one anyway
    (e.g. a greedy draft scored against a truncated ``q``) we keep it iff the target allows it,
    rather than dividing by zero.

    Example:
        >>> acceptance_probability(torch.tensor([0.2, 0.9]), torch.tensor([0.4, 0.3]))
        tensor([0.5000, 1.0000])
    """
    ratio = p_x / q_x.clamp_min(torch.finfo(q_x.dtype).tiny)
    return torch.where(q_x > 0, ratio.clamp(max=1.0), (p_x > 0).to(ratio.dtype))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``normalize(max(p - q, 0))`` over the last axis; falls back to ``p`` where that is all zero.

    The residual is what a rejection must be resampled from so that the overall output follows
    ``p``. It is all zero only when ``p <= q`` everywhere, i.e. ``p == q`` for normalised inputs;
    then a rejection has probability zero in exact arithmetic, and ``p`` is the correct (and
    only safe) distribution to sample if round-off produced one anyway.

    Example:
        >>> residual_distribution(torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.6, 0.2]))
        tensor([1., 0., 0.])
    """
    residual = (p - q).clamp_min(0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), p)


def speculative_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    draft_len: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> AcceptResult:
    """Lossless sampling verification (speculative sampling, Leviathan et al. 2023).

    Draft token ``x_i`` is kept with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first
    rejection the appended token is drawn from :func:`residual_distribution` ``(p_i, q_i)``; if
    every real draft token of a row is kept, the bonus token is drawn from ``p`` at index
    ``draft_len``. The emitted tokens are then distributed exactly as sampling from ``p``.

    Args:
        draft_tokens: ``LongTensor[b, k]``, sampled from ``draft_probs``.
        draft_probs: ``q``, ``FloatTensor[b, k, V]``, the *processed* draft distributions.
        target_probs: ``p``, ``FloatTensor[b, k+1, V]``, the *processed* target distributions
            (same temperature / top-k / top-p as ``q``, applied by the caller).
        draft_len: ``LongTensor[b]``; positions ``>= draft_len[i]`` are padding, never accepted (range-checked
            when it is on the host; a device tensor is trusted: checking it would read the device back).
        generator: source of all randomness (uniforms, then one multinomial draw per row), so a
            seeded generator reproduces the result exactly.

    Example:
        >>> p = torch.tensor([[[0.0, 1.0], [1.0, 0.0]]])  # target: token 1, then token 0
        >>> r = speculative_accept(torch.tensor([[1]]), torch.tensor([[[0.5, 0.5]]]), p)
        >>> r.num_accepted.tolist(), r.next_tokens.tolist()
        ([1], [0])
    """
    b, k = _check_shapes(draft_tokens, target_probs, "target_probs")
    if draft_probs.shape != (b, k, target_probs.shape[-1]):
        raise ValueError(
            f"draft_probs must be [b, k, V] = [{b}, {k}, {target_probs.shape[-1]}], "
            f"got shape {tuple(draft_probs.shape)}"
        )
    device = target_probs.device
    draft_len = _resolve_draft_len(draft_len, b, k, device)
    # Sampling in fp32 at least: multinomial rejects bf16 and the p/q ratios want the precision.
    dtype = torch.promote_types(torch.promote_types(target_probs.dtype, draft_probs.dtype), torch.float32)
    p = target_probs.to(dtype)
    q = draft_probs.to(dtype)

    idx = draft_tokens.long()[..., None]
    p_x = p[:, :k].gather(2, idx).squeeze(2)
    q_x = q.gather(2, idx).squeeze(2)
    # One uniform per position (padding included) keeps the random stream's layout independent
    # of draft_len, so a fixed seed gives the same draws whatever the ragged lengths are.
    u = torch.rand((b, k), generator=generator, device=device, dtype=dtype)
    num_accepted = accepted_prefix_len(u < acceptance_probability(p_x, q_x), draft_len)

    rows = torch.arange(b, device=device)
    p_at = p[rows, num_accepted]  # [b, V]: target at the first rejection, or at the bonus slot
    if k > 0:
        q_at = q[rows, num_accepted.clamp(max=k - 1)]
        rejected = (num_accepted < draft_len)[:, None]
        next_dist = torch.where(rejected, residual_distribution(p_at, q_at), p_at)
    else:
        next_dist = p_at
    next_tokens = torch.multinomial(next_dist, 1, generator=generator).squeeze(1)
    return AcceptResult(num_accepted=num_accepted, next_tokens=next_tokens)


def expected_accepted_tokens(acc: float, k: int) -> float:
    """Expected tokens per round, ``E[tau] = (1 - acc^(k+1)) / (1 - acc)``.

    ``acc`` is the per-token acceptance rate (i.i.d. model), ``k`` the number of draft tokens
    verified; the count includes the target's own token, so it lies in ``[1, k+1]`` and equals
    ``k + 1`` at ``acc == 1`` (the formula's limit).

    Example:
        >>> expected_accepted_tokens(0.5, 2)
        1.75
    """
    if not 0.0 <= acc <= 1.0:
        raise ValueError(f"acc must be in [0, 1], got {acc}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if 1.0 - acc < 1e-6:
        # The closed form cancels catastrophically next to 1; the geometric series it sums is
        # the same quantity without the division.
        return float(sum(acc**i for i in range(k + 1)))
    return (1.0 - acc ** (k + 1)) / (1.0 - acc)


def expected_speedup(acc: float, k: int, rho: float, draft_forwards: int | None = None) -> float:
    """Expected speedup over plain decoding, ``E[tau] / (rho * k + 1)``.

    ``rho`` is the cost of one drafter forward relative to one target forward. The SPEC formula
    charges one drafter forward per draft token (autoregressive drafter, the default); a one-pass
    block drafter (DFlash) costs a single forward whatever ``k`` is, so pass ``draft_forwards=1``
    to get ``E[tau] / (rho * 1 + 1)``.

    Example:
        >>> expected_speedup(0.5, 2, rho=0.25)
        1.1666666666666667
    """
    if rho < 0:
        raise ValueError(f"rho must be >= 0, got {rho}")
    forwards = k if draft_forwards is None else draft_forwards
    if forwards < 0:
        raise ValueError(f"draft_forwards must be >= 0, got {draft_forwards}")
    return expected_accepted_tokens(acc, k) / (rho * forwards + 1.0)
