"""Kept for imports: the verify-length rules live in :mod:`.length` (:mod:`.length.rules`, :mod:`.length.planner`).

:func:`choose_verify_length` is the one-call form of a rule for scripts: it builds the rule a policy names from the
keywords that rule reads (:func:`.length.rules.make_rule`) and applies it to one round.
"""

from __future__ import annotations

import torch

from .length.cost import RoundCost
from .length.names import POLICY_NAMES, LengthPolicy, LengthSettings, default_policy, resolve_policy
from .length.rules import (
    RoundInputs,
    adaptive_verify_length,
    cost_aware_verify_length,
    expected_gain_verify_length,
    fixed_verify_length,
    load_scaled_rate,
    make_rule,
    survival_curve,
)

__all__ = ["LengthPolicy", "POLICY_NAMES", "RoundCost", "adaptive_verify_length", "choose_verify_length",
           "cost_aware_verify_length", "default_policy", "resolve_policy", "expected_gain_verify_length",
           "fixed_verify_length", "load_scaled_rate", "survival_curve"]


def choose_verify_length(policy: LengthPolicy | str, batch: int, block_size: int, *, ratio: torch.Tensor | None = None,
                         draft_logits: torch.Tensor | None = None, rate: float = 1.0, min_len: int = 1,
                         verify_token_cost: float = 0.05, device: torch.device | str | None = None,
                         round_cost: RoundCost | None = None, max_len: torch.Tensor | None = None,
                         unread_whole: bool = False, drafted: bool = False) -> torch.Tensor:
    """Each row's verify length under ``policy`` for one round (``LongTensor[batch]`` on ``device``, default the
    ratio's or the logits'), by the rule :func:`~.length.rules.make_rule` builds from the keywords it reads.

    Example:
        >>> choose_verify_length("adaptive", 2, 16, ratio=torch.tensor([0.5, 1.0]), rate=0.5).tolist()
        [4, 8]
    """
    rule = make_rule(LengthSettings(LengthPolicy(policy), rate, min_len, None, verify_token_cost), round_cost)
    k_hat = rule.lengths(RoundInputs(batch, block_size, ratio, draft_logits, max_len, unread_whole, drafted))
    where = device if device is not None else next((t.device for t in (ratio, draft_logits) if t is not None), None)
    return k_hat if where is None else k_hat.to(where)
