"""Command-line options that several commands share (click decorators), so they read the same everywhere."""

from pathlib import Path

import click

from dlrm.choices import DEVICES, SPLITS

checkpoint_option = click.option(
    "--checkpoint",
    "checkpoint_path",
    type=click.Path(path_type=Path),
    required=True,
    help="checkpoints/best.pt or last.pt of a run (any backend), or checkpoints/best or last (directories) "
    "of a torchrun run.",
)

# The splits of a preprocessed data directory (dlrm.data.splits); test, the reported one, by default.
split_option = click.option(
    "--split",
    type=click.Choice(SPLITS),
    default="test",
    help="Split of a preprocessed data directory: test (what a run reports), val (what selected best.pt), "
    "or train.",
)

device_option = click.option(
    "--device",
    type=click.Choice(DEVICES),
    default="auto",
    help="Where the model runs (auto: cuda when available).",
)
