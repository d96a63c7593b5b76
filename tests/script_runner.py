"""Run several scripts (or `-m` modules) as `python SCRIPT ARGS...` would, paying one interpreter start.

A fresh interpreter that imports torch, transformers and adaflash_hf costs several seconds on the CI's
two cores, more than many of the smoke runs themselves. `run_scripts` starts ONE interpreter, imports
the `preload` modules once, then forks a child per job: each child has its own process (no state
leaks from one job to the next), working directory, `sys.argv`, `sys.path[0]` (the script's folder,
or the working directory for a module), stdout and stderr files, and exits like `python` does
(normal interpreter shutdown: atexit handlers, non-daemon threads joined; an uncaught exception
prints its traceback and exits 1). Each job still runs its own imports in fresh globals. Jobs of one
call should import the library from the same place (the preload comes from the first job's path).
`parallel` jobs run at a time (the CI has two cores, and the pytest process only waits meanwhile).

    results = run_scripts([Job("quick", ["examples/quickstart.py", "--smoke"], cwd=tmp)], env=env)
    assert results["quick"].returncode == 0 and "identical: True" in results["quick"].stdout
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

PRELOAD = ("torch", "transformers", "adaflash_hf")
BACKGROUND: dict = {}  # runs started when collection finished (conftest.py), by name; their fixtures wait on them

# The interpreter's side: argv[1] is a JSON spec {"preload": [...], "jobs": [...], "results": path}.
_RUNNER = r'''
import json, os, runpy, signal, sys, time, traceback


def path0(job):  # what `python SCRIPT` / `python -m MODULE` puts first on sys.path
    return job["cwd"] if job["module"] else os.path.dirname(os.path.abspath(job["argv"][0]))


spec = json.load(open(sys.argv[1]))
while spec["after_pid"] and os.path.exists(f"/proc/{spec['after_pid']}/stat"):  # the run before this one
    if open(f"/proc/{spec['after_pid']}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
        break  # exited, not yet reaped by pytest
    time.sleep(0.2)
sys.path[0] = path0(spec["jobs"][0])  # preload from where the first job imports (not this runner's cwd)
for name in spec["preload"]:
    __import__(name)
results = {}


def run_job(job):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the runner's handler is not the job's
    os.chdir(job["cwd"])
    for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = list(job["argv"])
    sys.path[0] = path0(job)
    try:
        if job["module"]:
            runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(job["argv"][0], run_name="__main__")
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        raise SystemExit(1)


def start(job):
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the job: leaves through SystemExit, so the interpreter shuts down as `python` would
        run_job(job)
        raise SystemExit(0)
    return pid, time.monotonic()


def finish(job, status, started, timed_out=False):
    results[job["name"]] = {"returncode": os.waitstatus_to_exitcode(status), "timed_out": timed_out,
                            "seconds": time.monotonic() - started}
    json.dump(results, open(spec["results"], "w"))


waiting, running = list(spec["jobs"]), {}  # running: pid -> (job, start time)
parent = os.getppid()


def stop_all(*_):  # asked to stop, or orphaned (the test session ended): end the running jobs too
    for pid in running:
        os.kill(pid, signal.SIGKILL)
    os._exit(1)


signal.signal(signal.SIGTERM, stop_all)
while waiting or running:
    if os.getppid() != parent:
        stop_all()
    while waiting and len(running) < spec["parallel"]:
        job = waiting.pop(0)
        pid, started = start(job)
        running[pid] = (job, started)
    for pid, (job, started) in list(running.items()):
        done, status = os.waitpid(pid, os.WNOHANG)
        if not done and time.monotonic() - started > job["timeout"]:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            finish(job, status, started, timed_out=True)
            del running[pid]
        elif done:
            finish(job, status, started)
            del running[pid]
    time.sleep(0.05)
'''


@dataclass
class Job:
    """One `python ARGV...` (or `python -m MODULE ARGV[1:]...` when `module` is set) run in `cwd`."""

    name: str
    argv: list[str]
    cwd: Path
    module: str | None = None
    timeout: float = 120.0


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False
    seconds: float = field(default=0.0)
    argv: list[str] = field(default_factory=list)  # the job's, as run (str)
    cwd: str = ""


class Running:
    """A started runner: `wait()` returns the results by job name; `stop()` ends it and its jobs."""

    def __init__(self, proc: subprocess.Popen, spec: dict, timeout: float, context: dict | None = None):
        self.proc, self.spec, self.timeout = proc, spec, timeout
        self.context = context or {}  # what the caller needs beside the results (e.g. the folder it ran in)

    def wait(self) -> dict[str, Result]:
        try:
            out, err = self.proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        assert self.proc.returncode == 0, f"the script runner failed:\n{out[-3000:]}\n{err[-3000:]}"
        done = json.loads(Path(self.spec["results"]).read_text())
        return {
            j["name"]: Result(stdout=Path(j["stdout"]).read_text(errors="replace"),
                              stderr=Path(j["stderr"]).read_text(errors="replace"), argv=j["argv"], cwd=j["cwd"],
                              **done[j["name"]])
            for j in self.spec["jobs"]
        }

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # the runner kills its running jobs (SIGTERM handler) and exits
            self.proc.wait(30)


def start_scripts(jobs: list[Job], env: dict, preload=PRELOAD, workdir: Path | None = None, parallel: int = 1,
                  after: Running | None = None, context: dict | None = None) -> Running:
    """Start `jobs` in forks of one interpreter started with `env`, `parallel` at a time, once the run `after`
    (if any) has ended; returns at once."""
    workdir = Path(workdir or jobs[0].cwd)
    workdir.mkdir(parents=True, exist_ok=True)
    spec = {"preload": list(preload), "parallel": parallel, "after_pid": after.proc.pid if after else None, "results": str(workdir / "runner_results.json"), "jobs": []}
    for job in jobs:
        Path(job.cwd).mkdir(parents=True, exist_ok=True)
        spec["jobs"].append({"name": job.name, "argv": [str(a) for a in job.argv], "cwd": str(job.cwd),
                             "module": job.module, "timeout": job.timeout,
                             "stdout": str(workdir / f"{job.name}.stdout"), "stderr": str(workdir / f"{job.name}.stderr")})
    (workdir / "runner_spec.json").write_text(json.dumps(spec))
    proc = subprocess.Popen([sys.executable, "-c", _RUNNER, str(workdir / "runner_spec.json")], env=env, cwd=jobs[0].cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return Running(proc, spec, timeout=60 + sum(job.timeout for job in jobs) + (after.timeout if after else 0), context=context)


def run_scripts(jobs: list[Job], env: dict, preload=PRELOAD, workdir: Path | None = None, parallel: int = 1) -> dict[str, Result]:
    """`start_scripts(...).wait()`: run `jobs` and return their results by job name."""
    return start_scripts(jobs, env, preload, workdir, parallel).wait()
