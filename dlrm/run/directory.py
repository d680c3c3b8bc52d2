"""The run directory: chosen and checked before a run sets anything up, created (or emptied for
--overwrite) once it has, and files written into it whole (a temporary name renamed into place).

A run writes MARKER first: --overwrite deletes only a directory that has it, holding nothing but what a
run writes (`check_overwritable`), and never the working directory or one above it."""

import json
import re
import shutil
import tempfile
import time
from datetime import datetime
from pathlib import Path

from loguru import logger

from dlrm import atomic
from dlrm.config import RunConfig

# What makes a directory hold a run (besides TensorBoard event files).
RUN_FILES = ("config.json", "metrics.json", "checkpoints")
# Written into the run directory before anything else: what makes --overwrite allowed to empty it.
MARKER = ".dlrm-run"
# What a run writes: at its top (config.json, metrics.json, sharding_plan.json, MARKER, TensorBoard events,
# profiler traces) and in checkpoints/ (last.pt, best.pt, step-<N>.pt, a torchrun job's last/ and best/);
# in both, the temporaries of dlrm.atomic (.<name>.tmp-<pid>...) and of sharded checkpoints (.last.tmp,
# .last.old).
_TOP = re.compile(
    r"(config\.json|metrics\.json|sharding_plan\.json|\.dlrm-run|checkpoints"
    r"|events\.out\.tfevents\..*|.*\.pt\.trace\.json(\.tmp)?|\..*\.tmp-\d+.*)"
)
_CHECKPOINTS = re.compile(
    r"(last\.pt|best\.pt|step-\d+\.pt|last|best|\.(last|best)\.(tmp|old)|\..*\.tmp-\d+.*)"
)


def check_run_dir(cfg: RunConfig, output_dir: Path | None, resume: Path | None, overwrite: bool) -> Path:
    """The run directory (`output_dir`, or runs/<name>-<timestamp> when None), checked before anything is
    set up: not a file, not a directory of other files than a run's, not holding a run unless resuming or
    `overwrite`, and writable (probed with a
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
    # (with --overwrite, check_overwritable below refuses such a directory, naming why it may not be emptied)
    listed = output_dir.iterdir() if output_dir.is_dir() and not holds_run and not overwrite else ()
    foreign = sorted(p.name for p in listed if not _TOP.fullmatch(p.name))
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ValueError(
            f"{output_dir} is not empty and holds no run (it holds {shown}); give a new or empty directory "
            "(--output-dir)"
        )
    if holds_run and resume is None and not overwrite:
        sharded = (output_dir / "checkpoints" / "last").is_dir()  # a torchrun job's
        last = output_dir / "checkpoints" / ("last" if sharded else "last.pt")
        raise ValueError(f"{output_dir} holds a run; use --resume {last} or --overwrite")
    if overwrite and resume is not None and output_dir.resolve() in resume.resolve().parents:
        raise ValueError(f"--overwrite would delete {resume}, the checkpoint --resume reads")
    if overwrite and resume is None:
        check_overwritable(output_dir)
    existing = next(p for p in (output_dir, *output_dir.parents) if p.exists())
    try:
        probe = Path(tempfile.mkdtemp(prefix=".dlrm-write-probe-", dir=existing))
        probe.rmdir()
    except OSError as err:
        raise ValueError(
            f"{output_dir}: cannot write the run directory here: {err.strerror or err}"
        ) from None
    return output_dir


def check_overwritable(run_dir: Path) -> None:
    """Raise ValueError unless --overwrite may empty `run_dir`: it is not the working directory or a
    directory above it, and it is missing, empty, or a run directory (MARKER) holding only what a run
    writes."""
    resolved = run_dir.resolve()
    if resolved == Path.cwd().resolve() or resolved in Path.cwd().resolve().parents:
        raise ValueError(
            f"--overwrite: {run_dir} is the working directory or holds it; refusing to delete it "
            "(name the run directory itself, e.g. runs/<name>)"
        )
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return
    if not (run_dir / MARKER).is_file():
        raise ValueError(
            f"--overwrite: {run_dir} is not a run directory (no {MARKER}, which every run writes first); "
            "refusing to delete it: choose another --output-dir or delete it yourself"
        )
    foreign = [e.name for e in sorted(run_dir.iterdir()) if not _TOP.fullmatch(e.name)]
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir():
        foreign += [
            f"checkpoints/{e.name}"
            for e in sorted(checkpoints.iterdir())
            if not _CHECKPOINTS.fullmatch(e.name)
        ]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ValueError(
            f"--overwrite: {run_dir} holds files a run does not write ({shown}); refusing to delete them: "
            "move them or choose another --output-dir"
        )


def make_run_dir(run_dir: Path, clear: bool) -> None:
    """Create `run_dir` and write MARKER into it (emptied first when `clear`: --overwrite, of what a run
    writes only, checked by `check_overwritable`), and remove the temporaries that a killed run left
    there (`remove_stale_temporaries`). Raises ValueError naming the path."""
    try:
        if clear and run_dir.is_dir():
            check_overwritable(run_dir)  # again: the directory may have changed while the run set up
            logger.info("--overwrite: deleting the earlier run in {}", run_dir)
            for entry in run_dir.iterdir():
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        run_dir.mkdir(parents=True, exist_ok=True)
        if not (run_dir / MARKER).is_file():
            marker = {"program": "dlrm.train", "created": datetime.now().isoformat(timespec="seconds")}
            atomic.write_text(run_dir / MARKER, json.dumps(marker) + "\n")
        remove_stale_temporaries(run_dir)
    except OSError as err:
        raise ValueError(f"{run_dir}: cannot write the run directory: {err.strerror or err}") from None


def remove_stale_temporaries(run_dir: Path) -> None:
    """Remove what a run killed while writing left in `run_dir` (a checkpoint's temporary is as big as
    it): dlrm.atomic's temporaries (.<name>.tmp-<pid>...) whose process is gone, here and in checkpoints/;
    a sharded checkpoint's .last.tmp / .best.tmp / .old directories; the profiler's <trace>.tmp."""
    checkpoints = run_dir / "checkpoints"
    stale = [p for p in run_dir.glob("*.pt.trace.json.tmp") if p.is_file()]
    for directory in (run_dir, checkpoints):
        for path in directory.glob(".*.tmp-*") if directory.is_dir() else ():
            pid = re.search(r"\.tmp-(\d+)", path.name)
            if pid is not None and not atomic.process_alive(int(pid.group(1))) and path.is_file():
                stale.append(path)
    if checkpoints.is_dir():  # (only rank 0 runs this, before any rank writes a checkpoint)
        stale += [p for p in checkpoints.glob(".*") if re.fullmatch(r"\.(last|best)\.(tmp|old)", p.name)]
    for path in stale:
        logger.info("removing {}, left by a run that was stopped while writing it", path)
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


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
