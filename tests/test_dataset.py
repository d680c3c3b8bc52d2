"""Tests of the batch loader (dlrm.data.dataset) against the shipped real Criteo rows."""

import gzip
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dlrm.data.dataset import Batch, BatchLoader, ParquetDataset, load_metadata, open_split
from dlrm.data.preprocess import preprocess
from dlrm.data.schema import (
    DENSE_COLUMNS,
    LABEL,
    LECTURE_DENSE_COLUMNS,
    LECTURE_LABEL,
    LECTURE_SPARSE_COLUMNS,
    SPARSE_COLUMNS,
)

SAMPLE = Path(__file__).parents[1] / "data" / "day_0_head10k.tsv.gz"


def reference_batch(lines: list[str]) -> Batch:
    """The expected batch of raw lines, parsed with plain Python."""
    fields = [line.split("\t") for line in lines]
    dense = [[math.log1p(max(int(x), 0)) if x else 0.0 for x in f[1:14]] for f in fields]
    sparse = [[int(x, 16) if x else -1 for x in f[14:40]] for f in fields]
    label = [float(f[0]) for f in fields]
    return Batch(
        torch.tensor(dense, dtype=torch.float32),
        torch.tensor(sparse, dtype=torch.int64),
        torch.tensor(label, dtype=torch.float32),
    )


def assert_batch_equal(actual: Batch, expected: Batch) -> None:
    assert actual.dense.dtype == torch.float32 and actual.dense.shape == expected.dense.shape
    assert actual.sparse.dtype == torch.int64 and actual.sparse.shape == expected.sparse.shape
    assert actual.label.dtype == torch.float32 and actual.label.shape == expected.label.shape
    # log1p in float32 (loader) and float64 rounded (reference) may differ in the last bit.
    torch.testing.assert_close(actual.dense, expected.dense, rtol=1e-6, atol=0)
    assert torch.equal(actual.sparse, expected.sparse)
    assert torch.equal(actual.label, expected.label)


def concat(batches) -> Batch:
    return Batch(*(torch.cat(parts) for parts in zip(*batches, strict=True)))


@pytest.fixture(scope="module")
def lines() -> list[str]:
    return gzip.decompress(SAMPLE.read_bytes()).decode().splitlines()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "criteo_sample"
    preprocess([SAMPLE], out, rows_per_file=3000)
    return out


@pytest.fixture(scope="module")
def train_set(data_dir) -> ParquetDataset:
    return open_split(data_dir, "train")


def id_dataset(tmp_path: Path, rows: int) -> ParquetDataset:
    """A dataset whose C1 is the row index, to follow rows through shuffling."""
    columns = {LABEL: np.arange(rows) % 2, **{c: np.ones(rows) for c in DENSE_COLUMNS}}
    columns.update({c: np.arange(rows) if c == "C1" else np.zeros(rows, np.int64) for c in SPARSE_COLUMNS})
    pq.write_table(pa.table(columns), tmp_path / "ids.parquet")
    return ParquetDataset([tmp_path / "ids.parquet"])


def test_batches_match_the_tsv(train_set, lines):
    assert train_set.num_rows == len(train_set) == 8000
    assert [f.name for f in train_set.files] == [
        "part-00000.parquet",
        "part-00001.parquet",
        "part-00002.parquet",
    ]
    loader = BatchLoader(train_set, batch_size=64)
    first = next(iter(loader))
    assert isinstance(first, Batch)
    assert_batch_equal(first, reference_batch(lines[:64]))
    assert_batch_equal(concat(loader), reference_batch(lines[:8000]))


def test_val_then_test_are_the_last_rows(data_dir, lines):
    val_set, test_set = open_split(data_dir, "val"), open_split(data_dir, "test")
    assert_batch_equal(concat(BatchLoader(val_set, batch_size=512)), reference_batch(lines[8000:9000]))
    assert_batch_equal(concat(BatchLoader(test_set, batch_size=512)), reference_batch(lines[9000:]))


def test_len_and_drop_last(train_set):
    loader = BatchLoader(train_set, batch_size=3000)
    assert loader.num_rows == 8000
    assert len(loader) == 3
    assert [len(b.label) for b in loader] == [3000, 3000, 2000]
    loader = BatchLoader(train_set, batch_size=3000, drop_last=True)
    assert len(loader) == 2
    assert [len(b.label) for b in loader] == [3000, 3000]
    assert len(BatchLoader(train_set, batch_size=8001, drop_last=True)) == 0
    assert list(BatchLoader(train_set, batch_size=8001, drop_last=True)) == []
    assert len(BatchLoader(train_set, batch_size=4000)) == 2
    with pytest.raises(ValueError, match="batch_size"):
        BatchLoader(train_set, batch_size=0)


def test_shuffle_is_a_deterministic_permutation_per_epoch(tmp_path):
    dataset = id_dataset(tmp_path, 1000)

    def epoch_ids(loader: BatchLoader, epoch: int) -> torch.Tensor:
        loader.set_epoch(epoch)
        return torch.cat([b.sparse[:, 0] for b in loader])

    loader = BatchLoader(dataset, batch_size=96, shuffle=True, seed=7)
    epoch0 = epoch_ids(loader, 0)
    assert torch.equal(epoch0.sort().values, torch.arange(1000))
    assert not torch.equal(epoch0, torch.arange(1000))
    assert torch.equal(epoch_ids(BatchLoader(dataset, batch_size=96, shuffle=True, seed=7), 0), epoch0)
    epoch1 = epoch_ids(loader, 1)
    assert not torch.equal(epoch1, epoch0)
    assert torch.equal(epoch1.sort().values, torch.arange(1000))
    assert torch.equal(epoch_ids(loader, 0), epoch0)
    assert not torch.equal(epoch_ids(BatchLoader(dataset, batch_size=96, shuffle=True, seed=8), 0), epoch0)
    # Rows stay whole: each label still belongs to its id.
    for batch in loader:
        assert torch.equal(batch.label, (batch.sparse[:, 0] % 2).float())


def test_shuffle_with_drop_last_leaves_out_a_random_remainder(tmp_path):
    loader = BatchLoader(id_dataset(tmp_path, 100), batch_size=30, shuffle=True, drop_last=True)
    ids = torch.cat([b.sparse[:, 0] for b in loader])
    assert len(ids) == 90 and len(ids.unique()) == 90


def test_lecture_layout_gives_the_same_batches(tmp_path, data_dir, train_set):
    ours = pq.read_table(data_dir / "train" / "part-00000.parquet")
    lecture = {LECTURE_LABEL: pa.array(ours.column(LABEL).to_numpy().astype(np.int32))}
    for name, lecture_name in zip(DENSE_COLUMNS, LECTURE_DENSE_COLUMNS, strict=True):
        lecture[lecture_name] = pa.array(ours.column(name).to_numpy().astype(np.int64))
    for name, lecture_name in zip(SPARSE_COLUMNS, LECTURE_SPARSE_COLUMNS, strict=True):
        lecture[lecture_name] = ours.column(name)
    pq.write_table(pa.table(lecture), tmp_path / "lecture.parquet")
    lecture_set = ParquetDataset([tmp_path / "lecture.parquet"])
    assert lecture_set.num_rows == 3000
    expected = train_set.batch(slice(0, 3000))
    for actual, wanted in zip(lecture_set.batch(slice(0, 3000)), expected, strict=True):
        assert actual.dtype == wanted.dtype and torch.equal(actual, wanted)


def test_wrong_schema_names_file_and_missing_columns(tmp_path, data_dir):
    table = pq.read_table(data_dir / "test" / "part-00000.parquet").drop_columns(["I3", "C7"])
    pq.write_table(table, tmp_path / "broken.parquet")
    with pytest.raises(ValueError, match=r"broken.parquet: missing columns I3, C7 \(expected"):
        ParquetDataset(tmp_path)
    table = pa.table(
        {"C1": pa.array(["a"]), **{c: [1] for c in (LABEL, *DENSE_COLUMNS, *SPARSE_COLUMNS[1:])}}
    )
    pq.write_table(table, tmp_path / "broken.parquet")
    with pytest.raises(ValueError, match="broken.parquet: column C1 has type string"):
        ParquetDataset(tmp_path)


def test_open_split_without_metadata_globs_the_split_dir(tmp_path, data_dir, train_set):
    (tmp_path / "train").mkdir()
    for i in range(3):
        name = f"part-{i:05d}.parquet"
        (tmp_path / "train" / name).write_bytes((data_dir / "train" / name).read_bytes())
    dataset = open_split(tmp_path, "train")
    assert torch.equal(dataset.sparse, train_set.sparse)
    with pytest.raises(FileNotFoundError, match="no \\*.parquet files in .*val"):
        open_split(tmp_path, "val")


def test_open_split_errors(tmp_path, data_dir):
    with pytest.raises(ValueError, match="has no split 'eval'"):
        open_split(data_dir, "eval")
    out = tmp_path / "no_test"
    preprocess([SAMPLE], out, val_fraction=0.2, test_fraction=0.0)
    assert load_metadata(out)["rows"] == {"train": 8000, "val": 2000, "test": 0}
    with pytest.raises(ValueError, match="split 'test' .* is empty"):
        open_split(out, "test")


def test_batch_to_keeps_values(train_set):
    batch = train_set.batch(torch.tensor([5, 0, 7]))
    moved = batch.to(torch.device("cpu"))
    assert isinstance(moved, Batch)
    assert all(torch.equal(a, b) for a, b in zip(moved, batch, strict=True))
    assert torch.equal(batch.sparse, train_set.sparse[[5, 0, 7]])


@pytest.mark.gpu
def test_cuda_batches_are_pinned_copies(train_set):
    loader = BatchLoader(train_set, batch_size=1000, device="cuda")
    cpu = BatchLoader(train_set, batch_size=1000)
    for on_gpu, on_cpu in zip(loader, cpu, strict=True):
        assert all(t.is_cuda for t in on_gpu)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(on_gpu, on_cpu, strict=True))
    assert train_set.batch(slice(0, 4)).pin_memory().dense.is_pinned()
