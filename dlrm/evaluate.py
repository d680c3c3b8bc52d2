"""`python -m dlrm.evaluate`: AUC, logloss and normalized entropy of a checkpoint on a data split, as JSON.
The checkpoint is a one-process .pt or the sharded directory of a torchrun run, read whole here."""

import json
import sys
from pathlib import Path

import click
import torch

from dlrm.checkpoint import load_checkpoint
from dlrm.config import from_dict
from dlrm.data.dataset import BatchLoader, open_split
from dlrm.metrics import evaluate
from dlrm.model import model_from_checkpoint
from dlrm.step import resolve_device


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option(
    "--checkpoint",
    "checkpoint_path",
    type=click.Path(path_type=Path),
    required=True,
    help="checkpoints/best.pt or last.pt of a run, or checkpoints/best or last (directories) of a torchrun "
    "run.",
)
@click.option(
    "--data",
    "data_dir",
    type=click.Path(path_type=Path),
    required=True,
    help="Preprocessed data directory (with metadata.json).",
)
@click.option(
    "--split", default="eval", help="Split to evaluate: eval, or val / test for layouts kaggle, terabyte."
)
@click.option("--batch-size", type=click.IntRange(min=1), default=4096)
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto")
def main(checkpoint_path, data_dir, split, batch_size, device):
    """Print {"auc", "logloss", "ne", "samples"} of a checkpoint on DATA/SPLIT as JSON."""
    try:
        state = load_checkpoint(checkpoint_path)
        cfg = from_dict(state["config"])
        dev = resolve_device(device)
        model = model_from_checkpoint(cfg.model, state["table_rows"], state["model"]).to(dev)
        loader = BatchLoader(open_split(data_dir, split), batch_size, device=dev)
        with torch.no_grad():
            result = evaluate(model, loader, dev)
    except (ValueError, FileNotFoundError) as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(2)
    click.echo(json.dumps({"checkpoint": str(checkpoint_path), "split": split, **result}))


if __name__ == "__main__":
    main()
