"""Verify-length policies: adaptive (length head), fixed, expected-gain (DSpark-style), load rate."""

from __future__ import annotations

import math

import pytest
import torch

from adaflash_hf.speculation.length.rules import (
    adaptive_verify_length,
    expected_gain_verify_length,
    fixed_verify_length,
    load_scaled_rate,
)

# --------------------------------------------------------------------------------------------
# adaptive_verify_length: k_hat = clamp(floor(a * B * rate), min_len, B), the paper's formula

A_GRID = torch.linspace(0, 1, 41)

ADAPTIVE_CASES = [
    # block_size, rate, min_len
    (16, 1.0, 1),
    (16, 0.5, 1),
    (16, 1.0, 4),
    (16, 2.0, 1),
    (8, 0.75, 2),
    (1, 1.0, 1),
]


@pytest.mark.parametrize("B,rate,min_len", ADAPTIVE_CASES)
def test_adaptive_verify_length(B, rate, min_len):
    k_hat = adaptive_verify_length(A_GRID, B, rate=rate, min_len=min_len)
    assert k_hat.dtype == torch.long and k_hat.shape == A_GRID.shape
    assert ((k_hat >= min_len) & (k_hat <= B)).all()
    assert (k_hat[1:] >= k_hat[:-1]).all()  # more confident head -> never shorter
    ref = [min(B, max(min_len, math.floor(float(a) * B * rate))) for a in A_GRID.tolist()]
    assert k_hat.tolist() == ref
    # extremes: a = 0 verifies the minimum; a = 1 at rate >= 1 verifies the full block
    assert k_hat[0].item() == min_len
    if rate >= 1.0:
        assert k_hat[-1].item() == B
    # column-vector head output and NaN predictions are handled
    assert torch.equal(adaptive_verify_length(A_GRID[:, None], B, rate, min_len), k_hat)
    assert adaptive_verify_length(torch.tensor([float("nan")]), B, rate, min_len).item() == min_len


# (ratio, block, rate, k_hat by hand): floor, not round, as in the paper
PAPER_FORMULA_CASES = [(0.47, 16, 1.0, 7), (0.99, 16, 1.0, 15), (0.06, 16, 1.0, 1), (0.5, 16, 0.5, 4), (0.9, 8, 1.0, 7)]


@pytest.mark.parametrize("a,B,rate,expected", PAPER_FORMULA_CASES)
def test_adaptive_is_the_papers_floor(a, B, rate, expected):
    assert adaptive_verify_length(torch.tensor([a]), B, rate=rate).item() == expected


@pytest.mark.parametrize("B", [8, 16])
def test_a_perfect_head_verifies_exactly_what_is_accepted(B):
    accepted = torch.arange(B)  # the head's label is (accepted + 1) / B
    assert torch.equal(adaptive_verify_length((accepted + 1) / B, B), accepted + 1)


def test_adaptive_rate_scales_length():
    a = torch.tensor([1.0, 0.5])
    full = adaptive_verify_length(a, 16, rate=1.0)
    half = adaptive_verify_length(a, 16, rate=0.5)
    assert torch.equal(half * 2, full)  # exact here: a*B is even for both rows


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(rate=0.0), "rate must be"),
        (dict(rate=-1.0), "rate must be"),
        (dict(rate=float("inf")), "rate must be"),
        (dict(min_len=0), "min_len must be in"),
        (dict(min_len=17), "min_len must be in"),
        (dict(block_size=0, min_len=1), "block_size must be"),
    ],
)
def test_adaptive_validation(kwargs, match):
    args = dict(block_size=16) | kwargs
    with pytest.raises(ValueError, match=match):
        adaptive_verify_length(torch.tensor([0.5]), **args)


def test_fixed_verify_length():
    k = fixed_verify_length(3, 16)
    assert k.dtype == torch.long and k.tolist() == [16] * 3
    with pytest.raises(ValueError, match="block_size"):
        fixed_verify_length(3, 0)


# --------------------------------------------------------------------------------------------
# expected_gain_verify_length against a brute-force loop over every prefix length.


def _brute_force(c: torch.Tensor, cost_per_token: float, base_cost: float, min_len: int) -> list[int]:
    out = []
    B = c.shape[1] + 1
    for row in c.tolist():
        best_k, best = 0, -1.0
        for k in range(B):
            gain = 1.0 + sum(math.prod(row[:m]) for m in range(1, k + 1))
            value = gain / (base_cost + cost_per_token * (k + 1))
            if value > best * (1 + 1e-6):  # strict: ties go to the shorter prefix
                best_k, best = k, value
        out.append(min(B, max(min_len, best_k + 1)))
    return out


GAIN_CASES = [
    # name, B, cost_per_token, base_cost, min_len
    ("cheap_tokens", 16, 0.02, 1.0, 1),
    ("mid_cost", 16, 0.2, 1.0, 1),
    ("expensive_tokens", 16, 1.0, 1.0, 1),
    ("small_base_cost", 8, 0.1, 0.5, 1),
    ("min_len", 16, 1.0, 1.0, 3),
    ("small_block", 2, 1.0, 1.0, 1),
]


@pytest.mark.parametrize("name,B,cpt,base,min_len", GAIN_CASES, ids=[c[0] for c in GAIN_CASES])
def test_expected_gain_matches_brute_force(name, B, cpt, base, min_len):
    g = torch.Generator().manual_seed(B)
    # decaying per-position acceptance, like a real drafter (SPEC: ~0.9 -> ~0.1 across a block)
    c = torch.rand(32, B - 1, generator=g) ** 0.3 * torch.linspace(1.0, 0.2, B - 1)
    k_hat = expected_gain_verify_length(c, cpt, base_cost=base, min_len=min_len)
    assert k_hat.dtype == torch.long and k_hat.shape == (32,)
    assert k_hat.tolist() == _brute_force(c, cpt, base, min_len)
    # a higher per-token price never lengthens the verify
    pricier = expected_gain_verify_length(c, cpt * 2 + 0.1, base_cost=base, min_len=min_len)
    assert (pricier <= k_hat).all()


def test_expected_gain_extremes():
    B = 16
    c = torch.full((2, B - 1), 0.7)
    assert expected_gain_verify_length(c, cost_per_token=0.0).tolist() == [B, B]  # free tokens
    assert expected_gain_verify_length(c, cost_per_token=1.0, base_cost=0.0).tolist() == [1, 1]
    assert expected_gain_verify_length(torch.ones(2, B - 1), cost_per_token=1.0).tolist() == [B, B]
    assert expected_gain_verify_length(torch.zeros(2, B - 1), cost_per_token=0.0).tolist() == [1, 1]
    # per-row cost tensor: a loaded row gets a shorter verify than an idle one
    k = expected_gain_verify_length(c, cost_per_token=torch.tensor([0.01, 1.0]))
    assert k[0] > k[1]


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        ((torch.rand(4),), dict(cost_per_token=0.1), r"\[b, B-1\]"),
        ((torch.rand(2, 3),), dict(cost_per_token=-0.1), "costs must be"),
        ((torch.rand(2, 3),), dict(cost_per_token=0.0, base_cost=0.0), "cannot be free"),
        ((torch.rand(2, 3),), dict(cost_per_token=0.1, min_len=5), "min_len must be in"),
    ],
)
def test_expected_gain_validation(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        expected_gain_verify_length(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# load_scaled_rate

RATE_CASES = [
    # base_rate, halving_batch, min_rate
    (1.0, 64, 0.25),
    (1.5, 16, 0.5),
    (1.0, 2, 0.1),
    (0.2, 64, 0.25),  # base below the floor: the floor must not raise the rate
]


@pytest.mark.parametrize("base,halving,floor", RATE_CASES)
def test_load_scaled_rate(base, halving, floor):
    batches = list(range(0, 4097))
    rates = [load_scaled_rate(base, n, halving_batch=halving, min_rate=floor) for n in batches]
    assert all(later <= earlier for earlier, later in zip(rates, rates[1:]))  # monotone
    assert rates[0] == rates[1] == base
    assert all(min(base, floor) <= r <= base for r in rates)
    half = load_scaled_rate(base, halving, halving_batch=halving, min_rate=floor)
    assert half == pytest.approx(max(base / 2, min(base, floor)))
    assert rates[-1] < base or base <= floor  # it really shrinks under load


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(base_rate=0.0), "base_rate"),
        (dict(halving_batch=1), "halving_batch"),
        (dict(min_rate=0.0), "min_rate"),
    ],
)
def test_load_scaled_rate_validation(kwargs, match):
    args = dict(base_rate=1.0, batch_size=8) | kwargs
    with pytest.raises(ValueError, match=match):
        load_scaled_rate(**args)


# --------------------------------------------------------------------------------------------
# the engine keeps the rate fixed by default (the paper's; load is left to admission); load scaling on request
@pytest.mark.parametrize("halving,expected_len", [(None, 8), (2, 2)])  # 4 requests, rate 1: 1 / (1 + log2(4) / 1) -> floor(8/3)
def test_engine_rate_is_fixed_unless_load_scaling_is_asked(halving, expected_len):
    from generation_helpers import engine_prompts, force_length_head, make_drafter, make_target, plain_greedy_ids

    from adaflash_hf.engine import Engine

    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=8)
    force_length_head(drafter, ratio_high=True)
    prompts = engine_prompts([4, 5, 6, 7], seed=2)
    engine = Engine(target, drafter, length_policy="adaptive", max_slots=4, max_len=40, token_budget=64, length_rate=1.0,
                    halving_batch=halving)
    outs = engine.generate(prompts, max_new_tokens=12)
    assert [o.token_ids for o in outs] == [plain_greedy_ids(target, p, 12) for p in prompts]
    assert max(o.verify_lengths[0] for o in outs) == expected_len


def test_bench_flags_carry_the_length_settings():
    import argparse

    from adaflash_hf.bench.cli_args import add_arguments, config_from_args

    args = add_arguments(argparse.ArgumentParser()).parse_args(["--reference", "--length-rate", "0.75", "--halving-batch", "64"])
    cfg = config_from_args(args)
    assert (cfg.length_rate, cfg.halving_batch) == (0.75, 64)
    default = config_from_args(add_arguments(argparse.ArgumentParser()).parse_args(["--reference"]))
    assert (default.length_rate, default.halving_batch) == (None, None)
