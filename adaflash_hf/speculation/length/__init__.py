"""How many drafts a round verifies, in one place: the policy names and settings (:mod:`.names`, torch-free), one
rule per policy with only its own knobs (:mod:`.rules`), what a round costs (:mod:`.cost`), the head's ratios
calibrated by the traffic's acceptance (:mod:`.calibration`) and the planner that
generate's loop and the engine both ask each round (:mod:`.planner`). Names are imported on first use, so that the
CLI reads :mod:`.names` without torch.

Example:
    >>> import torch
    >>> planner = LengthPlanner(LengthSettings("cost", 1.0, 1), 8, RoundCost.flat())
    >>> planner.lengths([RowState(remaining=20)], torch.tensor([0.3])).tolist()  # a flat cost: the whole block
    [8]
"""

from importlib import import_module

_HOME = {
    **dict.fromkeys(("ENGINE_POLICIES", "HEAD_POLICIES", "LAYOUTS", "POLICY_NAMES", "LengthPolicy", "LengthSettings",
                     "default_policy", "layout_args", "resolve_policy", "round_layout"), "names"),
    "RoundCost": "cost",
    "HeadCalibration": "calibration",
    **dict.fromkeys(("LengthPlanner", "Plan", "RowState"), "planner"),
    **dict.fromkeys(("CostRule", "ExpectedGainRule", "FixedRule", "FloorRule", "RoundInputs", "make_rule"), "rules"),
}

__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_HOME[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_HOME))
