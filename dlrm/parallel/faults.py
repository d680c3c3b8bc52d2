"""What ends every rank of a `torchrun` job when one dies, hangs or fails: the heartbeat thread (`Watchdog`),
the peers it finds dead, and each rank's one exit line with how to go on from the run's last checkpoint.

    start_watchdog(rank, world_size, timeout_s)   # dlrm.parallel.group.init_distributed, once per process
    fail(err)                                     # a rank's exception under torchrun: end the job, one line

A heartbeat thread per rank (`Watchdog`) writes a counter into the rendezvous store every second
and reads the others'. A peer that dies is named by the others within about a second: each rank publishes
its process id, and a peer's process on the same host that ended is dead at once; one on another host is
dead when a collective with it failed on a closed connection and its counter has stopped for DEAD_S. Every
other rank then ends with one line naming it and how to go on from the run's last complete checkpoint
(`resume_hint`), exit 2. A rank whose counter stops for half the timeout (it died, or its process froze) is
named the same way, "rank k stopped ...". A rank whose main thread fails ends the job through `fail`: an
error the user can act on (dlrm.errors.one_line: a changed checkpoint, a config that does not fit it)
that every rank raised is one `error:` line from rank 0 and exit 2 from every rank; raised by one rank
alone, that rank's line, and the others end with it. A collective that timed out while every rank is
alive names the ranks not waiting in it as hung. A rank stuck in a collective (NCCL, or inside a CUDA
graph replay that no timeout sees) is ended by its own heartbeat thread when another rank ends the job.
Without a watchdog (a single process) every function here does nothing, or ends the process plainly.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from loguru import logger

from dlrm.errors import EXIT_BAD_INPUT, one_line

HEARTBEAT_S = 1.0
EXIT_FAILED = 1  # this rank's own unexpected error, or a collective that hung
EXIT_ENDED = EXIT_BAD_INPUT  # a peer died or stopped, or an error the user can act on: one line, exit 2
DEAD_S = 3 * HEARTBEAT_S  # a peer silent this long, once a collective with it failed on a closed connection
AGREE_S = 3 * HEARTBEAT_S  # how long a rank with an error waits for the others to report one too

_watchdog: Watchdog | None = None
_ending = threading.Lock()  # held by the thread that ends the process (never released)


@dataclass
class _Recovery:
    """What a rank that ends the job says to go on: `command(checkpoint)` (the train CLI's resume command
    line), the run's last checkpoint directory (complete once its meta.json is there: it is renamed into
    place whole) and the checkpoint the run resumed from."""

    command: Callable[[Path], str] | None = None
    last: Path | None = None
    resumed: Path | None = None


_recovery = _Recovery()


def start_watchdog(rank: int, world_size: int, timeout_s: float) -> None:
    """Start the heartbeat thread of this rank (once per process); `timeout_s`: the collectives' timeout."""
    global _watchdog
    if _watchdog is None:
        _watchdog = Watchdog(rank, world_size, stale_s=max(3.0, timeout_s / 2))
        _watchdog.start()


def stop_watchdog() -> None:
    """Stop the heartbeat thread (a no-op without one); every rank does so before leaving the process
    group, so that no rank sees another's stop as a failure."""
    global _watchdog
    if _watchdog is not None:
        _watchdog.stop()
        _watchdog.join(timeout=10 * HEARTBEAT_S)
        _watchdog = None


def note_progress(step: int) -> None:
    """Record the training step reached (shown in heartbeat messages); cheap, called every step."""
    if _watchdog is not None:
        _watchdog.step = step


def is_distributed() -> bool:
    """True in a process of a torchrun job whose process group is up."""
    return _watchdog is not None


def exit_now(code: int) -> None:
    """sys.exit(code) in one process; in a distributed one, end the process at once (os._exit after
    flushing): interpreter shutdown with the process group's threads alive can abort or hang."""
    if _watchdog is None:
        sys.exit(code)
    _watchdog.mark("ended")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def rank_prefix() -> str:
    """ "rank k: " on ranks other than 0 of a distributed run, else "" (for messages every rank prints)."""
    return f"rank {_watchdog.rank}: " if _watchdog is not None and _watchdog.rank else ""


class Watchdog(threading.Thread):
    """Heartbeats through the rendezvous store; ends this process when a peer dies or stops, or another
    rank ends the job.

    Keys (under a prefix per torchrun restart): `beat/<rank>` a counter and the step, written every
    HEARTBEAT_S; `proc/<rank>` the process id and host; `abort` the first failure ({"message", "code",
    "dead"}); `failed/<rank>` a collective failed on that rank; `error/<rank>` its error the user can act
    on; `ended/<rank>` it is ending on purpose (its process going away is no death). A peer is dead when
    its process on this host ended, when a collective with it failed on a closed connection (`closed`) and
    its counter has stopped for DEAD_S, and stopped when its counter has stopped for `stale_s` (half the
    timeout, at least 3 s). It talks to the store through its own client, so a main thread blocked in a
    collective or a graph replay does not stop it.
    """

    def __init__(self, rank: int, world_size: int, stale_s: float):
        super().__init__(name="dlrm-watchdog", daemon=True)
        self.rank, self.world_size, self.stale_s = rank, world_size, stale_s
        host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
        self.address = f"{host}:{port}"
        store = dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=stale_s), wait_for_workers=False
        )
        prefix = f"dlrm-watchdog/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self.store = dist.PrefixStore(prefix, store)
        self._stop_event = threading.Event()
        self._aborting = False
        self.step = 0  # the training loop's progress, for messages
        self.closed = False  # a collective failed on a closed connection: a silent peer is dead
        self.others = [r for r in range(world_size) if r != rank]
        self.seen: dict[int, tuple[bytes | None, float]] = {}  # peer: (last counter read, when it changed)
        self.pids: dict[int, int] = {}  # peer: process id, for the peers on this host
        self.located: set[int] = set()  # peers whose proc/<rank> was read

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        rank = self.rank
        start = time.monotonic()
        self.seen = {r: (None, start) for r in self.others}
        beat = 0
        while not self._stop_event.is_set():
            beat += 1
            try:
                if beat == 1:
                    self.store.set(f"proc/{rank}", f"{os.getpid()} {_host_id()}")
                self.store.set(f"beat/{rank}", f"{beat}:{self.step}")
                now = time.monotonic()
                for r in self.others:
                    key = f"beat/{r}"
                    value = self.store.get(key) if self.store.check([key]) else None
                    if value != self.seen[r][0]:
                        self.seen[r] = (value, now)
                    if r not in self.located and self.store.check([f"proc/{r}"]):
                        pid, host = self.store.get(f"proc/{r}").decode().split(" ", 1)
                        self.located.add(r)
                        if host == _host_id():
                            self.pids[r] = int(pid)
                self.check_peers(now)
            except Exception as err:  # the store is gone: its host (rank 0 or the torchrun agent) died
                if not self._stop_event.is_set():
                    reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
                    _end(
                        f"rank {rank}: ending: the rendezvous store {self.address} is unreachable "
                        f"({reason}): rank 0 or the torchrun agent died; {resume_hint()}",
                        EXIT_ENDED,
                    )
            self._stop_event.wait(HEARTBEAT_S)

    def check_peers(self, now: float) -> None:
        """End this process when another rank ended the job (`abort`) or a peer died or stopped."""
        if not self._aborting and self.store.check(["abort"]):  # (ours: our caller exits)
            self.end_aborted(json.loads(self.store.get("abort")))
        dead = self.dead_peers(now)
        if dead:
            self.end_for_dead(dead)

    def ended_processes(self) -> list[int]:
        """The peers on this host whose process ended (cheap: no store access, for a signal handler)."""
        return [r for r, pid in list(self.pids.items()) if not _process_alive(pid)]

    def dead_peers(self, now: float) -> dict[int, str]:
        """{rank: why} of the peers that died or stopped (class docstring), but those ending on purpose."""
        dead = {}
        for r in self.ended_processes():
            dead[r] = f"rank {r} died at step {self.step}: its process {self.pids[r]} ended"
        for r, (_, since) in list(self.seen.items()):
            silent = now - since
            if r in dead:
                continue
            if self.closed and silent > DEAD_S:
                dead[r] = (
                    f"rank {r} died: a collective with it failed on a closed connection and it has sent no "
                    f"heartbeat for {silent:.0f} s{self.last_step(r)}"
                )
            elif silent > self.stale_s:
                where = self.last_step(r)
                dead[r] = f"rank {r} stopped: no heartbeat for {self.stale_s:.0f} s{where}; it died or hung"
        if dead:  # a peer that ends on purpose (its own failure, read from the store too) is not dead
            dead = {r: why for r, why in dead.items() if not self.store.check([f"ended/{r}"])}
        return dead

    def last_step(self, r: int) -> str:
        """Where peer r was, " (last heartbeat at step N)", or "" before its first heartbeat."""
        value = self.seen.get(r, (None, 0.0))[0]
        return f" (last heartbeat at step {value.decode().split(':')[1]})" if value else ""

    def end_for_dead(self, dead: dict[int, str]) -> None:
        """End this rank, and tell the others, because the peers `dead` died or stopped: one line naming
        them and how to go on, exit 2. Never returns."""
        message = "; ".join(dead[r] for r in sorted(dead)) + f"; {resume_hint()}"
        self.abort(message, EXIT_ENDED, sorted(dead), wait=False)
        self.end_aborted({"message": message, "code": EXIT_ENDED, "dead": sorted(dead)})

    def end_aborted(self, abort: dict) -> None:
        """End this rank for the job's `abort` record: the lowest living rank of a job that lost ranks
        prints its message as the one `error:` line; every other rank logs `rank k: ending: ...` once that
        rank has (torchrun's agent stops the others as soon as one exits)."""
        rank, dead = self.rank, abort.get("dead") or []
        living = [r for r in range(self.world_size) if r not in dead]
        if dead and rank == min(living):
            _end(f"error: {abort['message']}", abort["code"], plain=True)
        _end(f"rank {rank}: ending: {abort['message']}", abort["code"], after=min(living) if dead else None)

    def mark(self, key: str, value: str = "1") -> None:
        """Set `<key>/<rank>` in the store (best effort)."""
        try:
            self.store.set(f"{key}/{self.rank}", value)
        except Exception:
            pass

    def mark_failed(self) -> None:
        """Record in the store that this rank's main thread saw a collective fail."""
        self.mark("failed")

    def not_failed(self) -> list[int]:
        """The ranks that have not marked a failed collective ([] when the store cannot be read)."""
        try:
            return [r for r in range(self.world_size) if not self.store.check([f"failed/{r}"])]
        except Exception:
            return []

    def abort(
        self, message: str, code: int = EXIT_FAILED, dead: list[int] | None = None, wait: bool = True
    ) -> None:
        """Tell every rank to end with `message` and exit `code` (best effort); with `wait`, give them two
        heartbeats to read it when this process hosts the store (rank 0 without torchrun's agent; `_end`
        waits for them itself)."""
        self._aborting = True
        try:
            self.store.set("abort", json.dumps({"message": message, "code": code, "dead": dead or []}))
        except Exception:
            return
        if wait and _hosts_store(self.rank):
            time.sleep(2 * HEARTBEAT_S)

    def wait_for(self, keys: list[str], timeout_s: float) -> None:
        """Until every key of `keys` is in the store, or `timeout_s` passed, or the store is gone."""
        until = time.monotonic() + timeout_s
        try:
            while time.monotonic() < until and not self.store.check(keys):
                time.sleep(0.05)
        except Exception:
            pass


def _hosts_store(rank: int) -> bool:
    """Whether this process hosts the rendezvous store: rank 0 without torchrun's agent (which holds it)."""
    return rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def _host_id() -> str:
    """This host (and process-id namespace): peers with the same one can see each other's processes."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()}/{namespace}"


def _process_alive(pid: int) -> bool:
    """Whether process `pid` of this host runs (a zombie, ended but not reaped yet, does not)."""
    if os.path.isdir("/proc/self"):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                return f.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
        except (OSError, IndexError):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def set_resume_command(command: Callable[[Path], str]) -> None:
    """The command line that goes on from a checkpoint (the train CLI's), for `resume_hint`."""
    _recovery.command = command


def note_checkpoints(last: Path, resumed: Path | None) -> None:
    """Where the run writes its last checkpoint (a sharded directory), and the checkpoint it resumed
    from, if any: `resume_hint` names the newer of the two that is complete."""
    _recovery.last, _recovery.resumed = last, resumed


def resume_hint() -> str:
    """How to go on after the job ended: "<checkpoint> holds step N; go on with: <command>" for the run's
    last complete checkpoint (else the one it resumed from), or that there is none yet."""
    last, resumed = _recovery.last, _recovery.resumed
    checkpoint = next((c for c in (last, resumed) if c is not None and _complete(c)), None)
    if checkpoint is None:
        where = f" ({last.parent.parent})" if last is not None else ""
        return f"no checkpoint was written yet{where}: start the run again"
    command = _recovery.command(checkpoint) if _recovery.command else f"--resume {checkpoint}"
    step = _checkpoint_step(checkpoint)
    held = f"{checkpoint} holds step {step}" if step is not None else f"{checkpoint} is the last checkpoint"
    return f"{held}; go on with: {command}"


def _complete(checkpoint: Path) -> bool:
    """A checkpoint file, or a sharded checkpoint directory with its meta.json (written last)."""
    return (checkpoint / "meta.json").is_file() if checkpoint.is_dir() else checkpoint.is_file()


def _checkpoint_step(checkpoint: Path) -> int | None:
    """The step of a sharded checkpoint (its meta.json), None for a file (not read here) or on failure."""
    try:
        return int(json.loads((checkpoint / "meta.json").read_text())["step"])
    except Exception:
        return None


def peers_ended() -> bool:
    """True when a peer process of this torchrun job on this host has ended (cheap, for a signal
    handler: torchrun's agent sends SIGTERM to the others once a rank died)."""
    return _watchdog is not None and bool(_watchdog.ended_processes())


def abort_peers(message: str, code: int = EXIT_FAILED) -> None:
    """Make every other rank end with `message` and exit `code` (no-op in a single process)."""
    if _watchdog is not None:
        _watchdog.abort(message, code)


def fail(err: BaseException) -> None:
    """End this rank after an exception in a distributed run: tell the others, and name the cause.
    Never returns.

    An error the user can act on (dlrm.errors.one_line: a changed checkpoint, a config that does not fit
    it) ends the job with its one line (`_end_on_error`). A collective that failed because a peer died
    (gloo: "connection closed") is usually seen before that peer is found dead: this rank marks itself
    failed in the store and waits up to the staleness window, in which a dead or stopped peer is named
    (`Watchdog.end_for_dead`). When every rank is alive, the ranks that did not mark themselves failed are
    alive but outside the collective that timed out: named as hung. Otherwise (this rank's own error) the
    message is this rank's error.
    """
    _hold_stop_signals()
    rank = _watchdog.rank if _watchdog is not None else 0
    first_line = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
    message = f"rank {rank} failed: {type(err).__name__}: {first_line}"
    mapped = None if is_communication_error(err) else one_line(err)
    if _watchdog is not None and mapped is not None:
        _end_on_error(*mapped)
    if _watchdog is not None and is_communication_error(err):
        _watchdog.mark_failed()
        _watchdog.closed = _watchdog.closed or "closed" in str(err).lower()
        deadline = time.monotonic() + _watchdog.stale_s + 2 * HEARTBEAT_S
        while time.monotonic() < deadline:
            try:
                _watchdog.check_peers(time.monotonic())
            except Exception:  # the store is gone: the heartbeat thread says so
                pass
            time.sleep(0.2)
        hung = _watchdog.not_failed()
        if hung:
            names = ", ".join(str(r) for r in hung)
            message = (
                f"rank {names} hung: alive, but not in the collective that failed on rank {rank} "
                f"({type(err).__name__}: {first_line}); {resume_hint()}"
            )
    else:  # this rank's own error: its traceback, then the one-line message
        logger.debug("".join(traceback.format_exception(err)))
    if _watchdog is not None:
        _watchdog.abort(message, wait=False)
    _end(f"rank {rank}: ending: {message}", EXIT_FAILED)


def _hold_stop_signals() -> None:
    """While this rank ends the job (bounded: AGREE_S, or the staleness window) a first SIGINT / SIGTERM
    is ignored, so that it cannot cut that short: torchrun's agent sends SIGTERM to every rank as soon as
    one exits. A second one stops at once (KeyboardInterrupt). Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return
    received = []

    def handle(signum: int, frame: object) -> None:
        if received:
            raise KeyboardInterrupt
        received.append(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handle)


def _end_on_error(message: str, code: int) -> None:
    """End the job for this rank's error the user can act on (`message`, exit `code`). When every rank
    reports one within AGREE_S (the same check failed on all: a checkpoint that changed, a config that does
    not fit it), rank 0 prints its message as the one `error:` line and every rank exits `code`; else this
    rank prints `rank k: error: message` and the others end with it. Never returns."""
    w = _watchdog
    rank, world = w.rank, w.world_size
    w.mark("error", message)
    w.wait_for([f"error/{r}" for r in range(world)], AGREE_S)
    try:
        every_rank = w.store.check([f"error/{r}" for r in range(world)])
    except Exception:
        every_rank = False
    if not every_rank:
        w.abort(f"error: {message}", code, wait=False)
        _end(f"{rank_prefix()}error: {message}", code, plain=True)
    if rank == 0:
        _end(f"error: {message}", code, plain=True)
    _end("", code, after=0)


def is_communication_error(err: BaseException) -> bool:
    """A collective that failed (a peer gone, a timeout) rather than this rank's own error."""
    if isinstance(err, dist.DistError):
        return True
    failures = getattr(err, "failures", None)  # DCP's CheckpointException: each rank's exception
    if isinstance(failures, dict):
        return any(is_communication_error(exc) for exc, _ in failures.values())
    if not isinstance(err, RuntimeError | ConnectionError | TimeoutError):
        return False
    text = str(err).lower()
    return any(word in text for word in ("connection", "timed out", "timeout", "peer", "closed"))


def _end(message: str, code: int, plain: bool = False, after: int | None = None) -> None:
    """Print `message` as this rank's one error line (`plain`: as it is, else through the logger; "":
    nothing) and end the process now with `code` (no atexit, no NCCL teardown, which can hang with a dead
    peer). The first thread to call it ends the process; any other waits for that. `after`: a rank whose
    line comes first: wait (a few seconds at most) until it has ended, since torchrun's agent stops the
    other ranks as soon as one exits. A process that hosts the store waits for the others to leave it."""
    _ending.acquire()
    if _watchdog is not None and after is not None and after != _watchdog.rank:
        _watchdog.wait_for([f"ended/{after}"], 5 * HEARTBEAT_S)
    if message and plain:
        _print_line(message)
    elif message:
        logger.error(message)
    if _watchdog is not None:
        _watchdog.mark("ended")
        if _hosts_store(_watchdog.rank):
            others = [f"ended/{r}" for r in _watchdog.others]
            _watchdog.wait_for(others, 2 * HEARTBEAT_S)
    _flush_and_exit(code)


def _print_line(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _flush_and_exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
