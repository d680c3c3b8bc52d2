"""scripts/cross_registers.py: the cross forward kernel compiled for sm_90a without a GPU, in a process of
its own (the tests' interpreter cannot compile): both epilogues of the largest tuned tile compile without
spilling, and the eighths issue their loads between the stores of the pieces before them."""

import os
import re
import subprocess
import sys

from tests.conftest import REPO


def test_both_epilogues_of_the_largest_tile_compile_without_spills():
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "cross_registers.py"), "--tiles", "128x256"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and "AHEAD False" in lines[0] and "AHEAD True" in lines[1], result.stdout
    for line in lines:
        assert " 0 B spilled" in line, line
    quarters, eighths = (line.split("| ")[1].split() for line in lines)
    assert sum(run.endswith("S") for run in quarters) == 4 and sum(run.endswith("S") for run in eighths) == 8
    assert all(re.fullmatch(r"\d+[LS]", run) for run in quarters + eighths)
