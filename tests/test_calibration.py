"""The length head's calibration tables (adaflash_hf.bench.calibration) on rounds with a known head: an exact
head reads as calibrated (the negative control), one predicting half of what is accepted as under-predicting 2x."""

from __future__ import annotations

import random

import pytest

from adaflash_hf.bench import calibration as C
from adaflash_hf.bench.replay import TraceRound

B = 16


def _rounds(scale: float, n: int = 4000, seed: int = 0) -> list[TraceRound]:
    """Rounds with geometric acceptance; the head predicts ``(L + 1) / B / scale`` (``scale`` 1: exact)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a = 0
        while a < B - 1 and rng.random() < 0.7:
            a += 1
        out.append(TraceRound(a, (a + 1) / B / scale))
    return out


def test_an_exact_head_reads_as_calibrated():
    rounds = _rounds(1.0)
    assert C.fitted_scale(rounds, B) == pytest.approx(1.0)
    assert all(b["ratio"] == pytest.approx(1.0) for b in C.by_bucket(rounds, B))
    for p in C.by_position(rounds, B):  # the point estimate is exact round by round, so per position too
        assert p["predicted"] == pytest.approx(p["realised"]) and p["lost"] == 0.0
    rule = C.rule_outcome(rounds, B, rate=1.0)
    assert rule["tau_share"] == pytest.approx(1.0) and rule["verify_len"] == pytest.approx(rule["tau"], rel=1e-3)


def test_a_head_predicting_half_under_predicts_2x():
    rounds = _rounds(2.0)
    assert C.fitted_scale(rounds, B) == pytest.approx(2.0)
    # every bucket with enough rounds (not the clamped first one) reads ~2x
    assert all(b["ratio"] == pytest.approx(2.0, rel=0.15) for b in C.by_bucket(rounds, B)[1:] if b["count"] > 50)
    positions = C.by_position(rounds, B, rate=1.0)
    assert all(p["realised"] >= p["predicted"] for p in positions) and positions[2]["lost"] > 0.05
    # the floor rule at rate 2 undoes the halving: whole tau kept, at rate 1 it is not
    assert C.rule_outcome(rounds, B, rate=2.0)["tau_share"] == pytest.approx(1.0)
    assert C.rule_outcome(rounds, B, rate=1.0)["tau_share"] < 0.8


def test_bad_rounds_are_rejected():
    with pytest.raises(ValueError, match="at least one round"):
        C.fitted_scale([], B)
    with pytest.raises(ValueError, match="outside"):
        C.by_position([TraceRound(B, 0.5)], B)
