"""scripts/cross_registers.py: the cross forward kernel compiled for sm_90a without a GPU, in a process of
its own (the tests' interpreter cannot compile): the largest tuned tile compiles without spilling, its
epilogue's loads and stores in four pieces."""

import os
import re
import subprocess
import sys

from tests.conftest import REPO


def test_the_largest_tile_compiles_without_spills():
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "cross_registers.py"), "--tiles", "128x256"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    ((line,),) = [lines]
    assert line.startswith("128x256x") and " 0 B spilled" in line, line
    quarters = line.split("| ")[1].split()
    assert sum(run.endswith("S") for run in quarters) == 4
    assert all(re.fullmatch(r"\d+[LS]", run) for run in quarters)
