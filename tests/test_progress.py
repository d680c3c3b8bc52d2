"""What `python -m dlrm.train` shows: a progress bar on a terminal, log lines otherwise, or neither."""

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest

from dlrm.progress import resolve_mode
from tests.conftest import REPO

BAR = "steps |"  # in the training bar: "epoch 0: 4/4 steps |####| 00:01<00:00, 3.1step/s, loss ..."


@pytest.fixture(scope="module")
def command(criteo_sample, tmp_path_factory):
    config = json.loads((REPO / "configs" / "tiny.json").read_text())
    config["data"]["path"] = str(criteo_sample)
    config["profiler"]["enabled"] = False
    path = tmp_path_factory.mktemp("progress") / "tiny.json"
    path.write_text(json.dumps(config))
    return [sys.executable, "-m", "dlrm.train", "--config", str(path), "--device", "cpu", "--max-steps", "4"]


def test_bar_on_a_terminal(command, tmp_path):
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))
    process = subprocess.Popen(
        [*command, "--output-dir", str(tmp_path)], cwd=REPO, stdout=follower, stderr=follower
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # the terminal closed: the process is gone
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert process.wait(timeout=120) == 0
    os.close(leader)
    output = b"".join(chunks).decode("utf-8", "replace")
    assert BAR in output and "\r" in output
    assert "epoch 0: 4/4 steps" in output and "samples/s" in output and "loss 0." in output
    assert "eval val" in output and "eval test" in output  # the evaluations' bars
    assert "val auc" in output and "test (weights of step" in output  # log lines still print, above the bar


def test_log_lines_when_not_a_terminal(command, tmp_path):
    result = subprocess.run(
        [*command, "--output-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert BAR not in result.stdout + result.stderr and "\r" not in result.stdout + result.stderr
    lines = ("reading ", "building the model", "epoch 0 step 4 | loss", "evaluating on val", "val auc")
    for line in (*lines, "evaluating on test", "test (weights of step"):
        assert line in result.stderr, line


def test_quiet_shows_neither(command, tmp_path):
    result = subprocess.run(
        [*command, "--output-dir", str(tmp_path), "--quiet"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert BAR not in result.stdout + result.stderr and "INFO" not in result.stdout + result.stderr
    assert (tmp_path / "metrics.json").is_file()


def test_resolve_mode():
    assert resolve_mode("auto") in ("bar", "log") and resolve_mode("quiet") == "quiet"
    with pytest.raises(ValueError, match="progress: expected one of auto, bar, log, quiet, got 'x'"):
        resolve_mode("x")
