"""Fixed-width binary splits: the rows of a parquet split as three flat column files, for loaders that read
large contiguous ranges straight into pinned memory (NVIDIA DLRM's "split binary" idea).

Letters: N rows of the split; 13 dense features (N_dense), 26 sparse features (F).

    DIR/binary/<split>/label.bin    uint8   [N]       0 or 1
    DIR/binary/<split>/dense.bin    float32 [N, 13]   log(1 + max(count, 0)), missing counts 0: the values
                                                      the parquet loaders deliver, so every loader trains on
                                                      bit-identical batches
    DIR/binary/<split>/sparse.bin   int32   [N, 26]   the raw 32-bit id's bits (ids are 8 hex digits);
                                                      missing = -1, so the id 0xFFFFFFFF reads as missing;
                                                      multi-hot data: [N, S], the bags' ids in the layout of
                                                      dlrm.data.bags (S in format.json's "columns")
    DIR/binary/<split>/format.json  {"version", "rows", "columns": {file: [dtype, width]}}

157 bytes a row on disk (264 in the parquet loaders' tensors); `widen_ids` turns int32 ids back into the
int64 raw ids the model hashes, on the device. `python -m dlrm.data.binary --data DIR` writes every split
of a preprocessed directory (or `python -m dlrm.data.preprocess ... --binary`); each split is written
under a temporary name and renamed when complete, so a crash never leaves a split that looks whole (a run
removes the temporaries of killed ones). An earlier binary split is replaced; a `binary/<split>/` holding
other files is refused.
"""

import json
import os
import shutil
from pathlib import Path
from typing import NamedTuple

import click
import numpy as np
import pyarrow.parquet as pq
import torch
from torch import Tensor
from tqdm import tqdm

from dlrm.cli_options import command, data_option
from dlrm.data.dataset import columns_of, decode_table, load_metadata, split_paths
from dlrm.data.output import remove_stale_temporaries
from dlrm.data.schema import NUM_DENSE, NUM_SPARSE
from dlrm.errors import cli_errors

VERSION = 1
# file -> (numpy dtype, values per row)
COLUMNS = {
    "label.bin": ("uint8", 1),
    "dense.bin": ("float32", NUM_DENSE),
    "sparse.bin": ("int32", NUM_SPARSE),
}
_ID_LIMIT = 2**32


class BinarySplit(NamedTuple):
    """A validated binary split: its directory, row count and the paths of label, dense and sparse."""

    directory: Path
    rows: int
    label: Path
    dense: Path
    sparse: Path
    sparse_width: int = NUM_SPARSE  # ids a row: F, or S for multi-hot data


def binary_dir(data_dir: Path | str, split: str) -> Path:
    return Path(data_dir) / "binary" / split


def open_binary(directory: Path | str) -> BinarySplit:
    """Check a binary split's format.json and file sizes; return where its files are.

    Raises:
        FileNotFoundError: no format.json (the split was never converted: the message says how).
        ValueError: format.json is unreadable or of another version, or a column file's size is not
            rows x row width (truncated or foreign); the message names the file.
    """
    directory = Path(directory)
    fmt_path = directory / "format.json"
    if not fmt_path.is_file():
        raise FileNotFoundError(
            f"{fmt_path}: no binary split here: write it with python -m dlrm.data.binary --data DIR"
        )
    try:
        fmt = json.loads(fmt_path.read_text())
        rows, version = int(fmt["rows"]), fmt["version"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{fmt_path}: not a binary split description ({err})") from None
    if version != VERSION:
        raise ValueError(f"{fmt_path}: format version {version!r}, this reader knows {VERSION}")
    sparse_width = fmt.get("columns", {}).get("sparse.bin", [None, NUM_SPARSE])[1]
    if isinstance(sparse_width, bool) or not isinstance(sparse_width, int) or sparse_width < NUM_SPARSE:
        raise ValueError(
            f"{fmt_path}: sparse.bin width {sparse_width!r}, expected an integer >= {NUM_SPARSE}"
        )
    for name, (dtype, width) in split_columns(sparse_width).items():
        path = directory / name
        expected = rows * width * np.dtype(dtype).itemsize
        size = path.stat().st_size if path.is_file() else None
        if size != expected:
            found = "missing" if size is None else f"{size} bytes"
            raise ValueError(
                f"{path}: expected {expected} bytes ({rows} rows x {width} {dtype}), found {found}: "
                "truncated or not written by dlrm.data.binary; write the split again"
            )
    return BinarySplit(directory, rows, *(directory / name for name in COLUMNS), sparse_width)


def split_columns(sparse_width: int) -> dict[str, tuple[str, int]]:
    """`COLUMNS` of a split whose rows hold `sparse_width` ids (F one-hot, S multi-hot)."""
    return {**COLUMNS, "sparse.bin": ("int32", sparse_width)}


def widen_ids(sparse: Tensor) -> Tensor:
    """[n, F] int32 id bits -> [n, F] int64 raw ids in [0, 2**32), missing -1 (on the tensor's device)."""
    wide = sparse.long()
    return torch.where(wide < -1, wide + _ID_LIMIT, wide)


def write_binary_split(parquet_files: list[Path], directory: Path) -> int:
    """Write the rows of `parquet_files` (in order) as a binary split in `directory`, replacing it; return
    the row count. Reads one row group at a time (memory: one row group).

    Raises:
        ValueError: a file lacks the Criteo columns, or an id is outside [-1, 2**32); `directory` holds
            anything but a binary split's files (checked before reading).
    """
    _check_replaceable(directory)
    remove_stale_temporaries(directory)
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    rows, sparse_width = 0, None
    outputs = {name: open(tmp / name, "wb") for name in COLUMNS}  # noqa: SIM115 - closed below
    try:
        for path in parquet_files:
            columns = columns_of(path)
            parquet = pq.ParquetFile(path)
            for group in range(parquet.num_row_groups):
                batch = decode_table(parquet.read_row_group(group, columns=columns), columns, path)
                ids = batch.sparse
                if len(ids) and (ids.min() < -1 or ids.max() >= _ID_LIMIT):
                    raise ValueError(f"{path}: row group {group}: an id outside [-1, 2**32)")
                if sparse_width not in (None, ids.shape[1]):
                    raise ValueError(f"{path}: {ids.shape[1]} ids a row, the files before it {sparse_width}")
                sparse_width = ids.shape[1]
                outputs["label.bin"].write(batch.label.numpy().astype(np.uint8).tobytes())
                outputs["dense.bin"].write(batch.dense.numpy().tobytes())
                outputs["sparse.bin"].write(ids.numpy().astype(np.uint32).view(np.int32).tobytes())
                rows += len(batch.label)
    finally:
        for out in outputs.values():
            out.close()
    columns = {name: list(spec) for name, spec in split_columns(sparse_width or NUM_SPARSE).items()}
    (tmp / "format.json").write_text(json.dumps({"version": VERSION, "rows": rows, "columns": columns}))
    _check_replaceable(directory)  # again: it may have changed meanwhile
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return rows


def _check_replaceable(directory: Path) -> None:
    """Raise ValueError (one line) unless `directory` is missing or holds only a binary split's files."""
    if not directory.exists() and not directory.is_symlink():
        return
    if directory.is_symlink() or not directory.is_dir():
        raise ValueError(f"{directory} is not a binary split directory: refusing to replace it; move it away")
    own = {*COLUMNS, "format.json"}
    foreign = [p.name for p in sorted(directory.iterdir()) if p.name not in own or not p.is_file()]
    if foreign:
        raise ValueError(
            f"{directory} holds files that a binary split does not ({', '.join(foreign[:5])}): refusing to "
            "replace it; move them away"
        )


def write_binary(data_dir: Path | str, splits: list[str] | None = None) -> dict[str, int]:
    """Write `splits` (default: every split in metadata.json) of a preprocessed directory as binary splits
    under `data_dir`/binary/; return {split: rows}. Raises as `split_paths` and `write_binary_split`."""
    data_dir = Path(data_dir)
    splits = splits or list(load_metadata(data_dir)["files"])
    written = {}
    for split in tqdm(splits, desc="binary splits", unit="split", disable=len(splits) < 2):
        written[split] = write_binary_split(split_paths(data_dir, split), binary_dir(data_dir, split))
    return written


@command
@data_option("Preprocessed data directory (metadata.json and parquet splits).")
@click.option("--split", "splits", multiple=True, help="Split to write (repeatable) [default: all].")
def main(data_dir: Path, splits: tuple[str, ...]) -> None:
    """Write the parquet splits of DATA as fixed-width binary files under DATA/binary/ (for
    data.loader "binary")."""
    with cli_errors():
        written = write_binary(data_dir, list(splits) or None)
    for split, rows in written.items():
        click.echo(f"{binary_dir(data_dir, split)}: {rows} rows")


if __name__ == "__main__":
    main()
