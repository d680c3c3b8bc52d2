"""`python -m dlrm.data.preprocess`: raw Criteo TSV(.gz) click logs -> parquet shards + metadata.json.

    python -m dlrm.data.preprocess --input day_0.gz [--input day_1.gz ...] --output-dir DIR \\
        [--layout fraction|kaggle|terabyte] [--eval-fraction 0.2] [--rows-per-file 1000000] \\
        [--block-size 65536] [--workers N] [--min-frequency N] [--exact-distinct-limit 1048576] \\
        [--skip-bad-lines] [--overwrite]

Inputs are raw Criteo lines (40 tab-separated fields, no header: label, I1..I13, C1..C26), plain or gzip,
given in time order. Splits are cut by line position over the inputs concatenated (CTR hold-out is by
time), per `--layout`:
    fraction   the last `eval_fraction` of the lines is the eval split, the rest train;
    kaggle     FB-DLRM's convention for the Kaggle train.txt: the lines cut into 7 equal "days" (the first
               total % 7 days one line longer), days 0-5 train, day 6 halved: val, then test;
    terabyte   the 1TB logs given as day_0 .. day_23: every input but the last is train, the last day is
               halved: val, then test.
The first half of a halved day gets the odd line. Output:

    DIR/train/part-00000.parquet ...   shard k of a split: its lines [k, k + 1) * rows_per_file (bad lines
                                       left out), one parquet row group per block
    DIR/eval/part-00000.parquet ...    (or DIR/val/..., DIR/test/...)
    DIR/vocab/C1.parquet ...           with --min-frequency N: the train ids seen at least N times
    DIR/metadata.json                  row counts, shard list, positive rates, train cardinalities and
                                       dense statistics (see `preprocess`)

Parquet schema: `label` float32 (0/1); `I1..I13` float32, the raw counts (missing -> 0, negatives kept);
`C1..C26` int64, the 32-bit hex category read as an unsigned integer ("ffffffff" -> 4294967295;
missing -> -1).

One streaming pass, memory bounded by the block size and the number of workers, never by the input:
the main thread decompresses the inputs and cuts them into blocks of `block_size` lines; `workers`
threads parse, validate and summarize blocks (pyarrow and numpy, which run without the GIL); one writer
thread appends them, in order, to the shards and merges the statistics. The split points need the line
total: a background thread counts the lines meanwhile, and the main thread waits for it only when it
reaches a split point that the count so far cannot place yet.

Resumable: everything is written into `DIR.partial/` (with a manifest of the arguments and inputs), each
shard under a temporary name, renamed once complete and its row count checked against its footer.
A run that stops (killed, interrupted, disk full) leaves DIR.partial; running the same command again
keeps its completed shards and redoes the rest. DIR.partial is renamed to DIR only when everything is
written. A bad line stops the run with one message naming the file and its 1-based line number (and
removes DIR.partial), unless `--skip-bad-lines`, in which case bad lines are counted and left out.
"""

import ctypes
import fcntl
import json
import os
import queue
import shutil
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

import click
import pyarrow as pa
import pyarrow.parquet as pq
from loguru import logger
from tqdm import tqdm

from dlrm import __version__
from dlrm.data.parse import OUTPUT_SCHEMA, parse_block
from dlrm.data.schema import LABEL
from dlrm.data.stats import DEFAULT_EXACT_DISTINCT_LIMIT, BlockStats, SplitStats, block_stats
from dlrm.data.text import InputStream, LineCounter, PreprocessError, TextBlock, split_block
from dlrm.errors import cli_errors

__all__ = [
    "LAYOUTS",
    "METADATA_FILE",
    "OUTPUT_SCHEMA",
    "PreprocessError",
    "SplitWriter",
    "build_metadata",
    "load_metadata",
    "move_into_place",
    "preprocess",
    "split_starts",
]

LAYOUTS = ("fraction", "kaggle", "terabyte")
VOCAB_SCHEMA = pa.schema([("value", pa.int64()), ("count", pa.int64())])
METADATA_FILE = "metadata.json"
MANIFEST_FILE = "manifest.json"
LOCK_FILE = (
    "lock"  # flock'ed by the process writing DIR.partial (the manifest itself is replaced as it grows)
)
PROGRESS_DIR = "_progress"  # per completed shard: its line range and row count (removed at the end)
VOCAB_DIR = "vocab"
COUNTS_DIR = "_counts"  # with --min-frequency: occurrences per id spilled to disk (removed at the end)
DEFAULT_BLOCK_SIZE = 1 << 16  # lines per block = rows per parquet row group (~16 MiB of Criteo text)
# Lines parsed at once within a block: on ~8 MiB of text (two pieces of a default block) the parse costs
# ~10% less CPU than on a whole block, whose text and columns overflow the CPU caches; smaller pieces
# cost more again (5M rows: 64k lines 21.4 CPU-s, 32k 19.3, 16k 19.7).
PARSE_LINES = 1 << 15
_COUNTER_POLL_S = 0.02
# glibc's mallopt parameters, and what the CLI sets them to (see `_keep_freed_memory`).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks of text and numpy temporaries stay below it
_TRIM_THRESHOLD = 1 << 30


def load_metadata(data_dir: Path | str) -> dict:
    """The metadata.json written by `preprocess` into `data_dir`.

    Raises:
        FileNotFoundError: `data_dir` holds no metadata.json.
    """
    path = Path(data_dir) / METADATA_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run python -m dlrm.data.preprocess first")
    return json.loads(path.read_text())


def split_starts(layout: str, line_counts: list[int], eval_fraction: float) -> list[tuple[str, int]]:
    """The splits of `layout` in file order, as (name, 0-based first line over all inputs); each runs to
    the next one's first line (see the module docstring). Raises PreprocessError for an unknown layout
    or, for terabyte, fewer than two inputs.

    Every first line is non-decreasing in each line count, so counts that are lower bounds of the true
    ones give lower bounds of the true first lines."""
    total = sum(line_counts)
    if layout == "fraction":
        return [("train", 0), ("eval", total - round(total * eval_fraction))]
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


def preprocess(
    inputs: Sequence[Path | str],
    output_dir: Path | str,
    eval_fraction: float = 0.2,
    layout: str = "fraction",
    rows_per_file: int = 1_000_000,
    skip_bad_lines: bool = False,
    overwrite: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
    workers: int | None = None,
    min_frequency: int | None = None,
    exact_distinct_limit: int = DEFAULT_EXACT_DISTINCT_LIMIT,
) -> dict:
    """Convert raw Criteo files into parquet shards per split and metadata.json under `output_dir`.

    Args:
        inputs: raw Criteo TSV files, plain or gzip, in time order.
        output_dir: directory to create; it must not exist unless `overwrite`.
        eval_fraction: layout "fraction": share of lines, taken from the end, that forms the eval split;
            in [0, 1).
        layout: "fraction", "kaggle" or "terabyte" (see the module docstring).
        rows_per_file: lines per parquet shard (the last of a split may be shorter; bad lines are left out).
        skip_bad_lines: count and leave out malformed lines instead of stopping at the first one.
        overwrite: replace an existing `output_dir` that holds an earlier preprocess output.
        block_size: lines a worker parses as one task (in pieces of PARSE_LINES), and rows per parquet
            row group; memory grows with it.
        workers: threads that parse blocks (default: the CPU count).
        min_frequency: also write, per sparse column, the train ids seen at least this many times
            (DIR/vocab/<column>.parquet: `value` int64 ascending, `count` int64).
        exact_distinct_limit: distinct counts are exact up to this many ids per column, estimated past it.
    Returns:
        The metadata written to metadata.json:
        {"version", "source": [inputs], "layout", "eval_fraction" (null unless layout "fraction"),
         "rows": {split: rows}, "files": {split: [paths relative to output_dir]},
         "positive_rate": {split: rate} (null for an empty split),
         "categorical": {"C1": {"cardinality": distinct non-missing train ids, "exact": whether that count
             is exact (else a HyperLogLog estimate, ~0.8% standard error), with --min-frequency also
             "vocab": relative path, "vocab_size": ids in it}, ...},
         "dense": {"I1": {"min", "max", "mean"} over train after missing -> 0, ...}, "skipped_lines",
         "exact_distinct_limit", and with --min-frequency "min_frequency"}.
    Raises:
        PreprocessError: bad arguments, an unusable output directory, a missing, empty or truncated input,
            or a malformed line (without `skip_bad_lines`); the message is a single line.
    """
    inputs = [Path(p) for p in inputs]
    output_dir = Path(output_dir)
    workers = (os.cpu_count() or 1) if workers is None else workers
    _check_arguments(
        inputs,
        output_dir,
        eval_fraction,
        layout,
        rows_per_file,
        overwrite,
        block_size,
        workers,
        min_frequency,
        exact_distinct_limit,
    )
    started = time.perf_counter()
    partial_dir = output_dir.with_name(f"{output_dir.name}.partial")
    identity = {
        "inputs": [_fingerprint(p) for p in inputs],
        "layout": layout,
        "eval_fraction": eval_fraction,
        "rows_per_file": rows_per_file,
        "skip_bad_lines": skip_bad_lines,
    }
    with _open_partial(partial_dir, identity) as partial:
        try:
            run = _Run(
                inputs, partial, layout, eval_fraction, rows_per_file, skip_bad_lines, block_size, workers,
                min_frequency, exact_distinct_limit,
            )  # fmt: skip
            metadata = run.execute()
        except PreprocessError:
            shutil.rmtree(partial_dir, ignore_errors=True)  # the input needs fixing: nothing to resume
            raise
        except BaseException:
            logger.warning("stopped; run the same command again to resume from {}", partial_dir)
            raise
        metadata |= {"layout": layout, "eval_fraction": eval_fraction if layout == "fraction" else None}
        (partial_dir / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
        shutil.rmtree(partial_dir / PROGRESS_DIR, ignore_errors=True)
        shutil.rmtree(partial_dir / COUNTS_DIR, ignore_errors=True)
        (partial_dir / MANIFEST_FILE).unlink()
        (partial_dir / LOCK_FILE).unlink()
    move_into_place(partial_dir, output_dir)

    seconds = time.perf_counter() - started
    if metadata["skipped_lines"]:
        logger.warning("skipped {:,} bad line(s)", metadata["skipped_lines"])
    rows = sum(metadata["rows"].values()) + metadata["skipped_lines"]
    logger.info(
        "preprocessed {:,} lines from {} file(s) in {:.1f} s ({:,.0f} rows/s): {} -> {}",
        rows,
        len(inputs),
        seconds,
        rows / seconds,
        " / ".join(f"{n:,} {split}" for split, n in metadata["rows"].items()),
        output_dir,
    )
    return metadata


def _check_arguments(
    inputs: list[Path],
    output_dir: Path,
    eval_fraction: float,
    layout: str,
    rows_per_file: int,
    overwrite: bool,
    block_size: int,
    workers: int,
    min_frequency: int | None,
    exact_distinct_limit: int,
) -> None:
    if not inputs:
        raise PreprocessError("no input files given")
    if not 0.0 <= eval_fraction < 1.0:
        raise PreprocessError(f"eval fraction must be in [0, 1), got {eval_fraction}")
    split_starts(layout, [1] * len(inputs), eval_fraction)  # an unknown layout, or terabyte with one input
    if rows_per_file < 1:
        raise PreprocessError(f"rows per file must be at least 1, got {rows_per_file}")
    if block_size < 1:
        raise PreprocessError(f"block size must be at least 1, got {block_size}")
    if workers < 1:
        raise PreprocessError(f"workers must be at least 1, got {workers}")
    if min_frequency is not None and min_frequency < 1:
        raise PreprocessError(f"min frequency must be at least 1, got {min_frequency}")
    if exact_distinct_limit < 0:
        raise PreprocessError(f"exact distinct limit must be at least 0, got {exact_distinct_limit}")
    for path in inputs:
        if not path.exists():
            raise PreprocessError(f"{path}: no such file")
        if not path.is_file():
            raise PreprocessError(f"{path}: not a regular file")
    if output_dir.exists():
        if not overwrite:
            raise PreprocessError(f"{output_dir} already exists: pass --overwrite to replace it")
        # --overwrite deletes the directory, so only accept one that an earlier run wrote (or an empty one).
        if not output_dir.is_dir() or not (
            (output_dir / METADATA_FILE).is_file() or not any(output_dir.iterdir())
        ):
            raise PreprocessError(
                f"{output_dir} exists and is not a preprocess output (no {METADATA_FILE}): not replacing it"
            )


def _fingerprint(path: Path) -> dict:
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


class _open_partial:  # noqa: N801 - used as a context manager, like open()
    """DIR.partial, locked for this process: resumed when its manifest has the same `identity`
    (arguments and input fingerprints), else made anew (an earlier run's with other arguments is removed).

    Raises:
        PreprocessError: DIR.partial exists but is not a preprocess work directory, or another process
            is writing it.
    """

    def __init__(self, partial_dir: Path, identity: dict) -> None:
        self.partial_dir, self.identity = partial_dir, identity
        self._lock: IO | None = None

    def __enter__(self) -> Path:
        manifest = self.partial_dir / MANIFEST_FILE
        if self.partial_dir.exists() and not manifest.is_file():
            raise PreprocessError(
                f"{self.partial_dir} exists and is not a preprocess work directory (no {MANIFEST_FILE})"
            )
        if self.partial_dir.exists():
            self._lock_partial()
            if json.loads(manifest.read_text())["identity"] == self.identity:
                logger.info("resuming the preprocess in {}", self.partial_dir)
                return self.partial_dir
            logger.warning("{} was written with other arguments or inputs: starting anew", self.partial_dir)
            shutil.rmtree(self.partial_dir)
            self._lock.close()
        fresh = self.partial_dir.with_name(f"{self.partial_dir.name}.tmp-{os.getpid()}")
        shutil.rmtree(fresh, ignore_errors=True)  # left by a killed run whose pid was reused
        fresh.mkdir(parents=True)
        (fresh / MANIFEST_FILE).write_text(json.dumps({"identity": self.identity}, indent=2) + "\n")
        os.replace(fresh, self.partial_dir)
        self._lock_partial()
        return self.partial_dir

    def _lock_partial(self) -> None:
        self._lock = (self.partial_dir / LOCK_FILE).open("a")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise PreprocessError(f"{self.partial_dir} is being written by another preprocess") from None

    def __exit__(self, *exc) -> None:
        if self._lock is not None:
            self._lock.close()


def move_into_place(tmp_dir: Path, output_dir: Path) -> None:
    """Rename the finished `tmp_dir` to `output_dir`, replacing an earlier output if there is one."""
    if output_dir.exists():
        old_dir = output_dir.with_name(f"{output_dir.name}.old-{os.getpid()}")
        os.replace(output_dir, old_dir)
        os.replace(tmp_dir, output_dir)
        shutil.rmtree(old_dir)
    else:
        os.replace(tmp_dir, output_dir)


class SplitWriter:
    """Writes one split as parquet shards and merges its statistics (see `SplitStats`).

    Each shard is written as `<split>/part-NNNNN.parquet.tmp` and renamed once closed and its footer's row
    count checked. With `rows_per_file` a shard is closed after that many rows; with None only by
    `end_shard`. With `progress_dir`, a completed shard also leaves `<split>-NNNNN.json` there (its first
    line, lines and rows), which is how a resumed run recognizes it.
    """

    def __init__(
        self,
        root: Path,
        split: str,
        rows_per_file: int | None,
        collect_feature_stats: bool,
        exact_distinct_limit: int = DEFAULT_EXACT_DISTINCT_LIMIT,
        value_counts_dir: Path | None = None,
        progress_dir: Path | None = None,
    ) -> None:
        self.root, self.split, self.rows_per_file = root, split, rows_per_file
        self.progress_dir = progress_dir
        self.files: list[str] = []
        self.stats = SplitStats(
            collect_feature_stats, exact_distinct_limit, value_counts_dir if collect_feature_stats else None
        )
        self.bad_lines = 0
        self._writer: pq.ParquetWriter | None = None
        self._rows_in_file = 0

    @property
    def rows(self) -> int:
        return self.stats.rows

    @property
    def positives(self) -> float:
        return self.stats.positives

    def shard_path(self, index: int) -> str:
        """Path of shard `index`, relative to the root."""
        return f"{self.split}/part-{index:05d}.parquet"

    def progress_path(self, index: int) -> Path:
        return self.progress_dir / f"{self.split}-{index:05d}.json"

    def write(self, rows: pa.RecordBatch | pa.Table, stats: BlockStats | None = None) -> None:
        """Append `rows` (OUTPUT_SCHEMA) to the open shard as one row group, opening a shard first if none
        is; `stats` are the rows' block_stats when the caller has them."""
        if rows.num_rows == 0:
            return
        self._open()
        take = rows.num_rows if self.rows_per_file is None else self.rows_per_file - self._rows_in_file
        if take < rows.num_rows:  # only with rows_per_file, which then computes the statistics here
            self.write(rows.slice(0, take))
            self.write(rows.slice(take))
            return
        self.stats.add(stats or block_stats(rows, self.stats.features, self.stats.value_counts))
        self._writer.write(rows)
        self._rows_in_file += rows.num_rows
        if self._rows_in_file == self.rows_per_file:
            self.end_shard()

    def end_shard(self, first_line: int = 0, lines: int = 0, bad_lines: int = 0) -> None:
        """Close the open shard (an empty one if none is open and `lines` > 0); for the progress file,
        it covered `lines` input lines from 0-based line `first_line` over all inputs, `bad_lines` bad."""
        if lines:
            self._open()
        if self._writer is None:
            return
        self._writer.close()
        self._writer = None
        relative = self.files[-1]
        tmp = self.root / f"{relative}.tmp"
        footer_rows = pq.read_metadata(tmp).num_rows
        if footer_rows != self._rows_in_file:
            raise OSError(f"{tmp}: footer says {footer_rows} rows, {self._rows_in_file} were written")
        if self.progress_dir is not None:
            record = {"first_line": first_line, "lines": lines, "rows": footer_rows, "bad_lines": bad_lines}
            _write_atomically(self.progress_path(len(self.files) - 1), json.dumps(record) + "\n")
        os.replace(tmp, self.root / relative)
        self._rows_in_file = 0

    def add_completed_shard(self, stats: list[BlockStats], bad_lines: int) -> None:
        """Count a shard that an earlier run completed (the next index) with its rows' statistics."""
        self.files.append(self.shard_path(len(self.files)))
        for s in stats:
            self.stats.add(s)
        self.bad_lines += bad_lines

    def close(self) -> None:
        self.end_shard()

    def _open(self) -> None:
        if self._writer is None:
            relative = self.shard_path(len(self.files))
            (self.root / self.split).mkdir(exist_ok=True)
            self._writer = pq.ParquetWriter(self.root / f"{relative}.tmp", OUTPUT_SCHEMA)
            self.files.append(relative)
            self._rows_in_file = 0

    def positive_rate(self) -> float | None:
        return self.stats.positive_rate()

    def cardinalities(self) -> dict:
        return self.stats.cardinalities()

    def dense_stats(self) -> dict:
        return self.stats.dense_stats()


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def build_metadata(writers: dict[str, SplitWriter], source: list[str], skipped_lines: int) -> dict:
    """The metadata.json contents for closed split writers; "train" carries the feature statistics."""
    train = writers["train"]
    return {
        "version": __version__,
        "source": source,
        "rows": {name: w.rows for name, w in writers.items()},
        "files": {name: w.files for name, w in writers.items()},
        "positive_rate": {name: w.positive_rate() for name, w in writers.items()},
        "categorical": train.cardinalities(),
        "dense": train.dense_stats(),
        "skipped_lines": skipped_lines,
        "exact_distinct_limit": train.stats.exact_distinct_limit,
    }


class _Run:
    """One streaming pass over the inputs into the splits' shards (see the module docstring)."""

    def __init__(
        self,
        inputs: list[Path],
        root: Path,
        layout: str,
        eval_fraction: float,
        rows_per_file: int,
        skip_bad_lines: bool,
        block_size: int,
        workers: int,
        min_frequency: int | None,
        exact_distinct_limit: int,
    ) -> None:
        self.inputs, self.root = inputs, root
        self.layout, self.eval_fraction = layout, eval_fraction
        self.rows_per_file, self.skip_bad_lines = rows_per_file, skip_bad_lines
        self.block_size, self.workers, self.min_frequency = block_size, workers, min_frequency
        progress_dir = root / PROGRESS_DIR
        progress_dir.mkdir(exist_ok=True)
        shutil.rmtree(
            root / COUNTS_DIR, ignore_errors=True
        )  # a stopped run's: resumed shards are counted again
        counts_dir = root / COUNTS_DIR if min_frequency is not None else None
        self.names = [name for name, _ in split_starts(layout, [1] * len(inputs), eval_fraction)]
        self.writers = {
            name: SplitWriter(
                root,
                name,
                None,
                name == "train",
                exact_distinct_limit,
                counts_dir,
                progress_dir,
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
                manifest_path = self.root / MANIFEST_FILE
                manifest = json.loads(manifest_path.read_text())
                _write_atomically(manifest_path, json.dumps(manifest | {"line_counts": known}) + "\n")
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
        return split_starts(self.layout, counts, self.eval_fraction)[index][1], exact

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
        self._known = json.loads((self.root / MANIFEST_FILE).read_text()).get("line_counts", self._known)
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
            self._write_vocabularies(metadata)
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
        progress = writer.progress_path(shard)
        path = self.root / writer.shard_path(shard)
        if not (progress.is_file() and path.is_file()):
            return 0
        record = json.loads(progress.read_text())
        # Terabyte's counts of the inputs not read yet stay unknown: a full shard is still placed by lower
        # bounds, a shorter one (the last of its split) is redone.
        counts, exact = self._line_counts(wait=self.layout != "terabyte")
        ends = [start for _, start in split_starts(self.layout, counts, self.eval_fraction)] + [sum(counts)]
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

    def _write_vocabularies(self, metadata: dict) -> None:
        """DIR/vocab/<column>.parquet (see `preprocess`), written piece by piece."""
        (self.root / VOCAB_DIR).mkdir(exist_ok=True)
        for column, pieces in self.writers["train"].stats.vocabularies(self.min_frequency).items():
            relative = f"{VOCAB_DIR}/{column}.parquet"
            size = 0
            with pq.ParquetWriter(self.root / f"{relative}.tmp", VOCAB_SCHEMA) as writer:
                for piece in pieces:
                    writer.write_table(piece)
                    size += piece.num_rows
            os.replace(self.root / f"{relative}.tmp", self.root / relative)
            metadata["categorical"][column] |= {"vocab": relative, "vocab_size": size}


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--input",
    "inputs",
    multiple=True,
    required=True,
    type=click.Path(path_type=Path),
    help="Raw Criteo TSV file, plain or .gz. Repeat for several files (--input a --input b), in time order.",
)
@click.option("--output-dir", required=True, type=click.Path(path_type=Path), help="Directory to create.")
@click.option(
    "--layout",
    type=click.Choice(LAYOUTS),
    default="fraction",
    show_default=True,
    help="Splits: fraction (train/eval by --eval-fraction), kaggle (FB-DLRM's 7 days of train.txt: "
    "6 train, the last halved into val/test), terabyte (inputs day_0..day_23: the last halved: val/test).",
)
@click.option(
    "--eval-fraction",
    default=0.2,
    show_default=True,
    help="Share of lines, taken from the end of the inputs, that forms the eval split.",
)
@click.option("--rows-per-file", default=1_000_000, show_default=True, help="Lines per parquet shard.")
@click.option(
    "--block-size",
    default=DEFAULT_BLOCK_SIZE,
    show_default=True,
    help="Lines a worker parses as one task, and rows per parquet row group; memory grows with it and "
    "--workers.",
)
@click.option("--workers", type=int, default=None, help="Threads that parse blocks.  [default: CPU count]")
@click.option(
    "--min-frequency",
    type=int,
    default=None,
    help="Also write per sparse column the train ids seen at least this often (DIR/vocab/C*.parquet).",
)
@click.option(
    "--exact-distinct-limit",
    default=DEFAULT_EXACT_DISTINCT_LIMIT,
    show_default=True,
    help="Distinct ids per column counted exactly up to this many; a HyperLogLog estimate past it.",
)
@click.option(
    "--skip-bad-lines", is_flag=True, help="Count and leave out malformed lines instead of stopping."
)
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory of an earlier run.")
def main(
    inputs: tuple[Path, ...],
    output_dir: Path,
    layout: str,
    eval_fraction: float,
    rows_per_file: int,
    block_size: int,
    workers: int | None,
    min_frequency: int | None,
    exact_distinct_limit: int,
    skip_bad_lines: bool,
    overwrite: bool,
) -> None:
    """Convert raw Criteo click logs into parquet shards per split and metadata.json."""
    _keep_freed_memory()
    with cli_errors():  # PreprocessError is a ValueError; OSError on --input / --output-dir: PATH: reason
        preprocess(
            list(inputs),
            output_dir,
            eval_fraction,
            layout,
            rows_per_file,
            skip_bad_lines,
            overwrite,
            block_size,
            workers,
            min_frequency,
            exact_distinct_limit,
        )


def _keep_freed_memory() -> None:
    """Have glibc's malloc keep freed memory for reuse instead of handing it back to the kernel. By default
    it maps every allocation past 128 KiB (a block of text, numpy's per-column temporaries) on its own and
    unmaps it when freed, so each block faults its pages in again: 0.1-0.3 CPU-us per row of kernel time.
    Peak RSS grows by tens of MiB at most, since the blocks in flight are bounded. Process-wide, hence only
    in the CLI; a no-op where the C library has no mallopt."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # the C library linked into Python
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)


if __name__ == "__main__":
    main()
