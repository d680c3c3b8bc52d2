"""`python -m dlrm.data.preprocess`: raw Criteo TSV(.gz) click logs -> parquet shards + metadata.json.

    python -m dlrm.data.preprocess --input day_0.gz [--input day_1.gz ...] --output-dir DIR \\
        [--layout fraction|kaggle|terabyte] [--val-fraction 0.1 --test-fraction 0.1 | --eval-fraction 0.2] \\
        [--rows-per-file 1000000] \\
        [--block-size 65536] [--workers N] [--min-frequency N] [--exact-distinct-limit 1048576] \\
        [--skip-bad-lines] [--overwrite]

Inputs are raw Criteo lines (40 tab-separated fields, no header: label, I1..I13, C1..C26), plain or gzip,
given in time order. Splits are cut by line position over the inputs concatenated (CTR hold-out is by
time), per `--layout`, always train / val / test (dlrm.data.splits: training selects on val, reports test):
    fraction   the last `test_fraction` of the lines is test, the `val_fraction` before it val, the rest
               train (`--eval-fraction F`: F/2 each; default 0.1 each);
    kaggle     FB-DLRM's convention for the Kaggle train.txt: the lines cut into 7 equal "days" (the first
               total % 7 days one line longer), days 0-5 train, day 6 halved: val, then test;
    terabyte   the 1TB logs given as day_0 .. day_23: every input but the last is train, the last day is
               halved: val, then test.
The first half of a halved day gets the odd line. Output:

    DIR/train/part-00000.parquet ...   shard k of a split: its lines [k, k + 1) * rows_per_file (bad lines
                                       left out), one parquet row group per block
    DIR/val/part-00000.parquet ...     the same for val and test
    DIR/test/part-00000.parquet ...
    DIR/vocab/C1.parquet ...           with --min-frequency N: the train ids seen at least N times
    DIR/metadata.json                  row counts, shard list, positive rates, train cardinalities and
                                       dense statistics (see `preprocess`)

Parquet schema: `label` float32 (0/1); `I1..I13` float32, the raw counts (missing -> 0, negatives kept);
`C1..C26` int64, the 32-bit hex category read as an unsigned integer ("ffffffff" -> 4294967295;
missing -> -1).

One streaming pass (dlrm.data.pipeline), memory bounded by the block size and the number of workers, never
by the input. Resumable (dlrm.data.output): everything is written into `DIR.partial/`, which becomes DIR
only when everything is written; a run that stops (killed, interrupted, disk full) leaves DIR.partial, and
running the same command again keeps its completed shards and redoes the rest. A bad line stops the run
with one message naming the file and its 1-based line number (and removes DIR.partial), unless
`--skip-bad-lines`, in which case bad lines are counted and left out.

This module is the CLI and `preprocess`, which checks the arguments and ties the two together.
"""

import ctypes
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import click
from loguru import logger

from dlrm.cli_options import command, path_option
from dlrm.data.output import PartialDir, check_output_dir, move_into_place
from dlrm.data.pipeline import DEFAULT_BLOCK_SIZE, LAYOUTS, split_starts, write_splits
from dlrm.data.splits import held_out_fractions, held_out_options
from dlrm.data.stats import DEFAULT_EXACT_DISTINCT_LIMIT
from dlrm.data.text import PreprocessError
from dlrm.errors import cli_errors

__all__ = ["PreprocessError", "main", "preprocess"]

# glibc's mallopt parameters, and what the CLI sets them to (see `_keep_freed_memory`).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks of text and numpy temporaries stay below it
_TRIM_THRESHOLD = 1 << 30


def preprocess(
    inputs: Sequence[Path | str],
    output_dir: Path | str,
    eval_fraction: float | None = None,
    layout: str = "fraction",
    rows_per_file: int = 1_000_000,
    skip_bad_lines: bool = False,
    overwrite: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
    workers: int | None = None,
    min_frequency: int | None = None,
    exact_distinct_limit: int = DEFAULT_EXACT_DISTINCT_LIMIT,
    val_fraction: float | None = None,
    test_fraction: float | None = None,
) -> dict:
    """Convert raw Criteo files into parquet shards per split and metadata.json under `output_dir`.

    Args:
        inputs: raw Criteo TSV files, plain or gzip, in time order.
        output_dir: directory to write: missing or empty, or with `overwrite` one holding an earlier output
            and nothing else; never an input or a directory holding one (dlrm.data.output.check_output_dir).
        eval_fraction: layout "fraction": shorthand for val_fraction = test_fraction = eval_fraction / 2;
            in [0, 1); not with val_fraction or test_fraction.
        layout: "fraction", "kaggle" or "terabyte" (see the module docstring).
        rows_per_file: lines per parquet shard (the last of a split may be shorter; bad lines are left out).
        skip_bad_lines: count and leave out malformed lines instead of stopping at the first one.
        overwrite: replace an `output_dir` that holds an earlier output of a data tool.
        block_size: lines a worker parses as one task (in pieces of pipeline.PARSE_LINES), and rows per
            parquet row group; memory grows with it.
        workers: threads that parse blocks (default: the CPU count).
        min_frequency: also write, per sparse column, the train ids seen at least this many times
            (DIR/vocab/<column>.parquet: `value` int64 ascending, `count` int64).
        exact_distinct_limit: distinct counts are exact up to this many ids per column, estimated past it.
        val_fraction, test_fraction: layout "fraction": shares of lines, from the end, that form test and,
            before it, val; each in [0, 1) (default 0.1), together below 1.
    Returns:
        The metadata written to metadata.json:
        {"version", "source": [inputs], "layout", "val_fraction" and "test_fraction" (null unless layout
         "fraction"),
         "rows": {split: rows}, "files": {split: [paths relative to output_dir]},
         "positive_rate": {split: rate} (null for an empty split),
         "categorical": {"C1": {"cardinality": distinct non-missing train ids, "exact": whether that count
             is exact (else a HyperLogLog estimate, ~0.8% standard error), "max_id": the largest train id
             (null without any), with --min-frequency also
             "vocab": relative path, "vocab_size": ids in it}, ...},
         "dense": {"I1": {"min", "max", "mean"} over train after missing -> 0, ...}, "skipped_lines",
         "exact_distinct_limit", and with --min-frequency "min_frequency"}.
    Raises:
        PreprocessError: bad arguments (a bad fraction names its option, as does one given for a layout
            other than "fraction"), an unusable output directory, a missing, empty or truncated input,
            or a malformed line (without `skip_bad_lines`); the message is a single line.
    """
    inputs = [Path(p) for p in inputs]
    workers = (os.cpu_count() or 1) if workers is None else workers
    fractions = held_out_fractions(eval_fraction, val_fraction, test_fraction, layout, PreprocessError)
    _check_arguments(
        inputs, fractions, layout, rows_per_file, block_size, workers, min_frequency, exact_distinct_limit
    )
    output_dir = check_output_dir(output_dir, overwrite, inputs, error=PreprocessError)
    started = time.perf_counter()
    identity = {
        "inputs": [_fingerprint(p) for p in inputs],
        "layout": layout,
        "fractions": list(fractions),
        "rows_per_file": rows_per_file,
        "skip_bad_lines": skip_bad_lines,
    }
    with PartialDir(output_dir, identity) as partial:
        try:
            metadata = write_splits(
                inputs, partial, layout, *fractions, rows_per_file, skip_bad_lines, block_size, workers,
                min_frequency, exact_distinct_limit,
            )  # fmt: skip
        except PreprocessError:
            shutil.rmtree(partial.path, ignore_errors=True)  # the input needs fixing: nothing to resume
            raise
        except BaseException:
            logger.warning("stopped; run the same command again to resume from {}", partial.path)
            raise
        val, test = fractions if layout == "fraction" else (None, None)
        metadata |= {"layout": layout, "val_fraction": val, "test_fraction": test}
        partial.finish(metadata)
    move_into_place(partial.path, output_dir)

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
    fractions: tuple[float, float],
    layout: str,
    rows_per_file: int,
    block_size: int,
    workers: int,
    min_frequency: int | None,
    exact_distinct_limit: int,
) -> None:
    if not inputs:
        raise PreprocessError("no input files given")
    split_starts(layout, [1] * len(inputs), *fractions)  # an unknown layout, or terabyte with one input
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


def _fingerprint(path: Path) -> dict:
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


@command
@path_option(
    "--input",
    "inputs",
    multiple=True,
    required=True,
    help="Raw Criteo TSV file, plain or .gz. Repeat for several files (--input a --input b), in time order.",
)
@path_option("--output-dir", required=True, help="Directory to create.")
@click.option(
    "--layout",
    type=click.Choice(LAYOUTS),
    default="fraction",
    help="Splits: fraction (train/val/test by --val-fraction, --test-fraction), kaggle (FB-DLRM's 7 days "
    "of train.txt: 6 train, the last halved into val/test), terabyte (inputs day_0..day_23: the last "
    "halved: val/test).",
)
@held_out_options("Layout fraction")
@click.option("--rows-per-file", default=1_000_000, help="Lines per parquet shard.")
@click.option(
    "--block-size",
    default=DEFAULT_BLOCK_SIZE,
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
    help="Distinct ids per column counted exactly up to this many; a HyperLogLog estimate past it.",
)
@click.option(
    "--skip-bad-lines", is_flag=True, help="Count and leave out malformed lines instead of stopping."
)
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory of an earlier run.")
@click.option(
    "--binary",
    is_flag=True,
    help="Also write every split as fixed-width binary files under OUTPUT_DIR/binary/ (for data.loader "
    '"binary"; python -m dlrm.data.binary does the same later).',
)
def main(
    inputs: tuple[Path, ...],
    output_dir: Path,
    layout: str,
    val_fraction: float | None,
    test_fraction: float | None,
    eval_fraction: float | None,
    rows_per_file: int,
    block_size: int,
    workers: int | None,
    min_frequency: int | None,
    exact_distinct_limit: int,
    skip_bad_lines: bool,
    overwrite: bool,
    binary: bool,
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
            val_fraction,
            test_fraction,
        )
        if binary:
            # Imported here: dlrm.data.binary needs torch, whose import (1.2 s, 200 MiB) a preprocess without
            # --binary need not pay (it doubled the time of a 1M-row run).
            from dlrm.data.binary import write_binary

            write_binary(output_dir)


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
