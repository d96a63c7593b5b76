"""examples/train_with_trainer.py on the reference pair: its samples are the target's own tokens, training on them
does not lower held-out greedy tau, and (the control) answers the target did not write do lower it, which the
example's held-out check refuses, putting the starting weights back. Small settings: seconds, not the example's 40 steps."""

from __future__ import annotations

import copy
import importlib.util
import random
from pathlib import Path

import pytest
import torch

from adaflash_hf import load_reference_pair

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_with_trainer.py"
ANSWER_TOKENS = 16


@pytest.fixture(scope="module")
def ex():
    spec = importlib.util.spec_from_file_location("train_with_trainer", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def setup(ex):
    target, drafter, tok = load_reference_pair()
    train, held_out = ex.prompt_split()
    assert not set(train) & set(held_out)
    samples = ex.target_samples(target, tok, train[::6], ANSWER_TOKENS)
    return target, drafter, tok, samples, held_out[::2]


def test_samples_are_the_targets_own_tokens(ex, setup):
    target, _, tok, samples, _ = setup
    train, _ = ex.prompt_split()
    for prompt, sample in zip(train[::6], samples):
        ids = ex.encode(tok, prompt)
        assert sample["input_ids"] == target.generate(ids, max_new_tokens=ANSWER_TOKENS, do_sample=False)[0].tolist()
        n = ids.shape[1]
        assert sample["loss_mask"] == [0] * n + [1] * (len(sample["input_ids"]) - n)


def test_training_on_the_targets_answers_keeps_or_raises_held_out_tau(ex, setup, tmp_path):
    target, drafter, tok, samples, held_out = setup
    drafter = copy.deepcopy(drafter)  # a copy to train
    _, before, after, kept = ex.fine_tune_kept(target, drafter, tok, samples, held_out, str(tmp_path), 3, 1e-5, ANSWER_TOKENS, quiet=True)
    assert kept and after >= before
    assert ex.held_out_tau(target, drafter, tok, held_out, ANSWER_TOKENS) >= before


def test_answers_the_target_did_not_write_lower_tau_and_are_refused(ex, setup, tmp_path):
    """The control: the same answers shuffled, at a learning rate that moves the weights, lower held-out tau; the
    example's check puts the starting weights back."""
    target, drafter, tok, samples, held_out = setup
    drafter = copy.deepcopy(drafter)
    rng = random.Random(0)
    foreign = []
    for s in samples:
        n = s["loss_mask"].index(1)
        answer = s["input_ids"][n:]
        rng.shuffle(answer)
        foreign.append({"input_ids": s["input_ids"][:n] + answer, "loss_mask": s["loss_mask"]})
    start = {k: v.clone() for k, v in drafter.state_dict().items()}
    _, before, after, kept = ex.fine_tune_kept(target, drafter, tok, foreign, held_out, str(tmp_path), 5, 1e-3, ANSWER_TOKENS, quiet=True)
    assert after < before and not kept
    assert all(torch.equal(v, start[k]) for k, v in drafter.state_dict().items())
