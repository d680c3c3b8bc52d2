"""Streaming loader for parquet splits larger than memory: row groups read as needed, shuffled by row
group, by row and through a bounded shuffle buffer; deterministic for a seed, resumable, rank-aware.

Letters: B batch, N rows of the split, W world size; 13 dense features (N_dense), 26 sparse features (F).

    loader = StreamingLoader(split_paths("data/terabyte", "train"), batch_size=65536, shuffle=True,
                             shuffle_buffer=1_000_000, rank=rank, world_size=world_size, device=device,
                             prefetch=4)
    loader.load_state_dict(checkpoint["loader"])          # optional: go on where a run stopped
    for epoch in range(loader.epoch, epochs):
        loader.set_epoch(epoch)
        for batch in loader:                              # Batch(dense, sparse, label) on the device
            ...
            checkpoint["loader"] = loader.state_dict()

One epoch of seed s. All ranks compute the same plan from the row-group sizes alone, without reading data:
1. Units: the (file, row group) pairs of the split. With shuffle, their order is a permutation drawn from
   (s, epoch) and each unit's rows are permuted by a draw from (s, epoch, unit). Put end to end, the units
   form the epoch's stream of N rows.
2. Ranks: rank r takes rows [r * n, (r + 1) * n) of the stream, with n = N // W under drop_last, else
   ceil(N / W) and the last ranks wrap around to the stream's first rows (fewer than W rows repeated, as
   torch's DistributedSampler pads). So the ranks' rows are disjoint up to that padding, every rank has
   the same number of batches (DDP needs that), and a rank reads only the units its rows lie in.
3. Shuffle buffer (with shuffle and `shuffle_buffer` > 0): each unit's rows join the buffer; whenever it
   would hold more than `shuffle_buffer` rows, a random set of the excess (draw from (s, epoch, rank, unit
   position)) leaves it for the batches; at the end of the stream the rest leaves in random order. A row
   thus comes out at most `shuffle_buffer` + (one unit) rows before its place in the stream. Memory holds
   the buffer (264 bytes per row), about two units, the units read ahead (`_READERS`, when prefetching)
   and the prefetched batches.
4. Batches of B rows; the last, smaller one is kept unless drop_last.

Resumption: the state is (epoch, batches consumed). Steps 1-3 depend only on row counts, so
`load_state_dict` is followed by a replay of them on row ids alone (no data read) up to the saved batch,
which gives the next unit, the offset in it and which rows the buffer held; those rows are read back
from their row groups, and the batches from there on are exactly those of an uninterrupted run.
"""

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow.parquet as pq
import torch
from torch import Tensor

from dlrm.data.dataset import Batch, columns_of, decode_table, parquet_errors, split_files
from dlrm.data.position import EpochPosition, Piece, rank_pieces
from dlrm.data.prefetch import prefetch_to_device
from dlrm.data.schema import NUM_DENSE

# Domain tags of the random streams, so that no two draws of an epoch share a seed.
_UNIT_ORDER, _UNIT_ROWS, _BUFFER = 0, 1, 2
# Row groups read and decoded ahead, in as many threads, when the loader prefetches.
_READERS = 4


class _Unit(NamedTuple):
    """One row group: file index, row group index in the file, rows, id of its first row (file order)."""

    file: int
    row_group: int
    rows: int
    first: int


class _Rows(NamedTuple):
    """Rows on their way through the pipeline: `key` [n] int64 row ids (position in the split, file order)
    and their `data`, or None when only the plan is replayed (resumption)."""

    key: Tensor
    data: Batch | None

    def __len__(self) -> int:
        return len(self.key)

    def __getitem__(self, index: slice | Tensor) -> "_Rows":
        """Rows `index`: a slice (views) or [n] int64 positions (a copy)."""
        if isinstance(index, slice):
            return _Rows(
                self.key[index], None if self.data is None else Batch(*(t[index] for t in self.data))
            )
        key = self.key.index_select(0, index)
        return _Rows(
            key, None if self.data is None else Batch(*(t.index_select(0, index) for t in self.data))
        )


def _cat(parts: Sequence[_Rows]) -> _Rows:
    if len(parts) == 1:
        return parts[0]
    key = torch.cat([p.key for p in parts])
    if parts[0].data is None:
        return _Rows(key, None)
    return _Rows(key, Batch(*(torch.cat(columns) for columns in zip(*(p.data for p in parts), strict=True))))


def _empty_like(rows: _Rows, n: int) -> _Rows:
    """Uninitialized room for `n` rows of the kind of `rows`."""
    key = torch.empty(n, dtype=torch.int64)
    if rows.data is None:
        return _Rows(key, None)
    return _Rows(key, Batch(*(torch.empty((n, *t.shape[1:]), dtype=t.dtype) for t in rows.data)))


def _copy_into(target: _Rows, positions: Tensor, source: _Rows, index: Tensor | None = None) -> None:
    """target[positions] = source[index] (all of `source` when index is None), in place."""
    src = [source.key] if source.data is None else [source.key, *source.data]
    dst = [target.key] if target.data is None else [target.key, *target.data]
    for d, s in zip(dst, src, strict=True):
        d.index_copy_(0, positions, s if index is None else s.index_select(0, index))


def _rng(*key: int) -> np.random.Generator:
    # SeedSequence takes non-negative entropy; a negative seed is folded into 64 bits.
    return np.random.default_rng([k % 2**64 for k in key])


def _permutation(n: int, *key: int) -> Tensor:
    return torch.from_numpy(_rng(*key).permutation(n))


class _ShuffleBuffer:
    """Holds up to `capacity` rows; `push` returns the rows that leave it to make room, in random order."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.size = 0
        self.rows: _Rows | None = None  # room for `capacity` rows, allocated with the first push

    def push(self, rows: _Rows, rng_key: tuple[int, ...]) -> _Rows | None:
        """Add `rows`, which must come in random order (a shuffled unit's rows do); return the rows that
        leave (None while the buffer is still filling)."""
        total = self.size + len(rows)
        if total <= self.capacity:
            self.fill(rows)
            return None
        self._allocate(rows)
        # Of the rows held and the new ones, a uniformly random set of total - capacity leave: a
        # hypergeometric share of it from random slots of the buffer, the rest a prefix of the new rows (a
        # random subset, as they come in random order). The new rows that stay take the freed slots and
        # the room left. Leaving rows are interleaved at random positions: no batch is all one unit's.
        rng = _rng(*rng_key)
        leaving = total - self.capacity
        from_buffer = int(rng.hypergeometric(self.size, len(rows), leaving)) if self.size else 0
        slots = torch.from_numpy(rng.choice(self.size, from_buffer, replace=False))
        places = torch.from_numpy(rng.permutation(leaving))
        from_new = leaving - from_buffer
        out = _empty_like(rows, leaving)
        _copy_into(out, places[:from_buffer], self.rows, slots)
        _copy_into(out, places[from_buffer:], rows[:from_new])
        _copy_into(self.rows, slots, rows[from_new : from_new + from_buffer])
        _copy_into(self.rows, torch.arange(self.size, self.capacity), rows[from_new + from_buffer :])
        self.size = self.capacity
        return out

    def fill(self, rows: _Rows) -> None:
        """Add `rows`, which must fit, behind the rows held."""
        self._allocate(rows)
        _copy_into(self.rows, torch.arange(self.size, self.size + len(rows)), rows)
        self.size += len(rows)

    def drain(self, rng_key: tuple[int, ...]) -> _Rows | None:
        """All rows held, in random order; the buffer is empty afterwards."""
        if not self.size:
            return None
        out = self.rows[: self.size][_permutation(self.size, *rng_key)]
        self.size = 0
        return out

    def held(self) -> _Rows:
        return self.rows[: self.size]

    def _allocate(self, like: _Rows) -> None:
        if self.rows is None:
            self.rows = _empty_like(like, self.capacity)


class StreamingLoader(EpochPosition):
    """Iterates the rows of parquet files in mini-batches, reading a few row groups at a time (see the
    module docstring for the order of the rows and what memory holds).

    Args:
        source: a directory of *.parquet files (read in name order) or a list of parquet files, e.g.
            `dlrm.data.dataset.split_paths(data_dir, "train")`.
        batch_size: rows per batch (B).
        shuffle: shuffle row groups, rows and through the buffer, by seed + epoch; else file order.
        seed: base seed of every draw.
        drop_last: leave out the last, smaller batch (and, with W > 1, the N mod W rows that would need
            padding).
        shuffle_buffer: rows of the shuffle buffer (0: rows shuffled within their row group only).
        rank, world_size: this process's part of the rows (see the module docstring).
        device: where batches are delivered; for CUDA they are pinned and copied non-blocking.
        bags: makes each batch's bags from its one-hot ids on `device` (data.multi_hot,
            dlrm.data.bags.BagMaker); None: the ids as read.
        prefetch: batches a background thread reads and decodes ahead (0: no thread; the reading happens
            in the consumer's `next`).
    Position: `state_dict`, `load_state_dict`, `set_epoch`, `len` (dlrm.data.position.EpochPosition).
    Batches: Batch(dense [B, 13] float32 log(1 + max(count, 0)), sparse [B, 26] int64, label [B] float32).
    Raises:
        FileNotFoundError: no parquet file in the directory, or a listed file does not exist.
        ValueError: a bad argument (the message names it), or a file without the Criteo columns.
    """

    # Settings that must match the loader's for a resume to be exact.
    STATE_KEYS = ("seed", "shuffle", "shuffle_buffer", "batch_size", "drop_last", "world_size", "num_rows")

    def __init__(
        self,
        source: Path | str | Sequence[Path | str],
        batch_size: int,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        shuffle_buffer: int = 0,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str = "cpu",
        prefetch: int = 0,
        bags: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        for name, value, low in (
            ("batch_size", batch_size, 1),
            ("shuffle_buffer", shuffle_buffer, 0),
            ("world_size", world_size, 1),
            ("prefetch", prefetch, 0),
        ):
            if value < low:
                raise ValueError(f"{name} must be at least {low}, got {value}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.files = split_files(source)
        self._columns = [columns_of(f) for f in self.files]
        self.units: list[_Unit] = []
        first = 0
        for i, path in enumerate(self.files):
            with parquet_errors(path):
                metadata = pq.ParquetFile(path).metadata
            for g in range(metadata.num_row_groups):
                rows = metadata.row_group(g).num_rows
                if rows:
                    self.units.append(_Unit(i, g, rows, first))
                    first += rows
        self.num_rows = first
        self._firsts = np.array([u.first for u in self.units], dtype=np.int64)
        self.batch_size, self.shuffle, self.seed, self.drop_last = batch_size, shuffle, seed, drop_last
        self.shuffle_buffer = shuffle_buffer if shuffle else 0
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.prefetch = prefetch
        self.bags = bags
        self._reset_position()

    def __iter__(self) -> Iterator[Batch]:
        start = self._begin()
        readahead = _READERS if self.prefetch else 0
        batches = _EpochStream(self, self.epoch, self._read, readahead).batches(start)
        if self.prefetch:
            width = len(self._columns[0]) - 1 - NUM_DENSE  # ids a row: F, or S for multi-hot files
            source = prefetch_to_device(batches, self.device, self.prefetch, self.batch_size, width)
        else:
            source = _to_device(batches, self.device)
        try:
            for batch in source:
                self._consumed += 1
                yield batch if self.bags is None else batch._replace(sparse=self.bags(batch.sparse))
        finally:
            source.close()

    def _plan(self, epoch: int) -> list[Piece]:
        """The pieces of units this rank reads in `epoch`, in order."""
        if self.shuffle:
            order = _permutation(len(self.units), _UNIT_ORDER, self.seed, epoch).tolist()
        else:
            order = list(range(len(self.units)))
        return rank_pieces(order, [u.rows for u in self.units], self.rank, self.rows_per_rank)

    def _unit_rows(self, unit: int, epoch: int) -> Tensor | slice:
        """The unit's rows in stream order: a permutation with shuffle, else all in file order."""
        if self.shuffle:
            return _permutation(self.units[unit].rows, _UNIT_ROWS, self.seed, epoch, unit)
        return slice(None)

    def _decode_unit(self, unit: int) -> Batch:
        u = self.units[unit]
        path = self.files[u.file]
        columns = self._columns[u.file]
        with parquet_errors(path, f": row group {u.row_group}"):
            table = pq.ParquetFile(path).read_row_group(u.row_group, columns=columns)
        return decode_table(table, columns, path)

    def _keys(self, piece: Piece, epoch: int) -> Tensor:
        rows = self._unit_rows(piece.unit, epoch)
        first = self.units[piece.unit].first
        if isinstance(rows, slice):
            return torch.arange(first + piece.start, first + piece.stop)
        return rows[piece.start : piece.stop] + first

    def _read(self, piece: Piece, epoch: int) -> _Rows:
        """The piece's rows with their data."""
        key = self._keys(piece, epoch)
        data = self._decode_unit(piece.unit)
        index = key - self.units[piece.unit].first
        if not self.shuffle and piece.stop - piece.start == len(data.label):
            return _Rows(key, data)
        return _Rows(key, Batch(*(t.index_select(0, index) for t in data)))

    def _read_keys(self, piece: Piece, epoch: int) -> _Rows:
        """The piece's row ids only: what the replay of a resumption needs."""
        return _Rows(self._keys(piece, epoch), None)

    def _fetch(self, key: Tensor) -> _Rows:
        """Rows `key` with their data, read from their units (one unit in memory at a time)."""
        units = torch.from_numpy(np.searchsorted(self._firsts, key.numpy(), side="right") - 1)
        out: _Rows | None = None
        for unit in units.unique().tolist():
            positions = torch.nonzero(units == unit).squeeze(1)
            data = self._decode_unit(unit)
            rows = _Rows(torch.arange(len(data.label)), data)[key[positions] - self.units[unit].first]
            if out is None:
                out = _empty_like(rows, len(key))
            _copy_into(out, positions, rows)
        out.key.copy_(key)
        return out


class _EpochStream:
    """The batches of one epoch of one rank, produced from the pieces of the plan through the buffer."""

    def __init__(
        self, loader: StreamingLoader, epoch: int, read: Callable[[Piece, int], _Rows], readahead: int = 0
    ) -> None:
        self.loader, self.epoch, self.read = loader, epoch, read
        self.pieces = loader._plan(epoch)
        self.next_piece = 0
        # Pieces read ahead by a pool of `readahead` threads (pyarrow and torch release the GIL while
        # decoding and copying), or none: read when needed.
        self.readahead = readahead
        self.pool: ThreadPoolExecutor | None = None
        self.ahead: deque[Future] = deque()
        self.submitted = 0
        # A buffer larger than the rank's rows would only hold them all: allocate no more.
        self.buffer = _ShuffleBuffer(min(loader.shuffle_buffer, loader.rows_per_rank))
        self.ready: deque[_Rows] = deque()  # rows out of the buffer, not yet batched
        self.ready_rows = 0

    def batches(self, start: int) -> Iterator[Batch]:
        """Batches `start`, `start` + 1, ... of the epoch, on the CPU."""
        if start:
            self._restore(start)
        self.submitted = self.next_piece
        try:
            while (rows := self.next_batch()) is not None:
                yield rows.data
        finally:
            if self.pool is not None:
                self.pool.shutdown(cancel_futures=True)

    def next_batch(self) -> _Rows | None:
        """The next batch's rows (B, or fewer at the end unless drop_last); None after the last."""
        size = self.loader.batch_size
        while self.ready_rows < size and self.next_piece < len(self.pieces):
            rows = self._read_next()
            if self.buffer.capacity:
                rng_key = (_BUFFER, self.loader.seed, self.epoch, self.loader.rank, self.next_piece)
                rows = self.buffer.push(rows, rng_key)
            self.next_piece += 1
            parts = [rows]
            if self.next_piece == len(self.pieces) and self.buffer.capacity:
                parts.append(self.buffer.drain((_BUFFER, self.loader.seed, self.epoch, self.loader.rank, -1)))
            for part in parts:
                if part is not None and len(part):
                    self.ready.append(part)
                    self.ready_rows += len(part)
        if self.ready_rows < size and (self.loader.drop_last or not self.ready_rows):
            return None
        return self._take(min(size, self.ready_rows))

    def _read_next(self) -> _Rows:
        """The rows of piece `next_piece`, keeping up to `readahead` later pieces in flight."""
        if not self.readahead:
            return self.read(self.pieces[self.next_piece], self.epoch)
        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.readahead, thread_name_prefix="dlrm-read")
        while self.submitted < min(self.next_piece + 1 + self.readahead, len(self.pieces)):
            self.ahead.append(self.pool.submit(self.read, self.pieces[self.submitted], self.epoch))
            self.submitted += 1
        return self.ahead.popleft().result()

    def _take(self, n: int) -> _Rows:
        parts = []
        while n:
            head = self.ready[0]
            if len(head) <= n:
                parts.append(self.ready.popleft())
                n -= len(head)
                self.ready_rows -= len(head)
            else:
                parts.append(head[:n])
                self.ready[0] = head[n:]
                self.ready_rows -= n
                n = 0
        return _cat(parts)

    def _restore(self, start: int) -> None:
        """Move to batch `start`: replay the plan on row ids, then read the rows held back then."""
        replay = _EpochStream(self.loader, self.epoch, self.loader._read_keys)
        for _ in range(start):
            replay.next_batch()
        self.next_piece = replay.next_piece
        if replay.buffer.size:
            self.buffer.fill(self.loader._fetch(replay.buffer.held().key))
        if replay.ready_rows:
            self.ready.append(self.loader._fetch(_cat(list(replay.ready)).key))
            self.ready_rows = replay.ready_rows


def _to_device(batches: Iterator[Batch], device: torch.device) -> Iterator[Batch]:
    # Pinned host memory lets the host-to-device copy run asynchronously; only CUDA has it.
    pin = device.type == "cuda"
    for batch in batches:
        yield batch.pin_memory().to(device, non_blocking=True) if pin else batch.to(device)
