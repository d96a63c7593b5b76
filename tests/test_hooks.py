"""The drafter hooks registry: the explicit channel between an online adapter and the decoding loops."""

import gc

import pytest
import torch

from adaflash_hf.spec.hooks import DrafterHooks, hooks_for, register_hooks, replace_hooks, unregister_hooks


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
    from adaflash_hf.spec import hooks as module

    drafter = torch.nn.Linear(2, 2)
    register_hooks(drafter, DrafterHooks(round_sink=print))
    n = len(module._registry)
    del drafter
    gc.collect()
    assert len(module._registry) == n - 1


def test_replace_swaps_in_one_step_and_only_the_owners_hooks():
    import threading

    drafter = torch.nn.Linear(2, 2)
    first, second = DrafterHooks(round_sink=print), DrafterHooks(round_sink=repr)
    register_hooks(drafter, first)
    with pytest.raises(RuntimeError, match="not the ones registered"):
        replace_hooks(drafter, DrafterHooks(), second)  # not the owner: nothing changes
    assert hooks_for(drafter) is first
    seen_bare, stop = [], threading.Event()

    def reader():  # a loop starting rounds while the owner swaps: never sees the drafter bare
        while not stop.is_set():
            seen_bare.append(hooks_for(drafter).round_sink is None)

    t = threading.Thread(target=reader)
    t.start()
    current = first
    for i in range(2000):
        nxt = second if current is first else first
        replace_hooks(drafter, current, nxt)
        current = nxt
    stop.set()
    t.join()
    assert seen_bare and not any(seen_bare)
    assert hooks_for(drafter) is current
