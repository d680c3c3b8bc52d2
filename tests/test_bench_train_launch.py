"""scripts/bench_train.py's runs of several GPUs (`launch_each`): their rows come back, also when the
invocation is stopped (Ctrl-C, or `timeout`'s signal) during a run."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import REPO

# A stand-in for `torchrun ... bench_train.py` (its second argument: finish, fail or wait): hands back one row
# and exits 0, exits 3 handing back nothing, or waits and, told to stop (SIGINT), hands back two rows, the
# second measured before the signal, as rank 0 of bench_train does.
RUN = """
import json, os, signal, sys, time
path = os.environ["DLRM_BENCH_ROWS"]
rows = [{"run": 0}]
def stop(*_):
    rows.append({"run": 1})
    open(path, "w").write(json.dumps(rows))
    sys.exit(130)
signal.signal(signal.SIGINT, stop)
open(sys.argv[1], "w").write("started")
if sys.argv[2] == "finish":
    open(path, "w").write(json.dumps(rows))
    sys.exit(0)
if sys.argv[2] == "fail":
    sys.exit(3)
time.sleep(60)
"""

# The invocation: launch_each with the stand-in as its launcher, its rows printed however it ends.
INVOCATION = """
import json, signal, subprocess, sys
# Ctrl-C raises KeyboardInterrupt, as in a shell's foreground: a process started in the background
# (nohup ... &) inherits SIGINT ignored, and so would this one under such a test run.
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {scripts!r})
import bench_train
bench_train.launcher = lambda n: [sys.executable, {run!r}, {started!r}]
bench_train.__file__ = {mode!r}  # the stand-in's second argument
rows = []
try:
    bench_train.launch_each([2], [], rows=rows)
    print("ended", json.dumps(rows))
except KeyboardInterrupt:
    print("interrupted", json.dumps(rows))
except subprocess.CalledProcessError as e:
    print("failed", e.returncode, json.dumps(rows))
"""


def _invoke(tmp_path, mode: str) -> subprocess.Popen:
    run, started = tmp_path / "run.py", tmp_path / "started"
    run.write_text(textwrap.dedent(RUN))
    code = INVOCATION.format(scripts=str(REPO / "scripts"), run=str(run), started=str(started), mode=mode)
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip


def _wait_for(path, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"{path} never appeared")
        time.sleep(0.05)


def test_a_finished_run_hands_back_its_rows(tmp_path):
    out, _ = _invoke(tmp_path, "finish").communicate(timeout=120)
    assert out.strip().split(maxsplit=1) == ["ended", json.dumps([{"run": 0}])]


def test_a_stopped_invocation_keeps_the_rows_measured_before_the_signal(tmp_path):
    """Only the invocation gets the signal (as from `timeout -s INT`): it passes it on to the run, and the
    rows that run hands back on stopping are kept."""
    invocation = _invoke(tmp_path, "wait")
    _wait_for(tmp_path / "started")
    invocation.send_signal(signal.SIGINT)
    out, _ = invocation.communicate(timeout=120)
    assert out.strip().split(maxsplit=1) == ["interrupted", json.dumps([{"run": 0}, {"run": 1}])]


def test_a_failed_run_raises_with_the_rows_of_the_runs_before_it(tmp_path):
    out, _ = _invoke(tmp_path, "fail").communicate(timeout=120)
    assert out.strip().split(maxsplit=2) == ["failed", "3", "[]"]
