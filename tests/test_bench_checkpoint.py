"""scripts/bench_checkpoint.py end to end on the CPU: its three phases on tiny tables, 2 gloo ranks under
torchrun and one process, as it runs them on GPUs, so that a change to dlrm.train's log lines, exit codes or
checkpoint layout that breaks its measurements fails here first."""

import csv
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, load_script
from tests.test_faults import TINY


def _rows(path) -> dict[tuple[str, int], dict]:
    with path.open(newline="") as f:
        return {(row["what"], int(row["nproc"])): row for row in csv.DictReader(f)}


def test_the_benchmark_measures_refusal_saves_and_resumes_on_two_gloo_ranks(tmp_path):
    results = tmp_path / "checkpoint.csv"
    command = [
        sys.executable, str(REPO / "scripts" / "bench_checkpoint.py"), "--nproc", "2", "--config", str(TINY),
        "--max-rows", "2000", "--data", str(tmp_path / "data"), "--work", str(tmp_path / "work"),
        "--save-at", "4", "--steps", "8", "--resume-steps", "3", "--no-use-triton", "--results", str(results),
        "--set", "train.device=cpu", "--set", "train.optimizer=adagrad", "--repeat-whole",
    ]  # fmt: skip
    # Seven launches of dlrm.train (refusal, save, whole, whole again, two resumes, the reshard), each ~15 s
    # of imports and start-up on an idle 2-core machine (~120 s in all); CI's parallel workers make it ~3x
    # that. The bound only catches a hang.
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = _rows(results)

    # 1. The full tiny tables into a disk reported too small (this one holds them): one line, exit 2.
    refused = rows[("refusal_exit_code", 2)]
    assert refused["value"] == "2" and refused["meets"] == "yes", refused
    assert "reported to the ranks" in refused["note"] and "no room for the checkpoints" in refused["note"]
    assert rows[("refusal_error_lines", 2)]["value"] == "1"
    assert 0 < float(rows[("refusal_s", 2)]["value"]) < 120

    # 2. Two saves (the evaluations at steps 4 and 8, in the background), each rank's RSS, step times.
    assert {what for what, _ in rows} >= {"save_s_step_4", "save_s_step_8", "save_held_s_step_4"}
    assert "in the background" in rows[("save_s_step_4", 2)]["note"]
    for rank in (0, 1):
        rss = rows[(f"rss_peak_during_save_rank{rank}", 2)]
        assert float(rss["value"]) >= float(rss["baseline_value"]) > 0.1, rss  # GiB
    step = rows[("step_ms_during_background_save", 2)]
    assert float(step["value"]) > 0 and float(step["baseline_value"]) > 0, step
    assert step["baseline"] == "step_ms_same_steps_uninterrupted" and "steps 5-" in step["note"], step

    # 3. On the same 2 ranks the resumed run is the uninterrupted one bit for bit (gloo on the CPU is
    # deterministic); resharded into one process, ulps apart (another order of the gradient sums).
    for what in ("resume_weights_max_abs_diff", "resume_loss_max_abs_diff"):
        same, one = rows[(what, 2)], rows[(what, 1)]
        assert same["value"] == "0.0" and same["meets"] == "yes", same
        assert 0 <= float(one["value"]) < 1e-4 and "resharded from 2 ranks" in one["note"], one
    assert "DCP data files with the same sha256" in rows[("resume_weights_max_abs_diff", 2)]["note"]
    # Loaded into one process and saved with no step between: the 2 ranks' weights bit for bit.
    reshard = rows[("reshard_weights_max_abs_diff", 1)]
    assert reshard["value"] == "0.0" and reshard["meets"] == "yes", reshard
    equal, _, count = reshard["note"].split(" model tensors")[0].split()
    assert equal == count and int(count) > 0, reshard
    # --repeat-whole: a second uninterrupted run, compared with the first (the noise the resumes read
    # against): the same bits here, every sum in a fixed order.
    for what in ("repeat_weights_max_abs_diff", "repeat_loss_max_abs_diff"):
        row = rows[(what, 2)]
        assert row["value"] == "0.0" and row["meets"] == "yes" and "run-to-run noise" in row["note"], row
    assert all(row["git_sha"] and row["device"] == "cpu" for row in rows.values())
    assert not list((tmp_path / "work").glob("*/checkpoints/*"))  # deleted at the end


def test_a_run_past_the_deadline_is_killed_with_what_it_started(tmp_path, monkeypatch):
    """A launch still going at its deadline ends at once, also when a process it started holds its stdout
    open (Inductor's compile workers under the ranks): the whole session is killed, not its leader alone."""
    bench = load_script("bench_checkpoint")
    fake = tmp_path / "python"  # stands in for the interpreter: whatever the arguments, it hangs
    fake.write_text("#!/bin/sh\necho started\nsleep 120 &\nsleep 120\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    start = time.monotonic()
    result = bench.launch("hang", 1, [], tmp_path, dict(os.environ), deadline=start + 2)
    assert result.timed_out and result.code != 0
    assert time.monotonic() - start < 30  # not the 120 s of the orphan holding the pipe
    assert result.lines and result.lines[0][1] == "started"


def test_a_run_starts_once_earlier_writes_are_on_disk(tmp_path, monkeypatch):
    """The page cache's writeback of an earlier run's checkpoints would run beside the next run's steps
    (the uninterrupted run's are the baseline): each launch syncs first."""
    bench = load_script("bench_checkpoint")
    calls = []
    monkeypatch.setattr(bench.os, "sync", lambda: calls.append("sync"))

    def popen(*args, **kwargs):
        calls.append("run")
        raise RuntimeError("not started")

    monkeypatch.setattr(bench.subprocess, "Popen", popen)
    with pytest.raises(RuntimeError, match="not started"):
        bench.launch("whole", 1, [], tmp_path, dict(os.environ), deadline=time.monotonic() + 60)
    assert calls == ["sync", "run"]
