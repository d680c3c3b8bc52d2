"""scripts/cross_registers.py: the cross forward kernels compiled for sm_90a without a GPU, in a process of
its own (the tests' interpreter cannot compile): the Triton kernel's largest tuned tile compiles without
spilling, its epilogue's loads and stores in four pieces; the Hopper kernel compiles without spilling,
within a CTA's shared memory."""

import os
import re
import subprocess
import sys

from tests.conftest import REPO


def _cross_registers(*args: str) -> subprocess.CompletedProcess:
    """The script's run with `args`, compiling (not interpreting) the kernels; its exit checked."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "cross_registers.py"), *args],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result


def test_the_largest_tile_compiles_without_spills():
    result = _cross_registers("--tiles", "128x256")
    lines = result.stdout.splitlines()
    ((line,),) = [lines]
    assert line.startswith("128x256x") and " 0 B spilled" in line, line
    quarters = line.split("| ")[1].split()
    assert sum(run.endswith("S") for run in quarters) == 4
    assert all(re.fullmatch(r"\d+[LS]", run) for run in quarters)


def test_the_hopper_kernel_compiles_without_spills_within_shared_memory():
    """kernels.cross_hopper's Gluon kernel: no spills at its register split, and its ring and epilogue
    buffers within the 232,448 bytes of shared memory a Hopper CTA can take."""
    result = _cross_registers("--kernel", "hopper")
    match = re.fullmatch(
        r"hopper bf16: (\d+) registers, (\d+) B spilled, (\d+) B shared", result.stdout.strip()
    )
    assert match, result.stdout
    assert int(match.group(2)) == 0 and 0 < int(match.group(3)) <= 232_448, result.stdout
