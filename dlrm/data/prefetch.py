"""Background prefetch: a thread pulls batches from a host-side iterator, pins them and copies them to the
device on a side CUDA stream, keeping up to `depth` batches ready ahead of the consumer.

    for batch in prefetch_to_device(host_batches, torch.device("cuda"), depth=4):
        ...                                                   # already on the GPU, copy finished

The consumer's stream waits on each batch's copy event (a GPU-side wait, no host sync), and the batch's
memory is recorded on the consumer's stream so the allocator does not reuse it while kernels still read it.
An exception raised in the thread is raised again, the same object, in the consumer. Closing the returned
generator (or dropping it) stops and joins the thread.
"""

import queue
import threading
from collections.abc import Iterator
from typing import NamedTuple

import torch

from dlrm.data.dataset import Batch

# How often a producer blocked on a full queue checks whether the consumer has gone.
_POLL_S = 0.05


class _Failure(NamedTuple):
    error: BaseException


_END = object()


def prefetch_to_device(batches: Iterator[Batch], device: torch.device, depth: int) -> Iterator[Batch]:
    """Batches of `batches` on `device`, read and copied by a background thread `depth` batches ahead.

    Args:
        batches: host batches (CPU tensors); iterated in the background thread only.
        device: for CUDA, batches are pinned and copied non-blocking on a side stream; otherwise they
            are moved with `Batch.to` in the thread.
        depth: batches ready ahead (the queue bound), at least 1.
    Raises:
        ValueError: depth < 1.
        Any exception of `batches` (or of the copy), re-raised in the consumer.
    """
    if depth < 1:
        raise ValueError(f"prefetch depth must be at least 1, got {depth}")
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    thread = threading.Thread(
        target=_produce, args=(batches, device, ready, stop), name="dlrm-prefetch", daemon=True
    )
    return _consume(thread, ready, stop, device)


def _consume(
    thread: threading.Thread, ready: queue.Queue, stop: threading.Event, device: torch.device
) -> Iterator[Batch]:
    thread.start()
    try:
        while (item := ready.get()) is not _END:
            if isinstance(item, _Failure):
                raise item.error
            batch, copied = item
            if copied is not None:
                stream = torch.cuda.current_stream(device)
                stream.wait_event(copied)
                for tensor in batch:
                    tensor.record_stream(stream)
            yield batch
    finally:
        stop.set()
        thread.join()


def _produce(
    batches: Iterator[Batch], device: torch.device, ready: queue.Queue, stop: threading.Event
) -> None:
    try:
        side = torch.cuda.Stream(device) if device.type == "cuda" else None
        for batch in batches:
            copied = None
            if side is not None:
                pinned = batch.pin_memory()
                with torch.cuda.stream(side):
                    batch = pinned.to(device, non_blocking=True)
                    copied = torch.cuda.Event()
                    copied.record(side)
            else:
                batch = batch.to(device)
            if not _put(ready, (batch, copied), stop):
                return
        _put(ready, _END, stop)
    except BaseException as err:  # noqa: BLE001 - handed to the consumer, which raises it
        _put(ready, _Failure(err), stop)


def _put(ready: queue.Queue, item: object, stop: threading.Event) -> bool:
    """Put `item` once there is room; False when the consumer stopped first."""
    while not stop.is_set():
        try:
            ready.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False
