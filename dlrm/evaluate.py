"""`python -m dlrm.evaluate`: AUC, logloss and normalized entropy of a checkpoint on a data split, as JSON.
The checkpoint is a one-process .pt or the sharded directory of a torchrun run, read whole here. By default
it scores with the run's kernels, precision and eval batch size (dlrm.scoring), so the test split gives the
numbers the run reported. A multi-hot model (`model.multi_hot_sizes`) reads bags as the run did: made from
one-hot data by the run's `data.multi_hot`, or as written (`python -m dlrm.data.multi_hot`, which writes the
same bags; dlrm.data.bag_source.scoring_bags)."""

import json

import click
import torch

from dlrm import progress
from dlrm.checkpoint import load_checkpoint
from dlrm.cli_options import checkpoint_option, command, data_option, device_option, split_option
from dlrm.config import from_dict
from dlrm.data.bag_source import scoring_bags
from dlrm.data.dataset import BatchLoader, open_split
from dlrm.data.splits import check_data_dir
from dlrm.device import resolve_device
from dlrm.errors import cli_errors
from dlrm.metrics import evaluate
from dlrm.scoring import resolve_scoring, scoring_model, scoring_options


@command
@checkpoint_option
@data_option("Preprocessed data directory (with metadata.json).")
@split_option
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=None,
    help="Rows per forward pass [default: the run's data.eval_batch_size].",
)
@scoring_options
@device_option
@click.option(
    "--quiet",
    is_flag=True,
    help="Print the JSON only: no progress bar (shown when stdout is a terminal) and no log lines.",
)
def main(checkpoint_path, data_dir, split, batch_size, backend, precision, device, quiet):
    """Print {"auc", "logloss", "ne", "samples"} of a checkpoint on DATA/SPLIT as JSON. A multi-hot model
    scores the bags its run read: made from one-hot DATA by the run's data.multi_hot, or read as python -m
    dlrm.data.multi_hot wrote them."""
    mode = progress.configure("quiet" if quiet else "auto")
    with cli_errors():
        check_data_dir(data_dir)  # an older train / eval directory: re-run preprocess
        state = load_checkpoint(checkpoint_path)
        cfg = from_dict(state["config"])
        dev = resolve_device(device)
        scoring = resolve_scoring(cfg, backend, precision)
        model = scoring_model(cfg, state["table_rows"], state["model"], scoring, dev)
        bags = scoring_bags(cfg, data_dir)
        split_set = open_split(data_dir, split)
        if split_set.num_rows == 0:
            raise ValueError(f"split {split!r} of {data_dir} has no rows: nothing to evaluate")
        loader = BatchLoader(split_set, batch_size or cfg.data.eval_batch_size, device=dev, bags=bags)
        with torch.no_grad():
            result = evaluate(model, progress.eval_batches(mode, loader, split), dev, scoring.precision)
    click.echo(json.dumps({"checkpoint": str(checkpoint_path), "split": split, **result}))


if __name__ == "__main__":
    main()
