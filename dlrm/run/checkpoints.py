"""A run's checkpoints: what checkpoints/last.pt and best.pt hold (weights, optimizer states, config,
table layout, run state, loader position, kernel choices; a sharded directory on many ranks), when a
periodic last.pt is due (train.checkpoint_interval, train.checkpoint_every_s), which ones the run keeps
(train.checkpoint_policy, train.keep_last), and the preflight that refuses a run whose checkpoints cannot
fit on its disk. Only a finite state is written (dlrm.run.nonfinite).

train.checkpoint_policy:
- "best_and_last": last.pt, and best.pt, the checkpoint of the best val evaluation's step. An evaluation
  that improves writes last.pt at its step and makes best.pt the same file (a hard link; many ranks: best/
  a directory of hard links to last/'s files), so it costs one save; the next last.pt is written beside
  it and best.pt keeps the old file. Up to 3 checkpoints at once on disk: last, best, and the one being
  written (under a temporary name until complete).
- "last_only": last.pt alone (up to 2 at once); the best weights are gone once training moves past them.
- "none": nothing written (benchmarks).
train.keep_last earlier last.pt files kept as step-<N>.pt add as many.

A checkpoint is written in the background when the device has room for a snapshot of the state
(dlrm.staging) and Inductor records no CUDA graphs of its own: training goes on, a second save waits for
the first (`wait_for_checkpoint`), and the failure of a background save is raised where the run waits for
it: the next save, or the test evaluation at the end (dlrm.run.selection.evaluate_selected), which every
run reaches.
"""

import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import torch
from loguru import logger

from dlrm.config import RunConfig, TrainConfig
from dlrm.data.loaders import STATEFUL_LOADERS
from dlrm.parallel.checkpoint import CheckpointError
from dlrm.run import kernel_choices
from dlrm.run.nonfinite import check_finite, nonfinite_stop, weights_finite
from dlrm.run.state import Interval, Run, RunState
from dlrm.staging import PendingSave
from dlrm.step import inductor_cuda_graphs

# Checkpoints a policy keeps at once on disk, before train.keep_last: (count, what they are).
AT_ONCE = {
    "best_and_last": (3, "last, best and the one being written"),
    "last_only": (2, "last and the one being written"),
    "none": (0, "none"),
}
HEADER_BYTES = 2**20  # a checkpoint's bytes besides its tensors (pickle, zip or DCP headers, meta.json) ...
HEADER_SHARE = 1e-3  # ... plus this share of its tensor bytes

# The checkpoint being written in the background, by run directory (at most one per run).
_pending: dict[Path, PendingSave] = {}


def checkpoint_due_by_steps(cfg: RunConfig, state: RunState) -> bool:
    """Whether a periodic last.pt is due by train.checkpoint_interval (every N steps)."""
    interval = cfg.train.checkpoint_interval
    return bool(interval) and state.step % interval == 0


def checkpoint_due_by_time(cfg: RunConfig, state: RunState) -> bool:
    """Whether train.checkpoint_every_s seconds have passed since the last last.pt."""
    every = cfg.train.checkpoint_every_s
    return every is not None and time.monotonic() - state.last_checkpoint_time >= every


def checkpoints_at_once(train: TrainConfig) -> int:
    """How many checkpoints the run may hold on disk at once (module docstring): the policy's, plus
    train.keep_last; 0 for "none"."""
    count = AT_ONCE[train.checkpoint_policy][0]
    return count + train.keep_last if count else 0


def preflight(cfg: RunConfig, strategy, model, optimizer, run_dir: Path) -> None:
    """Before the first step: log a checkpoint's size (each rank's tensors, from its shards of the tables,
    their dtype and optimizer state, and the dense part) and what train.checkpoint_policy keeps at once,
    against the free space of the file system of run_dir/checkpoints (plus what earlier checkpoints there
    hold, which the run replaces); on many ranks the size also goes into sharding_plan.json. A collective
    on many ranks (every rank decides alike, from the least room any rank sees).

    Raises:
        CheckpointError: the checkpoints the policy keeps cannot fit: one line naming the bytes needed and
            free, and how to change the policy.
    """
    per_rank = strategy.checkpoint_bytes(model, optimizer)
    tensors = sum(per_rank)
    each = tensors + HEADER_BYTES + int(HEADER_SHARE * tensors)
    directory = run_dir / "checkpoints"
    free, held, where = room(directory)
    available = int(min(strategy.per_rank(float(free + held))))
    t = cfg.train
    at_once = checkpoints_at_once(t)
    ranks = f" (ranks {' + '.join(_size(n) for n in per_rank)} of tensors)" if len(per_rank) > 1 else ""
    kept = AT_ONCE[t.checkpoint_policy][1] + (f", {t.keep_last} of train.keep_last" if t.keep_last else "")
    held_text = f" + {_size(held)} of earlier checkpoints there" if held else ""
    logger.info(
        "checkpoints: {} each{}; train.checkpoint_policy {!r} keeps up to {} at once ({}): {} of {} free on "
        "{}{}",
        _size(each), ranks, t.checkpoint_policy, at_once, kept, _size(at_once * each), _size(free), where,
        held_text,
    )  # fmt: skip
    if at_once * each <= available:
        return
    options = ["'none' (no checkpoints)"]
    if t.checkpoint_policy == "best_and_last":
        fewer = checkpoints_at_once(replace(t, checkpoint_policy="last_only")) * each
        options.insert(0, f"'last_only' ({_size(fewer)})")
    if t.keep_last:
        options.insert(0, "a lower train.keep_last")
    raise CheckpointError(
        None,
        f"no room for the checkpoints: each is {_size(each)}{ranks} and train.checkpoint_policy "
        f"{t.checkpoint_policy!r} keeps up to {at_once} at once ({kept}): {_size(at_once * each)} needed, "
        f"{_size(available - held)} free on {where}{held_text}; free space, choose another --output-dir, or "
        f"keep fewer: {' or '.join(options)} (--set train.checkpoint_policy=...)",
        str(directory),
    )


def room(directory: Path) -> tuple[int, int, Path]:
    """(free bytes on the file system that will hold `directory`, bytes of the checkpoint files already in
    it, each file once however many names it has, the existing directory the free space is of)."""
    existing = next(p for p in (directory, *directory.parents) if p.exists())
    if not existing.is_dir():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    inodes: dict[tuple[int, int], int] = {}
    if directory.is_dir():
        for path in directory.rglob("*"):
            if path.is_file() and not path.is_symlink():
                stat = path.stat()
                inodes[(stat.st_dev, stat.st_ino)] = stat.st_size
    return free, sum(inodes.values()), existing


def _size(nbytes: float) -> str:
    """`nbytes` in GiB (MiB below one GiB)."""
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


def save_last(run: Run, state: RunState, interval: Interval) -> None:
    """checkpoints/last.pt, written only for a finite state: the interval's losses are read first and the
    weights summed (NonFiniteLoss otherwise, leaving the previous last.pt). The last.pt it replaces is kept
    as step-<N>.pt (a hard link) when train.keep_last > 0, the oldest beyond keep_last deleted. Nothing
    with train.checkpoint_policy "none"."""
    check_finite(run, state, interval)
    if run.cfg.train.checkpoint_policy == "none":
        return
    last = checkpoint_path(run, "last.pt")
    written = last.exists() or run.run_dir in _pending
    if state.last_checkpoint_state == state.checkpointed() and written:
        return  # written at this step already (the end of a run, a signal right after a periodic one)
    if not weights_finite(run.model):
        raise nonfinite_stop(run, state, f"step {state.step}: the weights are not finite")
    write_last(run, state)


def save_best(run: Run, state: RunState) -> None:
    """The evaluation just made `state.best`: with train.checkpoint_policy "best_and_last", write last.pt
    at this step and make best.pt the same file (one save); the caller has checked that the evaluation and
    the weights are finite. Nothing with the other policies."""
    if run.cfg.train.checkpoint_policy != "best_and_last":
        return
    write_last(run, state, best=True)
    state.best_checkpoint = checkpoint_path(run, "best.pt")


def write_last(run: Run, state: RunState, best: bool = False) -> None:
    """Write last.pt (and with `best` make best.pt the same checkpoint), in the background where the
    device has room for a snapshot, after the save still being written, if any (`wait_for_checkpoint`).
    train.keep_last: the last.pt it replaces is kept as step-<N>.pt first, the oldest beyond it deleted."""
    wait_for_checkpoint(run)
    directory = run.run_dir / "checkpoints"
    # Many ranks write a sharded directory, checkpoints/last (keep_last is refused there: check_world).
    last, keep = checkpoint_path(run, "last.pt"), run.cfg.train.keep_last
    previous = state.last_checkpoint_step
    if keep and previous is not None and previous != state.step and last.exists():
        kept = directory / f"step-{previous}.pt"
        kept.unlink(missing_ok=True)
        try:
            os.link(last, kept)
        except OSError:  # a file system without hard links
            shutil.copyfile(last, kept)
    links = (checkpoint_path(run, "best.pt"),) if best else ()
    pending = save_run_checkpoint(run, state, "last.pt", links)
    if pending is not None:
        _pending[run.run_dir] = pending
    state.last_checkpoint_step, state.last_checkpoint_time = state.step, time.monotonic()
    state.last_checkpoint_state = state.checkpointed()
    names = f"{last}{''.join(f' and {link.name}' for link in links)}"
    if pending is None:
        logger.info("step {}: checkpoint {}", state.step, names)
    else:
        logger.info("step {}: writing checkpoint {} in the background", state.step, names)
    if keep:
        steps = sorted(
            int(p.stem.split("-", 1)[1]) for p in directory.glob("step-*.pt") if p.stem[5:].isdigit()
        )
        for step in steps[:-keep]:
            (directory / f"step-{step}.pt").unlink(missing_ok=True)


def wait_for_checkpoint(run: Run) -> None:
    """Wait until the checkpoint being written in the background (if any) is complete.

    Raises:
        what its writing raised (dlrm.atomic.DiskFull, OSError naming the file; many ranks: CheckpointError
            on every rank alike); the previous checkpoint under that name is unchanged.
    """
    pending = _pending.pop(run.run_dir, None)
    if pending is not None:
        pending.wait()


def settle_checkpoint(run: Run) -> None:
    """After a step: once the checkpoint being written in the background (if any) is complete, the training
    gets back the intra-op thread the save took (dlrm.staging.PendingSave.settle). What the writing raised
    waits for `wait_for_checkpoint`, where every rank meets it at the same step."""
    pending = _pending.get(run.run_dir)
    if pending is not None:
        pending.settle()


def save_run_checkpoint(
    run: Run, state: RunState, name: str, links: tuple[Path, ...] = ()
) -> PendingSave | None:
    """checkpoints/`name`: weights, optimizer states, config, table layout, run state, loader position,
    each rank's kernel choices (dlrm.run.kernel_choices); then `links` (checkpoint paths) name the same
    checkpoint. Many ranks: the sharded directory checkpoints/<name without .pt>/ (dlrm.parallel.checkpoint).
    In the background where the device has room for a snapshot and Inductor records no CUDA graphs of its
    own: returns its PendingSave, else None once written."""
    loader = run.train_loader
    meta = {
        "config": run.cfg.to_dict(),
        "table_rows": run.model.sparse_arch.table_rows,
        "loader": loader.state_dict() if isinstance(loader, STATEFUL_LOADERS) else None,
        kernel_choices.KEY: kernel_choices.record(run.strategy),
        **state.checkpointed(),
    }
    path = checkpoint_path(run, name)
    # Inductor records its CUDA graphs at moments the run does not see (a new shape, a failed guard), and a
    # writer's page-locked allocation during a capture fails it (dlrm.staging).
    background = not inductor_cuda_graphs(run.cfg, run.device)
    pending = run.strategy.save_checkpoint(path, run.model, run.optimizer, meta, links, background)
    if pending is not None and yields_core(run.device, run.cfg.train.use_torch_compile):
        pending.yield_core()
    return pending


def yields_core(device: torch.device, compiled: bool) -> bool:
    """Whether the training runs one intra-op thread fewer while a background save writes
    (dlrm.staging.PendingSave.yield_core): where the model trains on a GPU, whose host threads run the
    loader, not the model's numerics. Not on the CPU: torch's reductions split their work by the thread
    count, so a step beside a save would round its sums otherwise than the same step of a run that saved
    elsewhere, and a resumed run would not end bit-identical to an uninterrupted one. Not with `compiled`
    (--use-torch-compile): Dynamo guards on the thread count."""
    return device.type == "cuda" and not compiled


def checkpoint_path(run: Run, name: str) -> Path:
    """Where `save_run_checkpoint(run, state, name)` writes: checkpoints/`name`, a file, or many ranks'
    directory checkpoints/<name without .pt>/."""
    return run.strategy.checkpoint_path(run.run_dir, name)
