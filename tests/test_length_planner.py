"""The verify-length planner alone (no loop, no model): the whole block where verify cost is flat, fewer drafts where it
is not, plain plans where drafting cannot pay, and a return to drafting once acceptance rises, found by its probes."""

import pytest
import torch

from adaflash_hf.speculation.length import LengthPlanner, LengthSettings, RoundCost, RowState

COST = LengthSettings("cost", 1.0, 1)
FLAT = RoundCost.flat()
STEEP = RoundCost(rows=(1,), tokens_per_row=(1, 16), verify=((1.0, 5.5),), draft_fraction=0.0)
DEAR = RoundCost.flat(draft_fraction=0.5)  # a drafting round costs 1.5 steps: it pays from about 2 tokens a round
SURE_ONLY = RoundCost.flat(draft_fraction=5.0)  # 6 steps a drafting round: only sure drafts (ratio ~0.8 up) pay
NEVER = RoundCost.flat(draft_fraction=50.0)  # 51 steps: not even a block of 8 accepted drafts pays


def _run(planner, rows, ratio_of_round, rounds: int) -> list[str]:
    """What each round does as a loop asks it: ``plain``, ``whole`` (whole blocks, ratios read at the end) or the
    verify lengths chosen on the round's ratios; each drafting round accepts what its ratio says."""
    out = []
    for t in range(rounds):
        for r in rows:
            r.remaining = 1000
        plan = planner.plan(rows)
        if plan.plain:
            out.append("plain")
            continue
        ratio = torch.full((len(rows),), ratio_of_round(t))
        k = planner.lengths(rows, None if plan.whole else ratio)
        if plan.whole:
            planner.note_ratios(rows, ratio)
        out.append("whole" if plan.whole else str(k.tolist()))
        for r, n in zip(rows, k.tolist()):
            planner.observe(r, min(n - 1, round(ratio_of_round(t) * 8) - 1), n)
    return out


@pytest.mark.parametrize("cost,ratio,want", [(FLAT, 0.25, [8, 8]), (STEEP, 0.45, None)], ids=["flat", "steep"])
def test_the_whole_block_where_verify_is_flat_fewer_drafts_where_it_is_not(cost, ratio, want):
    planner = LengthPlanner(COST, 8, cost)
    k = planner.lengths([RowState(remaining=40), RowState(remaining=40)], torch.tensor([ratio, ratio])).tolist()
    if want is not None:
        assert k == want
    else:
        assert 1 < min(k) and max(k) < 8  # a verify token costs a third of a step: a few drafts, not the block


def test_plain_plans_where_drafting_cannot_pay_and_back_to_drafting_when_acceptance_rises():
    """Low acceptance on a dear drafter: after the first drafted round the planner's rounds are plain, with probes
    growing apart; once the text turns draftable (ratio 1.0), the next probe says so and every round drafts again.
    The control, acceptance that stays low, stays plain."""
    rise_at = 40
    rows = [RowState(), RowState()]
    seen = _run(LengthPlanner(COST, 8, DEAR), rows, lambda t: 0.125 if t < rise_at else 1.0, 120)
    before, after = seen[:rise_at], seen[rise_at:]
    probes = [t for t, s in enumerate(before) if s != "plain"]
    assert before[0] != "plain" and before.count("plain") > 0.8 * rise_at and len(probes) >= 3
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]  # the holds grow while the probes keep saying plain
    back = next(t for t, s in enumerate(after) if s != "plain")
    assert all(s != "plain" for s in after[back:])  # drafting again from the first probe that saw it pay
    assert back <= LengthPlanner(COST, 8, DEAR).probe_holds(2)[1] + 1  # found by the next probe, at most a cap away
    control = _run(LengthPlanner(COST, 8, DEAR), [RowState(), RowState()], lambda t: 0.125, 120)[rise_at:]
    assert control.count("plain") > 0.9 * len(control)


def test_plain_verdicts_are_kept_until_a_guess_may_change(monkeypatch):
    """A run of plain rounds runs the cost rule once: the verdict is kept for the same rows until a ratio is read or a
    round observed (then asked again)."""
    planner = LengthPlanner(COST, 8, SURE_ONLY)
    rows = [RowState(remaining=100)]
    planner.lengths(rows, torch.tensor([0.2]))  # a drafted round said plain
    calls = []
    real = planner.guessed_lengths
    monkeypatch.setattr(planner, "guessed_lengths", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    assert all(planner.plan(rows).plain for _ in range(5)) and len(calls) == 1
    planner.observe(rows[0], 1, 8)  # a guess may change: asked again (still plain)
    planner.plan(rows)
    assert len(calls) == 2
    other = [RowState(remaining=100, head_ratio=0.2)]  # other rows: asked again
    planner.plan(other)
    assert len(calls) == 3


@pytest.mark.parametrize("remaining,most,want", [((2, 20), 8, 8), ((3, 5), 8, 5), ((30, 30), 4, 4)])
def test_a_plain_stretch_lasts_until_the_row_with_the_most_left_is_done(remaining, most, want):
    """A plain stretch is not cut short for a row that ends inside it (the loop drops that row's later steps): it
    runs ``most`` steps, or what the row with the most left still needs."""
    planner = LengthPlanner(COST, 8, SURE_ONLY)
    rows = [RowState(remaining=n) for n in remaining]
    planner.lengths(rows, torch.tensor([0.2] * len(rows)))  # a drafted round said plain
    assert planner.plain_stretch(rows, most) == want


# a drafting round costs 3 steps (verify, body, overhead), a plain round 2 when it reads alone
READS = RoundCost.flat(draft_fraction=1.0, spec_overhead=1.0, plain_overhead=1.0)


@pytest.mark.parametrize("ratio,plain_steps,plain", [
    (0.3, 1, False),  # a plain round that reads alone: drafting at this acceptance pays
    (0.3, 8, True),  # eight plain rounds share a read: it does not
    (0.5, 8, False),  # unless the acceptance is higher
    (0.1, 1, True),  # control: too low to pay against either
])
def test_plain_rounds_are_priced_as_the_stretches_that_run_them(ratio, plain_steps, plain):
    """A loop whose plain rounds run ``plain_steps`` behind one read (the engine's stretches) pays that share of a plain
    round's overhead: the cost rule weighs drafting against that, and the probes of a plain run wait longer."""
    planner = LengthPlanner(COST, 8, READS, plain_steps=plain_steps)
    k = planner.guessed_lengths([RowState(remaining=40, head_ratio=ratio)], unread_whole=False)
    assert bool((k <= 1).all()) == plain
    alone = LengthPlanner(COST, 8, READS).probe_holds(1)
    assert (planner.probe_holds(1) > alone) == (plain_steps > 1) and all(a >= b for a, b in zip(planner.probe_holds(1), alone))


@pytest.mark.parametrize("cost,rows,never", [
    (NEVER, 1, True),  # a whole block of accepted drafts does not pay for the round
    (SURE_ONLY, 1, False),  # it does: probes may find such text
    (RoundCost(rows=(1, 8), tokens_per_row=(1, 8), verify=((1.0, 1.0), (1.0, 9.0)), draft_fraction=0.5), 8, True),
    (RoundCost(rows=(1, 8), tokens_per_row=(1, 8), verify=((1.0, 1.0), (1.0, 9.0)), draft_fraction=0.5), 1, False),
])
def test_where_no_acceptance_pays_no_round_drafts_not_even_a_probe(cost, rows, never):
    """Where even every draft accepted would not pay for a drafting round at this batch, the planner plans plain rounds
    from the first on and never probes (acceptance cannot rise above all), and every plain round may join a stretch;
    where some acceptance would pay (the controls: a cheaper round, a smaller batch on a verify that grows with the
    batch's tokens), the first round drafts, as a row yet to draft is guessed to accept everything."""
    planner = LengthPlanner(COST, 8, cost)
    state = [RowState(remaining=100) for _ in range(rows)]
    assert planner.never_pays(rows) == never
    plans = [planner.plan(state).plain for _ in range(50)]
    assert all(plans) == never and any(plans) == never  # the control's first round drafts
    assert (planner.plain_stretch(state, 8) == 8) == never  # the control has no plain verdict yet


@pytest.mark.parametrize("traffic,at_cap", [
    (0.125, True),  # the traffic's acceptance decodes plainly here: plain is the norm, the probes wait the cap at once
    (1.0, False),  # control: the traffic drafts, so this plain decision is a dip: the short first hold, then doubling
])
def test_probes_wait_the_cap_where_the_traffics_own_acceptance_is_plain(traffic, at_cap):
    planner = LengthPlanner(COST, 8, DEAR)
    rows = [RowState(remaining=100), RowState(remaining=100)]
    for _ in range(20):
        planner.observe(rows[0], round(traffic * 8) - 1, 8)
    assert planner.traffic_plain(2) is (traffic < 0.5)
    first, cap = planner.probe_holds(2)
    planner.lengths(rows, torch.tensor([0.05, 0.05]))  # this round's ratios say plain
    assert planner.drafted_plain and first < cap
    assert planner.plain_limit == (cap if at_cap else first)
