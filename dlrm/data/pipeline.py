"""The pass of `preprocess` over its inputs: raw Criteo lines -> the splits' parquet shards and statistics.

One streaming pass, memory bounded by the block size and the number of workers, never by the input:
the main thread decompresses the inputs and cuts them into blocks of `block_size` lines, along shard and
split boundaries; `workers` threads parse, validate and summarize blocks (pyarrow and numpy, which run
without the GIL); one writer thread appends them, in order, to the shards and merges the statistics. The
split points need the line total: a background thread counts the lines meanwhile, and the main thread
waits for it only when it reaches a split point that the count so far cannot place yet.

A resumed run (see `dlrm.data.output.PartialDir`) keeps the shards that an earlier run completed: their
lines are skipped in the inputs (inputs whose shards are all complete are not read) and their statistics
read back from the shards.
"""

import queue
import shutil
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from dlrm.data.output import PartialDir, SplitWriter, build_metadata, write_vocabularies
from dlrm.data.parse import OUTPUT_SCHEMA, parse_block
from dlrm.data.schema import LABEL
from dlrm.data.stats import BlockStats, block_stats
from dlrm.data.text import InputStream, LineCounter, PreprocessError, TextBlock, split_block

__all__ = ["DEFAULT_BLOCK_SIZE", "LAYOUTS", "split_starts", "write_splits"]

LAYOUTS = ("fraction", "kaggle", "terabyte")
DEFAULT_BLOCK_SIZE = 1 << 16  # lines per block = rows per parquet row group (~16 MiB of Criteo text)
# Lines parsed at once within a block: on ~8 MiB of text (two pieces of a default block) the parse costs
# ~10% less CPU than on a whole block, whose text and columns overflow the CPU caches; smaller pieces
# cost more again (5M rows: 64k lines 21.4 CPU-s, 32k 19.3, 16k 19.7).
PARSE_LINES = 1 << 15
_COUNTER_POLL_S = 0.02


def split_starts(
    layout: str, line_counts: list[int], val_fraction: float = 0.0, test_fraction: float = 0.0
) -> list[tuple[str, int]]:
    """The splits of `layout` in file order, train / val / test, as (name, 0-based first line over all
    inputs); each runs to the next one's first line (see dlrm.data.preprocess's docstring). Layout
    "fraction": test is the last round(total * test_fraction) lines, val the round(total * (val_fraction
    + test_fraction)) - that before it (fractions checked by dlrm.data.splits.held_out_fractions). Raises
    PreprocessError for an unknown layout or, for terabyte, fewer than two inputs.

    Every first line is non-decreasing in each line count, so counts that are lower bounds of the true
    ones give lower bounds of the true first lines."""
    total = sum(line_counts)
    if layout == "fraction":
        # Both cuts round from the end, so val + test is the rounded held-out share, never one line off it.
        test = total - round(total * test_fraction)
        return [("train", 0), ("val", total - round(total * (val_fraction + test_fraction))), ("test", test)]
    if layout == "kaggle":
        per_day, longer_days = divmod(total, 7)
        held_out = 6 * per_day + min(6, longer_days)  # first line of day 6
    elif layout == "terabyte":
        if len(line_counts) < 2:
            raise PreprocessError("layout terabyte needs the days as separate inputs (day_0 .. day_23)")
        held_out = total - line_counts[-1]
    else:
        raise PreprocessError(f"unknown layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    return [("train", 0), ("val", held_out), ("test", held_out + (total - held_out + 1) // 2)]


def write_splits(
    inputs: Sequence[Path],
    partial: PartialDir,
    layout: str,
    val_fraction: float,
    test_fraction: float,
    rows_per_file: int,
    skip_bad_lines: bool,
    block_size: int,
    workers: int,
    min_frequency: int | None,
    exact_distinct_limit: int,
) -> dict:
    """One pass over `inputs` into the splits' shards (and with `min_frequency` the vocabularies) in the
    open `partial`, resuming its completed shards; the arguments are `preprocess`'s, already checked.

    Returns:
        The metadata of `build_metadata`, with "min_frequency" and the columns' "vocab" and "vocab_size"
        when `min_frequency` is given (without "layout", "val_fraction" and "test_fraction").
    Raises:
        PreprocessError: a missing, empty or truncated input, a malformed line (without `skip_bad_lines`),
            or no train rows.
        OSError: a shard or file could not be written.
    """
    run = _Run(
        list(inputs), partial, layout, (val_fraction, test_fraction), rows_per_file, skip_bad_lines,
        block_size, workers, min_frequency, exact_distinct_limit,
    )  # fmt: skip
    return run.execute()


class _Run:
    """One streaming pass over the inputs into the splits' shards (see `write_splits`)."""

    def __init__(
        self,
        inputs: list[Path],
        partial: PartialDir,
        layout: str,
        fractions: tuple[float, float],
        rows_per_file: int,
        skip_bad_lines: bool,
        block_size: int,
        workers: int,
        min_frequency: int | None,
        exact_distinct_limit: int,
    ) -> None:
        self.inputs, self.partial, self.root = inputs, partial, partial.path
        self.layout, self.fractions = layout, fractions  # (val, test): layout "fraction"
        self.rows_per_file, self.skip_bad_lines = rows_per_file, skip_bad_lines
        self.block_size, self.workers, self.min_frequency = block_size, workers, min_frequency
        partial.progress_dir.mkdir(exist_ok=True)
        shutil.rmtree(partial.counts_dir, ignore_errors=True)  # a stopped run's: resumed shards count again
        counts_dir = partial.counts_dir if min_frequency is not None else None
        self.names = [name for name, _ in split_starts(layout, [1] * len(inputs), *fractions)]
        self.writers = {
            name: SplitWriter(
                self.root,
                name,
                None,
                name == "train",
                exact_distinct_limit,
                counts_dir,
                partial.progress_dir,
            )
            for name in self.names
        }
        self._counts: list[int] | None = None  # all line counts, once known
        self._known: list[int | None] = [None] * len(inputs)  # the line counts known so far
        self._counter: LineCounter | None = None
        # The line count runs over the inputs whose counts place the splits: for terabyte only the last
        # day (train ends where it starts, and the reader knows the other days' counts by then).
        self._counted = [len(inputs) - 1] if layout == "terabyte" else list(range(len(inputs)))
        self._stream: InputStream | None = None
        self._unread = 0  # lines of resumed shards not skipped in the inputs yet
        self._queue: queue.Queue = queue.Queue(maxsize=workers + 1)
        self._writer_error: BaseException | None = None

    # --- where the splits start

    def _line_counts(self, wait: bool = False) -> tuple[list[int], bool]:
        """(line count of each input, whether all are exact); lower bounds while not (see `LineCounter`).
        Counts are kept in the manifest as they become known, for a resumed run. With `wait`, waits for
        the line count (the inputs it does not count must have been read through).

        Raises:
            PreprocessError: the line count failed (an empty, unreadable, truncated or corrupt input).
        """
        if self._counts is None:
            known = list(self._known)
            if self._stream is not None:
                known = [
                    k if k is not None else c for k, c in zip(known, self._stream.line_counts, strict=True)
                ]
            if self._counter is not None and (wait or self._counter.done):
                for i, count in zip(self._counted, self._counter.result(), strict=True):
                    known[i] = count
            if known != self._known:
                self._known = known
                self.partial.save_line_counts(known)
            if None not in known:
                self._counts = known
        if self._counts is not None:
            return self._counts, True
        partial = dict(zip(self._counted, self._counter.partial(), strict=True))
        return [k if k is not None else partial.get(i, 0) for i, k in enumerate(self._known)], False

    def _split_start(self, index: int) -> tuple[float, bool]:
        """(0-based first line of split `index` over all inputs, whether exact); a lower bound while the
        line count runs; infinity past the last split."""
        if index >= len(self.names):
            return float("inf"), True
        counts, exact = self._line_counts()
        return split_starts(self.layout, counts, *self.fractions)[index][1], exact

    def _next_split_start(self, split: int, line: int) -> float:
        """Exact first line of the split after `split` if it is within a block of `line`, else a lower bound
        that is at least a block away (waiting for the line count as long as neither holds)."""
        if self.layout == "terabyte" and split == 0 and self._counts is None:
            return self._terabyte_train_end(line)
        while True:
            start, exact = self._split_start(split + 1)
            if exact or start >= line + self.block_size:
                return start
            time.sleep(_COUNTER_POLL_S)

    def _terabyte_train_end(self, line: int) -> float:
        """Where terabyte's train split ends (the start of the last input) as far as it matters at `line`:
        the exact line once the counts of the other inputs are known, else the end of those known (if
        past `line`), else infinity while the reader is in an earlier input than the last (blocks end at
        the ends of inputs)."""
        while True:
            self._line_counts()
            known_end = 0
            for count in self._known[:-1]:
                if count is None:
                    break
                known_end += count
            else:
                return known_end
            if line < known_end:
                return known_end
            self._skip_unread()
            before = self._stream.file_index
            self._stream.finish_file()  # if the current input is read through, its count becomes known
            if self._stream.file_index == before:
                return float("inf")

    def _skip_unread(self) -> None:
        """Skip the lines of the resumed shards in the inputs, all at once, so that inputs whose shards
        are all complete are not read."""
        if self._unread:
            if self._stream.skip(self._unread, self._known) != self._unread:
                raise PreprocessError(f"the inputs end before their line count of {sum(self._known)}")
            self._unread = 0

    # --- the pass

    def execute(self) -> dict:
        self._known = self.partial.line_counts() or self._known
        if None in self._known:
            self._counter = LineCounter([self.inputs[i] for i in self._counted])
        else:
            self._counts = self._known
        writer = threading.Thread(target=self._write_all, name="preprocess-writer", daemon=True)
        writer.start()
        reader_error: PreprocessError | None = None
        read_all = False
        try:
            with ThreadPoolExecutor(self.workers, thread_name_prefix="preprocess-parse") as pool:
                self._read_all(pool)
            read_all = True
        except PreprocessError as e:
            reader_error = e
        finally:
            self._put(None)
            writer.join()
            if self._counter is not None and (not read_all or self._writer_error is not None):
                self._counter.stop()
        # The writer's error is in an earlier block than where the reader stopped: the first in file order.
        if self._writer_error is not None:
            raise self._writer_error
        if reader_error is not None:
            raise reader_error
        self._line_counts(wait=True)
        if self.writers["train"].rows == 0:
            raise PreprocessError("no train rows: every line is bad or the hold-out splits take them all")
        skipped = sum(w.bad_lines for w in self.writers.values())
        metadata = build_metadata(self.writers, [str(p) for p in self.inputs], skipped)
        if self.min_frequency is not None:
            metadata["min_frequency"] = self.min_frequency
            vocabularies = self.writers["train"].stats.vocabularies(self.min_frequency)
            for column, entry in write_vocabularies(self.root, vocabularies).items():
                metadata["categorical"][column] |= entry
        return metadata

    def _read_all(self, pool: ThreadPoolExecutor) -> None:
        """Main thread: cut the inputs into blocks along shard and split boundaries and hand them on."""
        total_bytes = sum(p.stat().st_size for p in self.inputs)
        split, shard, shard_start, line = 0, 0, 0, 0  # line: 0-based over all inputs
        started = time.perf_counter()
        with (
            InputStream(self.inputs) as self._stream,
            tqdm(total=total_bytes, unit="B", unit_scale=True, desc="preprocess", disable=None) as bar,
        ):
            while True:
                next_split = self._next_split_start(split, line)
                while next_split == line:  # the next split starts here (possibly more than one: empty ones)
                    self._put(("end", split, shard_start, line - shard_start))
                    split, shard, shard_start = split + 1, 0, line
                    next_split = self._next_split_start(split, line)
                if line == shard_start and (resumed := self._resume_shard(pool, split, shard, shard_start)):
                    line = shard_start = shard_start + resumed
                    shard, self._unread = shard + 1, self._unread + resumed
                    continue
                self._skip_unread()
                shard_end = shard_start + self.rows_per_file
                block = self._stream.read(int(min(self.block_size, shard_end - line, next_split - line)))
                if block is None:
                    break
                self._put(("block", split, pool.submit(self._parse, block, self.names[split] == "train")))
                line += block.lines
                if line == shard_end:
                    self._put(("end", split, shard_start, line - shard_start))
                    shard, shard_start = shard + 1, line
                bar.update(self._stream.compressed_position - bar.n)
                bar.set_postfix_str(f"{line / (time.perf_counter() - started):,.0f} rows/s", refresh=False)
        self._put(("end", split, shard_start, line - shard_start))

    def _resume_shard(self, pool: ThreadPoolExecutor, split: int, shard: int, first_line: int) -> int:
        """If an earlier run completed shard `shard` of `split` from `first_line`, hand on its statistics
        (read back from the shard) and return its lines; else (not complete, or not verified) 0."""
        writer = self.writers[self.names[split]]
        record = writer.completed_shard(shard)
        if record is None:
            return 0
        path = self.root / writer.shard_path(shard)
        # Terabyte's counts of the inputs not read yet stay unknown: a full shard is still placed by lower
        # bounds, a shorter one (the last of its split) is redone.
        counts, exact = self._line_counts(wait=self.layout != "terabyte")
        ends = [start for _, start in split_starts(self.layout, counts, *self.fractions)] + [sum(counts)]
        lines = min(self.rows_per_file, ends[split + 1] - first_line)
        if (
            (lines < self.rows_per_file and not exact)
            or record["first_line"] != first_line
            or record["lines"] != lines
            or pq.read_metadata(path).num_rows != record["rows"]
        ):
            return 0
        features = self.names[split] == "train"
        self._put(("resumed", split, pool.submit(self._shard_stats, path, features), record["bad_lines"]))
        return lines

    def _parse(self, block: TextBlock, features: bool) -> tuple[pa.Table, int, BlockStats]:
        parsed = [parse_block(piece, self.skip_bad_lines) for piece in split_block(block, PARSE_LINES)]
        rows = pa.Table.from_batches([batch for batch, _ in parsed], schema=OUTPUT_SCHEMA)
        bad_lines = sum(bad for _, bad in parsed)
        return rows, bad_lines, block_stats(rows, features, self.min_frequency is not None)

    def _shard_stats(self, path: Path, features: bool) -> list[BlockStats]:
        shard = pq.ParquetFile(path)
        columns = None if features else [LABEL]
        value_counts = self.min_frequency is not None
        return [
            block_stats(pa.Table.from_batches([batch]), features, value_counts)
            for batch in shard.iter_batches(batch_size=self.block_size, columns=columns)
        ]

    def _put(self, item: tuple | None) -> None:
        """Queue `item` for the writer thread, stopping the pass if the writer has failed."""
        while True:
            if self._writer_error is not None and item is not None:
                raise self._writer_error
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _write_all(self) -> None:
        """Writer thread: append the parsed blocks to the shards, in order."""
        bad_in_shard = 0
        while (item := self._queue.get()) is not None:
            if self._writer_error is not None:
                continue  # drain the queue so that the main thread never blocks on it
            try:
                kind, split, *rest = item
                writer = self.writers[self.names[split]]
                if kind == "block":
                    rows, bad_lines, stats = rest[0].result()
                    writer.write(rows, stats)
                    writer.bad_lines += bad_lines
                    bad_in_shard += bad_lines
                elif kind == "end":
                    first_line, lines = rest
                    writer.end_shard(first_line, lines, bad_in_shard)
                    bad_in_shard = 0
                else:
                    stats, bad_lines = rest
                    writer.add_completed_shard(stats.result(), bad_lines)
            except BaseException as e:  # re-raised in the main thread
                self._writer_error = e
