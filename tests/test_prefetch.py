"""Tests of the background prefetch thread (dlrm.data.prefetch) on the CPU."""

import contextlib
import threading
import types

import pytest
import torch

from dlrm.data import prefetch
from dlrm.data.dataset import Batch
from dlrm.data.prefetch import prefetch_to_device


def batches(n: int, fail_at: int | None = None):
    for i in range(n):
        if i == fail_at:
            raise KeyError(f"batch {i} is missing")
        yield Batch(torch.full((2, 13), float(i)), torch.full((2, 26), i), torch.full((2,), float(i)))


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "dlrm-prefetch"]


@pytest.mark.parametrize("depth", [1, 2, 8])
def test_batches_come_through_in_order(depth):
    out = list(prefetch_to_device(batches(5), torch.device("cpu"), depth, batch_size=2))
    assert [int(b.sparse[0, 0]) for b in out] == [0, 1, 2, 3, 4]
    assert not prefetch_threads()


def test_the_thread_stays_at_most_depth_batches_ahead():
    produced = []

    def counted():
        for batch in batches(20):
            produced.append(batch)
            yield batch

    stream = prefetch_to_device(counted(), torch.device("cpu"), depth=3, batch_size=2)
    next(stream)
    for _ in range(100):  # let the thread fill the queue
        if len(produced) >= 5:
            break
        threading.Event().wait(0.01)
    # One consumed, 3 queued, one more waiting to be put.
    assert len(produced) == 5
    stream.close()
    assert not prefetch_threads()


def test_an_exception_in_the_thread_is_raised_in_the_consumer():
    stream = prefetch_to_device(batches(5, fail_at=2), torch.device("cpu"), depth=2, batch_size=2)
    assert int(next(stream).sparse[0, 0]) == 0
    assert int(next(stream).sparse[0, 0]) == 1
    with pytest.raises(KeyError, match="batch 2 is missing"):
        next(stream)
    assert not prefetch_threads()


def test_dropping_the_iterator_stops_the_thread():
    stream = prefetch_to_device(batches(1000), torch.device("cpu"), depth=2, batch_size=2)
    next(stream)
    assert prefetch_threads()
    del stream
    assert not prefetch_threads()


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="prefetch depth must be at least 1, got 0"):
        prefetch_to_device(batches(1), torch.device("cpu"), 0, batch_size=2)


def test_only_the_consumer_calls_cuda(monkeypatch):
    """The CUDA path with every CUDA entry point it uses replaced by a recorder: each call must come from
    the consumer's thread, since CUDA work of another thread invalidates a graph capture in the training
    thread (issue 12's crash with --cuda-graphs)."""
    calls = []

    def note(name):
        calls.append((name, threading.current_thread() is threading.main_thread()))

    class FakeEvent:
        def record(self, stream):
            note("Event.record")

        def query(self):
            note("Event.query")
            return True

        def synchronize(self):
            note("Event.synchronize")

    class FakeStream:
        def wait_event(self, event):
            note("Stream.wait_event")

    def fake(name, result):
        def call(*args, **kwargs):
            note(name)
            return result()

        return call

    def to(tensor, *args, **kwargs):
        note("Tensor.to")
        return tensor.clone()

    def plain_slots(count, batch_size, sparse_width):
        note("pin")
        return [Batch(torch.empty(batch_size, 13), torch.empty(batch_size, sparse_width, dtype=torch.int64),
                      torch.empty(batch_size)) for _ in range(count)]  # fmt: skip

    monkeypatch.setattr(prefetch, "_pinned_slots", plain_slots)
    monkeypatch.setattr(torch.cuda, "Stream", fake("Stream", FakeStream))
    monkeypatch.setattr(torch.cuda, "Event", fake("Event", FakeEvent))
    monkeypatch.setattr(torch.cuda, "current_stream", fake("current_stream", FakeStream))
    monkeypatch.setattr(torch.cuda, "stream", fake("stream", contextlib.nullcontext))
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: note("record_stream"))
    out = list(prefetch_to_device(batches(7), types.SimpleNamespace(type="cuda"), depth=2, batch_size=2))
    assert [int(b.sparse[0, 0]) for b in out] == list(range(7))
    assert {"pin", "Tensor.to", "Event.record", "Stream.wait_event"} <= {name for name, _ in calls}
    assert all(on_consumer for _, on_consumer in calls), [n for n, main in calls if not main]
