"""Verify-length policy names, the one default rule and what an engine round verifies under them, without
torch (the CLI builds its flags from them). ``length_policy`` is the one name of the setting in
``generate``, the engine, the CLI and bench.

The verify lengths themselves are computed in :mod:`.length_policy`.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["ENGINE_POLICIES", "HEAD_POLICIES", "LAYOUTS", "LengthPolicy", "POLICY_NAMES", "default_policy", "layout_args", "resolve_policy",
           "round_layout"]


class LengthPolicy(str, Enum):
    """How many block slots a row verifies: ``cost`` (length head, every row's length chosen against the
    round's cost: the default with a trained head), ``adaptive`` (length head, the paper's floor rule),
    ``fixed`` (the full block, DFlash) or ``expected_gain`` (per-position estimate, most expected tokens per
    verify cost)."""

    COST = "cost"
    ADAPTIVE = "adaptive"
    FIXED = "fixed"
    EXPECTED_GAIN = "expected_gain"

    def __str__(self) -> str:
        return self.value


POLICY_NAMES = tuple(p.value for p in LengthPolicy)
ENGINE_POLICIES = (LengthPolicy.COST.value, LengthPolicy.ADAPTIVE.value, LengthPolicy.FIXED.value)  # what the engine runs
HEAD_POLICIES = (LengthPolicy.COST, LengthPolicy.ADAPTIVE)  # the policies that read the length head


def default_policy(config) -> LengthPolicy:
    """``cost`` when the drafter (its ``config``) has a *trained* length head, else ``fixed``.

    Example:
        >>> from types import SimpleNamespace
        >>> default_policy(SimpleNamespace(use_length_head=True, length_head_trained=False)).value
        'fixed'
    """
    trained = getattr(config, "use_length_head", False) and getattr(config, "length_head_trained", False)
    return LengthPolicy.COST if trained else LengthPolicy.FIXED


def resolve_policy(name: str | LengthPolicy | None, drafter) -> LengthPolicy:
    """The policy ``name`` asks for (``None``: :func:`default_policy`), checked against ``drafter``.

    Raises ``ValueError`` for an unknown name, or ``cost`` / ``adaptive`` on a drafter without a length head.
    """
    if name is None:
        return default_policy(drafter.config)
    if name not in POLICY_NAMES:
        raise ValueError(f"unknown length_policy {name!r}: choose one of {', '.join(POLICY_NAMES)}")
    policy = LengthPolicy(name)
    if policy in HEAD_POLICIES and getattr(drafter, "length_head", None) is None:
        raise ValueError(f"length_policy={policy.value!r} needs a drafter with a length head (config.use_length_head)")
    return policy


def round_layout(drafter, length_policy: str | None = None, rectangular: bool = False) -> str:
    """What an engine round verifies: ``off`` (no drafter: plain decoding, one token per request), ``fixed``
    (the whole block), ``packed`` (``cost`` or ``adaptive``: each request its own ``k_hat``) or ``rectangular``
    (the same, every request padded to the round's largest ``k_hat``). ``length_policy`` is generate's
    setting (``None``: :func:`default_policy` of the drafter).

    Example:
        >>> round_layout(None)
        'off'
    """
    if drafter is None:
        if length_policy is not None or rectangular:
            raise ValueError(f"length_policy={length_policy!r} / rectangular={rectangular} need a drafter "
                             "(without one the engine decodes plainly)")
        return "off"
    policy = resolve_policy(length_policy, drafter)
    if policy.value not in ENGINE_POLICIES:
        raise ValueError(f"the engine runs length_policy {' or '.join(ENGINE_POLICIES)}, not {policy.value!r}")
    if rectangular and policy not in HEAD_POLICIES:
        raise ValueError("rectangular=True pads the length head's verify lengths: it needs length_policy='cost' or 'adaptive'")
    return "fixed" if policy is LengthPolicy.FIXED else ("rectangular" if rectangular else "packed")


LAYOUTS = ("packed", "rectangular", "fixed", "off")


def layout_args(drafter, layout: str, length_policy: str = LengthPolicy.COST.value) -> dict:
    """The ``Engine`` arguments (``adaflash_hf.engine``) giving round layout ``layout`` (the inverse of :func:`round_layout`),
    for scripts and tests that run every layout; ``packed`` and ``rectangular`` choose their lengths by ``length_policy``
    (``cost``, or ``adaptive``: the paper's floor rule).

    Example:
        >>> layout_args("d", "rectangular")
        {'drafter': 'd', 'length_policy': 'cost', 'rectangular': True}
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown round layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    if length_policy not in [p.value for p in HEAD_POLICIES]:
        raise ValueError(f"packed / rectangular layouts take length_policy 'cost' or 'adaptive', not {length_policy!r}")
    if layout == "off":
        return {"drafter": None}
    return {"drafter": drafter, "length_policy": "fixed" if layout == "fixed" else str(length_policy),
            **({"rectangular": True} if layout == "rectangular" else {})}
