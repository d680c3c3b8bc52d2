"""scripts/cross_registers.py: the cross kernels compiled for sm_90a without a GPU, in a process of
its own (the tests' interpreter cannot compile): the Triton kernel's largest tuned tile compiles without
spilling, its epilogue's loads and stores in four pieces; the Hopper kernels compile without spilling,
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


def test_the_hopper_kernels_compile_without_spills_within_shared_memory():
    """kernels.cross_hopper's Gluon kernels, the forward, the backward's four variants and the dz / dh
    kernel: no spills at their register split, and their rings and epilogue buffers within the 232,448
    bytes of shared memory a Hopper CTA can take."""
    lines = _cross_registers("--kernel", "hopper").stdout.splitlines()
    names = ["fwd", "dz"] + [f"bwd ACCUMULATE={a} FOLD_DXL={f}" for f in (0, 1) for a in (0, 1)]
    assert sorted(line.split(" bf16:")[0] for line in lines) == sorted(f"hopper {name}" for name in names)
    for line in lines:
        match = re.fullmatch(r"hopper .+ bf16: (\d+) registers, (\d+) B spilled, (\d+) B shared", line)
        assert match, line
        assert int(match.group(2)) == 0 and 0 < int(match.group(3)) <= 232_448, line
