"""The scripts of the online runs on the GPU (`examples/reference_pair/`): the data pack keeps the
recipe's chat prompts, the summary averages over seeds and pairs OPD with OSD by seed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REF = Path(__file__).resolve().parents[1] / "examples" / "reference_pair"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, REF / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _conversation(users: int) -> dict:
    turns = []
    for i in range(users):
        turns += [{"from": "human", "value": f" question {i} " + "word " * (40 * i)},
                  {"from": "gpt", "value": f"answer {i} " + "long " * 300}]
    return {"id": "x", "conversations": turns + [{"from": "human", "value": "unanswered"}]}


@pytest.mark.parametrize("users, turns", [(1, 16), (3, 2), (5, 16)])
def test_online_pack_keeps_every_chat_prompt_of_the_recipe(users, turns):
    from transformers import AutoTokenizer

    from adaflash_hf.reference import REFERENCE_DIR
    from adaflash_hf.training.data import _sharegpt_messages
    from adaflash_hf.training.train_drafter import _chat_turn_prompts

    devdata = _module("make_devdata")
    tok = AutoTokenizer.from_pretrained(f"{REFERENCE_DIR}/target")
    record = _conversation(users)
    packed = devdata._chat_for_prompts(record, turns)
    full, kept = _sharegpt_messages(record["conversations"]), _sharegpt_messages(packed["conversations"])
    assert _chat_turn_prompts(tok, kept, turns, 384) == _chat_turn_prompts(tok, full, turns, 384)
    assert len(json.dumps(packed)) < len(json.dumps(record))  # the last answer, cut
    assert sum(m["role"] == "user" for m in kept) == min(users, turns)


def _run(seed: int, clip: str, method: str, taus: list, maes: list, identical: bool = True) -> dict:
    curve = [{"update": u, "tau": t, "identical": identical, "head_mae": m, "mean_verify_length": 5.0}
             for u, (t, m) in enumerate(zip(taus, maes))]
    updates = [{"update": u, "head_mae_before": maes[u - 1] + 0.1, "head_mae_after": maes[u] + 0.1} for u in range(1, len(taus))]
    return {"dataset": "gsm8k", "policy": "adaptive", "seed": seed, "clip_mode": clip,
            "methods": {method: {"curve": curve, "updates": updates, "seconds": 50.0, "complete": True}}}


def test_summary_averages_over_seeds_and_pairs_opd_with_osd(tmp_path):
    summarise = _module("summarise_online")
    runs = [_run(0, "token", "opd", [1.5, 2.0], [0.3, 0.2]), _run(1, "token", "opd", [1.5, 2.2], [0.3, 0.1]),
            _run(0, "token", "osd", [1.5, 1.9], [0.3, 0.3]), _run(1, "token", "osd", [1.5, 2.0], [0.3, 0.3])]
    for i, r in enumerate(runs):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "online.json").write_text(json.dumps(r))
    assert summarise.main([str(tmp_path)]) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    opd = next(g for g in s["groups"] if g["variant"] == "opd-token")
    assert opd["seeds"] == [0, 1] and opd["identical"] and opd["tau"][1]["mean"] == pytest.approx(2.1)
    assert opd["tau"][1]["sd"] == pytest.approx(0.1414, abs=1e-4) and opd["gain"]["mean"] == pytest.approx(0.6)
    assert opd["head_mae_heldout"][1]["mean"] == pytest.approx(0.15) and opd["head_mae_served_after"][1]["mean"] == pytest.approx(0.25)
    (pair,) = s["opd_minus_osd"]
    assert pair["diff"][0]["mean"] == 0 and pair["diff"][1]["mean"] == pytest.approx(0.15)
    assert "opd-token" in (tmp_path / "summary.md").read_text()
    (tmp_path / "4").mkdir()
    (tmp_path / "4" / "online.json").write_text(json.dumps(_run(2, "entry", "opd", [1.5, 1.6], [0.3, 0.3], identical=False)))
    assert summarise.main([str(tmp_path)]) == 2  # an output that differed from plain greedy fails the summary
    assert "**NO**" in (tmp_path / "summary.md").read_text()


def _run_lines(path: Path) -> list[tuple[str, list[str]]]:
    import shlex

    lines = [line for line in path.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(parts[0], parts[1:]) for parts in map(shlex.split, lines)]


@pytest.mark.parametrize("run_file", sorted((REF / "online_runs").glob("*.txt")), ids=lambda p: p.name)
def test_every_run_of_the_run_files_parses_before_it_reaches_a_gpu(run_file):
    """Each line of a gpu_protocol.sh run file is a unique name and arguments the protocol accepts, its adapter
    settings valid for each of its methods; a misspelt setting (the control) is refused."""
    from online_protocol import parse_args

    runs = _run_lines(run_file)
    assert runs and len({name for name, _ in runs}) == len(runs)
    base = ["--target", "T", "--drafter", "D", "--out", "o"]
    for name, args in runs:
        a, config, _ = parse_args(base + args)
        for method in a.methods.split(","):
            if method != "off":
                config.replace(method=method)
    name, args = runs[0]
    with pytest.raises(TypeError, match="lrr"):
        parse_args(base + args + ["--set", "lrr=1e-4"])
    with pytest.raises(SystemExit):
        parse_args(base + args + ["--methods", "opd,osdd"])
