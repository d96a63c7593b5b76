"""examples/engine_probes/round_kernels.py ties each device activity of a traced round to the package frames that
launched it, by correlation id, and charges the device's idle time to the launch that ended it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "round_kernels", Path(__file__).resolve().parents[1] / "examples" / "engine_probes" / "round_kernels.py")
rk = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(rk)

PKG = "/x/adaflash_hf/engine/"


def py(name, ts, dur):
    return {"cat": "python_function", "name": PKG + name, "ts": ts, "dur": dur}


def launch(name, ts, corr):
    return {"cat": "cuda_runtime", "name": name, "ts": ts, "dur": 1, "args": {"correlation": corr}}


def kernel(name, ts, dur, corr):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def two_rounds():
    """Each round (100 us): a graph replay under target.py's RoundForward.__call__ > graphs.py's replay (2 kernels, 30 us),
    then an eager kernel under engine.py's _accept (5 us) that the device waits 20 us for."""
    ev = []
    for r, t0 in enumerate((0, 1000)):
        ev += [{"cat": "user_annotation", "name": "round", "ts": t0, "dur": 100},
               py("engine.py(10): _step", t0 + 1, 98),
               py("target.py(20): __call__", t0 + 2, 20), py("graphs.py(30): replay", t0 + 3, 10),
               launch("cudaGraphLaunch", t0 + 5, 10 * r + 1),
               py("engine.py(40): _accept", t0 + 50, 10), launch("cudaLaunchKernel", t0 + 55, 10 * r + 2),
               kernel("gemm", t0 + 10, 20, 10 * r + 1), kernel("norm", t0 + 30, 10, 10 * r + 1),
               kernel("argmax", t0 + 60, 5, 10 * r + 2)]
    ev.append(kernel("stray", 5000, 7, 99))  # launched outside any round: not counted
    return ev


def test_sites_device_time_and_waits():
    a = rk.analyse(two_rounds())
    sites = {s["site"]: s for s in a["sites"]}
    graph, eager = sites["target.py:__call__ > graphs.py:replay"], sites["engine.py:_step > engine.py:_accept"]
    assert (graph["launches"], graph["kernels"], graph["device_ms"]) == (1, 2, pytest.approx(0.030))
    assert (eager["launches"], eager["kernels"], eager["device_ms"]) == (1, 1, pytest.approx(0.005))
    assert eager["waited_for_ms"] == pytest.approx(0.020) and graph["waited_for_ms"] == 0
    assert a["rounds"] == 2 and a["device_busy_ms"] == pytest.approx(0.035)
    assert a["device_idle_between_ms"] == pytest.approx(0.020)
    assert "stray" not in {k["name"] for k in a["kernels"]}
    calls = [(r["call"], r["kernels"]) for r in a["median_round"]["launches"]]
    assert calls == [("cudaGraphLaunch", 2), ("cudaLaunchKernel", 1)]


def test_a_trace_without_round_marks_is_refused():
    with pytest.raises(SystemExit, match="round"):
        rk.analyse([e for e in two_rounds() if e.get("name") != "round"])
