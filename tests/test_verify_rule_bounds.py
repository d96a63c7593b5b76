"""The bounds of ``examples/reference_pair/project_verify_rules.py``: the oracle (knows each round's acceptance) and
"this head's bound" (knows the acceptance per bin of the head's ratio). A head whose ratio is the accepted count
reaches the oracle's bound; a head whose ratio says nothing falls short of it, yet never below the better of plain
decoding and whole blocks (it may choose either every round)."""

import importlib.util
import random
from pathlib import Path

import pytest

from adaflash_hf.speculation.length.cost import RoundCost

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "reference_pair" / "project_verify_rules.py"
spec = importlib.util.spec_from_file_location("project_verify_rules", SCRIPT)
rules = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rules)

B = 16
# a verify of 16 tokens per row costs 3 plain steps, the drafter a tenth of it: drafting pays only where it is accepted
COST = RoundCost(rows=(1, 8), tokens_per_row=(1, 16), verify=((1.0, 3.0), (1.2, 3.6)), draft_fraction=0.1)


def _rounds(head: str, n: int = 3000) -> list[tuple[int, float]]:
    rng = random.Random(1)
    accepted = [min(int(rng.expovariate(0.25)), B - 1) for _ in range(n)]
    return [(a, (a + 1) / B if head == "exact" else 0.5 + 0.01 * rng.random()) for a in accepted]


def _throughput(rounds, rule: str, c: int) -> float:
    if rule not in (rules.ORACLE, rules.HEAD_BOUND):
        return rules.tokens_per_time(rounds, COST, c, rule, B)
    survival, rho = rules.head_survival(rounds, B), rules.tokens_per_time(rounds, COST, c, "off", B)
    for _ in range(4):
        rho = rules.tokens_per_time(rounds, COST, c, rule, B, rho=rho, survival=survival)
    return rho


@pytest.mark.parametrize("c", [1, 8])
def test_an_exact_head_reaches_the_oracle_and_an_uninformative_one_does_not(c):
    exact, blind = _rounds("exact"), _rounds("blind")
    oracle = _throughput(exact, rules.ORACLE, c)
    assert _throughput(exact, rules.HEAD_BOUND, c) == pytest.approx(oracle, rel=0.03)
    bound = _throughput(blind, rules.HEAD_BOUND, c)
    assert bound < 0.9 * _throughput(blind, rules.ORACLE, c)  # the control: a ratio that says nothing buys less
    assert bound >= 0.99 * max(_throughput(blind, "off", c), _throughput(blind, "fixed", c))


def test_the_head_survival_is_the_acceptance_per_ratio_bin():
    rounds = [(0, 0.1)] * 50 + [(15, 0.9)] * 50
    survival = rules.head_survival(rounds, B, bins=2)
    assert survival([0.1]).tolist() == [[0.0] * (B - 1)] and survival([0.9]).tolist() == [[1.0] * (B - 1)]
