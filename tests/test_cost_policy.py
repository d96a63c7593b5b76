"""The cost-aware verify length (issue 35): the rule's properties table by table, a brute-force optimum, its cost
model and bad inputs, and the engine under it (greedy identity, plain rounds without the drafter's body)."""

import dataclasses
import itertools

import numpy as np
import pytest
import torch

import adaflash_hf.engine.engine as engine_mod
from adaflash_hf.speculation.length.planner import PLAIN_PROBE_ROUNDS
from adaflash_hf.engine import Engine
from adaflash_hf.engine.requests import Request
from adaflash_hf.engine.sampling import SamplingParams
from adaflash_hf.speculation.length import LengthPlanner
from adaflash_hf.speculation.length import LengthSettings
from adaflash_hf.speculation.length.rules import CostRule, RoundInputs, cost_aware_verify_length, make_rule, survival_curve
from adaflash_hf.speculation.length.cost import SPEC_H200_MS, SPEC_H200_OVERHEAD_MS, SPEC_ROWS, SPEC_TOKENS_PER_ROW, RoundCost

from generation_helpers import delay_drafting_rounds, engine_prompts, force_length_head, make_drafter, make_target, plain_greedy_ids

FLAT = RoundCost.flat()
STEEP = RoundCost(rows=(1,), tokens_per_row=(1, 16), verify=((1.0, 5.5),), draft_fraction=0.0)  # a token 0.3 of a step
TOKEN_A_STEP = RoundCost(rows=(1,), tokens_per_row=(1, 16), verify=((1.0, 16.0),), draft_fraction=0.0)
HEAVY_DRAFT = RoundCost.flat(draft_fraction=50.0)  # not even a block of accepted drafts pays: no round drafts
SURE_ONLY = RoundCost.flat(draft_fraction=6.5)  # a block of 8 pays only when nearly sure (ratio ~0.95 up): probes
SPEC_COST = RoundCost()

# (name, ratios, block, cost, expected k_hat): the properties, each a row
CASES = [
    ("flat cost: whole block, high ratio", [0.9, 0.6], 16, FLAT, [16, 16]),
    ("flat cost: whole block, low ratio", [0.1, 0.2, 0.15], 8, FLAT, [8, 8, 8]),
    ("flat cost, a drafter that costs: whole block still", [0.5, 0.7], 16, RoundCost.flat(0.5), [16, 16]),
    ("nothing predicted, drafter costs: plain", [0.0, 0.0], 8, RoundCost.flat(0.1), [1, 1]),
    ("drafting cannot pay: plain", [0.3, 0.5, 0.2], 16, HEAVY_DRAFT, [1, 1, 1]),
    ("every draft sure, a token a step: whole block (ties: the most slots)", [1.0], 16, TOKEN_A_STEP, [16]),
    ("a token a step, unsure drafts: plain", [0.45, 0.9], 16, TOKEN_A_STEP, [1, 1]),
    ("steeper: fewer tokens", [0.45, 0.45], 16, STEEP, [5, 5]),
    ("SPEC cost, batch 1, sure drafts: whole block", [1.0], 16, SPEC_COST, [16]),
]


@pytest.mark.parametrize("name,ratios,block,cost,expected", CASES, ids=[c[0] for c in CASES])
def test_cost_rule_table(name, ratios, block, cost, expected):
    assert cost_aware_verify_length(torch.tensor(ratios), block, cost).tolist() == expected


def _no_overhead(cost: RoundCost) -> RoundCost:
    return dataclasses.replace(cost, spec_overhead=0.0, plain_overhead=0.0)


# (name, ratios, block, cost, expected, control cost): the round's overhead (issue 35: a real round costs host time the
# graphs do not show). Each control is the same case without the term it tests (None: without any overhead) and must
# give other lengths, so every row fails if the rule ignores that term.
OVERHEAD_CASES = [
    ("a fixed cost per round, low load: whole block (steep verify alone: 5)", [0.45, 0.45], 16,
     dataclasses.replace(STEEP, spec_overhead=20.0, plain_overhead=20.0), [16, 16], None),
    ("a drafting round far dearer than a plain step: plain, however sure the drafts", [0.9, 0.6], 16,
     RoundCost.flat(spec_overhead=20.0), [1, 1], None),
    ("SPEC table at batch 1, a drafting round 30 steps dearer: plain", [1.0], 16,
     RoundCost(spec_overhead=30.0, plain_overhead=0.0), [1], None),
    ("what counts against drafting is the difference: equal overheads keep whole blocks", [0.25] * 4, 16,
     RoundCost.flat(spec_overhead=3.0, plain_overhead=3.0), [16] * 4, RoundCost.flat(spec_overhead=3.0)),
    ("SPEC table with its H200 overheads, 128 rows at the gsm8k pair's mean ratio: plain (the replay's off wins)",
     [0.25] * 128, 16, RoundCost(), [1] * 128, None),
]


@pytest.mark.parametrize("name,ratios,block,cost,expected,control", OVERHEAD_CASES, ids=[c[0] for c in OVERHEAD_CASES])
def test_cost_rule_weighs_the_rounds_overhead(name, ratios, block, cost, expected, control):
    ratio = torch.tensor(ratios)
    assert cost_aware_verify_length(ratio, block, cost).tolist() == expected
    control = control if control is not None else _no_overhead(cost)
    assert cost_aware_verify_length(ratio, block, control).tolist() != expected  # the term decides the row


def test_zero_overhead_keeps_the_rule_as_it_was():
    """Lengths summed per round on SPEC's table without overheads, as the rule chose them before the overhead term
    (commit 6d515d3, whose ``RoundCost`` had none); SPEC's default overheads change some (the control)."""
    g, zero = torch.Generator().manual_seed(0), RoundCost(spec_overhead=0.0, plain_overhead=0.0)
    ratios = [torch.rand(n, generator=g) * 0.6 for n in (1, 8, 32, 128)] + [torch.full((8,), 0.2), torch.full((128,), 0.25)]
    before = [16, 78, 256, 736, 64, 640]
    assert [cost_aware_verify_length(r, 16, zero).sum().item() for r in ratios] == before
    assert [cost_aware_verify_length(r, 16, RoundCost()).sum().item() for r in ratios] != before
    for cost in (FLAT, STEEP, TOKEN_A_STEP, HEAVY_DRAFT):  # the tables the rule's other tests use carry none
        assert cost.spec_overhead == (0.0,) and cost.plain_overhead == (0.0,)


# (name, ratios, block, cost, k_hat with the drafter still to pay, once it has run): `drafted`
DRAFTED = [
    ("a dear drafter: plain before it runs, whole blocks after", [0.3, 0.5], 16, HEAVY_DRAFT, [1, 1], [16, 16]),
    ("a dear round: the same", [0.3], 16, RoundCost.flat(spec_overhead=5.0), [1], [16]),
    ("SPEC at batch 1, a low ratio: a few drafts once they cost only their slots", [0.1], 16, SPEC_COST, [1], [5]),
    ("control: nothing predicted, slots that cost: nothing verified either way", [0.0, 0.0], 8,
     dataclasses.replace(STEEP, draft_fraction=50.0), [1, 1], [1, 1]),
    ("control: a free drafter, nothing to spend", [0.45, 0.45], 16, STEEP, [5, 5], [5, 5]),
]


@pytest.mark.parametrize("name,ratios,block,cost,before,after", DRAFTED, ids=[c[0] for c in DRAFTED])
def test_a_drafter_that_has_run_is_spent(name, ratios, block, cost, before, after):
    ratio = torch.tensor(ratios)
    assert cost_aware_verify_length(ratio, block, cost).tolist() == before
    assert cost_aware_verify_length(ratio, block, cost, drafted=True).tolist() == after
    chosen = CostRule(cost).lengths(RoundInputs(len(ratios), block, ratio, drafted=True))
    assert chosen.tolist() == after


# (name, ratios, cost, the rounds after it decode plainly, this round verifies drafts); block 8
IN_ROUND = [
    ("a dear drafter: plain from now on, this round's whole blocks verified", [0.3, 0.5], HEAVY_DRAFT, True, True),
    ("SPEC at batch 1, a low ratio: plain next, a few drafts now", [0.16], SPEC_COST, True, True),
    ("control: nothing predicted: plain now too", [0.0], dataclasses.replace(STEEP, draft_fraction=50.0), True, False),
    ("control: drafting pays: the rule's lengths, no plain rounds", [0.45, 0.45], STEEP, False, True),
]


@pytest.mark.parametrize("name,ratios,cost,plain,drafts", IN_ROUND, ids=[c[0] for c in IN_ROUND])
def test_the_engines_round_spends_the_body_it_ran(name, ratios, cost, plain, drafts):
    """Once a round's ratios are read its drafter body is spent: the plain decision for the rounds after it prices the
    body (they would spare it), this round's lengths do not."""
    target = make_target("qwen3")
    eng = Engine(target, make_drafter(target, block_size=8), length_policy="cost", round_cost=cost, max_slots=2,
                 max_len=64, token_budget=64)
    running = [Request(i, [1, 2], 30, SamplingParams(), None) for i in range(len(ratios))]
    ratio = torch.tensor(ratios)
    lengths = eng.planner.lengths(running, ratio).tolist()
    assert lengths == cost_aware_verify_length(ratio, 8, cost, drafted=plain).tolist()
    assert (max(lengths) > 1) is drafts
    assert (cost_aware_verify_length(ratio, 8, cost).max() <= 1).item() is plain
    assert eng.planner.drafted_plain is plain and (eng.planner.plain_limit > 0) is plain
    assert [r.head_ratio for r in running] == pytest.approx(ratios)


# (name, cost, rounds: each round's ratios and tokens left per row; the planner's state runs on from round to round)
BOTH_PATHS = [
    ("flat cost: whole blocks", FLAT, [([0.3, 0.9], [30, 30]), ([0.1, 0.2], [20, 5])]),
    ("steep cost: fewer drafts", STEEP, [([0.45, 0.45], [30, 30]), ([0.9, 0.2], [30, 3])]),
    ("a dear drafter: plain, then priced as spent", HEAVY_DRAFT, [([0.3, 0.5], [30, 30]), ([1.0, 1.0], [30, 30])]),
    ("SPEC table: a low ratio, then a high one", SPEC_COST, [([0.16], [40]), ([0.9], [40]), ([0.05], [2])]),
]


@pytest.mark.parametrize("name,cost,rounds", BOTH_PATHS, ids=[c[0] for c in BOTH_PATHS])
def test_generate_and_the_engine_plan_the_same_lengths(name, cost, rounds):
    """One ``cost`` algorithm: the planner generate's eager loop builds (through its candidate generator) and the one
    the engine builds, from the same keywords, give the same plan and lengths for the same round inputs, round after
    round (their state, guesses and probe holds, moves alike)."""
    from adaflash_hf.generation.drafting import AdaFlashCandidateGenerator
    from adaflash_hf.speculation.length import RowState
    from transformers import GenerationConfig

    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=8)
    kw = dict(length_policy="cost", length_min=1)
    eng = Engine(target, drafter, round_cost=cost, max_slots=2, max_len=64, token_budget=64, cuda_graphs=False, **kw)
    gen = AdaFlashCandidateGenerator.for_target(target, drafter, GenerationConfig(max_length=64), **kw)
    gen.planner.round_cost = cost
    assert type(gen.planner) is type(eng.planner) and gen.planner.settings == eng.planner.settings
    engine_rows = [Request(i, [1, 2], 40, SamplingParams(), None) for i in range(len(rounds[0][0]))]
    eager_rows = [RowState() for _ in engine_rows]
    for ratios, left in rounds:
        for r, e, n in zip(engine_rows, eager_rows, left):
            r.tokens = [0] * (r.max_new - n)
            e.remaining = n
        assert [r.remaining for r in engine_rows] == left
        assert gen.planner.plan(eager_rows) == eng.planner.plan(engine_rows)
        a = eng.planner.lengths(engine_rows, torch.tensor(ratios)).tolist()
        assert gen.planner.lengths(eager_rows, torch.tensor(ratios)).tolist() == a
        assert all(k <= n for k, n in zip(a, left))
        for r, e, k in zip(engine_rows, eager_rows, a):  # the round accepted half of what it verified
            eng.planner.observe(r, (k - 1) // 2, k)
            gen.planner.observe(e, (k - 1) // 2, k)
        assert gen.planner.traffic_seen == eng.planner.traffic_seen
        assert (gen.planner.drafted_plain, gen.planner.plain_limit) == (eng.planner.drafted_plain, eng.planner.plain_limit)


@pytest.mark.parametrize("cost,ratio_high,drafts", [(HEAVY_DRAFT, True, "never"), (SURE_ONLY, False, "probes"),
                                                    (FLAT, True, "always")],
                         ids=["no acceptance pays", "only sure drafts pay", "control: flat"])
def test_generate_plain_plans_skip_the_drafter(cost, ratio_high, drafts, monkeypatch):
    """The eager loop follows the planner: where no acceptance could pay it never runs the drafter; where only sure
    drafts pay and the head is unsure, it decodes plain rounds without the drafter but for its first round and the
    probes; output plain greedy decoding's either way. The control (a flat cost) drafts every round."""
    import adaflash_hf.generation.drafting as drafting_mod
    from adaflash_hf import speculative_generate

    calls = []
    real = drafting_mod.AdaFlashCandidateGenerator.propose
    monkeypatch.setattr(drafting_mod.AdaFlashCandidateGenerator, "propose",
                        lambda self, *a, **k: (calls.append(1), real(self, *a, **k))[1])
    real_init = drafting_mod.AdaFlashCandidateGenerator.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        self.planner.round_cost = cost

    monkeypatch.setattr(drafting_mod.AdaFlashCandidateGenerator, "__init__", init)
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=8)
    force_length_head(drafter, ratio_high=ratio_high)
    prompt = engine_prompts([5], seed=3)[0]
    out, stats = speculative_generate(target, drafter, torch.tensor([prompt]), length_policy="cost", max_new_tokens=24,
                                      fast_path=False, return_stats=True, prompt_ngrams=0)
    assert out[0, len(prompt):].tolist() == plain_greedy_ids(target, prompt, 24)
    if drafts == "never":
        assert calls == [] and stats.verify_lengths.count(1) == stats.rounds
    elif drafts == "probes":
        assert 0 < len(calls) < stats.rounds // 2 and stats.verify_lengths.count(1) >= stats.rounds - len(calls)
    else:
        assert len(calls) >= stats.rounds - 1 and max(stats.verify_lengths) == 8  # the last token: nothing to draft


def test_round_time_and_overhead_by_rows():
    cost = RoundCost(rows=(1, 9), tokens_per_row=(1,), verify=((1.0,), (2.0,)), draft_fraction=0.5,
                     spec_overhead=(1.0, 3.0), plain_overhead=0.5)
    assert cost.overhead(5, True) == 2.0 and cost.overhead(100, True) == 3.0 and cost.overhead(1, False) == 0.5  # flat past the table
    assert cost.round_time(1, 1, 4) == 1.5  # plain: the verify and the plain overhead, no drafter
    assert cost.round_time(1, 2, 4) == pytest.approx(1.0 + 0.5 * 1.0 + 1.0)  # drafting: verify + drafter + its overhead
    assert np.allclose(cost.round_time(9, np.array([9, 10, 36]), 4), [2.0 + 0.5, 2 + 1 + 3, 2 + 1 + 3])
    spec = RoundCost()
    assert np.allclose(np.array(spec.spec_overhead) * SPEC_H200_MS[0][0], SPEC_H200_OVERHEAD_MS["spec"])
    assert np.allclose(np.array(spec.plain_overhead) * SPEC_H200_MS[0][0], SPEC_H200_OVERHEAD_MS["plain"])
    assert RoundCost.from_ms((1, 8), (1, 4), ((2.0, 4.0), (3.0, 8.0))).spec_overhead == (0.0, 0.0)  # a measured table: none


def test_steep_cost_verifies_fewer_tokens_than_flat():
    ratio = torch.tensor([0.45] * 8)
    flat, steep = (cost_aware_verify_length(ratio, 16, c) for c in (FLAT, STEEP))
    assert flat.tolist() == [16] * 8
    assert 1 < steep.min() and steep.max() < 16
    # the SPEC table: 128 requests make a verify token dear, one request makes it cheap
    at1 = cost_aware_verify_length(torch.tensor([0.45]), 16, SPEC_COST)
    at128 = cost_aware_verify_length(torch.full((128,), 0.45), 16, SPEC_COST)
    assert at128.float().mean() < at1.float().mean()


def _throughput(surv: np.ndarray, ks, cost: RoundCost, block: int) -> float:
    n, drafted = len(ks), sum(k - 1 for k in ks)
    gain = n + sum(surv[i, : k - 1].sum() for i, k in enumerate(ks))
    return gain / (cost.verify_time(n, n + drafted) + (cost.draft_time(n, block) + cost.overhead(n, True) if drafted
                                                       else cost.overhead(n, False)))


@pytest.mark.parametrize("seed", range(6))
def test_greedy_allocation_is_the_brute_force_optimum(seed):
    g = torch.Generator().manual_seed(seed)
    block, n = 5, 3
    ratio = torch.rand(n, generator=g)
    curve = torch.rand(2, generator=g).tolist()  # a random convex-ish cost: base + slope * tokens^power
    cost = RoundCost(rows=(1, 3), tokens_per_row=(1, 2, 3, 4, 5),
                     verify=tuple(tuple(1 + r * curve[0] * q ** (1 + curve[1]) / 5 for q in range(1, 6)) for r in (0.2, 1.0)),
                     draft_fraction=0.3 * seed / 5, spec_overhead=(0.0, 0.4 * (seed % 3)), plain_overhead=0.1 * (seed % 2))
    surv = survival_curve(ratio.numpy(), block)
    best = max(_throughput(surv, ks, cost, block) for ks in itertools.product(range(1, block + 1), repeat=n))
    got = cost_aware_verify_length(ratio, block, cost).tolist()
    assert _throughput(surv, got, cost, block) == pytest.approx(best, rel=1e-9)
    # negative control: some other allocation is strictly worse, so the check can fail
    worst = min(_throughput(surv, ks, cost, block) for ks in itertools.product(range(1, block + 1), repeat=n))
    assert worst < best * 0.999


def test_monotone_in_ratio_rate_and_cost():
    others = torch.tensor([0.3, 0.6])
    lens = [cost_aware_verify_length(torch.cat([torch.tensor([a]), others]), 16, SPEC_COST)[0].item()
            for a in np.linspace(0, 1, 21)]
    assert lens == sorted(lens) and lens[0] == 1 and lens[-1] == 16
    ratio = torch.full((64,), 0.3)
    by_rate = [cost_aware_verify_length(ratio, 16, SPEC_COST, rate=r).sum().item() for r in (0.5, 1.0, 2.0, 3.0)]
    assert by_rate == sorted(by_rate) and by_rate[0] < by_rate[-1]
    by_draft = [cost_aware_verify_length(ratio, 16, RoundCost(draft_fraction=f)).sum().item() for f in (0.0, 0.2, 1.0, 5.0)]
    assert by_draft[-1] == 64  # plain decoding once the drafter is dear enough
    assert by_draft[0] > 64


def test_row_limits_and_min_len():
    ratio = torch.tensor([1.0, 1.0, 0.0])
    k = cost_aware_verify_length(ratio, 8, FLAT, max_len=torch.tensor([3, 8, 1]))
    assert k.tolist() == [3, 8, 1]
    k = cost_aware_verify_length(torch.tensor([0.0, 0.0]), 8, TOKEN_A_STEP, min_len=3)
    assert k.tolist() == [3, 3]  # min_len forces slots even where drafting does not pay


def test_survival_curve_expects_the_heads_length():
    B = 16
    a = torch.tensor([1 / 16, 3.55 / 16, 7.06 / 16, 1.0])
    surv = survival_curve(a.numpy(), B)
    assert np.allclose(surv.sum(axis=1), (a.numpy() * B - 1).clip(0, B - 1), atol=0.02)
    assert (np.diff(surv, axis=1) <= 1e-12).all()  # falls along the block
    doubled = survival_curve(a.numpy(), B, rate=2.0).sum(axis=1)
    assert np.allclose(doubled, (a.numpy() * B * 2 - 1).clip(0, B - 1), atol=0.02)  # the rate is a calibration scale
    assert survival_curve(np.array([np.nan]), B).max() == 0


def test_round_cost_follows_spec_table():
    for i, r in enumerate(SPEC_ROWS):
        for j, q in enumerate(SPEC_TOKENS_PER_ROW):
            assert SPEC_COST.verify_time(r, r * q) * SPEC_H200_MS[0][0] == pytest.approx(SPEC_H200_MS[i][j])
    tokens = np.arange(200, 4096, 100)
    assert (np.diff(SPEC_COST.verify_time(200, tokens)) > 0).all()  # past the table: still growing
    assert SPEC_COST.verify_time(48, 48 * 3) == pytest.approx((8.6 + 9.2 + 9.9 + 11.9) / 4 / 6.0)  # bilinear: 32..64 rows, 2..4 tokens
    assert FLAT.verify_time(128, 2048) == 1.0 and FLAT.draft_time(128, 16) == 0.0
    m = RoundCost.from_ms((1, 8), (1, 4), ((2.0, 4.0), (3.0, 8.0)), draft_fraction=0.1)
    assert m.verify_time(8, 32) == 4.0 and m.draft_time(1, 4) == pytest.approx(0.2)


# (name, verify table over tokens per row 1 / 8 / 16 at 1 row, expected time of 1 row x 116 tokens): past the table
EXTENSION_CASES = [
    ("a last step that grows: its slope", (1.0, 1.1, 1.5), 1.5 + 100 * 0.4 / 8),
    ("a last step that falls (timing noise): the whole table's slope", (1.0, 2.0, 1.9), 1.9 + 100 * 0.9 / 15),
    ("a table that falls throughout: flat, never cheaper than its last point", (2.0, 1.5, 1.0), 1.0),
]


@pytest.mark.parametrize("name,ms,expected", EXTENSION_CASES, ids=[c[0] for c in EXTENSION_CASES])
def test_past_the_table_a_shape_never_costs_less(name, ms, expected):
    cost = RoundCost(rows=(1,), tokens_per_row=(1, 8, 16), verify=(ms,))
    assert cost.verify_time(1, 116) == pytest.approx(expected)
    far = cost.verify_time(1, np.arange(16, 20000, 500))
    assert (far >= ms[-1] - 1e-12).all() and (np.diff(far) >= 0).all()


@pytest.mark.parametrize("kwargs,match", [
    (dict(rows=(16, 1)), "rows must be strictly ascending"),
    (dict(tokens_per_row=(0.5, 2, 4, 8, 16)), "tokens_per_row must be"),
    (dict(verify=((1.0,),)), "verify must be 5 x 5"),
    (dict(verify=tuple(tuple(-1.0 for _ in range(5)) for _ in range(5))), "finite and > 0"),
    (dict(draft_fraction=float("nan")), "draft_fraction"),
    (dict(spec_overhead=float("nan")), r"spec_overhead must be one number or 5 \(one per rows entry\), each finite and >= 0"),
    (dict(spec_overhead=-0.5), "spec_overhead must be"),
    (dict(plain_overhead=float("inf")), "plain_overhead must be"),
    (dict(plain_overhead=(0.0, 1.0)), "plain_overhead must be one number or 5"),
    (dict(spec_overhead=(0.1, 0.2, -1.0, 0.3, 0.4)), "spec_overhead must be"),
    (dict(unit_ms=0.0), "unit_ms must be"),
])
def test_round_cost_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RoundCost(**kwargs)


@pytest.mark.parametrize("args,kwargs,match", [
    ((torch.ones(2, 2), 8), {}, r"accept_ratio must be \[b\]"),
    ((torch.ones(2), 8), dict(rate=0.0), "rate must be"),
    ((torch.ones(2), 8), dict(min_len=9), "min_len must be"),
    ((torch.ones(2), 0), {}, "block_size must be"),
    ((torch.ones(2), 8), dict(max_len=torch.tensor([1])), "max_len must be"),
    ((torch.ones(2), 8), dict(max_len=torch.tensor([0, 3])), "max_len must be"),
])
def test_cost_rule_validation(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cost_aware_verify_length(*args, **kwargs)


def test_make_rule_builds_the_named_rule_with_the_given_cost():
    rule = make_rule(LengthSettings("cost", 1.0, 1), RoundCost.flat(0.1))
    assert rule == CostRule(RoundCost.flat(0.1), 1)
    k = rule.lengths(RoundInputs(2, 8, ratio=torch.tensor([1.0, 0.0])))
    assert k.tolist() == [8, 8] and k.dtype == torch.long
    with pytest.raises(ValueError, match="not a valid LengthPolicy"):
        make_rule(LengthSettings("costly", 1.0, 1))


# --------------------------------------------------------------------------- the engine under the rule
@pytest.fixture(scope="module")
def pair():
    target = make_target("qwen3")
    return target, make_drafter(target, block_size=8)


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("cost,ratio_high,drafts", [(HEAVY_DRAFT, True, "never"), (RoundCost.flat(spec_overhead=50.0), True, "never"),
                                                    (SURE_ONLY, False, "probes"), (FLAT, True, "always")])
def test_engine_plain_rounds_skip_the_drafter_body(pair, monkeypatch, graphs, cost, ratio_high, drafts):
    """A drafter that no acceptance could pay for never runs its body (every round after the prefill plain); one that
    only sure drafts pay for, with an unsure head: every round decodes plainly and the body runs only on the first
    round and the probes, which, their body spent, verify the whole block (a flat verify costs nothing more); a flat
    cost (the negative control): the body runs every round and whole blocks are verified. Output identical."""
    target, drafter = pair
    force_length_head(drafter, ratio_high=ratio_high)
    bodies = []
    if graphs:
        real = engine_mod.DraftGraphs.run_body
        monkeypatch.setattr(engine_mod.DraftGraphs, "run_body",
                            lambda self, slots, ctx, bonus: (bodies.append(bonus is not None), real(self, slots, ctx, bonus))[1])
    else:
        real = engine_mod.draft_blocks
        monkeypatch.setattr(engine_mod, "draft_blocks", lambda *a, **k: (bodies.append(True), real(*a, **k))[1])
    prompts = engine_prompts([5, 7], seed=11)
    eng = Engine(target, drafter, length_policy="cost", round_cost=cost, max_slots=2, max_len=64, token_budget=64,
                 cuda_graphs=graphs)
    outs = eng.generate(prompts, max_new_tokens=30)
    for o, p in zip(outs, prompts):
        assert o.token_ids == plain_greedy_ids(target, p, 30)
    lens = [v for o in outs for v in o.verify_lengths]
    ran = sum(bodies)
    if drafts == "never":
        assert ran == 0 and set(lens) == {1} and eng.skipped_drafts == eng.num_steps - 1  # all but the prefill round
    elif drafts == "probes":
        assert eng.skipped_drafts == eng.num_steps - 1 - ran  # all but the prefill round and the probes
        drafted = [v for v in lens if v > 1]  # probes verify whole blocks (or what a row has left), the rest plain
        assert max(lens) == 8 and 0 < len(drafted) <= ran * len(prompts)
        ramp = PLAIN_PROBE_ROUNDS.bit_length() - 1  # probes after 1, 2, 4 plain rounds before the steady cadence
        assert 0 < ran <= ramp + eng.num_steps // (PLAIN_PROBE_ROUNDS + 1) + 1  # probes only
    else:
        assert max(lens) == 8 and ran >= eng.num_steps - 2  # every verify round drafts


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("bias,cost,whole", [(20.0, FLAT, True), (0.0, STEEP, False)])
def test_engine_whole_block_rounds_read_their_ratios_at_the_end(pair, graphs, bias, cost, whole):
    """Sure drafts at a flat cost: after the first drafting round every round verifies whole blocks chosen on the last
    ratios, without the mid-round read (one device read a round instead of two), the ratios coming with the round's
    one read; unsure drafts at a steep cost (the control): the lengths need each round's own ratios, two reads a round
    but near the end.
    Outputs are plain greedy's and verify lengths equal those with the stretches off, either way."""
    target, drafter = pair
    saved = drafter.length_head.out.bias.detach().clone()
    force_length_head(drafter, ratio_high=True)
    with torch.no_grad():
        drafter.length_head.out.bias.fill_(bias)
    prompts = engine_prompts([5, 7], seed=11)
    runs = {}
    try:
        for on in (True, False):
            eng = Engine(target, drafter, length_policy="cost", round_cost=cost, max_slots=2, max_len=64, token_budget=64,
                         cuda_graphs=graphs, prompt_ngrams=0)
            eng.planner.whole_block_stretches = on
            outs = eng.generate(prompts, max_new_tokens=30)
            assert [o.token_ids for o in outs] == [plain_greedy_ids(target, p, 30) for p in prompts]
            runs[on] = (eng, [o.verify_lengths for o in outs])
    finally:
        with torch.no_grad():
            drafter.length_head.out.bias.copy_(saved)
    (eng, lens), (off, off_lens) = runs[True], runs[False]
    assert lens == off_lens and off.whole_rounds == 0
    drafting = eng.num_steps - eng.skipped_drafts - 1  # the prefill round verifies nothing
    assert eng.host_syncs == off.host_syncs - eng.whole_rounds  # each such round saved its mid-round read
    if whole:
        assert max(max(v) for v in lens) == 8 and eng.whole_rounds == drafting - 1
    else:  # only near a request's end, where what it has left is within the length the rule picks
        assert any(1 < v < 8 for v in lens[0]) and eng.whole_rounds <= drafting // 2


# a block of 8 pays from ratio ~0.7; the first probe after 16 plain rounds (4x its extra 4 steps): two whole stretches
PROBE_AT_16 = RoundCost.flat(draft_fraction=4.0)


@pytest.mark.parametrize("cost,stretches", [(PROBE_AT_16, True), (FLAT, False)])
def test_engine_plain_stretches_queue_steps_behind_one_read(monkeypatch, cost, stretches):
    """Where drafting does not pay, plain rounds run as ``decode_steps`` greedy steps behind one read, as ``off``
    does (only probes verify drafts): fewer device reads than one round at a time, the same outputs and verify
    lengths, and the probes' length-head ratios (the random head reads the drafter's context) equal to those of one
    plain round at a time, so the context the stretches stored is the same. A flat cost (the control) drafts every
    round: no stretch, the same reads."""
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=8, seed=5)  # its length head untouched: ratios follow the context
    prompts = engine_prompts([5, 7], seed=11)
    runs, real = {}, LengthPlanner.lengths
    for steps in (8, 1):
        probes = []

        def record(self, running, ratio, draft_logits=None, probes=probes):
            if ratio is not None:
                probes.append(ratio.float().cpu().view(-1).clone())
            return real(self, running, ratio, draft_logits)

        monkeypatch.setattr(LengthPlanner, "lengths", record)
        eng = Engine(target, drafter, length_policy="cost", round_cost=cost, max_slots=2, max_len=80, token_budget=64,
                     cuda_graphs=True, decode_steps=steps, prompt_ngrams=0)
        outs = eng.generate(prompts, max_new_tokens=40)
        assert [o.token_ids for o in outs] == [plain_greedy_ids(target, p, 40) for p in prompts]
        runs[steps] = (eng, [o.verify_lengths for o in outs], probes)
    (eng, lens, probes), (one, one_lens, one_probes) = runs[8], runs[1]
    assert lens == one_lens and len(probes) == len(one_probes) > 0
    for a, b in zip(probes, one_probes):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    if stretches:
        drafted = [v for row in lens for v in row if v > 1]  # the probes', their body spent (whole blocks rated high)
        assert len(drafted) <= len(probes) * len(prompts) and eng.host_syncs < one.host_syncs / 2
    else:
        assert eng.host_syncs == one.host_syncs


@pytest.mark.parametrize("mode", ["packed", "rectangular"])
@pytest.mark.parametrize("policy", ["cost", "adaptive"])
def test_engine_identity_both_head_policies(mode, policy):
    """The random length head (ratios differ per request and round) under a steep cost: lengths between 1 and the
    block, outputs equal to plain greedy."""
    from adaflash_hf.engine import layout_args

    target = make_target("llama")
    drafter = make_drafter(target, block_size=8, seed=3)
    prompts = engine_prompts([4, 9, 6], seed=12)
    eng = Engine(target, **layout_args(drafter, mode, policy), max_slots=3, max_len=48, token_budget=48, round_cost=STEEP)
    assert eng.policy.value == policy
    outs = eng.generate(prompts, max_new_tokens=20)
    for o, p in zip(outs, prompts):
        assert o.token_ids == plain_greedy_ids(target, p, 20)
    assert any(1 < v < 8 for o in outs for v in o.verify_lengths)


def test_engine_measures_its_own_round_cost(pair):
    """``measure_round_cost`` times the engine's own buckets (eagerly here: the static path on the CPU) into a valid
    RoundCost over the rows it can hold, frees what it borrowed, and the engine decodes identically under it."""
    from adaflash_hf.engine.warmup import measure_round_cost

    target, drafter = pair
    eng = Engine(target, drafter, length_policy="cost", max_slots=4, max_len=96, token_budget=64, cuda_graphs=True)
    before = {k: getattr(eng, k) for k in ("policy", "round_cost", "planner", "draft_source", "on_round", "admission")}
    state = vars(eng.planner).copy()
    cost = measure_round_cost(eng, context=16, reps=1)
    assert cost.rows == (1, 2, 4) and cost.tokens_per_row == (1, 2, 4, 8)
    assert cost.verify_time(1, 1) == 1.0 and cost.draft_fraction > 0
    for overhead in (cost.spec_overhead, cost.plain_overhead):  # measured at every row count, in the table's unit
        assert len(overhead) == 3 and all(np.isfinite(v) and v >= 0 for v in overhead)
    assert cost.unit_ms > 0
    assert eng.cache.num_free == 4 and eng.idle
    assert all(getattr(eng, k) is v for k, v in before.items())  # the rounds it ran borrowed the engine
    assert vars(eng.planner) == state  # and taught its planner nothing
    assert (eng.num_steps, eng.skipped_drafts, eng.forward_tokens) == (0, 0, [])
    eng.round_cost = cost
    prompts = engine_prompts([5, 7], seed=13)
    for o, p in zip(eng.generate(prompts, max_new_tokens=12), prompts):
        assert o.token_ids == plain_greedy_ids(target, p, 12)
    with pytest.raises(ValueError, match="rows must be in"):
        measure_round_cost(eng, rows=[8])
    with pytest.raises(ValueError, match="context must be"):
        measure_round_cost(eng, context=90)
    with pytest.raises(RuntimeError, match="graph path"):
        measure_round_cost(Engine(target, drafter, max_slots=2, max_len=32, cuda_graphs=False))
    short = Engine(target, drafter, length_policy="cost", max_slots=2, max_len=36, token_budget=36, cuda_graphs=True)
    with pytest.raises(ValueError, match="no room for a prompt and a timed round"):  # refused before any request
        measure_round_cost(short, rows=[1], context=4, reps=5)
    assert short.idle


DELAY_S = 0.3


@pytest.mark.parametrize("length_policy", ["cost", "fixed"])
def test_measured_overhead_is_what_a_round_costs_beyond_its_graphs(pair, length_policy):
    """Rounds that verify drafts spend ``DELAY_S`` more on the host: ``measure_round_cost``'s drafting overhead holds
    that time and its plain overhead (the control, same run) does not; an engine that never decodes plainly
    (``fixed``) measures no plain overhead."""
    from adaflash_hf.engine.warmup import measure_round_cost

    target, drafter = pair
    eng = Engine(target, drafter, length_policy=length_policy, max_slots=2, max_len=96, token_budget=64, cuda_graphs=True)
    delay_drafting_rounds(eng, DELAY_S)
    cost = measure_round_cost(eng, rows=[1], context=16, reps=2)
    unit_s = cost.unit_ms / 1e3
    assert cost.spec_overhead[0] * unit_s > 0.8 * DELAY_S
    if length_policy == "cost":
        assert cost.plain_overhead[0] * unit_s < 0.8 * DELAY_S
    else:
        assert cost.plain_overhead == (0.0,)
    assert eng.idle and eng.cache.num_free == 2


def test_the_dispatch_reads_the_head_ratio_as_its_label_not_scaled_by_the_floor_rules_rate():
    """The cost rule ``make_rule`` builds ignores ``rate`` (the floor rule's scale): at c=128 on the SPEC cost the
    lengths are the same whatever the rate; a ratio doubled by hand (what rate 2.0 used to do) gives others
    (the control)."""
    ratio = torch.full((128,), 0.25)
    for rate in (1.0, 2.0, 3.0):
        k = make_rule(LengthSettings("cost", rate, 1), SPEC_COST).lengths(RoundInputs(128, 16, ratio))
        assert torch.equal(k, cost_aware_verify_length(ratio, 16, SPEC_COST)), rate
    assert not torch.equal(cost_aware_verify_length(ratio * 2, 16, SPEC_COST), cost_aware_verify_length(ratio, 16, SPEC_COST))


@pytest.mark.parametrize("ms, want", [
    ([[1.0, 2.0], [3.0, 4.0]], [[1.0, 2.0], [3.0, 4.0]]),  # already monotone: unchanged
    ([[1.0, 3.4], [2.0, 2.1]], [[1.0, 2.1], [2.0, 2.1]]),  # a spike below a larger shape's time: lowered to it
    ([[1.0, 2.0, 9.0, 4.0]], [[1.0, 2.0, 4.0, 4.0]]),  # along tokens per row
    ([[5.0], [2.0], [3.0]], [[2.0], [2.0], [3.0]]),  # along rows, down to the first entry (the unit)
])
def test_monotone_table_lowers_every_entry_to_the_larger_shapes_least(ms, want):
    """A measured verify table is made monotone from the larger shapes down: a timing spike cannot make a larger
    verify look cheaper to the cost rule."""
    from adaflash_hf.engine.warmup import monotone_table

    assert monotone_table(ms) == want
