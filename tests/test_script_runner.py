"""tests/script_runner.py reports what `python SCRIPT` would: exit status, output, tracebacks, timeouts."""

from __future__ import annotations

import os
import sys

from script_runner import Job, run_scripts

SCRIPTS = {  # name -> (source, returncode, words in stdout, words in stderr)
    "ok": ("import os, sys\nprint('argv', sys.argv[1:], 'cwd', os.path.basename(os.getcwd()), 'path0', os.path.basename(sys.path[0]))",
           0, ["argv ['--smoke'] cwd ok path0 scripts"], []),
    "raises": ("raise RuntimeError('boom')", 1, [], ["Traceback", "RuntimeError: boom"]),
    "exits": ("import sys\nprint('before')\nsys.exit(3)", 3, ["before"], []),
    "thread": ("import threading, time\nthreading.Thread(target=lambda: (time.sleep(0.2), print('joined', flush=True))).start()",
               0, ["joined"], []),  # a non-daemon thread is joined at shutdown, as `python` does
    "atexit": ("import atexit\natexit.register(print, 'at exit')", 0, ["at exit"], []),
    "hangs": ("import time\ntime.sleep(60)", -9, [], []),
}  # fmt: skip


def test_each_job_reports_like_its_own_python(tmp_path):
    folder = tmp_path / "scripts"
    folder.mkdir()
    jobs = []
    for name, (source, *_) in SCRIPTS.items():
        (folder / f"{name}.py").write_text(source + "\n")
        jobs.append(Job(name, [folder / f"{name}.py", "--smoke"], cwd=tmp_path / name, timeout=1.5 if name == "hangs" else 30))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    results = run_scripts(jobs, env, preload=(), workdir=tmp_path / "logs", parallel=2)
    for name, (_, code, out_words, err_words) in SCRIPTS.items():
        r = results[name]
        assert r.returncode == code, (name, r)
        assert r.timed_out is (name == "hangs"), name
        assert all(w in r.stdout for w in out_words), (name, r.stdout)
        assert all(w in r.stderr for w in err_words), (name, r.stderr)
