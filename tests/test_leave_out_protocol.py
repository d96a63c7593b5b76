"""The leave-domain-out protocol's pieces that need no model: which families each drafter trains on, and the recovery
ratio R computed from the runs' measurements (the drivers themselves run at toy scale with --smoke)."""

from __future__ import annotations

import importlib.util
import json
import sys
from argparse import Namespace
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "online_protocol"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"online_protocol_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_each_leave_out_drafter_lacks_exactly_its_family():
    leave_out = _module("leave_out")
    names = leave_out.drafters(["math", "code", "chat"])
    assert list(names) == ["twin", "no-math", "no-code", "no-chat"]
    for family in ("math", "code", "chat"):
        assert set(names["twin"]) - set(names[f"no-{family}"]) == {family}


def _write_run(out: Path, name: str, taus: list[float], served: list[int]) -> None:
    versions = [{"version": v, "tau": t, "served": s, "identical": True, "acceptance_by_position": [0.5, None]}
                for v, (t, s) in enumerate(zip(taus, served))]
    (out / name).mkdir(parents=True)
    (out / name / "protocol.json").write_text(json.dumps({"versions": versions, "requests_served": served[-1]}))


def test_recovery_ratio_from_the_runs(tmp_path):
    recovery = _module("recovery")
    _write_run(tmp_path, "math-twin", [3.0], [0])
    _write_run(tmp_path, "math-opd-s0", [2.0, 1.9, 2.6], [0, 128, 256])  # recovers 0.6 of the gap, dips 5% on the way
    _write_run(tmp_path, "math-opd-s1", [2.0, 2.4], [0, 128])
    _write_run(tmp_path, "math-osd-s0", [2.0, 2.1], [0, 128])
    a = Namespace(out=str(tmp_path), families=["math"], methods=["opd", "osd"], seeds=2)
    result = recovery.summarise(a, {})
    runs = {r["run"]: r for r in result["runs"]}
    assert runs["math-opd-s0"]["R"] == pytest.approx(0.6)
    assert runs["math-opd-s0"]["lowest_vs_start"] == pytest.approx(-0.05)
    assert result["mean_R"]["math/opd"]["mean_R"] == pytest.approx(0.5)
    assert result["mean_R"]["math/osd"] == {"mean_R": pytest.approx(0.1), "sd": None, "seeds": 1}
    assert runs["math-osd-s1"].get("R") is None  # a run that wrote nothing counts for no seed
    assert "| math | opd | 0.500 |" in recovery.markdown(a, {**result, "command": "c", "date": "d", "device": "cpu"})


def test_no_gap_no_ratio(tmp_path):
    """The control: an in-domain twin no better than the start leaves nothing to recover, and R is not made up."""
    recovery = _module("recovery")
    _write_run(tmp_path, "code-twin", [2.0], [0])
    _write_run(tmp_path, "code-opd-s0", [2.0, 2.5], [0, 128])
    result = recovery.summarise(Namespace(out=str(tmp_path), families=["code"], methods=["opd"], seeds=1), {})
    assert result["runs"][0]["R"] is None and result["mean_R"] == {}
