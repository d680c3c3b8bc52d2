"""`python -m dlrm.data.preprocess`: raw Criteo TSV(.gz) click logs -> parquet shards + metadata.json.

    python -m dlrm.data.preprocess --input day_0.gz [--input day_1.gz ...] --output-dir DIR \\
        [--layout fraction|kaggle|terabyte] [--eval-fraction 0.2] [--rows-per-file 1000000] \\
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

    DIR/train/part-00000.parquet ...   at most `rows_per_file` rows each
    DIR/eval/part-00000.parquet ...    (or DIR/val/..., DIR/test/...)
    DIR/metadata.json                  row counts, shard list, positive rates, train cardinalities and
                                       dense statistics (see `preprocess`)

Parquet schema: `label` float32 (0/1); `I1..I13` float32, the raw counts (missing -> 0, negatives kept);
`C1..C26` int64, the 32-bit hex category read as an unsigned integer ("ffffffff" -> 4294967295;
missing -> -1).

Two passes over the inputs: the first counts lines (the split point needs the total) and rejects missing,
empty and truncated files before anything is written; the second parses, validates and writes one block
of text at a time. Everything is written into `DIR.tmp-<pid>` and renamed to DIR only when complete.
A bad line stops the run with one message naming the file and its 1-based line number, unless
`--skip-bad-lines` is given, in which case bad lines are counted and left out.
"""

import gzip
import json
import os
import shutil
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import click
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
from loguru import logger
from tqdm import tqdm

from dlrm import __version__
from dlrm.data.schema import (
    DENSE_COLUMNS,
    LABEL,
    MISSING_CATEGORY,
    RAW_COLUMNS,
    SPARSE_COLUMNS,
)

LAYOUTS = ("fraction", "kaggle", "terabyte")
METADATA_FILE = "metadata.json"
OUTPUT_SCHEMA = pa.schema(
    [
        pa.field(LABEL, pa.float32()),
        *(pa.field(c, pa.float32()) for c in DENSE_COLUMNS),
        *(pa.field(c, pa.int64()) for c in SPARSE_COLUMNS),
    ]
)

# Bytes of text parsed per block; one block is also one parquet row group (~65k Criteo rows).
_BLOCK_SIZE = 16 << 20
_GZIP_MAGIC = b"\x1f\x8b"
# At most 18 digits, so every accepted count fits in int64 without an overflow check.
_INTEGER_PATTERN = "^-?[0-9]{1,18}$"
_HEX_PATTERN = "^[0-9a-fA-F]{1,8}$"
# Byte -> hex digit value; only bytes that passed _HEX_PATTERN (or the padding "0") are looked up.
_HEX_DIGIT_VALUE = np.zeros(256, dtype=np.uint64)
for _digits, _first in ((b"0123456789", 0), (b"abcdef", 10), (b"ABCDEF", 10)):
    _HEX_DIGIT_VALUE[np.frombuffer(_digits, dtype=np.uint8)] = np.arange(_first, _first + len(_digits))
_HEX_SHIFTS = np.arange(28, -1, -4, dtype=np.uint64)  # bit position of each of the 8 hex digits


class PreprocessError(ValueError):
    """Bad input or arguments; the message is one line naming the file and line where there is one."""


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
    or, for terabyte, fewer than two inputs."""
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
) -> dict:
    """Convert raw Criteo files into train/eval parquet shards and metadata.json under `output_dir`.

    Args:
        inputs: raw Criteo TSV files, plain or gzip, in time order.
        output_dir: directory to create; it must not exist unless `overwrite`.
        eval_fraction: layout "fraction": share of lines, taken from the end, that forms the eval split;
            in [0, 1).
        layout: "fraction", "kaggle" or "terabyte" (see the module docstring).
        rows_per_file: maximum rows per parquet shard.
        skip_bad_lines: count and leave out malformed lines instead of stopping at the first one.
        overwrite: replace an existing `output_dir` that holds an earlier preprocess output.
    Returns:
        The metadata written to metadata.json:
        {"version", "source": [inputs], "layout", "eval_fraction" (null unless layout "fraction"),
         "rows": {split: rows}, "files": {split: [paths relative to output_dir]},
         "positive_rate": {split: rate} (null for an empty split),
         "categorical": {"C1": {"cardinality": distinct non-missing train values}, ...},
         "dense": {"I1": {"min", "max", "mean"} over train after missing -> 0, ...}, "skipped_lines"}.
    Raises:
        PreprocessError: bad arguments, an unusable output directory, a missing, empty or truncated input,
            or a malformed line (without `skip_bad_lines`); the message is a single line.
    """
    inputs = [Path(p) for p in inputs]
    output_dir = Path(output_dir)
    _check_arguments(inputs, output_dir, eval_fraction, rows_per_file, overwrite)
    started = time.perf_counter()

    line_counts = _count_lines_of_inputs(inputs)
    total_lines = sum(line_counts)
    starts = split_starts(layout, line_counts, eval_fraction)

    tmp_dir = output_dir.with_name(f"{output_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)  # left by a killed run whose pid was reused
    try:
        tmp_dir.mkdir(parents=True)
        metadata = _write_splits(inputs, line_counts, starts, tmp_dir, rows_per_file, skip_bad_lines)
        metadata["layout"] = layout
        metadata["eval_fraction"] = eval_fraction if layout == "fraction" else None
        (tmp_dir / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
        move_into_place(tmp_dir, output_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise

    seconds = time.perf_counter() - started
    if metadata["skipped_lines"]:
        logger.warning("skipped {:,} bad line(s)", metadata["skipped_lines"])
    logger.info(
        "preprocessed {:,} lines from {} file(s) in {:.1f} s ({:,.0f} rows/s): {} -> {}",
        total_lines,
        len(inputs),
        seconds,
        total_lines / seconds,
        " / ".join(f"{rows:,} {split}" for split, rows in metadata["rows"].items()),
        output_dir,
    )
    return metadata


def _check_arguments(
    inputs: list[Path], output_dir: Path, eval_fraction: float, rows_per_file: int, overwrite: bool
) -> None:
    if not inputs:
        raise PreprocessError("no input files given")
    if not 0.0 <= eval_fraction < 1.0:
        raise PreprocessError(f"eval fraction must be in [0, 1), got {eval_fraction}")
    if rows_per_file < 1:
        raise PreprocessError(f"rows per file must be at least 1, got {rows_per_file}")
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


def move_into_place(tmp_dir: Path, output_dir: Path) -> None:
    """Rename the finished `tmp_dir` to `output_dir`, replacing an earlier output if there is one."""
    if output_dir.exists():
        old_dir = output_dir.with_name(f"{output_dir.name}.old-{os.getpid()}")
        os.replace(output_dir, old_dir)
        os.replace(tmp_dir, output_dir)
        shutil.rmtree(old_dir)
    else:
        os.replace(tmp_dir, output_dir)


def _is_gzip(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(len(_GZIP_MAGIC)) == _GZIP_MAGIC


def _count_lines_of_inputs(inputs: list[Path]) -> list[int]:
    """First pass: the number of lines of each input, with a progress bar over the input bytes."""
    total_bytes = sum(p.stat().st_size for p in inputs)
    with tqdm(
        total=total_bytes, unit="B", unit_scale=True, desc="count lines", disable=None, leave=False
    ) as bar:
        return [_count_lines(p, bar) for p in inputs]


def _count_lines(path: Path, bar: tqdm) -> int:
    """Lines in `path` (plain or gzip text); a last line without a newline counts too.

    Raises:
        PreprocessError: the file cannot be read, is empty, or its gzip stream is truncated or corrupt;
            for the latter the line number is that of the first line that cannot be read in full.
    """
    newlines, last_byte = 0, b"\n"
    try:
        raw = path.open("rb")
    except OSError as e:
        raise PreprocessError(f"{path}: cannot open ({e.strerror})") from None
    with raw:
        text = gzip.GzipFile(fileobj=raw) if _is_gzip(path) else raw
        try:
            # read1 returns the data decompressed so far before raising, so the count is exact on truncation.
            while chunk := text.read1(1 << 20):
                newlines += chunk.count(b"\n")
                last_byte = chunk[-1:]
                bar.update(raw.tell() - bar.n)
        except (EOFError, OSError, zlib.error) as e:
            raise PreprocessError(
                f"{path} line {newlines + 1}: truncated or corrupt gzip data ({e})"
            ) from None
    lines = newlines + (last_byte != b"\n")
    if lines == 0:
        raise PreprocessError(f"{path} line 1: file is empty")
    return lines


class _Block(NamedTuple):
    """The good rows of one parsed block of an input file."""

    rows: pa.RecordBatch  # in OUTPUT_SCHEMA
    lines: np.ndarray  # [rows] int64, 1-based line numbers of `rows` in the file, increasing
    lines_read: int  # lines the block covered, good and bad
    bad_lines: int


def _parse_file(path: Path, skip_bad_lines: bool) -> Iterator[_Block]:
    """Second pass over one file: parse, validate and convert it block by block.

    Raises:
        PreprocessError: a malformed line (the first in file order), unless `skip_bad_lines`.
    """
    # Lines with the wrong field count never reach the batches; pyarrow reports them here with their line
    # numbers, in file order, from a thread that may already be parsing blocks after the one being handled.
    field_count_errors: list[tuple[int, int]] = []  # (line, fields)

    def on_invalid_row(row: pcsv.InvalidRow) -> str:
        field_count_errors.append((row.number, row.actual_columns))
        return "skip"

    def field_count_error(index: int) -> tuple[int, str]:
        line, fields = field_count_errors[index]
        return line, f"expected {len(RAW_COLUMNS)} tab-separated fields, got {fields}"

    next_line = 1  # first line not covered by the blocks handled so far
    consumed = 0  # field_count_errors before next_line
    try:
        reader = pcsv.open_csv(
            pa.input_stream(str(path), compression="gzip" if _is_gzip(path) else None),
            # Serial parsing: threaded parsing does not report the line numbers of bad rows.
            read_options=pcsv.ReadOptions(
                column_names=RAW_COLUMNS, use_threads=False, block_size=_BLOCK_SIZE
            ),
            # Empty lines are kept as rows (of empty fields) so that every line is a row or a reported error.
            parse_options=pcsv.ParseOptions(
                delimiter="\t", quote_char=False, invalid_row_handler=on_invalid_row, ignore_empty_lines=False
            ),
            # Every field as raw bytes: the checks in _convert find bad values with their line numbers.
            convert_options=pcsv.ConvertOptions(column_types={c: pa.binary() for c in RAW_COLUMNS}),
        )
        for raw in reader:
            # The block's rows are the first num_rows lines from next_line that are not field-count errors
            # (all errors among them are reported by now: a block is parsed before it is delivered).
            pending = np.array([line for line, _ in field_count_errors[consumed:]], dtype=np.int64)
            candidates = np.arange(next_line, next_line + raw.num_rows + len(pending), dtype=np.int64)
            lines = np.setdiff1d(candidates, pending, assume_unique=True)[: raw.num_rows]
            end = int(lines[-1]) + 1 if raw.num_rows else next_line
            skipped = int(np.searchsorted(pending, end))
            rows, bad_cell, message = _convert(raw)
            if not skip_bad_lines and (skipped or bad_cell.any()):
                errors = [field_count_error(consumed)] if skipped else []
                if bad_cell.any():
                    first = int(np.argmax(bad_cell))
                    errors.append((int(lines[first]), message(first)))
                line, what = min(errors)
                raise PreprocessError(f"{path} line {line}: {what}")
            yield _Block(
                rows.filter(pa.array(~bad_cell)),
                lines[~bad_cell],
                lines_read=end - next_line,
                bad_lines=skipped + int(bad_cell.sum()),
            )
            next_line, consumed = end, consumed + skipped
    except (pa.ArrowException, OSError) as e:
        raise PreprocessError(f"{path} line {next_line}: {str(e).splitlines()[0]}") from None
    # Bad lines after the last row of the file.
    trailing = len(field_count_errors) - consumed
    if trailing and not skip_bad_lines:
        line, what = field_count_error(consumed)
        raise PreprocessError(f"{path} line {line}: {what}")
    if trailing:
        yield _Block(
            pa.RecordBatch.from_pylist([], schema=OUTPUT_SCHEMA), np.empty(0, np.int64), trailing, trailing
        )


def _convert(raw: pa.RecordBatch) -> tuple[pa.RecordBatch, np.ndarray, Callable[[int], str]]:
    """Validate and convert one block of raw byte fields to OUTPUT_SCHEMA.

    Returns:
        rows: the converted block; values of bad cells are placeholders.
        bad: [rows] bool, rows with at least one bad cell.
        message: row index -> description of that row's first bad cell.
    """
    invalid: dict[str, np.ndarray] = {}
    arrays = []
    for name in RAW_COLUMNS:
        values = raw.column(name)
        empty = pc.equal(pc.binary_length(values), 0)
        if name == LABEL:
            ok = pc.is_in(values, value_set=pa.array([b"0", b"1"]))
            arrays.append(pc.cast(pc.equal(values, b"1"), pa.float32()))
        elif name in DENSE_COLUMNS:
            ok = pc.or_(empty, pc.match_substring_regex(values, _INTEGER_PATTERN))
            digits = pc.cast(pc.if_else(pc.and_not(ok, empty), values, b"0"), pa.string())
            # Not a safe cast: counts past 2**24 (Criteo's I5 reaches ~23M) round to the nearest float32.
            arrays.append(pc.cast(pc.cast(digits, pa.int64()), pa.float32(), safe=False))
        else:
            ok = pc.or_(empty, pc.match_substring_regex(values, _HEX_PATTERN))
            ids = _parse_hex(pc.if_else(ok, values, b""))
            arrays.append(pa.array(np.where(empty.to_numpy(zero_copy_only=False), MISSING_CATEGORY, ids)))
        invalid[name] = ~ok.to_numpy(zero_copy_only=False)
    bad = np.logical_or.reduce(list(invalid.values()))

    def message(row: int) -> str:
        name = next(c for c in RAW_COLUMNS if invalid[c][row])
        value = raw.column(name)[row].as_py().decode("utf-8", "replace")
        expected = {LABEL: "0 or 1"}.get(name, "an integer" if name in DENSE_COLUMNS else "1 to 8 hex digits")
        return f"{name}: expected {expected}, got {value[:40]!r}"

    return pa.RecordBatch.from_arrays(arrays, schema=OUTPUT_SCHEMA), bad, message


def _parse_hex(values: pa.Array) -> np.ndarray:
    """[n] int64 values of hex strings of at most 8 digits ("" -> 0), as unsigned 32-bit numbers."""
    if len(values) == 0:
        return np.empty(0, dtype=np.int64)
    # Left-pad to exactly 8 digits, so the strings form one contiguous [n, 8] byte matrix.
    padded = pc.cast(pc.utf8_lpad(pc.cast(values, pa.string()), 8, "0"), pa.binary(8))
    digits = np.frombuffer(
        padded.buffers()[1], dtype=np.uint8, count=8 * len(padded), offset=8 * padded.offset
    )
    nibbles = _HEX_DIGIT_VALUE[digits.reshape(-1, 8)]
    return (nibbles << _HEX_SHIFTS).sum(axis=1).astype(np.int64)


class _DistinctCounter:
    """Counts the distinct values of an int64 column seen block by block.

    Per-block uniques are merged only once they outgrow the merged set, which keeps the merging cost
    near-linear while memory stays within about twice the distinct count.
    """

    def __init__(self) -> None:
        self._merged = np.empty(0, dtype=np.int64)
        self._pending: list[np.ndarray] = []
        self._pending_size = 0

    def update(self, values: np.ndarray) -> None:
        unique = np.unique(values)
        self._pending.append(unique)
        self._pending_size += len(unique)
        if self._pending_size > max(len(self._merged), 1 << 16):
            self._merge()

    def count(self) -> int:
        self._merge()
        return len(self._merged)

    def _merge(self) -> None:
        self._merged = np.unique(np.concatenate([self._merged, *self._pending]))
        self._pending, self._pending_size = [], 0


class SplitWriter:
    """Writes one split as parquet shards of at most `rows_per_file` rows and tracks its statistics."""

    def __init__(self, root: Path, split: str, rows_per_file: int, collect_feature_stats: bool) -> None:
        self.root, self.split, self.rows_per_file = root, split, rows_per_file
        self.files: list[str] = []
        self.rows = 0
        self.positives = 0.0
        self._writer: pq.ParquetWriter | None = None
        self._rows_in_file = 0
        self._feature_stats = collect_feature_stats
        self._distinct = {c: _DistinctCounter() for c in SPARSE_COLUMNS}
        self._min = np.full(len(DENSE_COLUMNS), np.inf)
        self._max = np.full(len(DENSE_COLUMNS), -np.inf)
        self._sum = np.zeros(len(DENSE_COLUMNS))

    def write(self, rows: pa.RecordBatch) -> None:
        if rows.num_rows == 0:
            return
        self.rows += rows.num_rows
        self.positives += float(pc.sum(rows.column(LABEL)).as_py())
        if self._feature_stats:
            self._update_feature_stats(rows)
        while rows.num_rows:
            if self._writer is None:
                relative = f"{self.split}/part-{len(self.files):05d}.parquet"
                (self.root / self.split).mkdir(exist_ok=True)
                self._writer = pq.ParquetWriter(self.root / relative, OUTPUT_SCHEMA)
                self.files.append(relative)
            take = min(rows.num_rows, self.rows_per_file - self._rows_in_file)
            self._writer.write_batch(rows.slice(0, take))
            self._rows_in_file += take
            rows = rows.slice(take)
            if self._rows_in_file == self.rows_per_file:
                self.close()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer, self._rows_in_file = None, 0

    def _update_feature_stats(self, rows: pa.RecordBatch) -> None:
        dense = np.stack([rows.column(c).to_numpy() for c in DENSE_COLUMNS], axis=1)
        self._min = np.minimum(self._min, dense.min(axis=0))
        self._max = np.maximum(self._max, dense.max(axis=0))
        self._sum += dense.sum(axis=0, dtype=np.float64)
        for c in SPARSE_COLUMNS:
            ids = rows.column(c).to_numpy()
            self._distinct[c].update(ids[ids != MISSING_CATEGORY])

    def positive_rate(self) -> float | None:
        return self.positives / self.rows if self.rows else None

    def cardinalities(self) -> dict:
        return {c: {"cardinality": self._distinct[c].count()} for c in SPARSE_COLUMNS}

    def dense_stats(self) -> dict:
        return {
            c: {
                "min": float(self._min[i]),
                "max": float(self._max[i]),
                "mean": float(self._sum[i] / self.rows),
            }
            for i, c in enumerate(DENSE_COLUMNS)
        }


def _write_splits(
    inputs: list[Path],
    line_counts: list[int],
    starts: list[tuple[str, int]],
    out_dir: Path,
    rows_per_file: int,
    skip_bad_lines: bool,
) -> dict:
    """Second pass: parse every input and write its rows to the splits by line position (`starts`)."""
    writers = {
        name: SplitWriter(out_dir, name, rows_per_file, collect_feature_stats=name == "train")
        for name, _ in starts
    }
    first_lines = np.array([first for _, first in starts[1:]])
    skipped = 0
    lines_before = 0  # lines of the inputs before the current one
    with tqdm(
        total=sum(line_counts), unit="rows", unit_scale=True, desc="preprocess", disable=None, leave=False
    ) as bar:
        for path, line_count in zip(inputs, line_counts, strict=True):
            lines_read = 0
            for block in _parse_file(path, skip_bad_lines):
                # Lines are increasing, so a block holds consecutive runs of the splits, in split order.
                cuts = [0, *np.searchsorted(lines_before + block.lines - 1, first_lines), len(block.lines)]
                for writer, begin, end in zip(writers.values(), cuts[:-1], cuts[1:], strict=True):
                    writer.write(block.rows.slice(int(begin), int(end - begin)))
                skipped += block.bad_lines
                lines_read += block.lines_read
                bar.update(block.lines_read)
            # The split point assumes both passes agree on lines; pyarrow also ends lines at a lone "\r".
            if lines_read != line_count:
                raise PreprocessError(
                    f"{path}: parsed {lines_read} lines but counted {line_count} (stray carriage returns?)"
                )
            lines_before += line_count
    for writer in writers.values():
        writer.close()
    if writers["train"].rows == 0:
        raise PreprocessError("no train rows: every line is bad or the hold-out splits take them all")
    return build_metadata(writers, [str(p) for p in inputs], skipped)


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
    }


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
@click.option("--rows-per-file", default=1_000_000, show_default=True, help="Rows per parquet shard.")
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
    skip_bad_lines: bool,
    overwrite: bool,
) -> None:
    """Convert raw Criteo click logs into parquet shards per split and metadata.json."""
    try:
        preprocess(list(inputs), output_dir, eval_fraction, layout, rows_per_file, skip_bad_lines, overwrite)
    except PreprocessError as e:
        click.echo(f"error: {e}", err=True)
        raise click.exceptions.Exit(2) from None


if __name__ == "__main__":
    main()
