"""Verify-length policy names, the one default rule, the settings every loop takes (:class:`LengthSettings`) and what
an engine round verifies under them, without torch (the CLI builds its flags from them). ``length_policy`` is the one
name of the setting in ``generate``, the engine, the CLI and bench.

The verify lengths themselves are computed by the rules of :mod:`.rules`, round by round through :mod:`.planner`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum

__all__ = ["ENGINE_POLICIES", "HEAD_POLICIES", "LAYOUTS", "LengthPolicy", "LengthSettings", "POLICY_NAMES", "default_policy",
           "layout_args", "resolve_policy", "round_layout"]


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


@dataclass(frozen=True)
class LengthSettings:
    """How a loop chooses its verify lengths: one value where generate, the engine and the CLI took three loose keywords.

    Args:
        policy: ``cost``, ``adaptive``, ``fixed`` or ``expected_gain`` (:class:`LengthPolicy`); ``None``: the drafter's
            default (:func:`default_policy`).
        rate: the floor rule's scale (``adaptive``); ``None``: the drafter config's ``length_rate``.
        min_len: the shortest verify, bonus slot included; ``None``: the drafter config's ``length_min``.
        halving_batch: ``adaptive`` only: halve ``rate`` at this batch (``load_scaled_rate``); ``None``: a fixed rate.
        verify_token_cost: ``expected_gain`` only: one more verified token's cost against a whole round.

    Example:
        >>> from types import SimpleNamespace
        >>> cfg = SimpleNamespace(use_length_head=True, length_head_trained=True, length_rate=2.0, length_min=1, block_size=16)
        >>> s = LengthSettings(min_len=2).resolved(SimpleNamespace(config=cfg, length_head=object()))
        >>> s.policy.value, s.rate, s.min_len
        ('cost', 2.0, 2)
    """

    policy: LengthPolicy | str | None = None
    rate: float | None = None
    min_len: int | None = None
    halving_batch: int | None = None
    verify_token_cost: float = 0.05

    @classmethod
    def of(cls, value=None, **keywords) -> "LengthSettings":
        """``value`` (settings, a policy name or ``None``) with the loose keywords (``length_policy``, ``length_rate``,
        ``length_min``: generate's and the engine's names; ``None`` values left unset) on top."""
        base = value if isinstance(value, LengthSettings) else cls(policy=value)
        names = {"length_policy": "policy", "length_rate": "rate", "length_min": "min_len"}
        given = {names.get(k, k): v for k, v in keywords.items() if v is not None}
        return replace(base, **given) if given else base

    @property
    def given(self) -> list[str]:
        """The generate keywords these settings set (for the error of a call that has no drafter to apply them)."""
        return [k for k, v in (("length_policy", self.policy), ("length_rate", self.rate), ("length_min", self.min_len))
                if v is not None]

    def resolved(self, drafter) -> "LengthSettings":
        """Every field filled in for ``drafter`` (policy resolved and checked, rate and minimum from its config) and
        checked: ``ValueError`` before any work for an unknown policy, a head policy without a head, a rate that is not
        a finite number > 0, a minimum outside ``[1, block_size]`` or a halving batch below 2."""
        cfg = drafter.config
        policy = resolve_policy(self.policy, drafter)
        rate = float(getattr(cfg, "length_rate", 1.0) if self.rate is None else self.rate)
        min_len = int(getattr(cfg, "length_min", 1) if self.min_len is None else self.min_len)
        block = int(getattr(cfg, "block_size", min_len))
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"length_rate must be a finite number > 0, got {rate}")
        if not 1 <= min_len <= block:
            raise ValueError(f"length_min must be in [1, block_size={block}], got {min_len}")
        if self.halving_batch is not None and self.halving_batch < 2:
            raise ValueError(f"halving_batch must be >= 2, got {self.halving_batch}")
        if not (math.isfinite(self.verify_token_cost) and self.verify_token_cost >= 0):
            raise ValueError(f"verify_token_cost must be a finite number >= 0, got {self.verify_token_cost}")
        return replace(self, policy=policy, rate=rate, min_len=min_len)


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
