"""The training loop: `train(cfg)` sets a run up, loops over epochs and steps, evaluates, checkpoints and
writes metrics.json, top to bottom.

Each run writes into its own directory (default `runs/<name>-<timestamp>/`): config.json (resolved config),
TensorBoard events, a profiler trace `*.pt.trace.json`, checkpoints/last.pt and best.pt, and metrics.json.

The protocol (dlrm.data.splits): the periodic evaluations, early stopping and best.pt see the "val" split
only; when the run ends, however it ends, the selected weights (best.pt's) are evaluated once on "test",
and metrics.json reports both: val_* of the selecting evaluation, test_* of the same weights.

What changes while a run goes on lives in one `RunState`, the steps since the last log line in an
`Interval` (whose sums RunState takes before each checkpoint, so that a resumed run logs the losses of an
uninterrupted one), what is fixed once set up in a `Run` (dlrm.run.state). This module is the loop over them;
`after_step` is the one point after each step where logging, evaluation, periodic checkpoints and stop
signals hook in. The rest is in modules of one job each: dlrm.run.setup (set-up and `--resume`),
dlrm.run.selection (val evaluations, best.pt, early stopping, the test evaluation), dlrm.run.checkpoints
(last.pt and best.pt), dlrm.run.nonfinite (the non-finite guard).

Failures (README "Failures and recovery"): a non-finite loss is found where the interval's losses are read
(each log line, evaluation and checkpoint; no per-step host sync) and stops the run with NonFiniteLoss
(exit 3), last.pt left at the last finite checkpoint; SIGINT / SIGTERM finish the step, write last.pt and
raise Interrupted; device out-of-memory becomes OutOfMemory with the numbers that matter.
"""

import contextlib
import itertools
import json
import math
import resource
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from loguru import logger

from dlrm import parallel
from dlrm.config import RunConfig
from dlrm.data.dataset import Batch
from dlrm.data.loaders import STATEFUL_LOADERS, TrainLoader
from dlrm.errors import Interrupted, RunStopped
from dlrm.graphs import GraphedTrainStep
from dlrm.out_of_memory import out_of_memory
from dlrm.profiling import data_range, make_profiler, traced
from dlrm.run.checkpoints import (
    checkpoint_due_by_steps,
    checkpoint_due_by_time,
    checkpoint_path,
    save_last,
    settle_checkpoint,
)
from dlrm.run.nonfinite import check_finite, nonfinite_stop
from dlrm.run.selection import evaluate_and_select, evaluate_selected
from dlrm.run.setup import RunFinished, set_up, total_steps
from dlrm.run.state import Interval, Run, RunState
from dlrm.run.timing import TimeSpent, describe


def train(
    cfg: RunConfig,
    output_dir: Path | None = None,
    resume: Path | None = None,
    overwrite: bool = False,
    progress: str = "auto",
    kernel_choices: Path | None = None,
) -> dict:
    """Train per `cfg`, writing everything into the run directory; returns the metrics.json contents:
    {"steps", "samples", "train_loss", "val_auc", "val_logloss", "val_ne", "best_step", "test_auc",
    "test_logloss", "test_ne", "samples_per_s", "wall_s", "backend", ...}. "val_*" are those of the best
    val evaluation (its weights saved as checkpoints/best.pt, at "best_step"), "test_*" those of the same
    weights on the test split, evaluated once at the end (null when no val evaluation was finite).
    With `resume` (a checkpoint of a run of the same model config) training goes on from its step: weights,
    optimizer state, best evaluation and the train loader's position are restored (hyperparameters are the
    config's), and the run directory defaults to the checkpoint's. "steps" and "samples" cover the whole run.
    A `resume` of a finished run (its step at train.max_steps, or at the end of train.epochs) in its own
    run directory logs one warning line saying so and returns its metrics.json as it is ({} without one),
    writing nothing; into another `output_dir` it is evaluated and saved there.
    An `output_dir` that already holds a run is refused unless `resume` or `overwrite` (which empties it).
    `progress`: what it shows while it runs, "auto", "bar", "log" or "quiet" (dlrm.progress).
    `kernel_choices`: a checkpoint whose tuned kernel choices the run takes (dlrm.run.kernel_choices);
    None: `resume`'s, else timed as kernels are first launched.

    Under torchrun (dlrm.parallel) every rank runs this same loop on its part of each global batch; rank 0
    writes the run directory's files (checkpoints: every rank, sharded).

    Raises:
        ValueError: bad data directory (one without val and test splits included), config values the data
            contradicts, no CUDA for device "cuda", a checkpoint that does not fit the config, a run
            directory that holds a run or is not writable, or a test split that cannot be read at the end.
        NonFiniteLoss: a NaN or infinite loss with train.on_nonfinite "stop" (metrics.json written).
        Interrupted: SIGINT / SIGTERM (last.pt and metrics.json written).
        OutOfMemory: the device ran out of memory (nothing more written).
    """
    start = time.perf_counter()
    try:
        run, state = set_up(cfg, output_dir, resume, overwrite, progress, kernel_choices)
    except RunFinished as finished:  # a resume with no step left: its one line logged, nothing written
        return finished.metrics
    except torch.OutOfMemoryError as err:
        raise out_of_memory(cfg, err, "during set-up") from None
    state.time_spent = TimeSpent(start)  # set-up so far charged to "setup"
    try:
        with run.signals:  # Ctrl-C during set-up stops at once; from here on, after the step
            train_steps(run, state)
    except torch.OutOfMemoryError as err:
        run.writer.close()
        raise out_of_memory(cfg, err, f"at step {state.step + 1}") from None
    except RunStopped as err:
        finish(run, state, time.perf_counter() - start, stopped=err)
        raise
    return finish(run, state, time.perf_counter() - start)


def train_steps(run: Run, state: RunState) -> None:
    """The loop: epochs, steps, and after each step `after_step`; at the end an evaluation and last.pt.
    Its time is charged to `state.time_spent`'s parts (dlrm.run.timing): "data" while the loader is
    waited for, "step" (or "first_steps") from then until the next batch is asked for; the functions
    it calls charge theirs."""
    t = run.cfg.train
    loader = run.train_loader
    max_steps = total_steps(run.cfg, loader)
    interval = resumed_interval(run, state)
    stop = False
    run.model.train()
    worker = run.strategy.trace_worker
    profiler = make_profiler(run.cfg.profiler, run.run_dir, run.device, run.writer, state.step, worker)
    spent = state.time_spent
    with profiler:
        first_epoch, skip = resume_position(loader, state.step)
        for epoch in range(first_epoch, t.epochs):
            if stop or state.step >= max_steps:
                break
            loader.set_epoch(epoch)
            batches = epoch_batches(loader, skip if epoch == first_epoch else 0)
            while state.step < max_steps and not stop:
                spent.switch("data")
                step_start = spent.since
                with data_range(profiler):
                    batch = next(batches, None)
                if batch is None:
                    break
                spent.switch("step")
                apart_since = drain_before_apart_step(run, state, interval, batch)
                if state.first_step_s is None or apart_since is not None:
                    spent.switch("first_steps")  # until the next batch: compilation, its wait
                # Before the step (and its graph replay), on its stream: device writes, no host sync.
                run.lrs.set(state.step + 1)
                loss = run.step_fn(run.model, run.optimizer, batch)
                in_window = traced(profiler)
                report_s = profiler.step()  # the profiler's own work: its tracer started, stopped, written
                if report_s:
                    spent.move(report_s, "log")
                account_step(run, state, interval, loss, batch, step_start, apart_since, report_s, in_window)
                stop = after_step(run, state, interval, epoch)
            spent.switch("other")
            log_interval(run, state, interval, epoch)
            if not stop and state.last_eval_step != state.step:
                stop = evaluate(run, state, interval)  # end of epoch
    spent.switch("other")
    if state.last_eval is None:  # a resumed run whose loader had no batch left
        evaluate(run, state, interval)
    checkpoint_last(run, state, interval)


def after_step(run: Run, state: RunState, interval: Interval, epoch: int) -> bool:
    """What happens after a step, in this order: a background save that has ended gives its thread back,
    the log line, an evaluation, a stop signal (last.pt, then Interrupted), a periodic checkpoint. True
    when early stopping says stop.

    Many ranks: a signal and a checkpoint by wall time are decided by each rank's clock and handler, so
    they are acted on at log lines only, where the ranks agree on them (one small all-reduce), since the
    sharded checkpoint is a collective that every rank must enter at the same step."""
    t = run.cfg.train
    settle_checkpoint(run)
    at_log_line = state.step % t.log_interval == 0
    if at_log_line:
        log_interval(run, state, interval, epoch)
    stop = False
    if run.eval_every and state.step % run.eval_every == 0:
        stop = evaluate(run, state, interval)
    signum, timed = run.signals.received or 0, checkpoint_due_by_time(run.cfg, state)
    # At log lines many ranks agree (a collective); elsewhere agree() communicates nothing.
    with state.time_spent.part("collectives") if at_log_line else contextlib.nullcontext():
        signum, timed = run.strategy.agree(signum, timed, at_log_line)
    if signum:
        stop_on_signal(run, state, interval, signum)
    if timed or checkpoint_due_by_steps(run.cfg, state):
        checkpoint_last(run, state, interval)
    return stop


def resumed_interval(run: Run, state: RunState) -> Interval:
    """The interval the loop starts with: empty, or where a resumed run's checkpoint was written mid-interval,
    its steps before the checkpoint, read and summed (RunState.interval_*), so that the first log line
    averages the steps an uninterrupted run's does. Sums of another train.log_interval (more steps than
    the current one can hold since its last log line) are dropped."""
    log_every = run.cfg.train.log_interval
    interval = Interval(torch.empty(log_every, device=run.device))
    held = state.interval_steps
    if 0 < held <= state.step % log_every:
        interval.steps = interval.read = held
        interval.finite, interval.loss_sum = state.interval_finite, state.interval_loss_sum
    return interval


def keep_interval(run: Run, state: RunState, interval: Interval) -> None:
    """Read the interval's losses (`check_finite`: NonFiniteLoss as there) and put its sums into `state`,
    whose checkpoint then holds them (RunState.interval_*). Many ranks: the mean over the ranks of their
    sums, so that any number of ranks resumed from it logs the mean of the global batches (a collective:
    every rank calls it at the same step)."""
    check_finite(run, state, interval)
    state.interval_steps, state.interval_finite = interval.steps, interval.finite
    with state.time_spent.part("collectives"):
        state.interval_loss_sum = run.strategy.mean_loss(interval.loss_sum, run.device)


def evaluate(run: Run, state: RunState, interval: Interval) -> bool:
    """A val evaluation (dlrm.run.selection.evaluate_and_select: best.pt, early stopping; True: stop), the
    interval's sums kept first for the best.pt it may write (`keep_interval`). Charged to "eval" (its host
    syncs, collectives, best.pt and logging to theirs)."""
    with state.time_spent.part("eval"):
        keep_interval(run, state, interval)
        return evaluate_and_select(run, state, interval)


def checkpoint_last(run: Run, state: RunState, interval: Interval) -> None:
    """checkpoints/last.pt (dlrm.run.checkpoints.save_last), the interval's sums kept first
    (`keep_interval`). Charged to "checkpoint" (its host syncs and collectives to theirs)."""
    with state.time_spent.part("checkpoint"):
        keep_interval(run, state, interval)
        save_last(run, state, interval)


def resume_position(loader: TrainLoader, step: int) -> tuple[int, int]:
    """(epoch, batches of it to skip) where a run at `step` goes on. The streaming loaders know their place
    (their restored state); the others replay the epoch's deterministic order and skip the batches done."""
    if isinstance(loader, STATEFUL_LOADERS):
        return loader.epoch, 0
    return divmod(step, len(loader))


def epoch_batches(loader: TrainLoader, skip: int) -> Iterator[Batch]:
    """The batches of the loader's current epoch, after the first `skip`."""
    return itertools.islice(iter(loader), skip, None)


def drain_before_apart_step(run: Run, state: RunState, interval: Interval, batch: Batch) -> float | None:
    """Before a step timed apart from throughput other than the process's first, finish the steps before it
    (their losses are read, a host sync) and return the time it starts at, so that `account_step` keeps it
    out of the interval's throughput. Such a step is one-time work of the run: the first step of a batch
    size this process has not trained on yet (an epoch's partial last batch), which compiles and tunes
    kernels for its shape (seconds with --use-triton, as many steps' worth), and a step that warms up or
    captures the CUDA graph of its batch size (dlrm.graphs: launched kernel by kernel, tens of replays'
    worth on many ranks). None for any other step."""
    rows = len(batch.label)
    graph_ready = not isinstance(run.step_fn, GraphedTrainStep) or run.step_fn.replays(rows)
    if state.first_step_s is None or (rows in state.batch_sizes and graph_ready):
        return None
    with state.time_spent.part("device_wait"):
        check_finite(run, state, interval)
        if run.device.type == "cuda":
            torch.cuda.synchronize()
    return time.perf_counter()


def account_step(
    run: Run,
    state: RunState,
    interval: Interval,
    loss: torch.Tensor,
    batch: Batch,
    step_start: float,
    apart_since: float | None = None,
    report_s: float = 0.0,
    in_window: bool = False,
) -> None:
    """Count a finished step: its loss goes into the interval's device buffer (no host sync). The first
    step of the process pays for compilation (Inductor, Triton JIT): it is timed apart and kept out of the
    interval's throughput, and so are the first step of a new batch size and the CUDA graph's warm-up and
    capture steps, which started at `apart_since` (`drain_before_apart_step`), and a step of the profiler's
    window (`in_window`: traced, its kernels slowed by the tracing; waited for on a GPU, so that it ends on
    its own clock); `report_s` (the profiler's own work after the step: its tracer started, stopped, its
    trace written) is kept out of the interval's time."""
    state.step += 1
    parallel.note_progress(state.step)
    rows = len(batch.label)
    samples = rows * run.strategy.world_size  # the global batch
    state.samples += samples
    new_size = rows not in state.batch_sizes
    state.batch_sizes.add(rows)
    run.progress.step()
    interval.losses[interval.steps].copy_(loss.detach())
    interval.steps += 1
    if state.first_step_s is None:
        first_loss = loss.item()  # waits for the step
        state.first_step_s = time.perf_counter() - step_start
        logger.info("first step {:.2f} s (includes compile / kernel JIT), not timed", state.first_step_s)
        if state.train_loss is None and math.isfinite(first_loss):
            state.train_loss = first_loss
        interval.start = time.perf_counter()
        return
    if apart_since is not None:
        if run.device.type == "cuda":
            torch.cuda.synchronize()
        took = time.perf_counter() - apart_since
        interval.start += took
        logger.info(
            "step {}, {} {}: {:.2f} s ({}), not timed",
            state.step,
            "first of batch size" if new_size else "CUDA graph warm-up or capture at batch size",
            rows,
            took,
            "kernels for its shape" if new_size else "launched kernel by kernel",
        )
        return
    if in_window:
        if run.device.type == "cuda":
            with state.time_spent.part("device_wait"):
                torch.cuda.synchronize()
        interval.start += time.perf_counter() - max(step_start, interval.start)
        return
    interval.start += report_s
    interval.timed_steps += 1
    interval.samples += samples


def log_interval(run: Run, state: RunState, interval: Interval, epoch: int) -> None:
    """Log the steps since the last log line (its one host sync: the losses not read yet) and start a new
    interval: the mean loss of its steps, and the throughput of those not timed apart; TensorBoard's
    time/<part>_pct, the shares of the wall time since the last log line (dlrm.run.timing). Raises
    NonFiniteLoss as `note_losses`, and when every step of the interval was skipped (the weights
    themselves are no longer finite). Charged to "log" (the losses' read and mean to theirs)."""
    with state.time_spent.part("log"):
        _log_interval(run, state, interval, epoch)


def _log_interval(run: Run, state: RunState, interval: Interval, epoch: int) -> None:
    if not interval.steps:
        interval.start = time.perf_counter()
        return
    check_finite(run, state, interval)
    if not interval.finite:
        first = state.step - interval.steps + 1
        raise nonfinite_stop(run, state, f"steps {first}-{state.step}: every loss was skipped as non-finite")
    with state.time_spent.part("collectives"):
        state.train_loss = run.strategy.mean_loss(interval.loss_sum / interval.finite, run.device)
    writer = run.writer
    writer.add_scalar("train/loss", state.train_loss, state.step)
    writer.add_scalar("train/lr", run.lrs.lr, state.step)  # the dense lr of the interval's last step
    rate = ""
    if interval.timed_steps:
        elapsed = time.perf_counter() - interval.start
        state.timed_s += elapsed
        state.timed_samples += interval.samples
        state.timed_steps += interval.timed_steps
        samples_per_s = interval.samples / elapsed
        writer.add_scalar("perf/samples_per_s", samples_per_s, state.step)
        rate = f" | {samples_per_s:,.0f} samples/s | {1000 * elapsed / interval.timed_steps:.2f} ms/step"
        run.progress.interval(epoch, state.train_loss, samples_per_s)
    logger.info("epoch {} step {} | loss {:.5f}{}", epoch, state.step, state.train_loss, rate)
    for part, share in state.time_spent.shares().items():
        writer.add_scalar(f"time/{part}_pct", share, state.step)
    interval.steps, interval.timed_steps, interval.samples, interval.start = 0, 0, 0, time.perf_counter()
    interval.read, interval.loss_sum, interval.finite = 0, 0.0, 0


def stop_on_signal(run: Run, state: RunState, interval: Interval, signum: int) -> None:
    """Signal `signum` came (to this rank or another): write last.pt (a finite state only; many ranks: the
    sharded checkpoints/last; none under train.checkpoint_policy "none"), flush TensorBoard, raise
    Interrupted."""
    checkpoint_last(run, state, interval)
    run.writer.flush()
    stopped = f"stopped by {signal.Signals(signum).name} after step {state.step}"
    if run.cfg.train.checkpoint_policy == "none":  # nothing to go on from
        raise Interrupted(f"{stopped}; train.checkpoint_policy 'none' wrote no checkpoint", 128 + signum)
    checkpoint = checkpoint_path(run, "last.pt")
    raise Interrupted(f"{stopped}; {checkpoint} written", exit_code=128 + signum, checkpoint=checkpoint)


def finish(run: Run, state: RunState, wall_s: float, stopped: RunStopped | None = None) -> dict:
    """Write metrics.json (strict JSON: null for what is undefined), close the writer; return the metrics.
    `stopped`: why the run ended early, recorded as "stopped". First the selected weights are evaluated
    on the test split (`evaluate_selected`), whatever stopped the run."""
    spent = state.time_spent
    spent.switch("other")
    with spent.part("eval"):
        test = evaluate_selected(run, state) or {}
    with spent.part("log"):
        run.progress.close()
    cfg, best, last_eval = run.cfg, state.best or {}, state.last_eval or {}
    ms_per_step = 1000 * state.timed_s / state.timed_steps if state.timed_steps else None
    per_rank = run.strategy.per_rank(ms_per_step)
    time_per_rank = run.strategy.per_rank(spent.breakdown())  # up to here: the test evaluation included
    metrics = {
        "steps": state.step,
        "samples": state.samples,
        "train_loss": state.train_loss,
        # Selected on val; test is of the same weights, read once (dlrm.data.splits).
        "val_auc": best.get("auc"),
        "val_logloss": best.get("logloss"),
        "val_ne": best.get("ne"),
        "best_step": best.get("step"),
        "test_auc": test.get("auc"),
        "test_logloss": test.get("logloss"),
        "test_ne": test.get("ne"),
        "val_samples": best.get("samples"),
        "test_samples": test.get("samples"),
        "last_val_auc": last_eval.get("auc"),
        "skipped_batches": state.skipped_batches,
        "samples_per_s": state.timed_samples / state.timed_s if state.timed_s else None,
        "first_step_s": state.first_step_s,
        "evals": state.evals,
        "eval_s": state.eval_s,
        "first_eval_s": state.first_eval_s,
        "wall_s": wall_s,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "backend": cfg.backend,
        "mlp_kernel": cfg.mlp_kernel,
        "sparse_kernel": cfg.sparse_kernel,
        "device": str(run.device),
        "world_size": run.strategy.world_size,
        # Each rank's mean ms per training step (first step and evaluations excluded): the spread.
        "step_ms_min": min(per_rank) if None not in per_rank else None,
        "step_ms_max": max(per_rank) if None not in per_rank else None,
        "stopped": None if stopped is None else type(stopped).__name__,
        "nonfinite_step": state.nonfinite_step,
        # Where the wall time went, by part (dlrm.run.timing): this process's, and every rank's in rank order.
        "time": time_per_rank[run.strategy.rank],
        "time_per_rank": time_per_rank,
    }
    metrics = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}
    logger.info(describe(time_per_rank))
    run.strategy.write_text(run.run_dir / "metrics.json", json.dumps(metrics, indent=2, allow_nan=False))
    run.writer.close()
    if stopped is None:
        logger.info(
            "done: {} steps, best val auc {} ne {} at step {}, test auc {} ne {}, metrics in {}",
            state.step,
            *(_number(metrics[key]) for key in ("val_auc", "val_ne")),
            metrics["best_step"],
            *(_number(metrics[key]) for key in ("test_auc", "test_ne")),
            run.run_dir / "metrics.json",
        )
    return metrics


def _number(value: float | None) -> str:
    return "none" if value is None else f"{value:.4f}"
