"""The online protocol through the engine (`examples/research/online_protocol.py`) on a tiny pair: every held-out output is
checked against plain greedy decoding, an update happens between the measurements, and each measurement carries
acceptance per draft position and the accepted-draft density."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from generation_helpers import make_drafter, make_target, ragged_prompts

from adaflash_hf.online import OnlineConfig
from online_protocol import ProtocolSettings, run_protocol


def test_protocol_measures_checks_and_updates():
    target = make_target(layers=2, seed=3)
    drafter = make_drafter(target, block_size=4, seed=1)
    _, _, rows = ragged_prompts(11, [5, 7, 6], seed=2)
    prompts = [r.tolist() for r in rows]
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    saved = []
    result = run_protocol(target, drafter, SimpleNamespace(eos_token_id=None), prompts[3:], prompts[:3],
                          methods=("opd", "off"), settings=ProtocolSettings(updates=1, concurrency=4, max_new_tokens=8, max_len=64),
                          config=OnlineConfig(samples_per_update=4, epochs=1, lr=1e-3, guard_samples=0, rollback_rounds=0),
                          checkpoint=lambda r: saved.append({m: len(v["updates"]) for m, v in r["methods"].items()}))
    opd, off = result["methods"]["opd"], result["methods"]["off"]
    assert [c["update"] for c in opd["curve"]] == [0, 1] and [c["update"] for c in off["curve"]] == [0]
    assert len(opd["updates"]) == 1 and opd["complete"] and off["complete"]
    for c in opd["curve"] + off["curve"]:
        assert c["identical"], c  # every held-out output is plain greedy decoding's
        assert len(c["acceptance_by_position"]) == 3 and sum(c["accepted_density"]) == pytest.approx(1.0)
        assert c["tau"] >= 1.0 and c["rounds"] > 0
    assert opd["curve"][0]["tau"] == off["curve"][0]["tau"]  # the same drafter before any update
    # a checkpoint after every measurement, with the update records so far (a run stopped early keeps them)
    assert saved[:2] == [{"opd": 0}, {"opd": 1}] and saved[-1] == {"opd": 1, "off": 0}
    assert all(torch.equal(before[k], v) for k, v in drafter.state_dict().items())  # it trains copies, never the drafter passed in


@pytest.mark.parametrize("margin, outcome", [(100.0, "swapped"), (-100.0, "refused")])
def test_an_update_is_one_training_whatever_the_guard_decides(margin, outcome):
    """Each update of the curve is one training on ``samples_per_update`` requests: a refused one still counts (the
    stream is not served on until something is swapped in) and carries the last measurement, whose weights serve."""
    target = make_target(layers=2, seed=3)
    drafter = make_drafter(target, block_size=4, seed=1)
    _, _, rows = ragged_prompts(15, [5, 7, 6], seed=2)
    prompts = [r.tolist() for r in rows]
    result = run_protocol(target, drafter, SimpleNamespace(eos_token_id=None), prompts[3:], prompts[:3],
                          methods=("opd",),
                          settings=ProtocolSettings(updates=2, concurrency=4, max_new_tokens=8, max_len=64),
                          config=OnlineConfig(samples_per_update=4, epochs=1, lr=1e-3, guard_samples=1,
                                              guard_margin=margin, rollback_rounds=0))
    opd = result["methods"]["opd"]
    curve, trained = opd["curve"], [u for u in opd["updates"] if u["rollback_of"] is None]
    assert [c["update"] for c in curve] == [0, 1, 2] and [c["served"] for c in curve] == [0, 4, 8]
    assert len(trained) == 2  # two trainings for two updates, never more stream served than they need
    if outcome == "refused":  # -100: a candidate must gain 100 tokens per block, so every one is kept aside
        assert [c["outcome"] for c in curve[1:]] == ["refused", "refused"] and not any(u["swapped"] for u in trained)
        assert all(c["measured"] is False and c["tau"] == curve[0]["tau"] for c in curve[1:])
        assert curve[1]["rounds"] == curve[0]["rounds"] and curve[1]["identical"]
    else:  # the control: a candidate may lose 100 tokens per block, so both are swapped in and measured
        assert [c["outcome"] for c in curve[1:]] == ["swapped", "swapped"] and all(u["swapped"] for u in trained)
        assert all("measured" not in c and c["identical"] for c in curve)
