"""How a drafter's observers reach the decoding loops: an explicit, registered hooks object.

An online adapter needs two things from every loop that drafts with its drafter: each verified round
(its training signal), and a lock held while a round drafts (so new weights are swapped in only
between rounds). It registers a :class:`DrafterHooks` for the drafter; the loops look it up with
:func:`hooks_for`. Nothing is stored on the model itself, so copies, saves and ``deepcopy`` of a
drafter never carry an adapter with them.

Example:
    >>> import torch
    >>> drafter = torch.nn.Linear(1, 1)
    >>> seen = []
    >>> hooks = DrafterHooks(round_sink=seen.append)
    >>> register_hooks(drafter, hooks)
    >>> hooks_for(drafter).round_sink("round")
    >>> seen
    ['round']
    >>> unregister_hooks(drafter, hooks)
    >>> hooks_for(drafter).round_sink is None
    True
"""

from __future__ import annotations

import threading
import weakref
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["DrafterHooks", "hooks_for", "register_hooks", "replace_hooks", "round_callbacks", "unregister_hooks"]


@dataclass(frozen=True)
class DrafterHooks:
    """``round_sink``: receives every verified round drafted by the drafter (or None): a sink object
    (``on_round``, optionally ``on_request`` for finished requests) or a plain callable.
    ``weights_lock``: a context manager every round holds while it drafts (shared by concurrent
    rounds); the owner swaps weights only while holding it exclusively."""

    round_sink: Callable | None = None
    weights_lock: AbstractContextManager = field(default_factory=nullcontext)


_NONE = DrafterHooks()
_registry: "weakref.WeakKeyDictionary[object, DrafterHooks]" = weakref.WeakKeyDictionary()
_guard = threading.Lock()


def register_hooks(drafter, hooks: DrafterHooks) -> None:
    """Attach ``hooks`` to ``drafter``; refuses a drafter that already has another owner's hooks."""
    with _guard:
        current = _registry.get(drafter)
        if current is not None and current is not hooks:
            raise RuntimeError("this drafter already has hooks registered (e.g. another OnlineAdapter is attached)")
        _registry[drafter] = hooks


def replace_hooks(drafter, old: DrafterHooks, new: DrafterHooks) -> None:
    """Swap the owner's ``old`` hooks for ``new`` in one step: no loop ever sees ``drafter`` without
    hooks in between (it would draft without the weights lock). Refuses if ``old`` is not registered."""
    with _guard:
        if _registry.get(drafter) is not old:
            raise RuntimeError("replace_hooks: the hooks to replace are not the ones registered for this drafter")
        _registry[drafter] = new


def unregister_hooks(drafter, hooks: DrafterHooks) -> None:
    """Detach ``hooks`` from ``drafter`` if they are the ones registered (else do nothing)."""
    with _guard:
        if _registry.get(drafter) is hooks:
            del _registry[drafter]


def hooks_for(drafter) -> DrafterHooks:
    """The hooks registered for ``drafter``, or empty hooks (no sink, a no-op lock)."""
    return _registry.get(drafter, _NONE)


def round_callbacks(round_sink, drafter) -> tuple[Callable | None, Callable | None]:
    """``(on_round, on_request)`` for a loop: from an explicit ``round_sink``, else the sink registered
    for ``drafter`` (``(None, None)`` without either). A sink is an object with ``on_round`` (and
    optionally ``on_request``), or a plain callable taking each verified round."""
    sink = round_sink if round_sink is not None else (hooks_for(drafter).round_sink if drafter is not None else None)
    if sink is None:
        return None, None
    return getattr(sink, "on_round", sink), getattr(sink, "on_request", None)
