"""The read a whole-block round spares (issue 35 item 2): ``RoundCost.read_overhead``, the cost rule's ``unread_whole``,
the engine deciding whole-block stretches with it, and ``measure_round_cost`` timing it."""

import dataclasses
import itertools
import math
import time

import numpy as np
import pytest
import torch

import adaflash_hf.speculation.length.planner as vl
from adaflash_hf.engine import Engine
from adaflash_hf.speculation.length.rules import CostRule, RoundInputs, cost_aware_verify_length, survival_curve
from adaflash_hf.speculation.length.cost import SPEC_H200_MS, SPEC_H200_OVERHEAD_MS, RoundCost

from generation_helpers import (delay_drafting_rounds, engine_prompts, kept_length_head, make_drafter, make_target,
                                plain_greedy_ids)

SPEC = RoundCost()
BLOCK8 = RoundCost(rows=(1,), tokens_per_row=(1, 8), verify=((1.0, 2.0),), draft_fraction=0.0, spec_overhead=1.0,
                   read_overhead=0.5)  # a verify token 1/7 of a step, a drafting round one step, half of it the read

# (name, ratios, block, cost, max_len, with the read spared, after the read): each row differs between the two, but
# the last two (controls: nothing to spare, or drafting cannot pay even so)
CASES = [
    ("SPEC at batch 1: a tail worth less than its slots, more than the read", [0.2], 16, SPEC, None, [16], [13]),
    ("two rows, a verify token dearer: both whole", [0.4, 0.4], 8, BLOCK8, None, [8, 8], [6, 6]),
    ("whole means all a row may take", [0.4, 0.4], 8, BLOCK8, [3, 8], [3, 8], [3, 6]),
    ("a low ratio: drafting whole beats plain only without the read", [0.3, 0.3], 8,
     dataclasses.replace(BLOCK8, read_overhead=1.0), None, [8, 8], [1, 1]),
    ("control: no read to spare", [0.2], 16, dataclasses.replace(SPEC, read_overhead=0.0), None, [13], [13]),
    ("control: drafting cannot pay even without the read", [0.2, 0.5], 8,
     RoundCost.flat(draft_fraction=50.0, spec_overhead=1.0, read_overhead=1.0), None, [1, 1], [1, 1]),
]


@pytest.mark.parametrize("name,ratios,block,cost,max_len,unread,read", CASES, ids=[c[0] for c in CASES])
def test_the_rule_counts_the_read_whole_blocks_spare(name, ratios, block, cost, max_len, unread, read):
    ratio, cap = torch.tensor(ratios), None if max_len is None else torch.tensor(max_len)
    assert cost_aware_verify_length(ratio, block, cost, max_len=cap, unread_whole=True).tolist() == unread
    assert cost_aware_verify_length(ratio, block, cost, max_len=cap).tolist() == read
    # the cost rule object passes the flag through (what the planner asks)
    assert CostRule(cost).lengths(RoundInputs(len(ratios), block, ratio, max_len=cap, unread_whole=True)).tolist() == unread


def _rate(surv, ks, cost: RoundCost, block: int, caps, unread: bool) -> float:
    n, drafted = len(ks), sum(k - 1 for k in ks)
    gain = n + sum(surv[i, : k - 1].sum() for i, k in enumerate(ks))
    time_ = cost.round_time(n, n + drafted, block)
    if unread and drafted and list(ks) == [min(c, block) for c in caps]:
        time_ -= cost.read_time(n)
    return gain / time_


@pytest.mark.parametrize("seed", range(6))
def test_with_the_read_spared_the_rule_is_still_the_brute_force_optimum(seed):
    g = torch.Generator().manual_seed(seed)
    block, n = 5, 3
    ratio = torch.rand(n, generator=g)
    caps = [block, block, 2 + seed % 3]
    curve = torch.rand(2, generator=g).tolist()
    cost = RoundCost(rows=(1, 3), tokens_per_row=(1, 2, 3, 4, 5),
                     verify=tuple(tuple(1 + r * curve[0] * q ** (1 + curve[1]) / 5 for q in range(1, 6)) for r in (0.2, 1.0)),
                     draft_fraction=0.1 * seed, spec_overhead=(0.5, 0.8), plain_overhead=0.1, read_overhead=(0.3, 0.2 * seed))
    surv = survival_curve(ratio.numpy(), block)
    space = [ks for ks in itertools.product(range(1, block + 1), repeat=n) if all(k <= c for k, c in zip(ks, caps))]
    for unread in (True, False):
        best = max(_rate(surv, ks, cost, block, caps, unread) for ks in space)
        got = cost_aware_verify_length(ratio, block, cost, max_len=torch.tensor(caps), unread_whole=unread).tolist()
        assert _rate(surv, got, cost, block, caps, unread) == pytest.approx(best, rel=1e-9), unread


def test_read_overhead_defaults_caps_and_validation():
    assert np.allclose(np.array(SPEC.read_overhead) * SPEC_H200_MS[0][0], SPEC_H200_OVERHEAD_MS["read"])
    assert all(r <= s for r, s in zip(SPEC.read_overhead, SPEC.spec_overhead))
    assert SPEC.read_time(8) == pytest.approx(np.interp(8, SPEC.rows, SPEC.read_overhead))
    assert RoundCost.flat().read_overhead == (0.0,)  # other tables carry none unless given
    assert RoundCost.from_ms((1, 8), (1, 4), ((2.0, 4.0), (3.0, 8.0))).read_overhead == (0.0, 0.0)
    # part of the drafting overhead: capped by it, also when dataclasses.replace lowers that alone
    assert dataclasses.replace(SPEC, spec_overhead=0.1).read_overhead == (0.1, 0.1, 0.085, 0.0, 0.0)
    assert RoundCost.flat(spec_overhead=0.2, read_overhead=5.0).read_time(1) == 0.2
    for bad in (float("nan"), -0.1, (0.1, 0.2)):
        with pytest.raises(ValueError, match="read_overhead must be one number or 5"):
            RoundCost(read_overhead=bad)


@pytest.fixture(scope="module")
def pair():
    target = make_target("qwen3")
    return target, make_drafter(target, block_size=8)


def _head_says(drafter, ratio: float) -> None:
    with torch.no_grad():
        drafter.length_head.out.weight.zero_()
        drafter.length_head.out.bias.fill_(math.log(ratio / (1 - ratio)))


def _left(out, max_new: int) -> list[int]:
    """Tokens a request had left before each of its verify rounds (the prefill committed the first)."""
    left, n = [], max_new - 1
    for a in out.accepted:
        left.append(n)
        n -= a + 1
    return left


@pytest.mark.parametrize("graphs", [False, True])
def test_engine_spares_the_read_with_whole_blocks_where_it_pays(pair, graphs, monkeypatch):
    """The head says 0.4 for every block: under ``BLOCK8`` a round that reads its ratios verifies 6 of 8, but whole
    blocks sparing the read pay more, so every drafting round after the first is a whole-block stretch (one device
    read instead of two); without a read to spare (the control) the rounds stay packed at 6. Plain greedy output
    either way. The guess before a round is the head's last ratio here (the random drafter's rejections would
    otherwise say drafting seldom pays: ``test_next_round_guess``), and the head's ratios are read as they are (the
    traffic's trials would calibrate them down: ``test_length_calibration``)."""
    monkeypatch.setattr(vl, "GUESS_PRIOR_ROUNDS", 0.0)
    target, drafter = pair
    prompts = engine_prompts([5, 7], seed=11)
    runs = {}
    with kept_length_head(drafter):
        _head_says(drafter, 0.4)
        for read in (0.5, 0.0):
            eng = Engine(target, drafter, length_policy="cost", round_cost=dataclasses.replace(BLOCK8, read_overhead=read),
                         max_slots=2, max_len=64, token_budget=64, cuda_graphs=graphs, prompt_ngrams=0)
            eng.planner.calibrate_head = False
            outs = eng.generate(prompts, max_new_tokens=30)
            assert [o.token_ids for o in outs] == [plain_greedy_ids(target, p, 30) for p in prompts]
            runs[read] = (eng, [(o.verify_lengths, _left(o, 30)) for o in outs])
    (eng, lens), (ctl, ctl_lens) = runs[0.5], runs[0.0]
    drafting = eng.num_steps - eng.skipped_drafts - 1  # the prefill round verifies nothing
    # every drafting round but the first (no last ratios) and at most one near the end, whose ratios said plain and
    # which verified what its spent body had left
    assert drafting - 2 <= eng.whole_rounds <= drafting - 1
    for (row, left), (ctl_row, ctl_left) in zip(lens, ctl_lens):  # mid-text: 8 against 6; near the end what is left
        assert row[0] == 6 and all(k == 8 for k, n in zip(row[1:], left[1:]) if n >= 8)  # the first round has no last ratios
        assert all(k == 6 for k, n in zip(ctl_row, ctl_left) if n >= 8)
        assert all(k in (1, min(8, n)) for k, n in zip(row[1:], left[1:]))  # or, for the last token or two, plain
    assert 4 * ctl.whole_rounds < eng.whole_rounds  # the control: only near the ends
    assert eng.host_syncs < ctl.host_syncs


def test_the_whole_block_decision_is_made_while_the_drafters_body_runs(pair, monkeypatch):
    """On the graph path the round launches its drafter's body first and decides whole blocks after (the planner's host
    time overlaps the body's device time): in every drafting round ``whole_blocks`` comes after ``run_body``, and the
    output is plain greedy's. The control: the rounds the planner made plain ask ``whole_blocks`` nothing."""
    monkeypatch.setattr(vl, "GUESS_PRIOR_ROUNDS", 0.0)
    target, drafter = pair
    prompts = engine_prompts([5, 7], seed=11)
    events = []
    with kept_length_head(drafter):
        _head_says(drafter, 0.4)
        eng = Engine(target, drafter, length_policy="cost", round_cost=dataclasses.replace(BLOCK8, read_overhead=0.5),
                     max_slots=2, max_len=64, token_budget=64, cuda_graphs=True, prompt_ngrams=0)
        body, whole = eng.draft_graphs.run_body, eng.planner.whole_blocks
        monkeypatch.setattr(eng.draft_graphs, "run_body",
                            lambda s, c, b: (events.append("body" if b is not None else "context"), body(s, c, b))[1])
        monkeypatch.setattr(eng.planner, "whole_blocks", lambda *a, **k: (events.append("whole"), whole(*a, **k))[1])
        outs = eng.generate(prompts, max_new_tokens=30)
    assert [o.token_ids for o in outs] == [plain_greedy_ids(target, p, 30) for p in prompts]
    assert events.count("body") >= 3 and events.count("whole") == events.count("body")
    assert all(i > 0 and events[i - 1] == "body" for i, e in enumerate(events) if e == "whole")


DELAY_S = 0.2


@pytest.mark.parametrize("where", ["read", "round"])
def test_measured_read_overhead_is_what_the_mid_round_read_costs(pair, where):
    """A delay in the mid-round read of the ratios is the measured ``read_overhead`` (a whole-block stretch skips it);
    the control, the same delay in every drafting round's commit, is drafting overhead but not the read's."""
    from adaflash_hf.engine.warmup import measure_round_cost

    target, drafter = pair
    eng = Engine(target, drafter, length_policy="cost", max_slots=2, max_len=96, token_budget=64, cuda_graphs=True)
    if where == "read":
        real = eng.planner.lengths

        def slow(running, ratio, draft_logits=None):
            if ratio is not None:
                time.sleep(DELAY_S)
            return real(running, ratio, draft_logits)

        eng.planner.lengths = slow
    else:
        delay_drafting_rounds(eng, DELAY_S)
    cost = measure_round_cost(eng, rows=[1], context=16, reps=2)
    unit_s = cost.unit_ms / 1e3
    assert cost.spec_overhead[0] * unit_s > 0.8 * DELAY_S
    assert cost.read_overhead[0] <= cost.spec_overhead[0]
    if where == "read":
        assert cost.read_overhead[0] * unit_s > 0.8 * DELAY_S
    else:
        assert cost.read_overhead[0] * unit_s < 0.5 * DELAY_S
    assert eng.idle and eng.cache.num_free == 2 and eng.whole_rounds == 0


# (name, cost, rows, expected first hold, expected cap): the plain rounds before the first probe after a plain
# decision (until they have cost 1 / FIRST_PROBE_SHARE = 4 times what the probe adds) and the most between two probes
# (within 2% of their time)
PROBE_CASES = [
    ("a free probe: the floors", RoundCost.flat(), 1, 1, vl.PLAIN_PROBE_ROUNDS),
    ("a probe 0.2 of a plain round: probe after 1 (0.8 of the probe's 4), at most 10 apart",
     RoundCost.flat(draft_fraction=0.2), 4, 1, 10),
    ("a probe 0.32 of a plain round: probe after 2, 16 keep it within 2%", RoundCost.flat(draft_fraction=0.32), 4, 2, 16),
    ("its drafting overhead counts, less the plain one's: 4 x 1.5 against plain rounds of 1.18 / 2% of it",
     RoundCost.flat(spec_overhead=1.68, plain_overhead=0.18), 4, 6, 64),
    ("a drafter dearer than 6 plain rounds (the reference pair's own): 25 before the first probe",
     RoundCost.flat(draft_fraction=6.1), 1, 25, 305),
    ("a dear drafter: the ceiling for both", RoundCost.flat(draft_fraction=2000.0), 4, vl.PROBE_CAP, vl.PROBE_CAP),
]


@pytest.mark.parametrize("name,cost,rows,first,cap", PROBE_CASES, ids=[c[0] for c in PROBE_CASES])
def test_the_probe_holds_keep_probing_within_their_shares(pair, name, cost, rows, first, cap):
    target, drafter = pair
    eng = Engine(target, drafter, length_policy="cost", round_cost=cost, max_slots=2, max_len=64, cuda_graphs=False)
    assert eng.planner.probe_holds(rows) == (first, cap)


def test_the_probe_cap_grows_with_the_batch_on_the_spec_table(pair):
    """On SPEC's H200 table a probe costs ~0.6 of a plain step at batch 1 and 1.3 at 128 requests (the body runs
    every block position of every request): the holds grow with the batch."""
    target, drafter = pair
    eng = Engine(target, drafter, length_policy="cost", round_cost=SPEC, max_slots=2, max_len=64, cuda_graphs=False)
    eng.planner.block_size = 16  # SPEC's block
    holds = [eng.planner.probe_holds(n) for n in (1, 8, 32, 64, 128)]
    firsts, caps = [h[0] for h in holds], [h[1] for h in holds]
    assert caps[0] > vl.PLAIN_PROBE_ROUNDS and caps[-1] > 2 * caps[0] and caps[1:] == sorted(caps[1:])
    assert firsts[0] == 3 and firsts[-1] == 6 and firsts == sorted(firsts)  # 4 x 0.6 plain steps at 1, 4 x 1.3 at 128


def _probes(pair, cost: RoundCost, graphs: bool) -> int:
    """Drafter bodies run over 100 tokens of a prompt whose head predicts nothing (every round decodes plainly but the
    probes), checking the output is plain greedy and every verify length 1 but the probes' (their body spent, a flat
    cost verifies what they drafted)."""
    target, drafter = pair
    prompt = engine_prompts([6], seed=3)
    eng = Engine(target, drafter, length_policy="cost", round_cost=cost, max_slots=1, max_len=128, token_budget=128,
                 cuda_graphs=graphs, prompt_ngrams=0)
    bodies = []
    if graphs:
        real = eng.draft_graphs.run_body
        eng.draft_graphs.run_body = lambda s, c, b: (bodies.append(b is not None), real(s, c, b))[1]
    else:
        import adaflash_hf.engine.engine as engine_mod

        real = engine_mod.draft_blocks
        engine_mod.draft_blocks = lambda *a, **k: (bodies.append(True), real(*a, **k))[1]
    try:
        out = eng.generate(prompt, max_new_tokens=100)[0]
    finally:
        if not graphs:
            engine_mod.draft_blocks = real
    assert out.token_ids == plain_greedy_ids(target, prompt[0], 100)
    assert sum(k > 1 for k in out.verify_lengths) <= sum(bodies)
    return sum(bodies)


@pytest.mark.parametrize("graphs", [False, True])
def test_dear_probes_come_further_apart(pair, graphs, monkeypatch):
    """A head that predicts nothing and a drafter that cannot pay: every round decodes plainly but the probes, which
    back off from the first hold to the cap (from the second on: the traffic's acceptance then says plain). A probe
    dearer than a plain round (2.5 of one: first hold 10, cap 125) runs fewer of them than a cheap one (the control:
    1, 8); and the same dear probe with the first hold forced to 1 comes no later. Plain greedy output every time."""
    _, drafter = pair
    with kept_length_head(drafter):
        _head_says(drafter, 1e-6)
        dear, cheap = RoundCost.flat(draft_fraction=2.5), RoundCost.flat(draft_fraction=0.1)
        probes = {"dear": _probes(pair, dear, graphs), "cheap": _probes(pair, cheap, graphs)}
        monkeypatch.setattr(vl, "FIRST_PROBE_SHARE", 1e9)
        probes["dear, first hold 1"] = _probes(pair, dear, graphs)
    assert 0 < probes["dear"] <= probes["dear, first hold 1"] < probes["cheap"]

