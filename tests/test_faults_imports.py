"""Ctrl-C while a `python -m dlrm.<command>` still imports its libraries (torch, pyarrow: seconds before the
command starts): one `error: interrupted` line, exit 130, no traceback, for every command."""

import os
import signal
import subprocess
import sys
import time

import pytest

from dlrm import ctrl_c
from dlrm.errors import cli_errors
from tests.conftest import REPO

# Every `python -m dlrm.<module>` command: the modules that run a main as __main__.
COMMANDS = sorted(
    ".".join(path.relative_to(REPO).with_suffix("").parts)
    for path in (REPO / "dlrm").rglob("*.py")
    if 'if __name__ == "__main__":' in path.read_text()
)
HEAVY = ("/numpy/", "/pyarrow/", "/torch/")  # every command imports one of them, after dlrm/__init__.py


def _importing_heavy(pid: int) -> bool:
    """Whether process `pid` has begun loading a heavy library's shared objects (it is mid-import)."""
    with open(f"/proc/{pid}/maps") as maps:
        return any(lib in line for line in maps for lib in HEAVY)


def _interrupt_while_importing(module: str, **env: str) -> tuple[int, str, str]:
    """Start `python -m module --help`, press Ctrl-C (again and again) once it imports a heavy library:
    (exit status, stdout, stderr)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **env}
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "--help"], cwd=REPO, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not _importing_heavy(proc.pid):
        assert proc.poll() is None and time.monotonic() < deadline, "never reached its imports"
        time.sleep(0.002)
    while proc.poll() is None:  # Ctrl-C pressed again and again, as an impatient user does
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
    out, err = proc.communicate()
    return proc.returncode, out, err


@pytest.mark.parametrize("module", COMMANDS)
def test_ctrl_c_while_a_command_imports_is_one_line_and_exit_130(module):
    code, out, err = _interrupt_while_importing(module)
    assert code == 130 and err == "error: interrupted\n" and out == "", err


def test_under_torchrun_rank_0_alone_prints_the_line():
    for rank, line in (("0", "error: interrupted\n"), ("1", "")):
        code, out, err = _interrupt_while_importing("dlrm.train", RANK=rank, WORLD_SIZE="2")
        assert code == 130 and err == line and out == "", (rank, err)


@pytest.mark.parametrize(
    ("argv", "orig_argv", "takes_it"),
    [
        (["-m"], ["python", "-m", "dlrm.train", "--config", "c.json"], True),
        (["-m"], ["python", "-u", "-X", "faulthandler", "-mdlrm.data.preprocess"], True),
        (["-m"], ["python", "-m", "mytool.main"], False),  # another program that imports dlrm
        (["script.py"], ["python", "script.py", "-m", "dlrm.train"], False),
        (["-c"], ["python", "-c", "import dlrm"], False),
    ],
)
def test_only_a_dlrm_command_takes_ctrl_c_while_importing(monkeypatch, argv, orig_argv, takes_it):
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "orig_argv", orig_argv)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        ctrl_c.while_importing()
        taken = signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        assert taken == takes_it
        with cli_errors():  # the command has started: Ctrl-C is a KeyboardInterrupt for it to handle
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
