"""scripts/bench_save_overlap.py on the CPU: every part it can run there works beside the stand-in step and
writes its row, and a part it cannot (the copies from a GPU) is skipped, not faked."""

import csv
import subprocess
import sys

from tests.conftest import REPO


def test_each_part_of_a_background_save_gets_a_row_beside_the_step(tmp_path):
    results = tmp_path / "save_overlap.csv"
    command = [
        sys.executable, str(REPO / "scripts" / "bench_save_overlap.py"), "--gib", "0.01", "--step-ms", "2",
        "--dir", str(tmp_path / "out"), "--results", str(results), "--switch-interval", "0.5",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "d2h_pageable: skipped (needs a GPU)" in done.stdout
    with results.open(newline="") as f:
        rows = {row["condition"]: row for row in csv.DictReader(f)}
    assert set(rows) == {"sha256", "write_fsync", "writer", "dcp"}
    for row in rows.values():
        assert float(row["step_ms_alone"]) > 0 and float(row["part_s"]) > 0, row
        beside = float(row["step_ms_beside"])  # nan when the part ended before a step did
        assert beside != beside or abs(float(row["ratio"]) - beside / float(row["step_ms_alone"])) < 1e-2, row
        assert beside != beside or float(row["step_ms_beside_longest"]) >= beside, row
        assert row["device"] == "cpu" and row["git_sha"] and row["switch_ms"] == "0.5", row
    assert not list((tmp_path / "out").iterdir())  # the parts remove what they wrote


def test_an_unknown_part_is_refused_in_one_line(tmp_path):
    command = [sys.executable, str(REPO / "scripts" / "bench_save_overlap.py"), "--conditions", "sha256,gzip"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "unknown ['gzip']" in done.stderr, done.stderr
