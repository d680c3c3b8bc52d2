"""One place that turns failures into one line on stderr and an exit code, for every CLI.

    @click.command()
    def main(...):
        with cli_errors():
            ...

- `RunStopped` and its kinds below: its message, its `exit_code` (3 non-finite loss, 128 + signal number).
- ValueError, FileNotFoundError (bad config, data, checkpoint; the message names the file or key): 2.
- No space left, quota exceeded or read-only file system, however wrapped (dlrm.atomic.DiskFull): `PATH:
  reason (N MiB free on DIR)`, 2.
- Any other OSError on a user-given path (a directory for a file, permission, read-only file system):
  `PATH: reason`, 2.
- torch.OutOfMemoryError that the loop did not report itself (it adds batch size, table bytes, free
  memory): its first line, 2.
- KeyboardInterrupt (a second Ctrl-C, or one outside the training loop): `interrupted`, 130; the same line
  while the command still imports (dlrm.ctrl_c).

Anything else is a bug and keeps its traceback. Click's own usage errors (exit 2) pass through untouched.
"""

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import click

from dlrm import ctrl_c
from dlrm.atomic import disk_full

EXIT_BAD_INPUT = 2
EXIT_NONFINITE = 3


class RunStopped(Exception):
    """A run ended early on purpose; the message is one line for the user, `exit_code` the CLI's status,
    `checkpoint` the last.pt to go on from (the train CLI then prints the --resume command), if any."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, exit_code: int | None = None, checkpoint: Path | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code
        self.checkpoint = checkpoint


class NonFiniteLoss(RunStopped):
    """The training loss (or the weights) became NaN or infinite (train.on_nonfinite "stop"); exit 3."""

    exit_code = EXIT_NONFINITE


class Interrupted(RunStopped):
    """SIGINT or SIGTERM: the current step finished, last.pt written; exit 128 + the signal number."""


class OutOfMemory(RunStopped):
    """Device memory ran out during set-up or training; the message has the numbers and what to change."""


def os_error_line(err: OSError) -> str:
    """`PATH: reason` of an OSError (its strerror, e.g. "Permission denied", "Is a directory")."""
    reason = err.strerror or str(err)
    paths = [p for p in (err.filename, err.filename2) if p is not None]
    return f"{' -> '.join(str(p) for p in paths)}: {reason}" if paths else reason


def one_line(err: BaseException) -> tuple[str, int] | None:
    """(message, exit code) for a failure the user can act on, None for anything else (a bug)."""
    if isinstance(err, RunStopped):
        return str(err), err.exit_code
    if isinstance(err, click.exceptions.ClickException | click.exceptions.Exit | SystemExit):
        return None
    # torch as already imported, if at all: a CLI that never loads it (preprocess: 1.2 s, 200 MiB) cannot
    # have failed in it, and need not import it here.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(err, torch.OutOfMemoryError):
        first = str(err).strip().splitlines()[0] if str(err).strip() else "out of memory"
        return f"out of memory: {first}", EXIT_BAD_INPUT
    full = disk_full(err, None)
    if full is not None:  # (torch.save and the like raise a RuntimeError after the OSError)
        return os_error_line(full), EXIT_BAD_INPUT
    if isinstance(err, FileNotFoundError) and err.filename is None:
        return str(err), EXIT_BAD_INPUT  # our own "no such file" messages, already naming the path
    if isinstance(err, OSError):
        return os_error_line(err), EXIT_BAD_INPUT
    if isinstance(err, ValueError):
        return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__, EXIT_BAD_INPUT
    if isinstance(err, KeyboardInterrupt):
        return "interrupted", 130
    return None


def print_and_exit(message: str, code: int) -> None:
    """`error: <message>` on stderr, then exit with `code`."""
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


@contextmanager
def cli_errors(report: Callable[[str, int], None] = print_and_exit) -> Iterator[None]:
    """Hand what `one_line` knows to `report(message, exit code)`, which ends the process (default:
    `print_and_exit`; dlrm.train's also ends the other ranks of a torchrun job); re-raise the rest.
    A Ctrl-C from here on is a KeyboardInterrupt again (dlrm.ctrl_c took it while the command imported)."""
    ctrl_c.restore()
    try:
        yield
    except BaseException as err:
        mapped = one_line(err)
        if mapped is None:
            raise
        report(*mapped)
