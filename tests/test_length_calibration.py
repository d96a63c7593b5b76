"""The length head calibrated from the traffic's own acceptance: a head that under- or over-rates what the target
accepts is moved toward it, censored rounds included; one that rates it right is left where it is (the control)."""

import random

import pytest
import torch

from adaflash_hf.speculation.length import LengthPlanner, LengthSettings, RoundCost, RowState
from adaflash_hf.speculation.length.calibration import HeadCalibration
from adaflash_hf.speculation.length.rules import draft_acceptance

B = 16


def _rounds(cal, ratio: float, p_true: float, verify: int, n: int, seed: int = 0) -> None:
    """``n`` rows whose head says ``ratio``, each verifying ``verify - 1`` drafts that the target accepts one by one
    with probability ``p_true`` (stopping at the first rejection)."""
    rng = random.Random(seed)
    for _ in range(n):
        drafts, accepted = verify - 1, 0
        while accepted < drafts and rng.random() < p_true:
            accepted += 1
        cal.add(ratio, accepted, drafts)


def test_a_rows_ratio_waits_for_the_rounds_fit():
    """Rows add trials one by one; the fit runs once a round (:meth:`ratios`), not for every row."""
    cal = HeadCalibration(B)
    _rounds(cal, 0.15, 0.95, 4, 50)
    assert cal.ratio(0.15) == 0.15  # not fitted yet
    after = cal.ratios(torch.tensor([0.15])).item()
    assert after > 0.2 and cal.ratio(0.15) == pytest.approx(after, abs=2e-3)


def test_no_trials_leaves_the_heads_ratios_as_they_are():
    cal = HeadCalibration(B)
    ratio = torch.tensor([0.0, 0.13, 0.5, 1.0])
    assert cal.shift == 0.0 and torch.equal(cal.ratios(ratio), ratio) and cal.ratio(0.13) == 0.13


@pytest.mark.parametrize("ratio,p_true,verify,direction", [
    (0.15, 0.9, 4, 1),    # under-rated, short verifies all but always accepted (censored rounds)
    (0.15, 0.9, 16, 1),   # under-rated, whole blocks
    (0.6, 0.3, 16, -1),   # over-rated
    (0.3, None, 8, 0),    # the control: the target accepts what the head says
    (0.6, None, 4, 0),    # the control, censored
], ids=["under-censored", "under-whole", "over", "right", "right-censored"])
def test_the_shift_follows_the_traffic_and_leaves_a_right_head_alone(ratio, p_true, verify, direction):
    cal = HeadCalibration(B)
    p_head = float(draft_acceptance([ratio], B)[0])
    _rounds(cal, ratio, p_head if p_true is None else p_true, verify, 1500)
    moved = cal.ratios(torch.tensor([ratio])).item() - ratio
    if direction == 0:
        assert abs(cal.shift) < 0.35 and abs(moved) < 0.05
    else:
        assert cal.shift * direction > 0.8 and moved * direction > 0.1
        fitted = float(draft_acceptance([cal.ratio(ratio)], B)[0])
        assert abs(fitted - p_true) < 0.08  # the calibrated ratio's per-draft acceptance is near the traffic's


def test_a_few_rounds_move_it_little_and_old_rounds_fade():
    cal = HeadCalibration(B, decay=0.99)
    _rounds(cal, 0.15, 0.95, 4, 2)
    assert 0 < cal.shift < 0.5  # two rounds: the prior holds most of it
    _rounds(cal, 0.15, 0.95, 4, 300)
    high = cal.shift
    p_head = float(draft_acceptance([0.15], B)[0])
    _rounds(cal, 0.15, p_head, 16, 1500, seed=1)  # the text changes: the head is right again
    assert high > 1.0 and abs(cal.shift) < 0.3


def test_nothing_verified_or_no_ratio_teaches_nothing():
    cal = HeadCalibration(B)
    cal.add(0.2, 0, 0)
    cal.add(float("nan"), 3, 3)
    assert cal.trials == 0.0 and cal.shift == 0.0


# a drafting round costs 3 plain steps: a row must expect about 2 accepted drafts before drafting pays
DEAR = RoundCost.flat(draft_fraction=2.0)


@pytest.mark.parametrize("p_true,drafts_again", [(0.92, True), (None, False)], ids=["under-rated", "control"])
def test_a_head_that_under_rates_the_traffic_no_longer_keeps_the_planner_plain(p_true, drafts_again):
    """The head says about one draft a round (plain on this cost); the rows' probes verify what pays with the body
    spent (the whole block: verify slots cost nothing here), and the target accepts nearly all of them. Without
    calibration the rounds' ratios keep every round plain; calibrated, drafting pays. The control (the head is right)
    stays plain."""
    planner = LengthPlanner(LengthSettings("cost", 1.0, 1), B, DEAR)
    rows = [RowState(remaining=1000) for _ in range(4)]
    ratio = torch.full((4,), 0.12)
    p_head = float(draft_acceptance([0.12], B)[0])
    rng = random.Random(0)
    for _ in range(30):  # probe rounds: each verifies what its spent body pays for
        k = planner.lengths(rows, ratio)
        for r, n in zip(rows, k.tolist()):
            accepted = 0
            while accepted < n - 1 and rng.random() < (p_head if p_true is None else p_true):
                accepted += 1
            planner.observe(r, accepted, n)
    planner.lengths(rows, ratio)
    assert planner.drafted_plain is not drafts_again and planner.traffic_plain(4) is not drafts_again


STEEP = RoundCost(rows=(1,), tokens_per_row=(1, 16), verify=((1.0, 5.5),), draft_fraction=0.0)


@pytest.mark.parametrize("graphs", [False, True])
def test_an_engine_reading_calibrated_ratios_decodes_as_plain_greedy(graphs):
    """The head says 0.5 of every block; the random drafter's drafts are nearly all rejected, so the traffic's trials
    calibrate the head down and the engine verifies fewer drafts than it does with the head as it is (the control).
    Both decode exactly what plain greedy does."""
    from adaflash_hf.engine import Engine
    from generation_helpers import engine_prompts, kept_length_head, make_drafter, make_target, plain_greedy_ids

    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=8)
    prompts = engine_prompts([5, 7], seed=3)
    want = [plain_greedy_ids(target, p, 24) for p in prompts]
    runs = {}
    with kept_length_head(drafter):
        with torch.no_grad():
            drafter.length_head.out.weight.zero_()
            drafter.length_head.out.bias.fill_(0.0)  # sigmoid(0): the head says 0.5
        for calibrate in (True, False):
            eng = Engine(target, drafter, length_policy="cost", round_cost=STEEP, max_slots=2, max_len=64,
                         token_budget=64, cuda_graphs=graphs, prompt_ngrams=0)
            eng.planner.calibrate_head = calibrate
            outs = eng.generate(prompts, max_new_tokens=24)
            assert [o.token_ids for o in outs] == want
            lens = [v for o in outs for v in o.verify_lengths]
            runs[calibrate] = (sum(lens) / len(lens), eng.planner.calibration)
    (calibrated, cal), (control, ctl) = runs[True], runs[False]
    assert cal.trials > 0 and cal.shift < 0 and ctl.trials == 0
    assert calibrated < control, (calibrated, control)
