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

# Any config key from the command line (dlrm.config.apply_overrides), after the config file; a command's
# own flags (--use-triton, --max-steps, ...) are applied after these.
set_option = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Set any config key, e.g. --set train.lr=0.05 --set model.embedding_dim=32 (the dotted key of a "
    "config file; VALUE is read as JSON, else as a string). Repeatable; applied after the config file, "
    "before the other flags, and validated as the file is.",
)
