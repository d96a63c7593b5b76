"""The drafter hooks registry: the explicit channel between an online adapter and the decoding loops."""

import gc

import pytest
import torch

from adaflash_hf.speculation.hooks import DrafterHooks, hooks_for, register_hooks, replace_hooks, unregister_hooks


def test_registered_hooks_are_found_and_removed():
    drafter = torch.nn.Linear(2, 2)
    seen = []
    hooks = DrafterHooks(round_sink=seen.append)
    assert hooks_for(drafter).round_sink is None
    register_hooks(drafter, hooks)
    hooks_for(drafter).round_sink(7)
    assert seen == [7]
    assert not any(k.startswith("_round") or k.startswith("_weights") for k in vars(drafter))  # nothing on the model
    unregister_hooks(drafter, DrafterHooks())  # someone else's hooks: ignored
    assert hooks_for(drafter) is hooks
    unregister_hooks(drafter, hooks)
    assert hooks_for(drafter).round_sink is None


def test_second_owner_is_refused_and_copies_carry_nothing():
    import copy

    drafter = torch.nn.Linear(2, 2)
    register_hooks(drafter, DrafterHooks(round_sink=print))
    with pytest.raises(RuntimeError, match="already has hooks"):
        register_hooks(drafter, DrafterHooks(round_sink=print))
    assert hooks_for(copy.deepcopy(drafter)).round_sink is None


def test_registry_does_not_keep_a_drafter_alive():
    from adaflash_hf.speculation import hooks as module

    drafter = torch.nn.Linear(2, 2)
    register_hooks(drafter, DrafterHooks(round_sink=print))
    n = len(module._registry)
    del drafter
    gc.collect()
    assert len(module._registry) == n - 1


def test_replace_refuses_a_non_owner():
    drafter = torch.nn.Linear(2, 2)
    first, second = DrafterHooks(round_sink=print), DrafterHooks(round_sink=repr)
    register_hooks(drafter, first)
    with pytest.raises(RuntimeError, match="not the ones registered"):
        replace_hooks(drafter, DrafterHooks(), second)  # not the owner: nothing changes
    assert hooks_for(drafter) is first
    replace_hooks(drafter, first, second)
    assert hooks_for(drafter) is second


def test_adapter_attach_and_detach_never_leave_the_drafter_without_hooks(monkeypatch):
    """A round starting while the adapter attaches or detaches must still find the weights lock: the
    registry never goes through a state where the drafter has no hooks (it would get a no-op lock)."""
    import weakref

    from generation_helpers import make_drafter, make_target

    from adaflash_hf.online import OnlineAdapter
    from adaflash_hf.speculation import hooks as module

    bare_moments = []

    class Recording(weakref.WeakKeyDictionary):
        def __delitem__(self, key):
            super().__delitem__(key)
            bare_moments.append(key not in self)

    monkeypatch.setattr(module, "_registry", Recording())
    target = make_target()
    drafter = make_drafter(target, block_size=8, num_layers=1, seed=0)
    adapter = OnlineAdapter(drafter, target, sample_unit="round", samples_per_update=1000, epochs=1)
    try:
        lock = hooks_for(drafter).weights_lock
        for _ in range(3):
            adapter.attach()
            assert hooks_for(drafter).round_sink is adapter and hooks_for(drafter).weights_lock is lock
            adapter.detach()
            assert hooks_for(drafter).round_sink is None and hooks_for(drafter).weights_lock is lock
        assert bare_moments == []  # every swap replaced the hooks in place
    finally:
        adapter.close(timeout=10)
    assert bare_moments == [True]  # control: closing does unregister, and the recorder sees it
