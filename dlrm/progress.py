"""What a long command shows while it runs: a progress bar on a terminal, plain log lines otherwise, or
neither with `--quiet`.

Modes (`resolve_mode`):
    "auto"   "bar" when stdout is a terminal, else "log"
    "bar"    tqdm bars on stdout (training: epoch, step/steps, samples/s, loss, ETA; evaluation: batches and
             rows/s), with the loguru lines (set-up, intervals, evaluations) printed above them
    "log"    the loguru lines only (one per log interval, evaluation start and result), no bar
    "quiet"  no bar, and loguru only for warnings and errors

    mode = configure(mode)                            # once per process, in the CLI: loguru's sink
    bar = TrainProgress(mode, total_steps, first_step)
    bar.step()                                        # per training step; no host sync
    bar.interval(epoch, loss, samples_per_s)          # per log line, with the values the loop just read
    for batch in eval_batches(mode, loader, "test"): ...
    bar.close()
"""

import shutil
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from loguru import logger
from tqdm import tqdm

MODES = ("auto", "bar", "log", "quiet")
T = TypeVar("T")


def resolve_mode(mode: str) -> str:
    """ "auto" -> "bar" on a terminal (stdout), "log" otherwise; the other modes as they are.

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in MODES:
        raise ValueError(f"progress: expected one of {', '.join(MODES)}, got {mode!r}")
    if mode == "auto":
        return "bar" if sys.stdout.isatty() else "log"
    return mode


def configure(mode: str) -> str:
    """Point loguru at what `mode` needs (the resolved mode is returned): in "bar" mode its lines go through
    `tqdm.write`, so that they print above the bars instead of through them; in "quiet" mode only warnings
    and errors are printed. Process-wide: call it once, from a command's entry point."""
    mode = resolve_mode(mode)
    if mode == "bar":
        logger.remove()
        logger.add(lambda message: tqdm.write(message, end="", file=sys.stderr), colorize=sys.stderr.isatty())
    elif mode == "quiet":
        logger.remove()
        logger.add(sys.stderr, level="WARNING")
    return mode


class TrainProgress:
    """The training bar: "epoch E | step/steps [elapsed<ETA, steps/s] loss, samples/s". A no-op unless the
    mode resolves to "bar"."""

    def __init__(self, mode: str, total_steps: int, first_step: int = 0):
        self.mode = resolve_mode(mode)
        self.bar = None
        if self.mode == "bar":
            self.bar = tqdm(
                total=total_steps,
                initial=first_step,
                desc="train: ",
                unit="step",
                file=sys.stdout,
                **_screen(),
                bar_format="{desc}{n_fmt}/{total_fmt} steps |{bar}| {elapsed}<{remaining}, {rate_fmt}"
                "{postfix}",
            )

    def step(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def interval(self, epoch: int, loss: float, samples_per_s: float) -> None:
        """The values of the last log interval (the loop has just read them; no new host sync)."""
        if self.bar is not None:
            self.bar.set_description(f"epoch {epoch}", refresh=False)
            self.bar.set_postfix_str(f"loss {loss:.5f}, {samples_per_s:,.0f} samples/s")

    def eval_batches(self, batches: Iterable[T], split: str) -> Iterator[T]:
        """`eval_batches` in this bar's mode."""
        return eval_batches(self.mode, batches, split)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def eval_batches(mode: str, batches: Iterable[T], split: str) -> Iterator[T]:
    """`batches` (an evaluation's loader), with a bar that disappears when done ("bar"), or a log line
    first ("log")."""
    mode = resolve_mode(mode)
    total = len(batches) if hasattr(batches, "__len__") else None
    if mode == "log":
        rows = getattr(batches, "num_rows", None)
        logger.info("evaluating on {} ({} batches{})", split, total, f", {rows:,} rows" if rows else "")
    if mode != "bar":
        yield from batches
        return
    with tqdm(
        batches,
        total=total,
        desc=f"eval {split}",
        unit="batch",
        leave=False,
        file=sys.stdout,
        dynamic_ncols=True,
    ) as bar:
        yield from bar


def _screen() -> dict:
    """tqdm's ncols and nrows: the terminal's size, or 80 x 24 where it reports none (a pseudo-terminal of
    size 0, as `script` opens, on which tqdm would print nothing)."""
    size = shutil.get_terminal_size()
    return {"ncols": size.columns, "nrows": size.lines}
