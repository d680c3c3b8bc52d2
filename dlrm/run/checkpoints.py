"""A run's checkpoints: what checkpoints/last.pt and best.pt hold (weights, optimizer states, config,
table layout, run state, loader position; a sharded directory on many ranks), when a periodic last.pt is
due (train.checkpoint_interval, train.checkpoint_every_s) and which older ones are kept (train.keep_last).
Only a finite state is written (dlrm.run.nonfinite)."""

import os
import shutil
import time
from pathlib import Path

from loguru import logger

from dlrm.config import RunConfig
from dlrm.data.loaders import STATEFUL_LOADERS
from dlrm.run.nonfinite import check_finite, nonfinite_stop, weights_finite
from dlrm.run.state import Interval, Run, RunState


def checkpoint_due_by_steps(cfg: RunConfig, state: RunState) -> bool:
    """Whether a periodic last.pt is due by train.checkpoint_interval (every N steps)."""
    interval = cfg.train.checkpoint_interval
    return bool(interval) and state.step % interval == 0


def checkpoint_due_by_time(cfg: RunConfig, state: RunState) -> bool:
    """Whether train.checkpoint_every_s seconds have passed since the last last.pt."""
    every = cfg.train.checkpoint_every_s
    return every is not None and time.monotonic() - state.last_checkpoint_time >= every


def save_last(run: Run, state: RunState, interval: Interval) -> None:
    """checkpoints/last.pt, written only for a finite state: the interval's losses are read first and the
    weights summed (NonFiniteLoss otherwise, leaving the previous last.pt). The last.pt it replaces is kept
    as step-<N>.pt (a hard link) when train.keep_last > 0, the oldest beyond keep_last deleted."""
    check_finite(run, state, interval)
    directory = run.run_dir / "checkpoints"
    # Many ranks write a sharded directory, checkpoints/last (keep_last is refused there: check_world).
    last, keep = checkpoint_path(run, "last.pt"), run.cfg.train.keep_last
    if state.last_checkpoint_state == state.checkpointed() and last.exists():
        return  # written at this step already (the end of a run, a signal right after a periodic one)
    if not weights_finite(run.model):
        raise nonfinite_stop(run, state, f"step {state.step}: the weights are not finite")
    previous = state.last_checkpoint_step
    if keep and previous is not None and previous != state.step and last.exists():
        kept = directory / f"step-{previous}.pt"
        kept.unlink(missing_ok=True)
        try:
            os.link(last, kept)
        except OSError:  # a file system without hard links
            shutil.copyfile(last, kept)
    save_run_checkpoint(run, state, "last.pt")
    state.last_checkpoint_step, state.last_checkpoint_time = state.step, time.monotonic()
    state.last_checkpoint_state = state.checkpointed()
    logger.info("step {}: checkpoint {}", state.step, last)
    if keep:
        steps = sorted(
            int(p.stem.split("-", 1)[1]) for p in directory.glob("step-*.pt") if p.stem[5:].isdigit()
        )
        for step in steps[:-keep]:
            (directory / f"step-{step}.pt").unlink(missing_ok=True)


def save_run_checkpoint(run: Run, state: RunState, name: str) -> None:
    """checkpoints/`name`: weights, optimizer states, config, table layout, run state, loader position.
    Many ranks: the sharded directory checkpoints/<name without .pt>/ (dlrm.parallel.checkpoint)."""
    loader = run.train_loader
    meta = {
        "config": run.cfg.to_dict(),
        "table_rows": run.model.sparse_arch.table_rows,
        "loader": loader.state_dict() if isinstance(loader, STATEFUL_LOADERS) else None,
        **state.checkpointed(),
    }
    run.strategy.save_checkpoint(checkpoint_path(run, name), run.model, run.optimizer, meta)


def checkpoint_path(run: Run, name: str) -> Path:
    """Where `save_run_checkpoint(run, state, name)` writes: checkpoints/`name`, a file, or many ranks'
    directory checkpoints/<name without .pt>/."""
    return run.strategy.checkpoint_path(run.run_dir, name)
