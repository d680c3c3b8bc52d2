"""Loader of binary splits (dlrm.data.binary) for splits larger than GPU and host memory, at the speed of
the training step: large sequential reads into pinned windows by reader threads, one host-to-device copy
per window on a side stream, and the shuffle, id widening and batch gathers on the GPU.

Letters: B batch, N rows of the split, W world size; 13 dense features (N_dense), 26 sparse features (F).

    loader = BinaryLoader(binary_dir("data/terabyte", "train"), batch_size=65536, shuffle=True,
                          window_rows=1_000_000, rank=rank, world_size=world_size, device=device)
    loader.load_state_dict(checkpoint["loader"])          # optional: go on where a run stopped
    for epoch in range(loader.epoch, epochs):
        loader.set_epoch(epoch)
        for batch in loader:                              # Batch(dense, sparse, label) on the device
            ...

One epoch of seed s, rank r (all ranks compute the same plan from N alone):
1. Chunks: the split's rows cut into chunks of `chunk_rows` consecutive rows (65,536). With shuffle their
   order is a permutation drawn from (s, epoch); put end to end they form the epoch's stream of N rows.
2. Ranks: rank r takes rows [r * n, (r + 1) * n) of the stream, n = N // W under drop_last, else
   ceil(N / W) with the last ranks wrapping around to the stream's first rows (fewer than W rows
   repeated, as torch's DistributedSampler pads): disjoint rows and the same batch count on every rank.
3. Windows: the rank's rows cut into windows of `window_rows` rounded down to a multiple of B (at least
   B). Each window is read whole, copied to the GPU, and with shuffle its rows are permuted there by a
   draw from (s, epoch, r, window); batch j of a window is rows [j * B, (j + 1) * B) of that order.
So what is random: the order of the chunks in the epoch, and the order of rows within a window. A batch
holds rows of the window_rows / chunk_rows chunks of its window (a random choice of the split's chunks),
each a run of consecutive rows of the file. Without shuffle: file order.

Resumption is exact and cheap: batch k of an epoch is batch k mod (window / B) of window k // (window / B),
so `load_state_dict` ({epoch, batches}) starts at that window and skips within it. A state of W ranks
resumes on W' others with the same global batch W B: at global batch k of the epoch in the W' ranks' order
(that epoch's remaining rows are not exactly the saved run's; the next epochs are whole).

Memory: two pinned host windows and two device windows of `window_rows` x 157 bytes (the column files'
row width), plus the batches handed out (264 bytes a row). No thread but the caller's makes a CUDA call
(reader threads only fill pinned host memory), so a CUDA graph capture in the training thread is safe.
"""

import math
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from dlrm.data.binary import open_binary, split_columns, widen_ids
from dlrm.data.dataset import Batch
from dlrm.data.position import EpochPosition, rank_pieces

CHUNK_ROWS = 65536
_READERS = 4
# Reads are cut into pieces of at most this many bytes, so the reader threads share a window's work.
_READ_BYTES = 8 << 20
# Domain tags of the random streams, so that no two draws of an epoch share a seed.
_CHUNK_ORDER, _WINDOW_ORDER = 0, 1


class _Window(NamedTuple):
    """The three columns of up to `window_rows` rows, as stored (label uint8, dense float32, ids int32)."""

    label: Tensor
    dense: Tensor
    sparse: Tensor


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([k % 2**64 for k in key])


class BinaryLoader(EpochPosition):
    """Iterates a binary split in mini-batches (see the module docstring for the order and memory).

    Args:
        source: a binary split directory (dlrm.data.binary.binary_dir(data_dir, split)).
        batch_size: rows per batch (B).
        shuffle: shuffle chunks per epoch and rows within each window, by seed + epoch; else file order.
        seed: base seed of every draw.
        drop_last: leave out the last, smaller batch (and, with W > 1, the N mod W rows that would need
            padding).
        window_rows: rows read, copied and shuffled together (rounded down to a multiple of B, at least B).
        chunk_rows: rows of a chunk, the unit of the epoch's chunk order.
        rank, world_size: this process's part of the rows.
        device: where batches are delivered.
        readers: reader threads.
        bags: makes each batch's bags from its one-hot ids on `device` (data.multi_hot,
            dlrm.data.bags.BagMaker); None: the ids as read.
    Position: `state_dict`, `load_state_dict`, `set_epoch`, `len` (dlrm.data.position.EpochPosition).
    Batches: Batch(dense [B, 13] float32 log(1 + max(count, 0)), sparse [B, 26] int64, label [B] float32).
    Raises:
        FileNotFoundError, ValueError: as dlrm.data.binary.open_binary; a bad argument (named).
    """

    # Settings that must match the loader's for a resume to be exact; the per-rank ones may differ on another
    # number of ranks with the same global batch (EpochPosition.load_state_dict).
    RANK_KEYS = ("batch_size", "world_size", "window_rows")
    STATE_KEYS = (
        "seed",
        "shuffle",
        "batch_size",
        "drop_last",
        "world_size",
        "num_rows",
        "window_rows",
        "chunk_rows",
    )

    def __init__(
        self,
        source: Path | str,
        batch_size: int,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        window_rows: int = 1_000_000,
        chunk_rows: int = CHUNK_ROWS,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str = "cpu",
        readers: int = _READERS,
        bags: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        for name, value in (
            ("batch_size", batch_size),
            ("window_rows", window_rows),
            ("chunk_rows", chunk_rows),
            ("world_size", world_size),
            ("readers", readers),
        ):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.split = open_binary(source)
        self.num_rows = self.split.rows
        self.batch_size, self.shuffle, self.seed, self.drop_last = batch_size, shuffle, seed, drop_last
        self.window_rows = max(1, window_rows // batch_size) * batch_size
        self.chunk_rows = chunk_rows
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.readers = readers
        self.bags = bags
        self._reset_position()

    def ranges(self, epoch: int) -> list[tuple[int, int]]:
        """This rank's rows of `epoch` as (first file row, rows) ranges, in stream order."""
        chunks = math.ceil(self.num_rows / self.chunk_rows)
        order = _rng(_CHUNK_ORDER, self.seed, epoch).permutation(chunks) if self.shuffle else range(chunks)
        sizes = [min(self.chunk_rows, self.num_rows - c * self.chunk_rows) for c in range(chunks)]
        pieces = rank_pieces(list(order), sizes, self.rank, self.rows_per_rank)
        return [(p.unit * self.chunk_rows + p.start, p.stop - p.start) for p in pieces]

    def __iter__(self) -> Iterator[Batch]:
        start = self._begin()
        total = len(self)
        per_window = self.window_rows // self.batch_size
        windows = _Windows(self, self.ranges(self.epoch))
        try:
            for w in range(start // per_window, windows.count):
                rows, data = windows.get(w)
                order = self._window_order(w, rows)
                first = start % per_window if w == start // per_window else 0
                for j in range(first, math.ceil(rows / self.batch_size)):
                    if self._consumed == total:
                        return
                    index = slice(j * self.batch_size, min((j + 1) * self.batch_size, rows))
                    batch = _decode(data, index if order is None else order[index])
                    self._consumed += 1
                    yield batch if self.bags is None else batch._replace(sparse=self.bags(batch.sparse))
                    windows.poll(w)
                windows.release(w)
        finally:
            windows.close()

    def _window_order(self, w: int, rows: int) -> Tensor | None:
        if not self.shuffle:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(int(_rng(_WINDOW_ORDER, self.seed, self.epoch, self.rank, w).integers(2**62)))
        return torch.randperm(rows, generator=generator, device=self.device)


def _decode(window: _Window, index: slice | Tensor) -> Batch:
    """Rows `index` of a window as a Batch of new tensors (on the window's device)."""
    if isinstance(index, slice):
        label, dense, sparse = window.label[index], window.dense[index].clone(), window.sparse[index]
    else:
        label, dense, sparse = (t.index_select(0, index) for t in window)
    return Batch(dense, widen_ids(sparse), label.float())


class _Windows:
    """The windows of one epoch of one rank, read ahead by threads and copied to the device.

    Window w lives in host buffer w % 2 and device buffer w % 2 (on CUDA; on the CPU the host buffer is
    the window). Window w + 1 is read while window w is consumed; on CUDA its copy is issued, on a side
    stream, as soon as its read is done and the device buffer's previous window has been consumed.
    """

    def __init__(self, loader: BinaryLoader, ranges: list[tuple[int, int]]) -> None:
        self.loader = loader
        self.n = loader.rows_per_rank
        self.count = math.ceil(self.n / loader.window_rows)
        self.ranges = ranges
        self.cuda = loader.device.type == "cuda"
        size = min(loader.window_rows, self.n)
        width = loader.split.sparse_width
        self.host = [_allocate(size, "cpu", self.cuda, width) for _ in range(2)]
        self.device = (
            [_allocate(size, loader.device, False, width) for _ in range(2)] if self.cuda else self.host
        )
        self.pool = ThreadPoolExecutor(loader.readers, thread_name_prefix="dlrm-binary-read")
        self.reads: dict[int, list[Future]] = {}
        self.copied: dict[int, torch.cuda.Event] = {}
        self.consumed: list[torch.cuda.Event | None] = [None, None]
        self.side = torch.cuda.Stream(loader.device) if self.cuda else None
        split = loader.split
        self.files = [(os.open(path, os.O_RDONLY), path) for path in (split.label, split.dense, split.sparse)]

    def rows(self, w: int) -> int:
        return min(self.loader.window_rows, self.n - w * self.loader.window_rows)

    def get(self, w: int) -> tuple[int, _Window]:
        """Window w on the device, ordered before the consumer's next kernels; also starts reading w + 1."""
        if w not in self.reads:
            self._read(w)
        if w + 1 < self.count and w + 1 not in self.reads:
            self._read(w + 1)
        for future in self.reads[w]:
            future.result()
        if self.cuda:
            self._copy(w)
            torch.cuda.current_stream(self.loader.device).wait_event(self.copied[w])
        return self.rows(w), self.device[w % 2]

    def poll(self, w: int) -> None:
        """Called after each batch of window w: issue window w + 1's copy as soon as its read is done,
        so that it overlaps window w's steps instead of stalling the next window's first batch."""
        ahead = w + 1
        if self.cuda and ahead < self.count and ahead not in self.copied:
            if all(future.done() for future in self.reads[ahead]):
                self._copy(ahead)

    def release(self, w: int) -> None:
        """Window w is consumed: its device buffer may take window w + 2 once the consumer's kernels so
        far are done (an event, waited for on the side stream). On the CPU batches are copies: nothing to
        wait for."""
        if self.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.loader.device))
            self.consumed[w % 2] = event

    def _read(self, w: int) -> None:
        """Submit the reads of window w into host buffer w % 2, once that buffer's last copy is done."""
        if self.cuda and w - 2 in self.copied:
            self.copied.pop(w - 2).synchronize()
        buffer = self.host[w % 2]
        futures = []
        window_start, window_end = w * self.loader.window_rows, w * self.loader.window_rows + self.rows(w)
        position = 0
        for first, count in self.ranges:
            lo, hi = max(position, window_start), min(position + count, window_end)
            if lo < hi:
                file_row, dest = first + lo - position, lo - window_start
                for file, column in zip(self.files, buffer, strict=True):
                    futures += self._submit_column(file, column, file_row, dest, hi - lo)
            position += count
            if position >= window_end:
                break
        self.reads[w] = futures

    def _submit_column(
        self, file: tuple[int, Path], column: Tensor, file_row: int, dest: int, rows: int
    ) -> list[Future]:
        """Reads of `rows` rows of one column file from `file_row` into `column` from row `dest`."""
        array = column.numpy()
        row_bytes = array[0:1].nbytes
        step = max(1, _READ_BYTES // row_bytes)
        return [
            self.pool.submit(
                _pread_into, file, array[dest + i : dest + min(i + step, rows)], (file_row + i) * row_bytes
            )
            for i in range(0, rows, step)
        ]

    def _copy(self, w: int) -> None:
        """Issue window w's host-to-device copy on the side stream (once)."""
        if w in self.copied:
            return
        rows = self.rows(w)
        consumed = self.consumed[w % 2]
        with torch.cuda.stream(self.side):
            if consumed is not None:
                self.side.wait_event(consumed)
            for dst, src in zip(self.device[w % 2], self.host[w % 2], strict=True):
                dst[:rows].copy_(src[:rows], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.side)
        self.copied[w] = event

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)
        for fd, _ in self.files:
            os.close(fd)
        if self.cuda:
            # The side stream's copies read the pinned buffers, which are freed with this object.
            self.side.synchronize()


def _allocate(rows: int, device: torch.device | str, pin: bool, sparse_width: int) -> _Window:
    shapes = [
        ((rows, width) if width > 1 else (rows,), getattr(torch, dtype))
        for dtype, width in split_columns(sparse_width).values()
    ]
    return _Window(
        *(torch.empty(shape, dtype=dtype, device=device, pin_memory=pin) for shape, dtype in shapes)
    )


def _pread_into(file: tuple[int, Path], array: np.ndarray, offset: int) -> None:
    """Fill `array` with the file's bytes from `offset` (no CUDA call: reader threads run this).

    Raises:
        ValueError: the file ends early (it shrank since open_binary checked its size).
        OSError: the read failed (e.g. an I/O error of the disk), naming the file and the byte offset.
    """
    fd, path = file
    view = memoryview(array.reshape(-1).view(np.uint8))
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as err:
            raise OSError(err.errno, f"{err.strerror} reading at byte {offset + done}", str(path)) from None
        if n == 0:
            raise ValueError(f"{path}: ends before byte {offset + len(view)}: truncated since it was opened")
        done += n
