"""Writers of synthetic rows (dlrm.data.synthetic_rows): raw Criteo TSV(.gz), or the parquet splits and
metadata.json that dlrm.data.preprocess writes, each under a temporary name renamed when complete."""

import gzip
import json
import os
import queue
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
from loguru import logger
from tqdm import tqdm

from dlrm.data.oracle import SplitOracle
from dlrm.data.oracle import describe as describe_oracle
from dlrm.data.output import (
    METADATA_FILE,
    SplitWriter,
    build_metadata,
    check_output_dir,
    move_into_place,
    temporary_dir,
)
from dlrm.data.parse import OUTPUT_SCHEMA
from dlrm.data.pipeline import split_starts
from dlrm.data.schema import MISSING_CATEGORY, NUM_DENSE, NUM_SPARSE, RAW_COLUMNS, SPARSE_COLUMNS
from dlrm.data.splits import held_out_fractions
from dlrm.data.synthetic_rows import (
    CARDINALITY_PRESETS,
    Rows,
    SyntheticConfig,
    SyntheticError,
    iter_blocks,
    planted_bias,
)

# 16-bit value -> its 4 lowercase hex digits as ASCII bytes, read as one (native-endian) uint32.
_HEX_OF_UINT16 = (
    np.frombuffer(b"0123456789abcdef", dtype=np.uint8)[
        (np.arange(1 << 16, dtype=np.uint32)[:, None] >> np.array([12, 8, 4, 0], dtype=np.uint32)) & 15
    ]
    .view(np.uint32)
    .ravel()
)


# ---------------------------------------------------------------------------------------------------------
# Conversion


def to_raw_table(rows: Rows) -> pa.Table:
    """The rows as raw Criteo fields (RAW_COLUMNS): label int8, I1..I13 int64 and C1..C26 8-hex-digit
    strings, null where missing (written as empty fields)."""
    n = rows.num_rows
    columns = [pa.array(rows.label)]
    dense = np.ascontiguousarray(rows.dense.T)  # [13, n], one contiguous buffer per column
    present = ~np.ascontiguousarray(rows.dense_missing.T)
    for j in range(NUM_DENSE):
        columns.append(_array_from_buffers(pa.int64(), n, present[j], [pa.py_buffer(dense[j])]))
    # [26, n, 2] uint32 = [26, n, 8] ASCII hex digits, 4 per 16-bit half of an id.
    ids = np.ascontiguousarray(rows.sparse.T).astype(np.uint32)
    digits = np.empty((NUM_SPARSE, n, 2), dtype=np.uint32)
    np.take(_HEX_OF_UINT16, ids >> 16, out=digits[:, :, 0])
    np.take(_HEX_OF_UINT16, ids & np.uint32(0xFFFF), out=digits[:, :, 1])
    offsets = pa.py_buffer(np.arange(0, 8 * n + 1, 8, dtype=np.int32))
    present = np.ascontiguousarray(rows.sparse.T) != MISSING_CATEGORY
    for c in range(NUM_SPARSE):
        columns.append(_array_from_buffers(pa.string(), n, present[c], [offsets, pa.py_buffer(digits[c])]))
    return pa.Table.from_arrays(columns, names=RAW_COLUMNS)


def _array_from_buffers(dtype: pa.DataType, n: int, present: np.ndarray, buffers: list) -> pa.Array:
    """An arrow array of `n` values in `buffers`, null where not `present` ([n] bool)."""
    nulls = n - int(np.count_nonzero(present))
    validity = pa.py_buffer(np.packbits(present, bitorder="little")) if nulls else None
    return pa.Array.from_buffers(dtype, n, [validity, *buffers], null_count=nulls)


def to_record_batch(rows: Rows, bag_sizes: tuple[int, ...] | None = None) -> pa.RecordBatch:
    """The rows in preprocess's OUTPUT_SCHEMA: what preprocess makes of their raw lines; with `bag_sizes`
    each C column is followed by its bag's C_1 .. C_(k-1) (int64, dlrm.data.bags' parquet layout)."""
    arrays = [pa.array(rows.label.astype(np.float32))]
    arrays += [pa.array(rows.dense[:, j].astype(np.float32)) for j in range(NUM_DENSE)]
    if bag_sizes is None:
        arrays += [pa.array(np.ascontiguousarray(rows.sparse[:, c])) for c in range(NUM_SPARSE)]
        return pa.RecordBatch.from_arrays(arrays, schema=OUTPUT_SCHEMA)
    arrays += [pa.array(np.ascontiguousarray(rows.sparse[:, s])) for s in range(rows.sparse.shape[1])]
    return pa.RecordBatch.from_arrays(arrays, schema=record_schema(bag_sizes))


def record_schema(bag_sizes: tuple[int, ...] | None) -> pa.Schema:
    """OUTPUT_SCHEMA, with each C column followed by C_1 .. C_(k-1) (int64) for `bag_sizes`."""
    if bag_sizes is None:
        return OUTPUT_SCHEMA
    fields = list(OUTPUT_SCHEMA)[: 1 + NUM_DENSE]
    for column, k in zip(SPARSE_COLUMNS, bag_sizes, strict=True):
        fields += [pa.field(f"{column}_{j}" if j else column, pa.int64()) for j in range(k)]
    return pa.schema(fields)


# ---------------------------------------------------------------------------------------------------------
# Writers


def _check_output_file(path: Path, overwrite: bool) -> None:
    if not path.exists():
        if not path.parent.is_dir():
            raise SyntheticError(f"{path.parent}: no such directory")
        return
    if not overwrite:
        raise SyntheticError(f"{path} already exists: pass --overwrite to replace it")
    if not path.is_file():
        raise SyntheticError(f"{path} exists and is not a regular file: not replacing it")


class _TsvWriter:
    """Formats tables as raw Criteo lines and writes (and gzips) them on a thread, so that generating the
    next block overlaps formatting and compressing this one."""

    _OPTIONS = pcsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none", batch_size=8192)

    def __init__(self, path: Path, compress: bool) -> None:
        self._raw = path.open("wb")
        # Level 1: the default level 6 compresses several times slower than the rows are generated.
        self._file = (
            gzip.GzipFile(fileobj=self._raw, mode="wb", compresslevel=1, mtime=0) if compress else self._raw
        )
        self._queue: queue.Queue[pa.Table | None] = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="synthetic-tsv-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (table := self._queue.get()) is not None:
            if self._error is None:
                try:
                    sink = pa.BufferOutputStream()
                    pcsv.write_csv(table, sink, self._OPTIONS)
                    self._file.write(sink.getvalue())
                except BaseException as e:  # re-raised in the caller's thread
                    self._error = e

    def write(self, table: pa.Table) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(table)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        try:
            if self._file is not self._raw:
                self._file.close()
        finally:
            self._raw.close()
        if self._error is not None:
            raise self._error


def write_tsv(
    config: SyntheticConfig, rows: int, path: Path | str, block_size: int = 1 << 16, overwrite: bool = False
) -> dict:
    """Write `rows` raw Criteo lines to `path` (gzip when it ends with .gz), via a temporary file.

    Returns:
        {"rows", "positive_rate", "oracle", "seconds", "rows_per_s", "bias"}; "oracle" is
        {"all": the planted model's {"auc", "auc_error_bound", "logloss", "ne", "rows"} on all rows}
        (dlrm.data.oracle; nothing else is written next to the file).
    Raises:
        SyntheticError: bad arguments or an unusable `path`.
    """
    path = Path(path)
    _check_counts(rows, block_size)
    if config.bag_sizes is not None:
        raise SyntheticError(
            "--multi-hot: only with --output-dir (a raw Criteo line holds one id per feature)"
        )
    _check_output_file(path, overwrite)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    started = time.perf_counter()
    positives = 0
    oracle = SplitOracle({"all": (0, rows)})
    try:
        writer = _TsvWriter(tmp, compress=path.name.endswith(".gz"))
        try:
            with _progress(rows) as bar:
                for start, block in zip(
                    range(0, rows, block_size), iter_blocks(config, rows, block_size), strict=True
                ):
                    writer.write(to_raw_table(block))
                    oracle.update(start, block.logit, block.label)
                    positives += int(block.label.sum())
                    bar.update(block.num_rows)
        finally:
            writer.close()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {
        "rows": rows,
        "positive_rate": positives / rows,
        "oracle": oracle.result(),
        **_finish(config, rows, positives, started, path, oracle.result()),
    }


def write_parquet(
    config: SyntheticConfig,
    rows: int,
    output_dir: Path | str,
    eval_fraction: float | None = None,
    rows_per_file: int = 1_000_000,
    block_size: int = 1 << 16,
    overwrite: bool = False,
    val_fraction: float | None = None,
    test_fraction: float | None = None,
) -> dict:
    """Write `rows` rows as dlrm.data.preprocess would write their raw lines: train/val/test parquet
    shards and metadata.json, via a temporary directory. The fractions are preprocess's (layout
    "fraction", dlrm.data.splits.held_out_fractions): test the last `test_fraction` of the rows, val the
    `val_fraction` before it (default 0.1 each), or `eval_fraction` F for F/2 each.

    metadata.json also holds "oracle": per split, the planted model's own {"auc", "auc_error_bound",
    "logloss", "ne", "rows"} on exactly that split's rows (dlrm.data.oracle), the best a model can score;
    and "synthetic", what the rows were generated from (`generator_metadata`).

    Returns:
        The metadata written (the keys of preprocess's, and "oracle"; "source" describes the generator),
        with "seconds", "rows_per_s" and "bias" added (these three are not written).
    `output_dir` may be missing or empty; one holding an earlier data directory is replaced only with
    `overwrite`, one holding anything else never (dlrm.data.output.check_output_dir).

    Raises:
        SyntheticError: bad arguments (a bad fraction names its option) or an unusable `output_dir`.
    """
    _check_counts(rows, block_size)
    fractions = held_out_fractions(eval_fraction, val_fraction, test_fraction, error=SyntheticError)
    if rows_per_file < 1:
        raise SyntheticError(f"rows per file must be at least 1, got {rows_per_file}")
    starts = split_starts("fraction", [rows], *fractions)  # as preprocess splits lines
    if starts[1][1] < 1:
        raise SyntheticError(
            f"no train rows: --rows {rows} with --val-fraction {fractions[0]} --test-fraction {fractions[1]}"
        )
    output_dir = check_output_dir(output_dir, overwrite, error=SyntheticError)

    started = time.perf_counter()
    tmp_dir = temporary_dir(output_dir)
    shutil.rmtree(tmp_dir, ignore_errors=True)
    try:
        tmp_dir.mkdir(parents=True)
        writers = {
            name: SplitWriter(
                tmp_dir,
                name,
                rows_per_file,
                collect_feature_stats=name == "train",
                schema=record_schema(config.bag_sizes),
            )
            for name, _ in starts
        }
        ends = [start for _, start in starts[1:]] + [rows]
        oracle = SplitOracle({name: (first, last) for (name, first), last in zip(starts, ends, strict=True)})
        with _progress(rows) as bar:
            for start, block in zip(
                range(0, rows, block_size), iter_blocks(config, rows, block_size), strict=True
            ):
                batch = to_record_batch(block, config.bag_sizes)
                for (name, first), last in zip(starts, ends, strict=True):  # this block's rows of each split
                    lo, hi = max(first, start) - start, min(last, start + block.num_rows) - start
                    if hi > lo:
                        writers[name].write(batch.slice(lo, hi - lo))
                oracle.update(start, block.logit, block.label)
                bar.update(block.num_rows)
        for writer in writers.values():
            writer.close()
        metadata = build_metadata(writers, [_describe(config, rows)], skipped_lines=0)
        metadata |= {
            "layout": "fraction",
            "val_fraction": fractions[0],
            "test_fraction": fractions[1],
            "oracle": oracle.result(),
            "synthetic": generator_metadata(config, rows),
        }
        if config.bag_sizes is not None:  # read by the loaders (dlrm.data.bag_source)
            bags = {
                "sizes": list(config.bag_sizes),
                "distribution": config.bag_distribution,
                "seed": config.seed,
            }
            metadata["multi_hot"] = bags
        (tmp_dir / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
        move_into_place(tmp_dir, output_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    positives = round(sum(writer.positives for writer in writers.values()))
    return {**metadata, **_finish(config, rows, positives, started, output_dir, metadata["oracle"])}


def generator_metadata(config: SyntheticConfig, rows: int) -> dict:
    """What the rows were generated from, as metadata.json's "synthetic" holds it (`config_from_metadata`
    reads it back): {"rows", "seed", "ctr", "cardinalities", "ids", "bag_sizes", "bag_distribution"}."""
    return {
        "rows": rows,
        "seed": config.seed,
        "ctr": config.ctr,
        "cardinalities": list(config.cardinalities),
        "ids": config.ids,
        "bag_sizes": None if config.bag_sizes is None else list(config.bag_sizes),
        "bag_distribution": config.bag_distribution,
    }


def config_from_metadata(metadata: dict, source: str = "metadata.json") -> tuple[SyntheticConfig, int]:
    """(the generator's config, its row count) of a synthetic data directory's metadata.

    Raises:
        SyntheticError: no "synthetic" key (not synthetic data, or written before the key existed: generate
            it again), naming `source`.
    """
    given = metadata.get("synthetic")
    if given is None:
        raise SyntheticError(
            f'{source}: no "synthetic" key: not data of python -m dlrm.data.synthetic, or older than the key '
            "(generate it again)"
        )
    bags = given["bag_sizes"]
    config = SyntheticConfig(
        tuple(given["cardinalities"]), given["seed"], given["ctr"], None if bags is None else tuple(bags),
        given["bag_distribution"], given["ids"],
    )  # fmt: skip
    return config, given["rows"]


def _check_counts(rows: int, block_size: int) -> None:
    if rows < 1:
        raise SyntheticError(f"rows must be at least 1, got {rows}")
    if block_size < 1:
        raise SyntheticError(f"block size must be at least 1, got {block_size}")


def _describe(config: SyntheticConfig, rows: int) -> str:
    preset = next((name for name, ks in CARDINALITY_PRESETS.items() if ks == config.cardinalities), None)
    cards = preset or ",".join(map(str, config.cardinalities))
    bags = "" if config.bag_sizes is None else f",multi_hot={','.join(map(str, config.bag_sizes))}"
    bags += "" if config.bag_sizes is None else f",distribution={config.bag_distribution}"
    ids = "" if config.ids == "hash" else f",ids={config.ids}"
    return f"synthetic:rows={rows},seed={config.seed},ctr={config.ctr},cardinalities={cards}{ids}{bags}"


def _progress(rows: int) -> tqdm:
    return tqdm(total=rows, unit="rows", unit_scale=True, desc="synthetic", disable=None, leave=False)


def _finish(
    config: SyntheticConfig, rows: int, positives: int, started: float, path: Path, oracle: dict
) -> dict:
    seconds = time.perf_counter() - started
    logger.info(
        "generated {:,} rows in {:.1f} s ({:,.0f} rows/s), CTR {:.4f} -> {}; planted model (oracle): {}",
        rows,
        seconds,
        rows / seconds,
        positives / rows,
        path,
        describe_oracle(oracle),
    )
    return {"seconds": seconds, "rows_per_s": rows / seconds, "bias": planted_bias(config)}
