"""Ctrl-C while `python -m dlrm.<command>` is still importing (torch, triton, pyarrow: seconds): one
`error: interrupted` line (from rank 0 alone under torchrun) and exit 130, as a Ctrl-C inside the command
gives (dlrm.errors), in place of the traceback of whichever import it landed in.

dlrm/__init__.py calls `while_importing` before anything heavy is imported, and it takes SIGINT only in a
process started as `python -m dlrm.<module>` (a library user's Ctrl-C stays theirs); the command's
`cli_errors` calls `restore` as it starts, handing SIGINT back to Python's KeyboardInterrupt, which the
command handles itself (the training loop: finish the step, write last.pt)."""

import os
import signal
import sys


def while_importing() -> None:
    """Exit 130 with one line on SIGINT until `restore`, when this process runs a dlrm module with -m."""
    if runs_a_dlrm_module():
        signal.signal(signal.SIGINT, _exit_interrupted)


def restore() -> None:
    """SIGINT back to Python's default (KeyboardInterrupt) where `while_importing` took it."""
    if signal.getsignal(signal.SIGINT) is _exit_interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def runs_a_dlrm_module() -> bool:
    """True while `python [options] -m dlrm.<module>` locates its module: Python sets sys.argv[0] to "-m"
    until it has found it, and sys.orig_argv keeps the command line as given."""
    if sys.argv[:1] != ["-m"]:
        return False
    args = sys.orig_argv[1:]
    for i, arg in enumerate(args):
        if arg.startswith("-m"):
            module = arg[2:] or (args[i + 1] if i + 1 < len(args) else "")
            return module.split(".")[0] == "dlrm"
    return False


def _exit_interrupted(signum: int, frame) -> None:
    # Nothing is written before the command starts, so there is nothing to finish: leave at once (an
    # exception raised here would unwind through half-imported modules and their finalizers). Under
    # torchrun the signal reaches every rank: rank 0 alone says so.
    if os.environ.get("RANK", "0") == "0":
        os.write(2, b"error: interrupted\n")
    os._exit(128 + signum)
