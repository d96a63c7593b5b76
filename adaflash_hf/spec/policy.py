"""Verify-length policy names and the one default rule, without torch (the CLI builds its flags from them).

The verify lengths themselves are computed in :mod:`.length_policy`.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["LengthPolicy", "POLICY_NAMES", "default_policy", "resolve_policy"]


class LengthPolicy(str, Enum):
    """How many block slots a row verifies: ``adaptive`` (length head), ``fixed`` (the full block,
    DFlash) or ``expected_gain`` (per-position estimate, most expected tokens per verify cost)."""

    ADAPTIVE = "adaptive"
    FIXED = "fixed"
    EXPECTED_GAIN = "expected_gain"

    def __str__(self) -> str:
        return self.value


POLICY_NAMES = tuple(p.value for p in LengthPolicy)


def default_policy(config) -> LengthPolicy:
    """``adaptive`` when the drafter (its ``config``) has a *trained* length head, else ``fixed``.

    Example:
        >>> from types import SimpleNamespace
        >>> default_policy(SimpleNamespace(use_length_head=True, length_head_trained=False)).value
        'fixed'
    """
    trained = getattr(config, "use_length_head", False) and getattr(config, "length_head_trained", False)
    return LengthPolicy.ADAPTIVE if trained else LengthPolicy.FIXED


def resolve_policy(name: str | LengthPolicy | None, drafter) -> LengthPolicy:
    """The policy ``name`` asks for (``None``: :func:`default_policy`), checked against ``drafter``.

    Raises ``ValueError`` for an unknown name, or ``adaptive`` on a drafter without a length head.
    """
    if name is None:
        return default_policy(drafter.config)
    if name not in POLICY_NAMES:
        raise ValueError(f"unknown length_policy {name!r}: choose one of {', '.join(POLICY_NAMES)}")
    policy = LengthPolicy(name)
    if policy is LengthPolicy.ADAPTIVE and getattr(drafter, "length_head", None) is None:
        raise ValueError("length_policy='adaptive' needs a drafter with a length head (config.use_length_head)")
    return policy
