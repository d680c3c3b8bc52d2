"""Background prefetch that never calls CUDA from its thread: a thread pulls host batches from an iterator
and copies them into page-locked (pinned) slots; the consumer's thread issues each slot's host-to-device
copy on a side CUDA stream, one batch ahead.

    for batch in prefetch_to_device(host_batches, torch.device("cuda"), depth=4, batch_size=65536):
        ...                                                   # on the GPU, copy ordered before use

Why no CUDA call in the thread: a CUDA graph capture on the training thread (`--cuda-graphs`, or Inductor's
"reduce-overhead" mode) is invalidated by CUDA work of any other thread while it records (pinned
allocation, a copy, an event: cudaErrorStreamCaptureInvalidated). So the pinned slots are allocated by the
consumer before the thread starts, the thread only copies host memory into them, and every CUDA call
(copy, event, stream wait) is made by the consumer between steps.

A slot goes back to the thread once its copy has finished (its event, queried by the consumer). The
consumer's stream waits on each batch's copy event (a GPU-side wait, no host sync), and the batch's device
memory is recorded on the consumer's stream so the allocator does not reuse it while kernels still read
it. An exception raised in the thread is raised again, the same object, in the consumer. Closing the
returned generator (or dropping it) stops and joins the thread.

Memory: (depth + 2) pinned slots of `batch_size` rows (264 bytes a row) plus the batches in flight.
"""

import queue
import threading
from collections import deque
from collections.abc import Iterator
from typing import NamedTuple

import torch

from dlrm.data.dataset import Batch
from dlrm.data.schema import NUM_DENSE, NUM_SPARSE

# How often a thread blocked on a queue checks whether the other side has gone.
_POLL_S = 0.05
# Slots beyond `depth`: one whose copy is in flight and one the consumer's last batch was copied from.
_EXTRA_SLOTS = 2


class _Failure(NamedTuple):
    error: BaseException


_END = object()


def prefetch_to_device(
    batches: Iterator[Batch],
    device: torch.device,
    depth: int,
    batch_size: int,
    sparse_width: int = NUM_SPARSE,
) -> Iterator[Batch]:
    """Batches of `batches` on `device`, read `depth` batches ahead by a background thread.

    Args:
        batches: host batches (CPU tensors) of at most `batch_size` rows; iterated in the thread only.
        device: for CUDA, batches go through pinned slots and a side-stream copy (module docstring);
            otherwise the thread hands them over as they are and the consumer moves them.
        depth: batches ready ahead (the queue bound), at least 1.
        batch_size: rows of the largest batch (B), the size of a pinned slot.
        sparse_width: ids a row (F, or S for multi-hot rows: dlrm.data.bags).
    Raises:
        ValueError: depth < 1.
        Any exception of `batches`, re-raised in the consumer.
    """
    if depth < 1:
        raise ValueError(f"prefetch depth must be at least 1, got {depth}")
    slots = _pinned_slots(depth + _EXTRA_SLOTS, batch_size, sparse_width) if device.type == "cuda" else []
    free: queue.Queue = queue.Queue()
    for index in range(len(slots)):
        free.put(index)
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    thread = threading.Thread(
        target=_produce, args=(batches, slots, free, ready, stop), name="dlrm-prefetch", daemon=True
    )
    return _consume(thread, slots, free, ready, stop, device)


def _pinned_slots(count: int, batch_size: int, sparse_width: int) -> list[Batch]:
    return [
        Batch(
            torch.empty(batch_size, NUM_DENSE, dtype=torch.float32, pin_memory=True),
            torch.empty(batch_size, sparse_width, dtype=torch.int64, pin_memory=True),
            torch.empty(batch_size, dtype=torch.float32, pin_memory=True),
        )
        for _ in range(count)
    ]


def _consume(
    thread: threading.Thread,
    slots: list[Batch],
    free: queue.Queue,
    ready: queue.Queue,
    stop: threading.Event,
    device: torch.device,
) -> Iterator[Batch]:
    side = torch.cuda.Stream(device) if slots else None
    in_flight: deque[tuple[int, torch.cuda.Event]] = deque()
    thread.start()
    try:
        while (item := ready.get()) is not _END:
            if isinstance(item, _Failure):
                raise item.error
            if side is None:
                yield item.to(device)
                continue
            index, rows = item
            consumer = torch.cuda.current_stream(device)
            with torch.cuda.stream(side):
                batch = Batch(*(t[:rows].to(device, non_blocking=True) for t in slots[index]))
                copied = torch.cuda.Event()
                copied.record(side)
            consumer.wait_event(copied)
            for tensor in batch:
                tensor.record_stream(consumer)
            in_flight.append((index, copied))
            # Hand back the slots whose copies are done; the oldest of two is one batch old, so waiting
            # for it costs nothing in practice and bounds the slots held here.
            while in_flight and (len(in_flight) > 1 or in_flight[0][1].query()):
                index, copied = in_flight.popleft()
                copied.synchronize()
                free.put(index)
            yield batch
    finally:
        stop.set()
        thread.join()


def _produce(
    batches: Iterator[Batch], slots: list[Batch], free: queue.Queue, ready: queue.Queue, stop: threading.Event
) -> None:
    try:
        for batch in batches:
            if slots:
                index = _get(free, stop)
                if index is None:
                    return
                rows = len(batch.label)
                for slot, tensor in zip(slots[index], batch, strict=True):
                    slot[:rows].copy_(tensor)
                item = (index, rows)
            else:
                item = batch
            if not _put(ready, item, stop):
                return
        _put(ready, _END, stop)
    except BaseException as err:  # noqa: BLE001 - handed to the consumer, which raises it
        _put(ready, _Failure(err), stop)


def _get(free: queue.Queue, stop: threading.Event) -> int | None:
    """A free slot once there is one; None when the consumer stopped first."""
    while not stop.is_set():
        try:
            return free.get(timeout=_POLL_S)
        except queue.Empty:
            continue
    return None


def _put(ready: queue.Queue, item: object, stop: threading.Event) -> bool:
    """Put `item` once there is room; False when the consumer stopped first."""
    while not stop.is_set():
        try:
            ready.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False
