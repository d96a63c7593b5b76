"""The leave-domain-out protocol's pieces: which families each drafter trains on, the recovery ratio R computed from the
runs' measurements, the time a run keeps for its newest version (from its own start measurement), and a run stopped
during its traffic keeping that start measurement (the drivers themselves run at toy scale with --smoke)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
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


def _write_run(out: Path, name: str, taus: list[float], served: list[int], traffic_ended: bool = True) -> None:
    versions = [{"version": v, "tau": t, "served": s, "identical": True, "acceptance_by_position": [0.5, None]}
                for v, (t, s) in enumerate(zip(taus, served))]
    (out / name).mkdir(parents=True)
    newest = len(versions) - 1 if traffic_ended else None  # run.py: null while the traffic runs
    (out / name / "protocol.json").write_text(json.dumps({"versions": versions, "requests_served": served[-1] if
                                                          traffic_ended else None, "newest": newest}))


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


def test_a_run_stopped_during_its_traffic_still_counts_its_start(tmp_path):
    """A run stopped before its traffic ended (newest: null) gives tau at the start and no R; the control, the same
    measurements with the traffic ended, gives R."""
    recovery = _module("recovery")
    _write_run(tmp_path, "math-twin", [3.0], [0])
    _write_run(tmp_path, "math-opd-s0", [2.0], [0], traffic_ended=False)
    _write_run(tmp_path, "math-opd-s1", [2.0, 2.5], [0, 128])
    result = recovery.summarise(Namespace(out=str(tmp_path), families=["math"], methods=["opd"], seeds=2), {})
    stopped, ended = result["runs"]
    assert stopped["tau_start"] == 2.0 and stopped.get("R") is None and stopped.get("tau_online") is None
    assert ended["R"] == pytest.approx(0.5) and result["mean_R"]["math/opd"]["seeds"] == 1
    table = recovery.markdown(Namespace(), {**result, "command": "c", "date": "d", "device": "cpu"})
    assert "| math | opd | 0 | - | - | 2.000 | - |" in table


def test_the_traffic_stops_in_time_for_the_newest_measurement(monkeypatch):
    """The traffic's cut is the run's end less what its own start measurement says the newest version takes (with the
    owed update and the server's exit); a start measurement too slow for any traffic sends none and stops the server."""
    run = _module("run")
    reserve = run.Reserve()
    assert reserve.after_traffic(40.0, wait_s=30.0) - reserve.after_traffic(20.0, wait_s=30.0) == pytest.approx(
        reserve.margin * 20.0)
    asked, stopped = [], []
    monkeypatch.setattr(run, "server_url", lambda a, proc, by: asked.append(by))  # None: not listening by the cut
    monkeypatch.setattr(run, "stop", lambda proc, timeout: stopped.append(proc))
    end = time.monotonic() + 100.0
    *_, why = run.serve(Namespace(wait=30.0), "server", [[1]], end, 5.0)
    assert asked == [pytest.approx(end - reserve.after_traffic(5.0, wait_s=30.0))] and "not listening" in why
    *_, why = run.serve(Namespace(wait=30.0), "server", [[1]], end, 50.0)  # 30 + 10 + 1.5 * 50 + 10 s kept: over 100
    assert len(asked) == 1 and "no time" in why and stopped == ["server", "server"]


def test_a_run_stopped_during_its_traffic_keeps_its_start(tmp_path):
    """run.py measures the start drafter before the traffic: stopped (its process group) while serving, it leaves
    protocol.json with v0 and the traffic marked unfinished."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, str(EXAMPLES / "run.py"), "--smoke", "--requests", "40", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
    guard = threading.Timer(120, os.killpg, (proc.pid, signal.SIGKILL))  # a run that hangs ends the wait too
    guard.start()
    try:
        line = next((line for line in proc.stdout if "requests answered" in line), "")  # the traffic is under way
        assert line, "the run ended without serving"
    finally:
        guard.cancel()
        with contextlib.suppress(ProcessLookupError):  # already ended by the guard
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    result = json.loads((out / "protocol.json").read_text())
    assert [v["version"] for v in result["versions"]] == [0] and result["newest"] is None
    assert result["versions"][0]["tau"] >= 1.0 and result["versions"][0]["identical"]
    assert "Traffic not finished" in (out / "protocol.md").read_text()


@pytest.mark.parametrize("parallel, alive_at_last_start", [(4, 3), (1, 0)])
def test_drafters_train_side_by_side(tmp_path, monkeypatch, parallel, alive_at_last_start):
    """--parallel 4 starts the twin and the three leave-out drafters together (each sees the others running when it
    starts); the control, --parallel 1, starts each after the one before it ended."""
    leave_out = _module("leave_out")
    started: list[subprocess.Popen] = []
    alive: list[int] = []

    def start(cmd, log):
        alive.append(sum(p.poll() is None for p in started))
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.0)"]))
        return started[-1]

    monkeypatch.setattr(leave_out, "_start", start)
    monkeypatch.setattr(leave_out, "_run", lambda cmd, log, timeout: (0, 0.0))  # the regeneration
    a = leave_out.parse_args(["--out", str(tmp_path), "--parallel", str(parallel), "--minutes", "0.01"])
    record = leave_out.build(a)
    assert list(record["drafters"]) == ["twin", "no-math", "no-code", "no-chat"]
    assert all(d["status"] == "ok" and d["side_by_side"] == parallel for d in record["drafters"].values())
    assert alive[-1] == alive_at_last_start and len(started) == 4


def test_a_later_call_adds_seeds_and_keeps_the_measured_twin(tmp_path):
    """--first-seed 1 plans seeds 1.. only and no twin already measured in --out, and its table still has seed 0 from
    the earlier call; the control, a first call, plans the twin and seed 0."""
    recovery = _module("recovery")
    drafters = tmp_path / "drafters"
    for name in ("twin", "no-math"):
        (drafters / name).mkdir(parents=True)
        (drafters / name / "config.json").write_text("{}")
    out = tmp_path / "recovery"
    argv = ["--drafters", str(drafters), "--out", str(out), "--families", "math", "--methods", "opd", "--seeds", "2"]
    first = [name for wave in recovery.plan(recovery.parse_args(argv)) for name, _ in wave]
    assert first == ["math-twin", "math-opd-s0", "math-opd-s1"]
    _write_run(out, "math-twin", [3.0], [0])
    _write_run(out, "math-opd-s0", [2.0, 2.5], [0, 128])
    again = [name for wave in recovery.plan(recovery.parse_args(argv)) for name, _ in wave]
    assert again == first  # a first call again measures its own twin (its drafters may be new)
    later = recovery.parse_args([*argv, "--first-seed", "1"])
    assert [name for wave in recovery.plan(later) for name, _ in wave] == ["math-opd-s1"]
    rows = {r["run"]: r for r in recovery.summarise(later, {"math-opd-s1": 0})["runs"]}
    assert rows["math-opd-s0"]["R"] == pytest.approx(0.5) and rows["math-opd-s0"]["status"] == "an earlier call"
    assert rows["math-opd-s1"]["status"] == 0
    with pytest.raises(SystemExit):
        recovery.parse_args([*argv, "--first-seed", "2"])
