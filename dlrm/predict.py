"""`python -m dlrm.predict`: the click-through rate of every input row under a trained checkpoint, as parquet.

    python -m dlrm.predict --checkpoint runs/<run>/checkpoints/best.pt --input day_1.tsv.gz \\
        --output predictions.parquet [--batch-size 4096] [--device auto|cpu|cuda]
    python -m dlrm.predict --checkpoint ... --input data/criteo_sample [--split test|val|train] --output ...

Inputs:
    FILE (any name but *.parquet)   raw Criteo lines, plain or gzip, parsed and validated exactly as
                                    `dlrm.data.preprocess` does (a bad line stops with its file and line
                                    number, exit code 2). Lines of 40 fields have a label; lines of 39
                                    fields (Criteo's unlabeled test files) have none.
    FILE.parquet                    one preprocessed shard (either parquet layout of dlrm.data.dataset)
    DIR with metadata.json          the `--split` of a preprocessed data directory (default test)
    DIR of *.parquet                those shards, in name order

Output (one row per input row, in input order): `row` int64 (0-based: the line number - 1 for text, the
position in the split's shards for parquet), `logit` float32, `ctr` float32 (sigmoid of the logit), and
`label` float32 when the input has labels. The output is written under a temporary name and renamed into
place once complete.

Streaming in bounded memory: text is read `--block-size` lines at a time, parquet one record batch of at
most `--block-size` rows at a time, and scored `--batch-size` rows at a time; nothing grows with the input.
Any backend's checkpoint works (the weights are saved in one layout); scoring runs the run's kernels and
precision by default (`--backend`, `--precision`: dlrm.scoring).

A multi-hot model (`model.multi_hot_sizes`) scores bags as its run read them (dlrm.data.bag_source.RunBags):
one-hot rows (text, or one-hot parquet) get the bags of the run's `data.multi_hot`, drawn over the id ranges
of the data directory's metadata.json (that of a DIR input, else the run's `data.path`); parquet written with
bags (`python -m dlrm.data.multi_hot`) is read as written.
"""

import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import click
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from loguru import logger
from tqdm import tqdm

from dlrm import atomic, progress
from dlrm.checkpoint import load_checkpoint
from dlrm.cli_options import checkpoint_option, command, device_option, path_option, split_option
from dlrm.config import RunConfig, from_dict
from dlrm.data.bag_source import RunBags, scoring_bags
from dlrm.data.dataset import Batch, columns_of, decode_table, parquet_errors, split_files, split_paths
from dlrm.data.parse import parse_block
from dlrm.data.schema import RAW_COLUMNS
from dlrm.data.splits import check_data_dir
from dlrm.data.text import LineReader, PreprocessError, TextBlock
from dlrm.device import resolve_device
from dlrm.errors import cli_errors
from dlrm.metrics import forward_logits
from dlrm.model import Model
from dlrm.scoring import Scoring, resolve_scoring, scoring_model, scoring_options

DEFAULT_BLOCK_SIZE = 1 << 16


def load_model(
    checkpoint: Path, device: torch.device, backend: str = "eager", precision: str = "fp32"
) -> tuple[Model, Scoring]:
    """The eval-mode model of a training checkpoint (of any backend) on `device`, with the kernels and
    precision that `backend` and `precision` name for its run (dlrm.scoring), and that scoring.

    Raises:
        ValueError: the file is missing or not a DLRM checkpoint.
    """
    model, scoring, _ = load_run(checkpoint, device, backend, precision)
    return model, scoring


def load_run(
    checkpoint: Path, device: torch.device, backend: str = "eager", precision: str = "fp32"
) -> tuple[Model, Scoring, RunConfig]:
    """`load_model`'s model and scoring, and the run's config."""
    state = load_checkpoint(checkpoint)
    cfg = from_dict(state["config"])
    scoring = resolve_scoring(cfg, backend, precision)
    return scoring_model(cfg, state["table_rows"], state["model"], scoring, device), scoring, cfg


def input_bags(cfg: RunConfig, source: Path) -> RunBags:
    """The bags of the run of `cfg` for the rows of `source` (module docstring): a data directory's are
    checked against the model first (dlrm.data.bag_source.scoring_bags).

    Raises:
        ValueError, FileNotFoundError: as scoring_bags, for a data directory with metadata.json.
    """
    if source.is_dir() and (source / "metadata.json").is_file():
        return scoring_bags(cfg, source)
    return RunBags(cfg, cfg.data.path)


def input_blocks(source: Path, split: str, block_size: int) -> Iterator[tuple[Batch, bool]]:
    """The rows of `source` in order, `block_size` rows at most at a time, as (Batch on the CPU, whether
    the rows have labels); see the module docstring for what `source` may be.

    Raises:
        PreprocessError: a bad line of a text input (the message names the file and line).
        FileNotFoundError, ValueError: no such input, a directory without parquet files, a parquet file
            without the expected columns.
    """
    if source.is_dir():
        check_data_dir(source)  # an older train / eval directory: re-run preprocess
        files = split_paths(source, split) if (source / "metadata.json").is_file() else split_files(source)
        yield from _parquet_blocks(files, block_size)
    elif source.suffix == ".parquet":
        yield from _parquet_blocks([source], block_size)
    elif source.exists():
        yield from _text_blocks(source, block_size)
    else:
        raise FileNotFoundError(f"{source}: no such file or directory")


def _parquet_blocks(files: list[Path], block_size: int) -> Iterator[tuple[Batch, bool]]:
    for path in files:
        columns = columns_of(path)
        with parquet_errors(path):  # (decode_table's ValueErrors, naming the file already, pass through)
            for record_batch in pq.ParquetFile(path).iter_batches(batch_size=block_size, columns=columns):
                yield decode_table(pa.Table.from_batches([record_batch]), columns, path), True


_FIELD_COUNT = re.compile(rf"expected {len(RAW_COLUMNS)} tab-separated fields, got (\d+)")


def _text_blocks(path: Path, block_size: int) -> Iterator[tuple[Batch, bool]]:
    labeled = None
    with LineReader(path) as reader:
        while (block := reader.read(block_size)) is not None:
            if labeled is None:  # decided by the first line: 40 fields, or 39 without the label
                first_line = block.data.split(b"\n", 1)[0]
                labeled = first_line.count(b"\t") != len(RAW_COLUMNS) - 2
            try:
                rows, _ = parse_block(block if labeled else _with_label_field(block), skip_bad_lines=False)
            except PreprocessError as err:
                if labeled:
                    raise
                # Name the field count of the line as written, without the placeholder label.
                message = _FIELD_COUNT.sub(
                    lambda m: (
                        f"expected {len(RAW_COLUMNS) - 1} tab-separated fields (no label), "
                        f"got {int(m.group(1)) - 1}"
                    ),
                    str(err),
                )
                raise PreprocessError(message) from None
            yield decode_table(pa.Table.from_batches([rows]), RAW_COLUMNS, path), labeled
    if labeled is None:
        raise PreprocessError(f"{path} line 1: file is empty")


def _with_label_field(block: TextBlock) -> TextBlock:
    """The block's lines with a placeholder label field "0" in front, so that unlabeled lines parse."""
    data = b"0\t" + block.data.replace(b"\n", b"\n0\t")
    if block.data.endswith(b"\n"):
        data = data[:-2]
    return block._replace(data=data)


@torch.no_grad()
def predict(
    model: Model,
    blocks: Iterator[tuple[Batch, bool]],
    output: Path,
    batch_size: int,
    device: torch.device,
    mode: str = "log",
    precision: str = "fp32",
    bags: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict:
    """Score every row of `blocks` with `model` in `precision` (dlrm.metrics.forward_logits) and write
    `output` (parquet, see the module docstring); returns {"rows", "mean_ctr", "output"}. `output` appears
    only when complete. `mode` (dlrm.progress): "bar" counts the rows on a progress bar. `bags` maps each
    batch's ids to the model's (`input_bags`); None: the ids as read."""
    writer = None
    rows = 0
    ctr_sum = 0.0
    bar = tqdm(desc="predict", unit=" rows", unit_scale=True, file=sys.stdout, disable=mode != "bar")
    with atomic.replacing(output) as tmp, bar:
        try:
            for block, labeled in blocks:
                for start in range(0, len(block.label), batch_size):
                    batch = Batch(*(t[start : start + batch_size] for t in block)).to(device)
                    sparse = batch.sparse if bags is None else bags(batch.sparse)
                    logits = forward_logits(model, precision, batch.dense, sparse)
                    ctr = torch.sigmoid(logits)
                    n = len(logits)
                    columns = {
                        "row": pa.array(torch.arange(rows, rows + n).numpy()),
                        "logit": pa.array(logits.cpu().numpy()),
                        "ctr": pa.array(ctr.cpu().numpy()),
                    }
                    if labeled:
                        columns["label"] = pa.array(batch.label.cpu().numpy())
                    table = pa.table(columns)
                    if writer is None:
                        writer = pq.ParquetWriter(tmp, table.schema)
                    writer.write_table(table)
                    rows += n
                    ctr_sum += ctr.double().sum().item()
                    bar.update(n)
            if writer is None:
                raise ValueError("the input has no rows")
        finally:  # before the file is renamed into place, or removed on an error
            if writer is not None:
                writer.close()
    return {"rows": rows, "mean_ctr": ctr_sum / rows, "output": str(output)}


@command
@checkpoint_option
@path_option(
    "--input",
    "input_path",
    required=True,
    help="Raw Criteo TSV(.gz) (40 fields, or 39 without the label), a .parquet shard, a preprocessed data "
    "directory (with metadata.json; see --split) or a directory of .parquet shards.",
)
@path_option(
    "--output",
    required=True,
    help="Parquet file to write: row, logit, ctr, and label when the input has one.",
)
@split_option
@click.option("--batch-size", type=click.IntRange(min=1), default=4096, help="Rows scored at once.")
@click.option(
    "--block-size",
    type=click.IntRange(min=1),
    default=DEFAULT_BLOCK_SIZE,
    help="Lines (or parquet rows) read at once; memory grows with it, not with the input.",
)
@scoring_options
@device_option
@click.option(
    "--quiet", is_flag=True, help="No progress bar (shown when stdout is a terminal) and no log lines."
)
def main(
    checkpoint_path, input_path, output, split, batch_size, block_size, backend, precision, device, quiet
):
    """Write the click-through rate of every row of INPUT under a checkpoint to OUTPUT (parquet). A
    multi-hot model scores the bags its run read: made from one-hot rows by the run's data.multi_hot, or
    read as python -m dlrm.data.multi_hot wrote them."""
    mode = progress.configure("quiet" if quiet else "auto")
    with cli_errors():
        atomic.check_output_file(output, "--output", [input_path])  # before any scoring
        dev = resolve_device(device)
        model, scoring, cfg = load_run(checkpoint_path, dev, backend, precision)
        logger.info("scoring {} with {} on {} ({})", input_path, checkpoint_path, dev, scoring)
        blocks = input_blocks(input_path, split, block_size)
        bags = input_bags(cfg, input_path)
        result = predict(model, blocks, output, batch_size, dev, mode, scoring.precision, bags)
    logger.info("{} rows, mean ctr {:.4f}, written to {}", result["rows"], result["mean_ctr"], output)


if __name__ == "__main__":
    main()
