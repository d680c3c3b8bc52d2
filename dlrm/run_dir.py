"""The run directory: chosen and checked before a run sets anything up, created (or emptied for
--overwrite) once it has, and files written into it whole (a temporary name renamed into place)."""

import shutil
import tempfile
import time
from datetime import datetime
from pathlib import Path

from loguru import logger

from dlrm.config import RunConfig

# What makes a directory hold a run (besides TensorBoard event files).
RUN_FILES = ("config.json", "metrics.json", "checkpoints")


def check_run_dir(cfg: RunConfig, output_dir: Path | None, resume: Path | None, overwrite: bool) -> Path:
    """The run directory (`output_dir`, or runs/<name>-<timestamp> when None), checked before anything is
    set up: not a file, not holding a run unless resuming or `overwrite`, and writable (probed with a
    temporary directory, removed at once). Raises ValueError naming the path and the reason."""
    if output_dir is None:
        output_dir = Path("runs") / f"{cfg.name}-{datetime.now():%Y%m%d-%H%M%S}"
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(
            f"{output_dir}: exists and is not a directory (--output-dir names the run directory)"
        )
    holds_run = output_dir.is_dir() and (
        any((output_dir / name).exists() for name in RUN_FILES)
        or any(output_dir.glob("events.out.tfevents.*"))
    )
    if holds_run and resume is None and not overwrite:
        raise ValueError(
            f"{output_dir} holds a run; use --resume {output_dir / 'checkpoints' / 'last.pt'} or --overwrite"
        )
    if overwrite and resume is not None and output_dir.resolve() in resume.resolve().parents:
        raise ValueError(f"--overwrite would delete {resume}, the checkpoint --resume reads")
    existing = next(p for p in (output_dir, *output_dir.parents) if p.exists())
    try:
        probe = Path(tempfile.mkdtemp(prefix=".dlrm-write-probe-", dir=existing))
        probe.rmdir()
    except OSError as err:
        raise ValueError(
            f"{output_dir}: cannot write the run directory here: {err.strerror or err}"
        ) from None
    return output_dir


def make_run_dir(run_dir: Path, clear: bool) -> None:
    """Create `run_dir` (emptied first when `clear`: --overwrite). Raises ValueError naming the path."""
    try:
        if clear and run_dir.is_dir():
            logger.info("--overwrite: deleting what {} holds", run_dir)
            for entry in run_dir.iterdir():
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{run_dir}: cannot write the run directory: {err.strerror or err}") from None


def wait_past_event_files(run_dir: Path) -> None:
    """Wait until the clock's second is past those in the names of run_dir's TensorBoard event files
    (events.out.tfevents.<second>.<host>.<pid>...). TensorBoard reads the files in name order; a resumed
    run's file started within the same second as the stopped run's could sort before it (by pid), and its
    purge of the steps logged after the checkpoint would then be undone. At most a second, on resume only."""
    seconds = [
        int(p.name.split(".")[3])
        for p in run_dir.glob("events.out.tfevents.*")
        if p.name.split(".")[3].isdigit()
    ]
    while seconds and int(time.time()) <= max(seconds):
        time.sleep(0.05)
