"""Command-line options that several commands share (click decorators), so they read the same everywhere."""

from pathlib import Path

import click

checkpoint_option = click.option(
    "--checkpoint",
    "checkpoint_path",
    type=click.Path(path_type=Path),
    required=True,
    help="checkpoints/best.pt or last.pt of a run (any backend), or checkpoints/best or last (directories) "
    "of a torchrun run.",
)

device_option = click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default="auto",
    help="Where the model runs (auto: cuda when available).",
)
