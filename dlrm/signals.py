"""Stop signals for a training run: SIGINT / SIGTERM ask the loop to stop after the current step."""

import os
import signal
import threading
from typing import Any


class StopSignals:
    """SIGINT / SIGTERM handlers while a run trains (main thread only): the first signal asks the loop to
    stop after the current step (`received`: its number), saying so on stderr when `announce` (rank 0 of
    a torchrun job: the signal reaches every rank); a second one stops at once (KeyboardInterrupt). The
    previous handlers come back on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, announce: bool = True) -> None:
        self.announce = announce
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self.handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def handle(self, signum: int, frame: object) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum
        if not self.announce:
            return
        # Not the logger: it is not re-entrant, and the signal may come while it writes. os.write is.
        name = signal.Signals(signum).name
        notice = f"{name} received: stopping after this step, writing a checkpoint (again: stop at once)\n"
        os.write(2, notice.encode())
