"""Tests of the GPU-resident loader (dlrm.data.resident), on the CPU device (and on CUDA where present)."""

import copy

import pytest
import torch

from dlrm.data.dataset import BatchLoader, ParquetDataset
from dlrm.data.resident import ResidentLoader, row_bytes
from tests.test_streaming import ROWS, write_id_files


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> ParquetDataset:
    return ParquetDataset(write_id_files(tmp_path_factory.mktemp("ids")))


def epoch_ids(loader: ResidentLoader, epoch: int) -> torch.Tensor:
    loader.set_epoch(epoch)
    return torch.cat([b.sparse[:, 0] for b in loader]).cpu()


def test_shuffled_epoch_is_a_deterministic_permutation_of_all_rows(dataset):
    loader = ResidentLoader(dataset, batch_size=16, shuffle=True, seed=4)
    epoch0 = epoch_ids(loader, 0)
    assert torch.equal(epoch0.sort().values, torch.arange(ROWS))
    assert not torch.equal(epoch0, torch.arange(ROWS))
    assert torch.equal(epoch_ids(ResidentLoader(dataset, batch_size=16, shuffle=True, seed=4), 0), epoch0)
    epoch1 = epoch_ids(loader, 1)
    assert torch.equal(epoch1.sort().values, torch.arange(ROWS)) and not torch.equal(epoch1, epoch0)
    assert not torch.equal(epoch_ids(ResidentLoader(dataset, 16, shuffle=True, seed=5), 0), epoch0)
    for batch in loader:  # rows stay whole
        assert torch.equal(batch.label, (batch.sparse[:, 0] % 2).float())
        assert torch.equal(batch.dense, dataset.dense[batch.sparse[:, 0]])


def test_unshuffled_batches_are_those_of_the_memory_loader(dataset):
    ours, theirs = list(ResidentLoader(dataset, batch_size=30)), list(BatchLoader(dataset, batch_size=30))
    assert [len(b.label) for b in ours] == [30, 30, 30, 10]
    for a, b in zip(ours, theirs, strict=True):
        assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(a, b, strict=True))


def test_drop_last_and_bad_batch_size(dataset):
    loader = ResidentLoader(dataset, batch_size=30, shuffle=True, drop_last=True)
    assert len(loader) == 3
    ids = epoch_ids(loader, 0)
    assert len(ids) == 90 and len(ids.unique()) == 90
    with pytest.raises(ValueError, match="batch_size must be at least 1, got 0"):
        ResidentLoader(dataset, batch_size=0)


def test_row_bytes_counts_the_tensors_as_held_and_the_permutation(dataset):
    """The module's documented cost: dense 13 x float32, sparse 26 x int64, label float32 (264 bytes), plus
    8 for the row's int64 entry in the epoch's permutation; a narrower dtype counts its own size."""
    assert row_bytes(dataset) == 13 * 4 + 26 * 8 + 4 + 8
    narrow = copy.copy(dataset)  # a shallow copy: the fixture is shared
    narrow.sparse = narrow.sparse.to(torch.int32)
    assert row_bytes(narrow) == 13 * 4 + 26 * 4 + 4 + 8


@pytest.mark.gpu
def test_cuda_resident_permutation(dataset):
    loader = ResidentLoader(dataset, batch_size=16, shuffle=True, seed=4, device="cuda")
    assert loader.dataset.sparse.is_cuda
    batches = list(loader)
    assert all(t.is_cuda for b in batches for t in b)
    ids = torch.cat([b.sparse[:, 0] for b in batches]).cpu()
    assert torch.equal(ids.sort().values, torch.arange(ROWS))
    assert torch.equal(epoch_ids(ResidentLoader(dataset, 16, shuffle=True, seed=4, device="cuda"), 0), ids)
