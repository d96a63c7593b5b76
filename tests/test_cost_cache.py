"""The round cost measured where it runs: profiled once per models, device, dtype and engine shape, cached in the
user's cache directory, read back by the next engine, re-profiled on request, printed by ``adaflash info``; and the
planner on a profiled table decoding plainly where the drafter cannot pay."""

import dataclasses
import json

import pytest
import torch

import adaflash_hf.engine.warmup as warmup_mod
from adaflash_hf.engine import Engine
from adaflash_hf.engine.cost_cache import cached_costs, cached_round_cost, round_cost_key
from adaflash_hf.speculation.length import LengthPlanner, RoundCost, RoundInputs, RowState

from generation_helpers import engine_prompts, make_drafter, make_target, plain_greedy_ids

SHAPE = dict(length_policy="cost", max_slots=2, max_len=96, token_budget=64, cuda_graphs=True)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAFLASH_HF_CACHE", str(tmp_path))
    return tmp_path / "round_cost"


@pytest.fixture
def measured(monkeypatch):
    """How many times the round cost was measured (the real measurement runs)."""
    calls = []
    real = warmup_mod.measure_round_cost
    monkeypatch.setattr(warmup_mod, "measure_round_cost", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


def test_measured_once_then_read_back(cache, measured):
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=8)
    first = Engine(target, drafter, round_cost="measured", **SHAPE)
    assert len(measured) == 1 and first.round_cost.unit_ms > 0 and len(list(cache.glob("*.json"))) == 1
    again = Engine(target, drafter, round_cost="measured", **SHAPE)
    assert len(measured) == 1 and again.round_cost == first.round_cost  # read back, not measured
    prompts = engine_prompts([5, 7], seed=2)
    assert [o.token_ids for o in again.generate(prompts, max_new_tokens=12)] == \
        [plain_greedy_ids(target, p, 12) for p in prompts]
    assert cached_round_cost(again, refresh=True) is not None and len(measured) == 2  # the flag re-profiles
    other = make_drafter(target, block_size=4)  # another drafter: another key, measured
    assert round_cost_key(Engine(target, other, **SHAPE)) != round_cost_key(again)
    Engine(target, other, round_cost="measured", **SHAPE)
    assert len(measured) == 3 and len(cached_costs()) == 2


def test_a_damaged_file_is_measured_again_and_bad_engines_refused(cache, measured):
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=8)
    Engine(target, drafter, round_cost="measured", **SHAPE)
    (path,) = cache.glob("*.json")
    path.write_text(path.read_text()[:40])
    with pytest.warns(RuntimeWarning, match="ignoring the cache file"):
        Engine(target, drafter, round_cost="measured", **SHAPE)
    assert len(measured) == 2 and json.loads(path.read_text())["value"]["rows"] == [1, 2]
    with pytest.raises(ValueError, match="graph path"):
        Engine(target, drafter, round_cost="measured", **{**SHAPE, "cuda_graphs": False})
    with pytest.raises(ValueError, match="round_cost must be"):
        Engine(target, drafter, round_cost="guessed", **SHAPE)


def test_info_prints_the_cached_tables(cache, capsys):
    from adaflash_hf.cli import main

    assert main(["info", "--round-costs"]) == 0
    assert "no round cost" in capsys.readouterr().out
    target = make_target("qwen3")
    Engine(target, make_drafter(target, block_size=8), round_cost="measured", **SHAPE)
    assert main(["info", "--round-costs"]) == 0
    out = capsys.readouterr().out
    assert "draft fraction" in out and "rows    1:" in out and "on cpu" in out and "torch" in out


def test_the_planner_decodes_plainly_where_the_profiled_drafter_cannot_pay(cache):
    """A drafter far heavier than its target, profiled on this machine: a low acceptance decodes plainly (the drafter
    cannot pay) and the rounds after it are plain plans; the control, the same profiled verify times with the drafter
    and its rounds' overhead made free, drafts at that acceptance."""
    target = make_target("qwen3", layers=1)
    drafter = make_drafter(target, block_size=8, num_layers=8)
    eng = Engine(target, drafter, round_cost="measured", **SHAPE)
    cost = eng.round_cost
    assert cost.draft_fraction > 2, cost  # the profile saw the heavy drafter
    free = dataclasses.replace(cost, draft_fraction=0.0, spec_overhead=cost.plain_overhead, read_overhead=0.0)
    for table in (cost, free):
        planner = LengthPlanner(eng.planner.settings, 8, table)
        rule = int(planner.rule.lengths(RoundInputs(1, 8, torch.tensor([0.15]), max_len=torch.tensor([40])))[0])
        rows = [RowState(remaining=40)]
        planner.lengths(rows, torch.tensor([0.15]))  # a drafting round's ratio: the rounds after it, plain or not
        plain_next = planner.plan(rows).plain
        assert (rule == 1 and plain_next) is (table is cost), (rule, plain_next, table)


def test_the_default_measures_under_cost_on_cuda_only(monkeypatch, measured, cache):
    """``round_cost=None`` measures where the cost rule runs on CUDA's graph path (a stand-in engine here: no GPU),
    keeps SPEC's table with a warning where that cannot be measured, and measures nothing on the CPU (control)."""
    from types import SimpleNamespace

    import adaflash_hf.engine.cost_cache as cc
    from adaflash_hf.speculation.length import LengthPolicy

    asked = []
    monkeypatch.setattr(cc, "cached_round_cost", lambda engine: asked.append(engine) or RoundCost.flat())
    gpu = SimpleNamespace(drafter=object(), graphs=object(), policy=LengthPolicy.COST, device=torch.device("cuda"),
                          round_cost=None)
    cc.measure_if_asked(gpu, None)
    assert asked == [gpu] and gpu.round_cost == RoundCost.flat()
    for other in (dict(policy=LengthPolicy.FIXED), dict(graphs=None), dict(device=torch.device("cpu"))):
        cc.measure_if_asked(SimpleNamespace(**{**vars(gpu), **other}), None)
    assert len(asked) == 1

    def too_short(engine):
        raise ValueError("max_len leaves no room")

    monkeypatch.setattr(cc, "cached_round_cost", too_short)
    gpu.round_cost = None
    with pytest.warns(RuntimeWarning, match="not measured"):
        cc.measure_if_asked(gpu, None)
    assert gpu.round_cost is None
    with pytest.raises(ValueError, match="no room"):
        cc.measure_if_asked(gpu, "measured")  # asked for: the error stands

    def not_as_planned(engine):
        raise RuntimeError("measure_round_cost: the timed plain rounds were not plain")

    monkeypatch.setattr(cc, "cached_round_cost", not_as_planned)  # seen on an H200 with a tiny random pair
    with pytest.warns(RuntimeWarning, match="were not plain"):
        cc.measure_if_asked(gpu, None)
    assert gpu.round_cost is None
    with pytest.raises(RuntimeError, match="not plain"):
        cc.measure_if_asked(gpu, "measured")
    target = make_target("qwen3")
    eng = Engine(target, make_drafter(target, block_size=8), **SHAPE)  # the CPU: SPEC's table, nothing measured
    assert eng.round_cost == RoundCost() and measured == []
