"""Tests of the background prefetch thread (dlrm.data.prefetch) on the CPU."""

import threading

import pytest
import torch

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
    out = list(prefetch_to_device(batches(5), torch.device("cpu"), depth))
    assert [int(b.sparse[0, 0]) for b in out] == [0, 1, 2, 3, 4]
    assert not prefetch_threads()


def test_the_thread_stays_at_most_depth_batches_ahead():
    produced = []

    def counted():
        for batch in batches(20):
            produced.append(batch)
            yield batch

    stream = prefetch_to_device(counted(), torch.device("cpu"), depth=3)
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
    stream = prefetch_to_device(batches(5, fail_at=2), torch.device("cpu"), depth=2)
    assert int(next(stream).sparse[0, 0]) == 0
    assert int(next(stream).sparse[0, 0]) == 1
    with pytest.raises(KeyError, match="batch 2 is missing"):
        next(stream)
    assert not prefetch_threads()


def test_dropping_the_iterator_stops_the_thread():
    stream = prefetch_to_device(batches(1000), torch.device("cpu"), depth=2)
    next(stream)
    assert prefetch_threads()
    del stream
    assert not prefetch_threads()


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="prefetch depth must be at least 1, got 0"):
        prefetch_to_device(batches(1), torch.device("cpu"), 0)
