"""`python -m dlrm.data.multi_hot`: MLPerf-style synthetic multi-hot data from a one-hot data directory.

    python -m dlrm.data.multi_hot --data data/criteo_sample --sizes mlperf --distribution pareto --seed 0 \\
        [--output-dir data/criteo_sample_multi_hot] [--overwrite]

Every parquet file of every split of DATA is written again under OUT with, after each sparse column C of
bag size k > 1, the columns C_1 .. C_(k-1): the bag's drawn ids (dlrm.data.bags.make_bags; C itself keeps
the one-hot id, the bag's first). OUT/metadata.json is DATA's with "multi_hot": {"sizes", "distribution",
"seed"}, which the loaders check against `model.multi_hot_sizes`. The bags equal those that `data.multi_hot`
makes on the fly from DATA, batch by batch. OUT is written under a temporary name and renamed when
complete; one row group is in memory at a time. OUT may be missing or empty; one holding an earlier data
directory is replaced only with `--overwrite`, and one holding anything else, DATA itself or a directory
holding DATA is refused (dlrm.data.output.check_output_dir).
"""

import json
import shutil
from pathlib import Path

import click
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from dlrm.choices import BAG_DISTRIBUTIONS
from dlrm.cli_options import command, data_option, path_option
from dlrm.data.bag_source import data_bag_sizes
from dlrm.data.bags import id_ranges, is_one_hot, make_bags, parse_sizes
from dlrm.data.dataset import columns_of, decode_table, parquet_errors
from dlrm.data.output import check_output_dir, load_metadata, move_into_place, temporary_dir
from dlrm.errors import cli_errors


def add_bags(table: pa.Table, columns: list[str], bags: torch.Tensor, sizes: tuple[int, ...]) -> pa.Table:
    """`table` with each sparse column c of size k > 1 followed by c_1 .. c_(k-1) (int64, from `bags`
    [n, S])."""
    extra, start = {}, 0
    for c, k in zip(columns[-len(sizes) :], sizes, strict=True):
        extra[c] = [
            (f"{c}_{j}", pa.array(np.ascontiguousarray(bags[:, start + j].numpy()))) for j in range(1, k)
        ]
        start += k
    out = []
    for name in table.column_names:
        out.append((name, table.column(name)))
        out.extend(extra.get(name, []))
    return pa.table(dict(out))


def write_multi_hot(
    data_dir: Path | str,
    output_dir: Path | str,
    sizes: tuple[int, ...],
    distribution: str,
    seed: int,
    overwrite: bool = False,
) -> dict[str, int]:
    """Write DATA's splits with bags into `output_dir` (module docstring); return {split: rows}.
    `overwrite`: replace an earlier output that `output_dir` holds.

    Raises:
        FileNotFoundError: no metadata.json or parquet file.
        ValueError: DATA holds bags already, lacks cardinalities, or a file is not a Criteo split;
            `output_dir` is DATA, holds it, or holds anything but an earlier output (that, without
            `overwrite`).
    """
    data_dir = Path(data_dir)
    metadata = load_metadata(data_dir)
    if not is_one_hot(data_bag_sizes(metadata)):
        raise ValueError(f"{data_dir}/metadata.json: holds bags already; give one-hot data")
    num_ids = id_ranges(metadata, str(data_dir / "metadata.json"))
    output_dir = check_output_dir(output_dir, overwrite, [data_dir])
    files = [name for split in metadata["files"].values() for name in split]
    tmp = temporary_dir(output_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    rows: dict[str, int] = {}
    try:
        for split, names in metadata["files"].items():
            rows[split] = 0
            for name in tqdm(names, desc=f"multi-hot {split}", unit="file", disable=len(files) < 2):
                rows[split] += _write_file(data_dir / name, tmp / name, sizes, num_ids, distribution, seed)
        bags = {"sizes": list(sizes), "distribution": distribution, "seed": seed}
        (tmp / "metadata.json").write_text(json.dumps({**metadata, "multi_hot": bags}, indent=2))
        output_dir.parent.mkdir(parents=True, exist_ok=True)
        move_into_place(tmp, output_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def _write_file(
    source: Path, target: Path, sizes: tuple[int, ...], num_ids: list[int], distribution: str, seed: int
) -> int:
    columns = columns_of(source)
    if len(columns) != 1 + 13 + len(sizes):
        raise ValueError(f"{source}: holds bags already; give one-hot data")
    target.parent.mkdir(parents=True, exist_ok=True)
    with parquet_errors(source):
        parquet = pq.ParquetFile(source)
        writer = None
        rows = 0
        try:
            for group in range(parquet.num_row_groups):
                table = parquet.read_row_group(group)
                ids = decode_table(table.select(columns), columns, source).sparse
                out = add_bags(table, columns, make_bags(ids, sizes, num_ids, distribution, seed), sizes)
                writer = writer or pq.ParquetWriter(target, out.schema)
                writer.write_table(out)
                rows += table.num_rows
        finally:
            if writer is not None:
                writer.close()
    return rows


@command
@data_option("One-hot preprocessed data directory (metadata.json and parquet splits).")
@click.option("--sizes", default="mlperf", help="Bag sizes of C1..C26: 'mlperf' or 26 comma-separated ints.")
@click.option(
    "--distribution", type=click.Choice(BAG_DISTRIBUTIONS), default="pareto", help="Law of the drawn ids."
)
@click.option("--seed", type=int, default=0, help="Seed of the drawn ids.")
@path_option(
    "--output-dir",
    help="Where to write the multi-hot directory [default: DATA_multi_hot next to DATA].",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory of an earlier run.")
def main(
    data_dir: Path, sizes: str, distribution: str, seed: int, output_dir: Path | None, overwrite: bool
) -> None:
    """Write DATA with MLPerf-style bags of ids per sparse feature (dlrm.data.bags)."""
    with cli_errors():
        output_dir = output_dir or data_dir.resolve().with_name(f"{data_dir.resolve().name}_multi_hot")
        written = write_multi_hot(data_dir, output_dir, parse_sizes(sizes), distribution, seed, overwrite)
    for split, rows in written.items():
        click.echo(f"{output_dir / split}: {rows} rows")


if __name__ == "__main__":
    main()
