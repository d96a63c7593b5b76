"""`adaflash bench` for issue 36 items 2 and 4 on tiny random models (CPU): prompt lookup's grid chosen on one
run and reported on another (computed and timed, cross-checked), multi-turn sets with the target's answers,
the Spec-Bench suite in the loader, the per-set summary."""

import json

import pytest
import torch
from conftest import build_drafter, build_tiny_target
from test_bench import MAX_NEW, make_tokenizer, write_prompts

from adaflash_hf.bench import BenchConfig, run_bench
from adaflash_hf.bench.multiturn import base_label, turn_label, turn_prompts
from adaflash_hf.bench.prompt_lookup_grid import GRID, best_setting, read_choice
from adaflash_hf.bench.prompt_lookup_tau import PromptLookupSettings
from adaflash_hf.bench.report import markdown
from adaflash_hf.bench.prompts import load_prompt_set
from adaflash_hf.bench.summary import pool
from adaflash_hf.speculation.rounds import tau_from_totals
from adaflash_hf.training.data import SPEC_BENCH_CATEGORIES, expand_datasets


@pytest.fixture(scope="module")
def models():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    target = build_tiny_target("qwen3", seed=1)
    yield dict(target=target, drafter=build_drafter(target, num_layers=1, block_size=4, seed=2), tokenizer=make_tokenizer())
    torch.set_num_threads(before)


def _run(models, out, datasets, **kw):
    base = dict(datasets=datasets, num_prompts=6, max_new_tokens=MAX_NEW, concurrency=[1], warmup=0, device="cpu",
                out=str(out), verbose=False, plots=False, command="pytest", **models)  # fmt: skip
    base.update(kw)
    return run_bench(BenchConfig(**base))


GRID_NEW = 48  # long enough for the random target's greedy loops to make the grid's settings differ


def _repetitive(path, n=4):
    """Prompts that repeat themselves, so prompt lookup's candidates (and the grid's settings) matter."""
    with open(path, "w") as f:
        for i in range(n):
            words = " ".join(f"w{5 + (i + j) % (4 + i)}" for j in range(24))
            f.write(json.dumps({"prompt": words}) + "\n")
    return f"jsonl:{path}"


def _as_validation(result, path, force=None):
    """The run's bench.json as a validation run's; ``force``: overwrite the grid cells' chosen setting."""
    d = result.to_dict()
    d["config"]["split"] = "validation"
    for c in d["results"]:
        if c["method"] == "prompt_lookup_grid" and force is not None:
            c["settings"].update(num_tokens=force.num_tokens, max_ngram=force.max_ngram)
    path.write_text(json.dumps(d))
    return str(path)


def test_grid_picks_the_best_then_reports_the_chosen_setting(models, tmp_path):
    ds = _repetitive(tmp_path / "rep.jsonl")
    val = _run(models, tmp_path / "val", [ds], methods=["plain", "prompt_lookup_grid"], max_new_tokens=GRID_NEW)
    cell = val.cell("prompt_lookup_grid", "rep", 1)
    taus = cell.settings["grid_tau"]
    assert set(taus) == {f"{s.num_tokens}x{s.max_ngram}" for s in GRID}
    assert len(set(taus.values())) > 1  # the settings differ here, so the choice is a real one
    assert cell.tau == max(taus.values()) and cell.settings["chosen_on"] == "these prompts"
    best = PromptLookupSettings(cell.settings["num_tokens"], cell.settings["max_ngram"])
    assert read_choice(_as_validation(val, tmp_path / "v.json"))["rep"] == best

    # A choice read from a validation file is reported as is, even where it is not this run's best; the timed
    # run at that non-default setting has the computed rounds (cross-check) and plain's outputs.
    worst = min(GRID, key=lambda s: (taus[f"{s.num_tokens}x{s.max_ngram}"], -s.num_tokens))
    choice = _as_validation(val, tmp_path / "forced.json", force=worst)
    res = _run(models, tmp_path / "test", [ds], methods=["plain", "prompt_lookup_grid", "prompt_lookup_tuned"],
               prompt_lookup_choice=choice, max_new_tokens=GRID_NEW)  # fmt: skip
    grid, tuned = res.cell("prompt_lookup_grid", "rep", 1), res.cell("prompt_lookup_tuned", "rep", 1)
    assert res.failures == [] and tuned.identical is True
    assert grid.tau == pytest.approx(taus[f"{worst.num_tokens}x{worst.max_ngram}"])
    assert grid.tau < cell.tau and grid.settings["chosen_on"].startswith("validation")
    assert (tuned.rounds, tuned.tau, tuned.tau_histogram) == (grid.rounds, grid.tau, grid.tau_histogram)
    assert any("cross-checked" in n for n in grid.notes)
    assert tuned.settings == {"num_tokens": worst.num_tokens, "max_ngram": worst.max_ngram}


def test_best_setting_ties_go_to_the_first_point():
    a, b = PromptLookupSettings(10, 2), PromptLookupSettings(20, 4)
    assert best_setting({a: 2.0, b: 2.0}) == a
    assert best_setting({a: 2.0, b: 2.1}) == b


def test_choice_refused_before_work(models, tmp_path):
    ds = write_prompts(tmp_path / "a.jsonl", 2, 0, False)
    with pytest.raises(ValueError, match="prompt_lookup_tuned runs the setting chosen on validation"):
        _run(models, tmp_path, [ds], methods=["plain", "prompt_lookup_tuned"])
    with pytest.raises(ValueError, match="test split .* --prompt-lookup-choice"):
        _run(models, tmp_path, ["gsm8k"], methods=["plain", "prompt_lookup_grid"], split="test")
    not_val = tmp_path / "all.json"
    not_val.write_text(json.dumps({"config": {"split": "all"}, "results": []}))
    with pytest.raises(ValueError, match="validation split"):
        read_choice(not_val)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"config": {"split": "validation"}, "results": [
        {"method": "prompt_lookup_grid", "dataset": "zzz", "concurrency": 1, "settings": {"num_tokens": 15, "max_ngram": 3}}]}))
    with pytest.raises(ValueError, match="no chosen setting for a"):
        _run(models, tmp_path, [ds], methods=["plain", "prompt_lookup_grid"], prompt_lookup_choice=str(other))


def test_multi_turn_set_benchmarks_each_turn_on_the_target_answers(models, tmp_path):
    path = tmp_path / "conv.jsonl"
    recs = [{"prompt": "w5 w6 w7", "turns": ["w5 w6 w7", "w8 w9"]}, {"prompt": "w10 w11", "turns": ["w10 w11"]},
            {"prompt": "w12 w13 w14 w15", "turns": ["w12 w13 w14 w15", "w16", "w17 w18"]}]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    res = _run(models, tmp_path / "out", [f"jsonl:{path}"], methods=["plain", "fixed", "prompt_lookup_exact"], concurrency=[1, 2])
    assert res.failures == []
    counts = {(c.dataset, c.concurrency): c.num_prompts for c in res.cells if c.method == "fixed"}
    assert counts == {("conv", 1): 3, ("conv", 2): 3, ("conv:turn2", 1): 2, ("conv:turn2", 2): 2, ("conv:turn3", 1): 1,
                      ("conv:turn3", 2): 1}  # fmt: skip
    assert all(c.identical for c in res.cells if c.method == "fixed")
    md = markdown(res)
    assert "| conv | 3 | 1 | fixed |" in md  # the summary pools the three turns
    fixed = [c for c in res.cells if c.method == "fixed" and c.concurrency == 1]
    pooled = pool(fixed)
    assert pooled.tau == pytest.approx(tau_from_totals(sum(c.new_tokens for c in fixed), 6, sum(c.rounds for c in fixed)))


def test_turn_prompts_carry_the_answers():
    conv = {0: [{"role": "user", "content": "a"}], 1: [{"role": "user", "content": "b"}]}
    out = turn_prompts(conv, [["a2"], []], {0: "ans", 1: "other"}, 2)
    assert out == {0: [{"role": "user", "content": "a"}, {"role": "assistant", "content": "ans"}, {"role": "user", "content": "a2"}]}
    assert base_label(turn_label("mt_bench", 2)) == ("mt_bench", 2) and base_label("spec_bench:qa") == ("spec_bench:qa", 1)
    with pytest.raises(ValueError, match="chat prompts"):
        turn_prompts({0: "raw text"}, [["x"]], {0: "y"}, 2)


def test_spec_bench_suite_in_the_loader():
    names = expand_datasets(["spec_bench_all", "mt_bench"])
    assert names == ["mt_bench", *(f"spec_bench:{c}" for c in SPEC_BENCH_CATEGORIES)]  # mt_bench once
    mt = load_prompt_set("mt_bench", 10, None)  # the fixture data (tests/conftest.py)
    assert mt.multi_turn and all(len(t) == 1 for t in mt.later_turns)
    for c in SPEC_BENCH_CATEGORIES:
        s = load_prompt_set(f"spec_bench:{c}", 10, None)
        assert s.prompts and not s.multi_turn
    with pytest.raises(ValueError, match="unknown spec_bench category"):
        load_prompt_set("spec_bench:nope", 1, None)
