"""The train / val / test protocol of a preprocessed data directory.

Every layout holds out two splits after train, in time order: "val", on which training evaluates, stops
early and selects checkpoints/best.pt, then "test", on which only the selected weights are evaluated,
once, for the number a run reports. Selecting on the split that is reported would overstate it.

Layout "fraction" cuts its held-out tail by `val_fraction` and `test_fraction` (shares of all lines);
`eval_fraction` F is shorthand for F/2 each. Data directories of older preprocess runs hold "eval" in
place of val / test; `require_val_test` refuses them with the command that rewrites them.
"""

from pathlib import Path

import click

from dlrm.data.output import METADATA_FILE, load_metadata

__all__ = [
    "DEFAULT_HELD_OUT",
    "REPORT",
    "SELECT",
    "check_data_dir",
    "held_out_fractions",
    "held_out_options",
    "require_val_test",
]

SELECT, REPORT = "val", "test"  # the split that selects the weights, the split that reports them
DEFAULT_HELD_OUT = 0.1  # val and test fraction each when none is given (0.2 held out in all)


def held_out_fractions(
    eval_fraction: float | None = None,
    val_fraction: float | None = None,
    test_fraction: float | None = None,
    layout: str = "fraction",
    error: type[ValueError] = ValueError,
) -> tuple[float, float]:
    """(val fraction, test fraction) of layout "fraction" from the options as given (None: not given).

    `eval_fraction` F means F/2 each; otherwise each defaults to DEFAULT_HELD_OUT. Both in [0, 1) and
    together below 1 (train keeps the rest). Layouts kaggle and terabyte cut by days and take none.

    Raises:
        `error` (a ValueError): --eval-fraction with --val-fraction or --test-fraction, a fraction outside
            [0, 1), val + test >= 1, or a fraction for layout kaggle / terabyte; one line naming the option.
    """
    given = {
        "--eval-fraction": eval_fraction,
        "--val-fraction": val_fraction,
        "--test-fraction": test_fraction,
    }
    named = [option for option, value in given.items() if value is not None]
    if layout in ("kaggle", "terabyte") and named:  # silently ignoring it would mislead
        raise error(f"{', '.join(named)}: only for --layout fraction (layout {layout} splits by days)")
    if eval_fraction is not None:
        if val_fraction is not None or test_fraction is not None:
            raise error(
                "--eval-fraction F is shorthand for --val-fraction F/2 --test-fraction F/2: give one or the "
                "other, not both"
            )
        if not 0.0 <= eval_fraction < 1.0:
            raise error(f"--eval-fraction must be in [0, 1), got {eval_fraction}")
        return eval_fraction / 2, eval_fraction / 2
    val = DEFAULT_HELD_OUT if val_fraction is None else val_fraction
    test = DEFAULT_HELD_OUT if test_fraction is None else test_fraction
    for option, value in (("--val-fraction", val), ("--test-fraction", test)):
        if not 0.0 <= value < 1.0:
            raise error(f"{option} must be in [0, 1), got {value}")
    if val + test >= 1.0:
        raise error(f"--val-fraction {val} + --test-fraction {test} must be below 1 (train keeps the rest)")
    return val, test


def held_out_options(when: str):
    """The click options --val-fraction, --test-fraction and --eval-fraction (floats, None where not given:
    `held_out_fractions` reads them) of a command that writes layout "fraction"; `when` (e.g. "With
    --output-dir") opens their help."""
    options = (
        click.option(
            "--val-fraction",
            type=float,
            default=None,
            help=f"{when}: share of rows, before the test split, that forms val (model selection).  "
            f"[default: {DEFAULT_HELD_OUT}]",
        ),
        click.option(
            "--test-fraction",
            type=float,
            default=None,
            help=f"{when}: share of rows, taken from the end, that forms test (the reported AUC).  "
            f"[default: {DEFAULT_HELD_OUT}]",
        ),
        click.option(
            "--eval-fraction",
            type=float,
            default=None,
            help=f"{when}: shorthand for --val-fraction F/2 --test-fraction F/2.",
        ),
    )

    def decorate(command):
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def check_data_dir(data_dir: Path) -> None:
    """`require_val_test` for a data directory with metadata.json (one without, of bare split directories,
    is read by dlrm.data.dataset.split_paths as it is). Raises ValueError as `require_val_test`."""
    if (Path(data_dir) / METADATA_FILE).is_file():
        require_val_test(Path(data_dir), load_metadata(data_dir))


def require_val_test(data_dir: Path, metadata: dict) -> None:
    """Refuse a data directory without both held-out splits (one written by an older preprocess, with
    train / eval): training there would select on the split it reports.

    Raises:
        ValueError: one line naming `data_dir` and the command that writes it again.
    """
    files = metadata.get("files", {})
    missing = [split for split in (SELECT, REPORT) if split not in files]
    if not missing:
        return
    source = metadata.get("source") or []
    if source and all(isinstance(s, str) and not s.startswith("synthetic:") for s in source):
        inputs = " ".join(f"--input {s}" for s in source)
        command = f"python -m dlrm.data.preprocess {inputs} --output-dir {data_dir} --overwrite"
    elif source:
        command = f"python -m dlrm.data.synthetic --rows N --output-dir {data_dir} --overwrite"
    else:
        command = f"python -m dlrm.data.preprocess --input ... --output-dir {data_dir} --overwrite"
    raise ValueError(
        f"{data_dir} has splits {', '.join(files) or 'none'}, no {' / '.join(missing)} (written by an older "
        f"preprocess: selection and the reported AUC would share a split); re-run: {command}"
    )
