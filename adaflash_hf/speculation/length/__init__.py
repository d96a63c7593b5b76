"""How many drafts a round verifies, in one place: the policy names and settings (:mod:`.names`, torch-free), one
rule per policy with only its own knobs (:mod:`.rules`), what a round costs (:mod:`.cost`) and the planner that
generate's loop and the engine both ask each round (:mod:`.planner`).

Example:
    >>> import torch
    >>> planner = LengthPlanner(LengthSettings("cost", 1.0, 1), 8, RoundCost.flat())
    >>> planner.lengths([RowState(remaining=20)], torch.tensor([0.3])).tolist()  # a flat cost: the whole block
    [8]
"""

from .cost import RoundCost
from .names import (
    ENGINE_POLICIES,
    HEAD_POLICIES,
    LAYOUTS,
    POLICY_NAMES,
    LengthPolicy,
    LengthSettings,
    default_policy,
    layout_args,
    resolve_policy,
    round_layout,
)
from .planner import LengthPlanner, Plan, RowState
from .rules import CostRule, ExpectedGainRule, FixedRule, FloorRule, RoundInputs, make_rule

__all__ = ["CostRule", "ENGINE_POLICIES", "ExpectedGainRule", "FixedRule", "FloorRule", "HEAD_POLICIES", "LAYOUTS",
           "LengthPlanner", "LengthPolicy", "LengthSettings", "POLICY_NAMES", "Plan", "RoundCost", "RoundInputs",
           "RowState", "default_policy", "layout_args", "make_rule", "resolve_policy", "round_layout"]
