"""Batch reader for preprocessed Criteo parquet splits: whole batches sliced out of in-memory tensors.

Letters: B batch, N rows of a split; 13 dense features (N_dense) and 26 sparse features (F).

    dataset = open_split("data/criteo_sample", "train")      # ParquetDataset, N rows in memory
    loader = BatchLoader(dataset, batch_size=128, shuffle=True, device=torch.device("cuda"))
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch in loader:                                     # Batch(dense, sparse, label) on the device
            ...

The split is read once with pyarrow into column tensors (the shipped sample is small); each batch is one
slice (or one index_select when shuffling) of those tensors, not B per-row lookups and a collate.
Dense counts are transformed once at load by log(1 + max(x, 0)), the FB-DLRM / TorchRec convention.
Two parquet layouts are accepted: ours (`label`, `I1..I13`, `C1..C26`, written by dlrm.data.preprocess)
and the lecture notebook's (`labels`, `DENSE_0..12`, `SPARSE_0..25`).
The file listing (`split_paths`, `split_files`), layout check (`columns_of`) and decoding (`decode_table`)
are shared with the GPU-resident (dlrm.data.resident) and streaming (dlrm.data.streaming) loaders.
"""

import copy
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torch import Tensor

from dlrm.data.output import load_metadata
from dlrm.data.schema import (
    DENSE_COLUMNS,
    LABEL,
    LECTURE_DENSE_COLUMNS,
    LECTURE_LABEL,
    LECTURE_SPARSE_COLUMNS,
    MISSING_CATEGORY,
    NUM_DENSE,
    SPARSE_COLUMNS,
)

# (label, dense, sparse) column names of each accepted parquet layout.
_LAYOUTS = (
    (LABEL, DENSE_COLUMNS, SPARSE_COLUMNS),
    (LECTURE_LABEL, LECTURE_DENSE_COLUMNS, LECTURE_SPARSE_COLUMNS),
)
_LAYOUT_NAMES = "label, I1..I13, C1..C26 or labels, DENSE_0..12, SPARSE_0..25"


class Batch(NamedTuple):
    """One mini-batch.

    dense: [B, 13] float32, log(1 + max(count, 0)).
    sparse: [B, 26] int64, raw category ids (-1 = missing); hashing into tables is the model's job.
        Multi-hot data: [B, S], each feature's bag of ids in consecutive columns (dlrm.data.bags).
    label: [B] float32, 0 or 1.
    """

    dense: Tensor
    sparse: Tensor
    label: Tensor

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        """The batch on `device` (the same tensors where they are already there)."""
        return Batch(*(t.to(device, non_blocking=non_blocking) for t in self))

    def pin_memory(self) -> "Batch":
        """The batch copied into page-locked host memory, for asynchronous copies to the GPU (needs CUDA)."""
        return Batch(*(t.pin_memory() for t in self))


class ParquetDataset:
    """All rows of a preprocessed split, held in memory as tensors.

    Args:
        source: a split directory of *.parquet files (e.g. data/criteo_sample/train), read in name order,
            or a list of parquet files, read in the given order.
    Attributes:
        files: the parquet files read.
        dense: [N, 13] float32, log(1 + max(count, 0)); missing counts are 0.
        sparse: [N, 26] int64 raw category ids, -1 = missing.
        label: [N] float32, 0 or 1.
    Raises:
        FileNotFoundError: the directory holds no parquet file, or a listed file does not exist.
        ValueError: a file lacks columns of both accepted layouts (the message names the file and the
            missing columns), or a column has a non-numeric type.
    """

    def __init__(self, source: Path | str | Sequence[Path | str]) -> None:
        self.files = split_files(source)
        parts = [_read_file(f) for f in self.files]
        self.dense, self.sparse, self.label = (torch.cat(tensors) for tensors in zip(*parts, strict=True))

    @property
    def num_rows(self) -> int:
        return len(self.label)

    def __len__(self) -> int:
        return self.num_rows

    def to(self, device: torch.device | str) -> "ParquetDataset":
        """The same rows with their tensors on `device` (a shallow copy; `self` when already there)."""
        if self.label.device == torch.device(device):
            return self
        moved = copy.copy(self)
        moved.dense, moved.sparse, moved.label = (t.to(device) for t in (self.dense, self.sparse, self.label))
        return moved

    def batch(self, index: slice | Tensor) -> Batch:
        """Rows `index` (a slice, giving views of the dataset's tensors, or [B] int64 row indices)."""
        if isinstance(index, slice):
            return Batch(self.dense[index], self.sparse[index], self.label[index])
        return Batch(self.dense.index_select(0, index), self.sparse.index_select(0, index), self.label[index])

    def __repr__(self) -> str:
        return f"ParquetDataset({self.num_rows} rows from {len(self.files)} file(s))"


def _read_file(path: Path) -> Batch:
    columns = columns_of(path)
    with parquet_errors(path):
        table = pq.read_table(path, columns=columns)
    return decode_table(table, columns, path)


@contextmanager
def parquet_errors(path: Path, where: str = "") -> Iterator[None]:
    """Turn pyarrow's errors while reading parquet file `path` (a truncated or damaged file: "Parquet
    magic bytes not found in footer", a bad page) into a ValueError naming the file (and `where` in it,
    e.g. ": row group 3")."""
    try:
        yield
    except (OSError, pa.ArrowException) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(
            f"{path}{where}: not a readable parquet file ({reason}): damaged or cut short; preprocess again"
        ) from None


def split_files(source: Path | str | Sequence[Path | str]) -> list[Path]:
    """The parquet files of `source`: a directory's *.parquet in name order, or the given list as is.

    Raises:
        FileNotFoundError: the directory holds no parquet file.
        ValueError: an empty list.
    """
    if isinstance(source, str | Path):
        directory = Path(source)
        files = sorted(directory.glob("*.parquet"))
        if not files:
            raise FileNotFoundError(f"no *.parquet files in {directory}: run python -m dlrm.data.preprocess")
        return files
    if not source:
        raise ValueError("no parquet files given")
    return [Path(f) for f in source]


def columns_of(path: Path) -> list[str]:
    """The columns to read from the parquet file `path`: [label, 13 dense, 26 sparse] of its layout, each
    sparse column followed by its bag's extra columns in a multi-hot file (dlrm.data.bags: S sparse).

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file lacks columns of both accepted layouts (the message names the file and the
            missing columns), or a column has a non-numeric type.
    """
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such parquet file")
    with parquet_errors(path):
        schema = pq.read_schema(path)
    names = set(schema.names)
    missing_per_layout = [[c for c in (lab, *den, *spa) if c not in names] for lab, den, spa in _LAYOUTS]
    # Name the columns missing from the layout the file comes closest to.
    best = min(range(len(_LAYOUTS)), key=lambda i: len(missing_per_layout[i]))
    if missing_per_layout[best]:
        missing = ", ".join(missing_per_layout[best])
        raise ValueError(f"{path}: missing columns {missing} (expected {_LAYOUT_NAMES})")
    label, dense, sparse = _LAYOUTS[best]
    for column in (label, *dense):
        if not _is_numeric(schema.field(column).type):
            raise ValueError(
                f"{path}: column {column} has type {schema.field(column).type}, expected a number"
            )
    # A multi-hot file (dlrm.data.bags): feature c's bag is c, c_1, c_2, ... (consecutive suffixes).
    sparse = [bag for c in sparse for bag in (c, *_bag_columns(c, names))]
    for column in sparse:
        if not pa.types.is_integer(schema.field(column).type):
            raise ValueError(
                f"{path}: column {column} has type {schema.field(column).type}, expected integers"
            )
    return [label, *dense, *sparse]


def _bag_columns(column: str, names: set[str]) -> list[str]:
    """The extra columns of `column`'s bag in a multi-hot file: column_1, column_2, ... while present."""
    extra = []
    while f"{column}_{len(extra) + 1}" in names:
        extra.append(f"{column}_{len(extra) + 1}")
    return extra


def decode_table(table: pa.Table, columns: list[str], path: Path) -> Batch:
    """The rows of `table` as a Batch: dense [n, 13] float32 log(1 + max(count, 0)) with missing counts 0,
    sparse [n, 26] (multi-hot: [n, S], dlrm.data.bags) int64 with missing ids -1, label [n] float32.

    Args:
        table: rows read from the parquet file `path` (which only names the file in errors).
        columns: [label, 13 dense, 26 (or S) sparse] column names, as returned by `columns_of(path)`.
    Raises:
        ValueError: `table` lacks some of `columns` (the file changed since `columns_of` read it), an id
            does not fit int64, a dense count is NaN or infinite, or a label is other than 0 and 1.
    """
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise ValueError(f"{path}: missing columns {', '.join(missing)} (expected {_LAYOUT_NAMES})")

    def column(name: str, dtype: pa.DataType, fill: int) -> np.ndarray:
        # Unsafe cast for floats: large counts may round to float32, as they do in preprocess.
        try:
            values = pc.cast(table.column(name), dtype, safe=pa.types.is_integer(dtype))
        except pa.ArrowInvalid as err:
            raise ValueError(f"{path}: column {name}: {err}") from None
        return pc.fill_null(values, fill).to_numpy()

    def finite(name: str) -> np.ndarray:
        values = column(name, pa.float32(), 0)
        if not np.isfinite(values).all():
            bad = int((~np.isfinite(values)).sum())
            raise ValueError(f"{path}: column {name}: {bad} NaN or infinite value(s), expected finite counts")
        return values

    def clicks(name: str) -> np.ndarray:
        # Checked here, once per file, so evaluation need not check each batch (dlrm.metrics.evaluate).
        values = column(name, pa.float32(), 0)
        bad = int(((values != 0) & (values != 1)).sum())
        if bad:
            raise ValueError(f"{path}: column {name}: {bad} value(s) other than 0 and 1, expected clicks")
        return values.copy()  # pyarrow's zero-copy arrays are read-only, and torch tensors are writable

    label, dense, sparse = columns[0], columns[1 : 1 + NUM_DENSE], columns[1 + NUM_DENSE :]
    return Batch(
        torch.log1p(torch.from_numpy(np.stack([finite(c) for c in dense], axis=1)).clamp_min_(0)),
        torch.from_numpy(np.stack([column(c, pa.int64(), MISSING_CATEGORY) for c in sparse], axis=1)),
        torch.from_numpy(clicks(label)),
    )


def _is_numeric(dtype: pa.DataType) -> bool:
    return pa.types.is_integer(dtype) or pa.types.is_floating(dtype) or pa.types.is_boolean(dtype)


def open_split(data_dir: Path | str, split: str) -> ParquetDataset:
    """The `split` ("train", "val", "test") of a preprocessed data directory, in memory (`split_paths`)."""
    return ParquetDataset(split_paths(data_dir, split))


def split_paths(data_dir: Path | str, split: str) -> list[Path]:
    """The parquet files of `split`: the shard list of `data_dir`/metadata.json when there is one, else
    `data_dir`/`split`/*.parquet in name order.

    Raises:
        FileNotFoundError: no parquet files for the split.
        ValueError: metadata.json lists no such split, or the split is empty.
    """
    data_dir = Path(data_dir)
    if not (data_dir / "metadata.json").is_file():
        return split_files(data_dir / split)
    files = load_metadata(data_dir)["files"]
    if split not in files:
        raise ValueError(f"{data_dir}/metadata.json has no split {split!r} (it has {', '.join(files)})")
    if not files[split]:
        raise ValueError(
            f"split {split!r} of {data_dir} is empty (preprocessed with a --{split}-fraction of 0?)"
        )
    return [data_dir / f for f in files[split]]


class BatchLoader:
    """Iterates a dataset in mini-batches of `batch_size` rows, as `Batch`es on `device`.

    Args:
        dataset: the rows (a ParquetDataset).
        batch_size: rows per batch (B); the last batch is smaller unless `drop_last`.
        shuffle: visit rows in a random order that depends only on `seed` + the epoch (see `set_epoch`).
        seed: base seed of the shuffle.
        drop_last: leave out the last batch if it has fewer than `batch_size` rows.
        device: where batches are delivered. For CUDA each batch is pinned and copied non-blocking.
        rank, world_size: with W = world_size > 1, `batch_size` is the global batch B and this rank gets
            rows [rank * B/W, (rank + 1) * B/W) of each global batch (every rank draws the same epoch
            order), so W ranks together train exactly the batches of one process. A last, smaller
            global batch is trimmed to a multiple of W rows (left out when it has fewer than W).
        bags: makes each batch's bags from its one-hot ids on `device` (data.multi_hot,
            dlrm.data.bags.BagMaker); None: the ids as read.
    Without shuffling on the CPU, batches are views of the dataset's tensors: do not modify them in place.
    Raises:
        ValueError: batch_size < 1, a rank outside [0, world_size), or W not dividing batch_size.
    """

    def __init__(
        self,
        dataset: ParquetDataset,
        batch_size: int,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        device: torch.device | str = "cpu",
        rank: int = 0,
        world_size: int = 1,
        bags: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if batch_size % world_size:
            raise ValueError(f"batch_size {batch_size} is not divisible by world_size {world_size}")
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.dataset = self.place(dataset, self.device)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.bags = bags
        self.epoch = 0

    def place(self, dataset: ParquetDataset, device: torch.device) -> ParquetDataset:
        """The rows the loader iterates, from the constructor's `dataset`: here the dataset as it is, each
        batch copied to `device` as it is made (a subclass may move the whole dataset instead)."""
        return dataset

    def set_epoch(self, epoch: int) -> None:
        """Select the shuffle order of `epoch` (the generator is seeded with seed + epoch)."""
        self.epoch = epoch

    @property
    def num_rows(self) -> int:
        return self.dataset.num_rows

    def __len__(self) -> int:
        """Number of batches per epoch."""
        if self.drop_last or self.num_rows % self.batch_size < self.world_size:
            return self.num_rows // self.batch_size
        return math.ceil(self.num_rows / self.batch_size)

    def permutation(self) -> Tensor:
        """[N] int64 row order of the current epoch: torch.randperm seeded with seed + epoch."""
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_rows, generator=generator)

    def __iter__(self) -> Iterator[Batch]:
        order = self.permutation() if self.shuffle else None
        # Pinned host memory lets the host-to-device copy run asynchronously; only CUDA has it. Rows that
        # already live on the device (ResidentLoader) need no copy.
        pin = (
            self.device.type == "cuda"
            and torch.cuda.is_available()
            and self.dataset.label.device.type == "cpu"
        )
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            stop = min(start + self.batch_size, self.num_rows)
            if self.world_size > 1:  # this rank's part of the global batch
                part = (stop - start) // self.world_size
                start, stop = start + self.rank * part, start + (self.rank + 1) * part
            batch = self.dataset.batch(slice(start, stop) if order is None else order[start:stop])
            if pin:
                batch = batch.pin_memory()
            batch = batch.to(self.device, non_blocking=pin)
            yield batch if self.bags is None else batch._replace(sparse=self.bags(batch.sparse))
