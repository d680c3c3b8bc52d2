"""The process group of a `torchrun` launch, and what ends every rank when one dies or hangs.

    dist, device = init_distributed("auto", cfg.parallel)   # from torchrun's RANK, WORLD_SIZE, LOCAL_RANK
    dist.enabled                                              # False without torchrun: nothing changes

Without torchrun (no WORLD_SIZE, or WORLD_SIZE=1) this returns `SINGLE` and the device of
`dlrm.device.resolve_device`, and starts nothing. With it: NCCL on CUDA (device cuda:LOCAL_RANK), gloo on the
CPU; the collectives' timeout is `parallel.timeout_s` (env DLRM_TIMEOUT_S overrides it). NVLink multicast
stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 are set before the
group is created, unless the environment already sets them).

Faults. A heartbeat thread per rank (`Watchdog`) writes a counter into the rendezvous store every second
and reads the others'. A rank whose counter stops for half the timeout (it died, or its process froze) is
named in one message, "rank k stopped ...", which every rank logs before exiting with status 1; a rank whose
main thread fails (an exception, a collective that timed out) sets the same abort key with its own message
(`fail`), so the others exit within about a second; when a collective timed out while every rank is
alive, the ranks not waiting in it are named as hung. A rank stuck in a collective (NCCL, or inside a
CUDA graph replay that no timeout sees) is ended by its own heartbeat thread when the abort key is set.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from loguru import logger

from dlrm.device import resolve_device

# NVLink multicast (NVLS) off: set before the process group is created, unless the environment says.
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
TIMEOUT_ENV = "DLRM_TIMEOUT_S"
HEARTBEAT_S = 1.0
EXIT_FAILED = 1


@dataclass(frozen=True)
class Dist:
    """This process's place in the job: rank in [0, world_size), local_rank on its host (its GPU)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    timeout_s: float = 300.0

    @property
    def enabled(self) -> bool:
        """True when several processes train one model (a process group exists)."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs, writes TensorBoard, config.json, metrics.json."""
        return self.rank == 0


SINGLE = Dist()
_watchdog: Watchdog | None = None


def world_from_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment; (0, 1, 0) without it.

    Raises:
        ValueError: a variable that is not an integer, or a rank outside [0, WORLD_SIZE).
    """
    values = {}
    for name, default in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)):
        raw = os.environ.get(name)
        try:
            values[name] = default if raw in (None, "") else int(raw)
        except ValueError:
            raise ValueError(f"environment {name}={raw!r}: expected an integer (set by torchrun)") from None
    rank, world_size, local_rank = values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"]
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"environment RANK={rank} WORLD_SIZE={world_size}: expected 0 <= RANK < WORLD_SIZE")
    return rank, world_size, local_rank


def timeout_from(config_s: float) -> float:
    """The collective timeout in seconds: env DLRM_TIMEOUT_S when set, else `config_s`.

    Raises:
        ValueError: DLRM_TIMEOUT_S is not a positive number.
    """
    raw = os.environ.get(TIMEOUT_ENV)
    if raw in (None, ""):
        return config_s
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"environment {TIMEOUT_ENV}={raw!r}: expected a positive number of seconds")
    return value


def init_distributed(device_name: str, timeout_s: float) -> tuple[Dist, torch.device]:
    """Join the torchrun job (or do nothing in a single process); return (Dist, this rank's device).

    Args:
        device_name: train.device, "auto" | "cpu" | "cuda"; under torchrun "cuda" means cuda:LOCAL_RANK.
        timeout_s: parallel.timeout_s (DLRM_TIMEOUT_S overrides it).
    Raises:
        ValueError: bad torchrun environment, "cuda" without a GPU, or fewer GPUs on the host than
            LOCAL_RANK + 1.
    """
    rank, world_size, local_rank = world_from_env()
    device = resolve_device(device_name)
    if world_size == 1:
        return SINGLE, device
    timeout_s = timeout_from(timeout_s)
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK={local_rank} but this host has {torch.cuda.device_count()} GPU(s): "
                "start at most one process per GPU (torchrun --nproc-per-node)"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    for name, value in MULTICAST_OFF.items():
        os.environ.setdefault(name, value)
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            timeout=timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    this = Dist(rank, world_size, local_rank, timeout_s)
    start_watchdog(this)
    if rank > 0:  # one log for the job: the other ranks say only what goes wrong
        logger.remove()
        logger.add(sys.stderr, level="WARNING", format="rank " + str(rank) + " | {level} | {message}")
    return this, device


def exit_now(code: int) -> None:
    """sys.exit(code) in one process; in a distributed one, end the process at once (os._exit after
    flushing): interpreter shutdown with the process group's threads alive can abort or hang."""
    if _watchdog is None:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def rank_prefix() -> str:
    """ "rank k: " on ranks other than 0 of a distributed run, else "" (for messages every rank prints)."""
    return f"rank {_watchdog.this.rank}: " if _watchdog is not None and _watchdog.this.rank else ""


def is_distributed() -> bool:
    """True in a process of a torchrun job whose process group is up."""
    return _watchdog is not None


def shutdown() -> None:
    """Stop the heartbeat thread and leave the process group (end of a torchrun job). A collective: every
    rank stops its heartbeats before any passes the barrier, so no rank sees another's stop (or the store
    of rank 0 going away) as a failure."""
    global _watchdog
    if _watchdog is not None:
        _watchdog.stop()
        _watchdog.join(timeout=10 * HEARTBEAT_S)
        _watchdog = None
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class Watchdog(threading.Thread):
    """Heartbeats through the rendezvous store; ends this process when a peer stops or a rank fails.

    Keys (under a prefix per torchrun restart): `beat/<rank>` a counter written every HEARTBEAT_S, `abort`
    the message of the first failure. A peer whose counter has not changed for `stale_s` seconds (half the
    timeout, at least 3 s) is declared stopped. It talks to the store through its own client, so a main
    thread blocked in a collective or a graph replay does not stop it.
    """

    def __init__(self, this: Dist, stale_s: float):
        super().__init__(name="dlrm-watchdog", daemon=True)
        self.this, self.stale_s = this, stale_s
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

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        rank, world = self.this.rank, self.this.world_size
        others = [r for r in range(world) if r != rank]
        start = time.monotonic()
        seen: dict[int, tuple[bytes | None, float]] = {r: (None, start) for r in others}
        beat = 0
        while not self._stop_event.is_set():
            beat += 1
            try:
                self.store.set(f"beat/{rank}", f"{beat}:{self.step}")
                if self.store.check(["abort"]) and not self._aborting:  # (ours: our caller exits)
                    _exit(f"rank {rank}: ending: {self.store.get('abort').decode()}")
                now = time.monotonic()
                for r in others:
                    key = f"beat/{r}"
                    value = self.store.get(key) if self.store.check([key]) else None
                    if value != seen[r][0]:
                        seen[r] = (value, now)
                    elif now - seen[r][1] > self.stale_s:
                        where = f" (last heartbeat at step {value.decode().split(':')[1]})" if value else ""
                        message = (
                            f"rank {r} stopped: no heartbeat for {self.stale_s:.0f} s{where}; it died or hung"
                        )
                        self.abort(message)
                        _exit(f"rank {rank}: ending: {message}")
            except Exception as err:  # the store is gone: its host (rank 0 or the torchrun agent) died
                if not self._stop_event.is_set():
                    reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
                    _exit(
                        f"rank {rank}: ending: the rendezvous store {self.address} is unreachable "
                        f"({reason}): rank 0 or the torchrun agent died"
                    )
            self._stop_event.wait(HEARTBEAT_S)

    def mark_failed(self) -> None:
        """Record in the store that this rank's main thread saw a collective fail."""
        try:
            self.store.set(f"failed/{self.this.rank}", "1")
        except Exception:
            pass

    def not_failed(self) -> list[int]:
        """The ranks that have not marked a failed collective ([] when the store cannot be read)."""
        try:
            return [r for r in range(self.this.world_size) if not self.store.check([f"failed/{r}"])]
        except Exception:
            return []

    def abort(self, message: str) -> None:
        """Tell every rank to end with `message` (best effort), and give them two heartbeats to read it
        (this process may host the store: without torchrun's agent, rank 0 does)."""
        self._aborting = True
        try:
            self.store.set("abort", message)
        except Exception:
            return
        time.sleep(2 * HEARTBEAT_S)


def start_watchdog(this: Dist) -> None:
    """Start the heartbeat thread of this rank (once per process)."""
    global _watchdog
    if _watchdog is None:
        _watchdog = Watchdog(this, stale_s=max(3.0, this.timeout_s / 2))
        _watchdog.start()


def note_progress(step: int) -> None:
    """Record the training step reached (shown in heartbeat messages); cheap, called every step."""
    if _watchdog is not None:
        _watchdog.step = step


def abort_peers(message: str) -> None:
    """Make every other rank end with `message` (no-op in a single process)."""
    if _watchdog is not None:
        _watchdog.abort(message)


def fail(err: BaseException) -> None:
    """End this rank after an exception in a distributed run: tell the others, and name the cause.
    Never returns.

    A collective that failed because a peer died (gloo: "connection closed") is usually seen before that
    peer's heartbeat goes stale: this rank marks itself failed in the store and waits up to the staleness
    window, in which the heartbeat thread names a rank that stopped (and exits the process). When every
    rank is alive, the ranks that did not mark themselves failed are alive but outside the collective that
    timed out: named as hung. Otherwise (this rank's own error) the message is this rank's error.
    """
    this = _watchdog.this if _watchdog is not None else SINGLE
    first_line = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
    message = f"rank {this.rank} failed: {type(err).__name__}: {first_line}"
    if _watchdog is not None and _is_communication_error(err):
        _watchdog.mark_failed()
        deadline = time.monotonic() + _watchdog.stale_s + 2 * HEARTBEAT_S
        while time.monotonic() < deadline:
            time.sleep(0.2)  # the heartbeat thread exits the process if it finds a stopped rank
        hung = _watchdog.not_failed()
        if hung:
            names = ", ".join(str(r) for r in hung)
            message = (
                f"rank {names} hung: alive, but not in the collective that failed on rank {this.rank} "
                f"({type(err).__name__}: {first_line})"
            )
    else:  # this rank's own error: its traceback, then the one-line message
        logger.debug("".join(traceback.format_exception(err)))
    abort_peers(message)
    _exit(f"rank {this.rank}: ending: {message}")


def _is_communication_error(err: BaseException) -> bool:
    """A collective that failed (a peer gone, a timeout) rather than this rank's own error."""
    text = str(err).lower()
    return isinstance(err, dist.DistError) or any(
        word in text for word in ("connection", "timed out", "timeout", "peer", "closed")
    )


def _exit(message: str) -> None:
    """Log `message` as this rank's one error line and end the process now (no atexit, no NCCL
    teardown, which can hang with a dead peer)."""
    logger.error(message)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_FAILED)
