"""`python -m dlrm.data.synthetic`: Criteo-shaped synthetic click logs with a planted, learnable signal.

    python -m dlrm.data.synthetic --rows 1000000 --output day_x.tsv.gz          # raw 40-field TSV(.gz)
    python -m dlrm.data.synthetic --rows 1000000 --output-dir data/synthetic    # as dlrm.data.preprocess
        [--cardinalities kaggle|terabyte] [--max-cardinality N] [--ids hash|index] [--ctr 0.1] [--seed 0]
        [--block-size 65536]
        [--val-fraction 0.1 --test-fraction 0.1 | --eval-fraction 0.2] [--rows-per-file 1000000] [--overwrite]
        [--multi-hot mlperf|K1,...,K26 [--multi-hot-distribution pareto|uniform]]   # with --output-dir

`--output` writes raw Criteo lines (label, I1..I13, C1..C26; tab-separated, no header; gzip when the name
ends with .gz) that `python -m dlrm.data.preprocess` reads unchanged. `--output-dir` writes what
preprocess would write for those lines with `--layout fraction`: DIR/train/, DIR/val/ and DIR/test/
part-*.parquet (test the last `test_fraction` of the rows, val the `val_fraction` before it; `--eval-fraction
F` is F/2 each) and DIR/metadata.json with the same keys, so `python -m dlrm.train` reads it, plus "oracle":
the planted model's own AUC, logloss and NE on each split, the best any model can score there
(dlrm.data.oracle; also in the final log line, and for --output over all rows).

The rows, their planted model and their determinism: dlrm.data.synthetic_rows; the writers:
dlrm.data.synthetic_output.
"""

from pathlib import Path

import click

from dlrm.choices import BAG_DISTRIBUTIONS, SYNTHETIC_IDS
from dlrm.cli_options import choice_option, command, path_option
from dlrm.data.bags import parse_sizes
from dlrm.data.splits import held_out_options
from dlrm.data.synthetic_output import write_parquet, write_tsv
from dlrm.data.synthetic_rows import (
    CARDINALITY_PRESETS,
    DEFAULT_CTR,
    SyntheticConfig,
    SyntheticError,
    preset_cardinalities,
)
from dlrm.errors import cli_errors

# ---------------------------------------------------------------------------------------------------------
# CLI


@command
@click.option("--rows", type=int, required=True, help="Number of rows (lines) to generate.")
@path_option(
    "--output",
    help="Raw Criteo TSV file to write (40 tab-separated fields, no header); gzip if the name ends with .gz.",
)
@path_option(
    "--output-dir",
    help="Directory to write in the layout of dlrm.data.preprocess (train/, val/, test/, metadata.json).",
)
@held_out_options("With --output-dir")
@choice_option(
    "--cardinalities",
    "preset",
    choices=sorted(CARDINALITY_PRESETS),
    default="kaggle",
    help="Distinct ids per column C1..C26: Criteo Kaggle train set, or Criteo 1TB days 0-23.",
)
@click.option("--max-cardinality", type=int, default=None, help="Cap every column's cardinality at this.")
@choice_option(
    "--ids",
    choices=SYNTHETIC_IDS,
    default="hash",
    help="Each column's ids: 32-bit hashes as raw Criteo logs hold, or contiguous indices in [0, K) as "
    "MLPerf's preprocessed Criteo 1TB holds (modulus hashing into K + 1 rows or more keeps them apart).",
)
@click.option("--ctr", type=float, default=DEFAULT_CTR, help="Mean click probability.")
@click.option(
    "--seed",
    type=int,
    default=0,
    help="Seed of every random stream (same arguments, same rows, whatever the block size).",
)
@click.option(
    "--block-size",
    type=int,
    default=1 << 16,
    help="Rows generated and written per block (bounds memory; does not change the rows).",
)
@click.option(
    "--rows-per-file",
    type=int,
    default=1_000_000,
    help="With --output-dir: rows per shard.",
)
@click.option(
    "--multi-hot",
    "multi_hot",
    default=None,
    help="With --output-dir: bags of ids per feature, sizes 'mlperf' or 26 comma-separated ints, and a "
    "planted model over the bags (dlrm.data.synthetic_rows).",
)
@choice_option(
    "--multi-hot-distribution",
    choices=BAG_DISTRIBUTIONS,
    default="pareto",
    help="Law of the bags' drawn ids (dlrm.data.bags).",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing output of an earlier run.")
def main(
    rows: int,
    output: Path | None,
    output_dir: Path | None,
    val_fraction: float | None,
    test_fraction: float | None,
    eval_fraction: float | None,
    preset: str,
    max_cardinality: int | None,
    ids: str,
    ctr: float,
    seed: int,
    block_size: int,
    rows_per_file: int,
    multi_hot: str | None,
    multi_hot_distribution: str,
    overwrite: bool,
) -> None:
    """Generate Criteo-shaped synthetic click logs with a planted, learnable click model.

    Writes either raw Criteo TSV (--output, readable by python -m dlrm.data.preprocess) or the
    preprocessed parquet layout directly (--output-dir, readable by python -m dlrm.train).
    """
    with cli_errors():  # SyntheticError (a ValueError) and OSError on the output path: one line, exit 2
        if (output is None) == (output_dir is None):
            raise SyntheticError("give exactly one of --output FILE.tsv[.gz] and --output-dir DIR")
        bag_sizes = None if multi_hot is None else parse_sizes(multi_hot, "--multi-hot")
        cardinalities = preset_cardinalities(preset, max_cardinality)
        config = SyntheticConfig(cardinalities, seed, ctr, bag_sizes, multi_hot_distribution, ids)
        given = {
            "--val-fraction": val_fraction,
            "--test-fraction": test_fraction,
            "--eval-fraction": eval_fraction,
        }
        if output is not None and (named := [option for option, v in given.items() if v is not None]):
            raise SyntheticError(f"{', '.join(named)}: only with --output-dir (--output writes raw lines)")
        if output is not None:
            write_tsv(config, rows, output, block_size, overwrite)
        else:
            write_parquet(
                config, rows, output_dir, eval_fraction, rows_per_file, block_size, overwrite,
                val_fraction, test_fraction,
            )  # fmt: skip


if __name__ == "__main__":
    main()
