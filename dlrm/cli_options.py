"""Command-line options that several commands share (click decorators), so they read the same everywhere."""

from collections.abc import Sequence
from pathlib import Path

import click

from dlrm.choices import DEVICES, SPLITS


def command(function):
    """`function` as a click command with what every dlrm command has: -h as well as --help, and each
    option's default shown in the help."""
    return click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})(
        function
    )


def path_option(*names: str, help: str, required: bool = False, **attrs):
    """A click option (`names` as click.option's) whose value is a pathlib.Path, None where not given
    unless `required`; further `attrs` as click.option's."""
    return click.option(*names, type=click.Path(path_type=Path), required=required, help=help, **attrs)


def choice_option(*names: str, choices: Sequence[str], default: str | None, help: str):
    """A click option (`names` as click.option's) whose value is one of `choices` (a click.Choice, listed
    in the help), `default` where not given."""
    return click.option(*names, type=click.Choice(choices), default=default, help=help)


def data_option(help: str):
    """The required `--data` option (parameter `data_dir`, a Path): a preprocessed data directory, whose
    expected contents `help` names."""
    return path_option("--data", "data_dir", required=True, help=help)


checkpoint_option = path_option(
    "--checkpoint",
    "checkpoint_path",
    required=True,
    help="checkpoints/best.pt or last.pt of a run (any backend), or checkpoints/best or last (directories) "
    "of a torchrun run.",
)

# The splits of a preprocessed data directory (dlrm.data.splits); test, the reported one, by default.
split_option = choice_option(
    "--split",
    choices=SPLITS,
    default="test",
    help="Split of a preprocessed data directory: test (what a run reports), val (what selected best.pt), "
    "or train.",
)

device_option = choice_option(
    "--device",
    choices=DEVICES,
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
