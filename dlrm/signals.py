"""Stop signals for a training run: SIGINT / SIGTERM ask the loop to stop after the current step."""

import os
import signal
import threading
from typing import Any

from dlrm.errors import RunStopped
from dlrm.parallel.faults import is_distributed, peers_ended


class StopSignals:
    """SIGINT / SIGTERM handlers while a run trains (main thread only): the first signal asks the loop to
    stop after the current step (`received`: its number), saying so on stderr when `announce` (rank 0 of
    a torchrun job: the signal reaches every rank); a second one stops at once (KeyboardInterrupt). The
    previous handlers come back on exit.

    Under torchrun a signal that comes once a peer process of this host has ended is not announced: it is
    torchrun's agent stopping the job, and the job ends through dlrm.parallel's fault handling, which names
    the dead rank. When the loop fails under torchrun (not a `RunStopped`), the handlers stay, quiet, so
    that the agent's SIGTERM cannot cut the fault handling short (a second signal still stops at once)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, announce: bool = True) -> None:
        self.announce = announce
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self.handle) for s in self.SIGNALS}
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        failed = exc_type is not None and not issubclass(exc_type, RunStopped | KeyboardInterrupt)
        if failed and is_distributed():
            self.announce = False  # dlrm.parallel.fail ends the process, in bounded time
            return
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def handle(self, signum: int, frame: object) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum
        if not self.announce or peers_ended():
            return
        # Not the logger: it is not re-entrant, and the signal may come while it writes. os.write is.
        name = signal.Signals(signum).name
        notice = f"{name} received: stopping after this step, writing a checkpoint (again: stop at once)\n"
        os.write(2, notice.encode())
