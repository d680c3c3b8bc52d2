"""Checkpoints of any size: the host memory a save stages (CHUNK_BYTES at a time), and saves written in the
background (`PendingSave`) from a snapshot of the state on its own device (`snapshot`, when `has_room`).
Used by dlrm.checkpoint (one process's .pt) and dlrm.parallel.checkpoint (DCP's sharded directories)."""

import copy
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from loguru import logger

CHUNK_BYTES = 256 * 2**20  # host memory a save stages at a time (one buffer of a device storage's bytes)
SNAPSHOT_MARGIN = 0.1  # of the device's memory left free after a background save's snapshot (at least 2 GiB)
SAVE_SWITCH_INTERVAL_S = 1e-4  # Python's thread switch interval while a background save writes (PendingSave)


# Held by a background save while it writes and by each CUDA graph capture (dlrm.graphs): page-locked
# memory allocated by the writer during another thread's capture fails ("invalid argument", H200, torch
# 2.11) and the capture with it, whatever its capture mode. Captures are rare (a new batch size, the first
# evaluation), so one waiting for a save to end costs little.
CAPTURE_LOCK = threading.Lock()


class _SwitchInterval:
    """Python's switch interval at SAVE_SWITCH_INTERVAL_S while any background save writes (saves of
    several runs of one process can overlap), the interval before the first set back when the last ends."""

    def __init__(self):
        self.lock, self.writing, self.before = threading.Lock(), 0, None

    def writing_starts(self) -> None:
        with self.lock:
            if self.writing == 0:
                self.before = sys.getswitchinterval()
                sys.setswitchinterval(SAVE_SWITCH_INTERVAL_S)
            self.writing += 1

    def writing_ends(self) -> None:
        with self.lock:
            self.writing -= 1
            if self.writing == 0:
                sys.setswitchinterval(self.before)


_switch_interval = _SwitchInterval()


class PendingSave:
    """A checkpoint written by a background thread, `write`; once written it logs `announce` (e.g. "step
    400: checkpoint RUN/checkpoints/last.pt") and the time it took. `wait()` returns once it is written and
    raises what the writing raised (once); a process that exits waits for it (the thread is not a
    daemon). One save at a time (a second waits for the first).

    `yield_core()`: while it writes, the thread that started it runs torch's intra-op pool with one thread
    fewer (torch.set_num_threads), leaving a core to the writing: an OpenMP parallel region waits for its
    slowest thread, and a thread that shares its core with the writing waits out whole scheduler slices (a
    loader's index_select on 2 cores beside a hashing thread: 3.4x slower with both threads, 0.9x with
    one). The setting is per thread, so that thread gives it back: in `settle()` once the writing has
    ended (the loop asks after every step), or in `wait()`. Not for a run that compiles: Dynamo guards on
    the thread count, so a change recompiles every compiled region; not for a model trained on the CPU,
    whose reductions split their work by the thread count (dlrm.run.checkpoints.yields_core).

    While it writes, Python's thread switch interval is SAVE_SWITCH_INTERVAL_S (sys.setswitchinterval; 5 ms
    by default), the process's own set back once no save writes (`_SwitchInterval`): the writing's
    Python-bound parts (DCP's planning, pickling) keep the GIL until another thread has waited a whole
    interval, and the training thread takes the GIL back after each torch call and each wait for the GPU, a
    few times a step. On this project's 2-core CPU machine, a step of 10 small torch ops between 1.5 ms
    waits beside a pure-Python thread: 15.7x slower than alone at 5 ms, 3.8x at 1 ms, 1.28x at 0.1 ms, the
    Python thread's own throughput 3% lower at 0.1 ms than at 5 ms.

    The writing holds CAPTURE_LOCK: a CUDA graph capture (dlrm.graphs) waits for it to end."""

    def __init__(self, write: Callable[[], None], announce: str):
        self.announce, self.error, self.started = announce, None, time.perf_counter()
        self.thread = threading.Thread(target=self._run, args=(write,), name="dlrm-save")
        self.threads: int | None = None  # the calling thread's intra-op threads while a core is yielded
        _switch_interval.writing_starts()
        self.thread.start()

    def _run(self, write: Callable[[], None]) -> None:
        try:
            with CAPTURE_LOCK:
                write()
        except BaseException as err:  # noqa: BLE001 - handed to the thread that waits
            self.error = err
        else:
            took = time.perf_counter() - self.started
            logger.info("{} (written in the background in {:.1f} s)", self.announce, took)
        finally:
            _switch_interval.writing_ends()

    def yield_core(self) -> None:
        """Run the calling thread's intra-op pool with one thread fewer until `settle()` or `wait()` gives it
        back (class docstring)."""
        if self.threads is None:
            self.threads = torch.get_num_threads()
            torch.set_num_threads(max(1, self.threads - 1))

    def settle(self) -> bool:
        """Whether the writing has ended; if so, the intra-op threads are given back (its outcome waits for
        `wait()`). Call it from the thread that started the save."""
        if self.thread.is_alive():
            return False
        self._give_back_threads()
        return True

    def _give_back_threads(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)
            self.threads = None

    def wait(self) -> None:
        self.thread.join()
        self._give_back_threads()
        error, self.error = self.error, None
        if error is not None:
            raise error


def announce(state: dict[str, Any], path: Path, links: Sequence[Path]) -> str:
    """ "step <N>: checkpoint <path>[ and <link names>]": the log line of a checkpoint of `state` written."""
    names = "".join(f" and {link.name}" for link in links)
    return f"step {state.get('step')}: checkpoint {path}{names}"


def tensor_bytes(state: Any) -> int:
    """Bytes of the storages of `state`'s tensors (each storage once): what torch.save writes of them."""
    storages: dict[int, int] = {}
    for t in _tensors(state):
        storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(storages.values())


def snapshot(state: Any) -> Any:
    """A copy of `state` that later updates of its tensors cannot change: each storage cloned on its own
    device (views keep their layout), the rest deep-copied; None when a device lacks room for its copies
    (`has_room`)."""
    tensors = list(_tensors(state))
    by_device: dict[torch.device, dict[int, int]] = {}
    for t in tensors:
        by_device.setdefault(t.device, {})[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    if not all(has_room(device, sum(sizes.values())) for device, sizes in by_device.items()):
        return None
    clones: dict[int, torch.UntypedStorage] = {}
    memo: dict[int, Any] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage._cdata not in clones:
            clones[storage._cdata] = storage.clone()
        copy_ = torch.empty(0, dtype=t.dtype, device=t.device)
        memo[id(t)] = copy_.set_(clones[storage._cdata], t.storage_offset(), t.size(), t.stride())
    for device in by_device:  # the copies are complete before another thread reads them
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
    return copy.deepcopy(state, memo)


def has_room(device: torch.device, nbytes: int) -> bool:
    """Whether `nbytes` more fit in `device`'s memory leaving SNAPSHOT_MARGIN of it (at least 2 GiB)
    free: the GPU's free memory, or the host's available memory (/proc/meminfo; False where unknown)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
    elif device.type == "cpu":
        free, total = _host_memory()
    else:
        return False
    return nbytes + max(2 * 2**30, SNAPSHOT_MARGIN * total) <= free


def _host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory; (0, 0) where /proc/meminfo cannot be read."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        return int(fields["MemAvailable"].split()[0]) * 1024, int(fields["MemTotal"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0, 0


def _tensors(state: Any) -> Iterator[torch.Tensor]:
    """The tensors in `state` (nested dicts, lists and tuples)."""
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from _tensors(value)
    elif isinstance(state, list | tuple):
        for value in state:
            yield from _tensors(value)
