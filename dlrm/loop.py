"""The training loop: `train(cfg)` sets a run up, loops over epochs and steps, evaluates, checkpoints and
writes metrics.json, top to bottom.

Each run writes into its own directory (default `runs/<name>-<timestamp>/`): config.json (resolved config),
TensorBoard events, a profiler trace `*.pt.trace.json`, checkpoints/last.pt and best.pt, and metrics.json.

The protocol (dlrm.data.splits): the periodic evaluations, early stopping and best.pt see the "val" split
only; when the run ends, however it ends, the selected weights (best.pt's) are evaluated once on "test",
and metrics.json reports both: val_* of the selecting evaluation, test_* of the same weights.

What changes while a run goes on lives in one `RunState` (step, samples, best evaluation, throughput
sums), which checkpoints save and `--resume` restores; the steps since the last log line live in an
`Interval`. What is fixed once set up (model, optimizer, step, loaders, writer) is a `Run`. Logging,
evaluation and checkpointing are plain functions of those; `after_step` is the one point after each step
where they, periodic checkpoints and stop signals hook in.

Failures (README "Failures and recovery"): a non-finite loss is found where the interval's losses are read
(each log line, evaluation and checkpoint; no per-step host sync) and stops the run with NonFiniteLoss
(exit 3), last.pt left at the last finite checkpoint; SIGINT / SIGTERM finish the step, write last.pt and
raise Interrupted; device out-of-memory becomes OutOfMemory with the numbers that matter.
"""

import itertools
import json
import math
import os
import resource
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from loguru import logger
from torch.utils.tensorboard import SummaryWriter

from dlrm import parallel
from dlrm.checkpoint import load_checkpoint, save_checkpoint
from dlrm.config import RunConfig
from dlrm.data.dataset import Batch, BatchLoader, ParquetDataset, load_metadata, open_split, split_paths
from dlrm.data.loaders import STATEFUL_LOADERS, TrainLoader, make_train_loader
from dlrm.data.resident import ResidentLoader
from dlrm.data.schema import NUM_SPARSE
from dlrm.data.splits import REPORT, SELECT, require_val_test
from dlrm.errors import Interrupted, NonFiniteLoss, RunStopped
from dlrm.lr_schedule import LearningRates, lr_factor
from dlrm.metrics import evaluate
from dlrm.model import DLRM, Model, build_model
from dlrm.out_of_memory import out_of_memory
from dlrm.parallel import checkpoint as sharded_checkpoint
from dlrm.parallel import run as ranks
from dlrm.parallel.evaluation import ShardedEvalSplit, evaluate_sharded
from dlrm.parallel.sharded import build_sharded_model
from dlrm.profiling import data_range, make_profiler
from dlrm.progress import TrainProgress
from dlrm.run_dir import check_run_dir, make_run_dir, wait_past_event_files, write_text_atomically
from dlrm.signals import StopSignals
from dlrm.step import (
    StepFn,
    build_step,
    make_optimizer,
    resolve_cuda_graphs,
    set_precision,
    use_interpreter_on_cpu,
)


@dataclass
class RunState:
    """What changes during a run; saved in every checkpoint, restored by `--resume`.

    step: optimization steps done. samples: train samples of those steps, over the whole run (resumes
    included). best: the best val evaluation so far ({"auc", "logloss", "ne", "samples", "step"}), None
    before the first finite one. evals_since_best: for early stopping. skipped_batches: steps whose
    non-finite loss was skipped (train.on_nonfinite "skip_batch"). last_finite_loss: (step, loss) of the
    last finite step loss read. train_loss: the last log line's mean loss (None before one). The rest are
    this process's: throughput sums, the last evaluation, when last.pt was written, where best's weights
    are.
    """

    step: int = 0
    samples: int = 0
    best: dict | None = None
    evals_since_best: int = 0
    skipped_batches: int = 0
    last_finite_loss: tuple[int, float] | None = None
    train_loss: float | None = None
    last_eval: dict | None = None
    last_eval_step: int | None = None
    first_step_s: float | None = None  # this process's first step, compilation included
    # Training throughput of this process: the first step (compilation) and evaluations excluded.
    timed_s: float = 0.0
    timed_samples: int = 0
    timed_steps: int = 0
    evals: int = 0  # evaluations of this process
    eval_s: float = 0.0  # their time, in all (best.pt's writes not included)
    first_eval_s: float | None = None  # the first's, which pays for the eval shapes' JIT and tuning
    last_checkpoint_step: int | None = None  # the step checkpoints/last.pt holds, when known
    last_checkpoint_time: float = field(default_factory=time.monotonic)
    last_checkpoint_state: dict | None = None  # checkpointed() as last.pt holds it
    # The checkpoint that holds `best`'s weights: this run's best.pt once it writes one; a resumed run's
    # until then is the one beside the checkpoint it resumed from (another run directory, maybe).
    best_checkpoint: Path | None = None

    def checkpointed(self) -> dict[str, Any]:
        """The fields a resumed run goes on from."""
        keys = (
            "step",
            "samples",
            "best",
            "evals_since_best",
            "skipped_batches",
            "last_finite_loss",
            "train_loss",
        )
        return {key: getattr(self, key) for key in keys}


@dataclass
class Interval:
    """The steps since the last log line. Their losses are copied into the device buffer `losses` (one
    slot per step, no host sync) and read at the log line, or earlier where an evaluation or checkpoint
    needs to know they are finite (`read` of them already checked)."""

    losses: torch.Tensor
    steps: int = 0
    samples: int = 0
    read: int = 0
    loss_sum: float = 0.0  # of the finite losses read
    finite: int = 0
    start: float = field(default_factory=time.perf_counter)


@dataclass
class Run:
    """What a run is set up with, fixed until it ends."""

    cfg: RunConfig
    device: torch.device
    model: Model
    optimizer: torch.optim.Optimizer
    step_fn: StepFn
    train_loader: TrainLoader
    val_loader: BatchLoader | ShardedEvalSplit  # many ranks: each scores its part of the split
    run_dir: Path
    writer: SummaryWriter | ranks.NullWriter
    signals: StopSignals
    lrs: LearningRates  # train.lr_schedule: set before each step
    progress: TrainProgress = field(default_factory=lambda: TrainProgress("log", 0))
    dist: parallel.Dist = parallel.SINGLE  # this process's rank; SINGLE without torchrun


def train(
    cfg: RunConfig,
    output_dir: Path | None = None,
    resume: Path | None = None,
    overwrite: bool = False,
    progress: str = "auto",
) -> dict:
    """Train per `cfg`, writing everything into the run directory; returns the metrics.json contents:
    {"steps", "samples", "train_loss", "val_auc", "val_logloss", "val_ne", "best_step", "test_auc",
    "test_logloss", "test_ne", "samples_per_s", "wall_s", "backend", ...}. "val_*" are those of the best
    val evaluation (its weights saved as checkpoints/best.pt, at "best_step"), "test_*" those of the same
    weights on the test split, evaluated once at the end (null when no val evaluation was finite).
    With `resume` (a checkpoint of a run of the same model config) training goes on from its step: weights,
    optimizer state, best evaluation and the train loader's position are restored (hyperparameters are the
    config's), and the run directory defaults to the checkpoint's. "steps" and "samples" cover the whole run.
    An `output_dir` that already holds a run is refused unless `resume` or `overwrite` (which empties it).
    `progress`: what it shows while it runs, "auto", "bar", "log" or "quiet" (dlrm.progress).

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
        run, state = set_up(cfg, output_dir, resume, overwrite, progress)
    except torch.OutOfMemoryError as err:
        raise out_of_memory(cfg, err, "during set-up") from None
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
    """The loop: epochs, steps, and after each step `after_step`; at the end an evaluation and last.pt."""
    t = run.cfg.train
    loader = run.train_loader
    max_steps = t.max_steps or t.epochs * len(loader)
    interval = Interval(torch.empty(t.log_interval, device=run.device))
    stop = False
    run.model.train()
    worker = f"rank{run.dist.rank}" if run.dist.enabled else None  # one trace per rank
    profiler = make_profiler(run.cfg.profiler, run.run_dir, run.device, run.writer, state.step, worker)
    with profiler:
        first_epoch, skip = resume_position(loader, state.step)
        for epoch in range(first_epoch, t.epochs):
            if stop or state.step >= max_steps:
                break
            loader.set_epoch(epoch)
            batches = epoch_batches(loader, skip if epoch == first_epoch else 0)
            while state.step < max_steps and not stop:
                step_start = time.perf_counter()
                with data_range(profiler):
                    batch = next(batches, None)
                if batch is None:
                    break
                # Before the step (and its graph replay), on its stream: device writes, no host sync.
                run.lrs.set(state.step + 1)
                loss = run.step_fn(run.model, run.optimizer, batch)
                profiler.step()
                account_step(run, state, interval, loss, batch, step_start)
                stop = after_step(run, state, interval, epoch)
            log_interval(run, state, interval, epoch)
            if not stop and state.last_eval_step != state.step:
                stop = evaluate_and_select(run, state, interval)  # end of epoch
    if state.last_eval is None:  # a resumed run that had no step left to train
        evaluate_and_select(run, state, interval)
    save_last(run, state, interval)


def after_step(run: Run, state: RunState, interval: Interval, epoch: int) -> bool:
    """What happens after a step, in this order: the log line, an evaluation, a stop signal (last.pt, then
    Interrupted), a periodic checkpoint. True when early stopping says stop.

    Many ranks: a signal and a checkpoint by wall time are decided by each rank's clock and handler, so
    they are acted on at log lines only, where the ranks agree on them (one small all-reduce), since the
    sharded checkpoint is a collective that every rank must enter at the same step."""
    t = run.cfg.train
    at_log_line = state.step % t.log_interval == 0
    if at_log_line:
        log_interval(run, state, interval, epoch)
    stop = False
    if t.eval_interval and state.step % t.eval_interval == 0:
        stop = evaluate_and_select(run, state, interval)
    signalled, timed = run.signals.received is not None, checkpoint_due_by_time(run.cfg, state)
    if run.dist.enabled:
        signalled, timed = ranks.any_rank([signalled, timed]) if at_log_line else (False, False)
    if signalled:
        stop_on_signal(run, state, interval)
    if timed or checkpoint_due_by_steps(run.cfg, state):
        save_last(run, state, interval)
    return stop


def set_up(
    cfg: RunConfig,
    output_dir: Path | None,
    resume: Path | None,
    overwrite: bool = False,
    progress: str = "auto",
) -> tuple[Run, RunState]:
    """Data, model, optimizer, step, loaders, run directory, TensorBoard writer and progress bar of a run,
    and its state (restored from `resume` when given). Under torchrun: the process group, the sharded
    tables and rank-aware loaders. The run directory is checked first and written only once all else is
    set up. Raises ValueError as `train`."""
    t = cfg.train
    _, world_size, _ = parallel.world_from_env()
    if world_size > 1:  # config / world-size mismatches: one-line errors before the process group
        ranks.check_world(cfg, world_size)
    dist, device = parallel.init_distributed(t.device, cfg.parallel.timeout_s)  # single process: no-op
    cfg = resolve_cuda_graphs(cfg, device, dist.world_size)
    t = cfg.train
    run_dir = output_dir if output_dir or resume is None else resume.parent.parent
    if dist.is_main:
        run_dir = check_run_dir(cfg, run_dir, resume, overwrite)
    if dist.enabled:
        run_dir = ranks.same_path(run_dir)
    use_interpreter_on_cpu(cfg, device)
    set_precision(t.precision)
    torch.manual_seed(t.seed)
    data_dir = Path(cfg.data.path)
    logger.info("reading {} ({} loader)", data_dir, cfg.data.loader)
    metadata = load_metadata(data_dir)
    require_val_test(data_dir, metadata)  # an older train / eval directory would select on what it reports
    # The streaming loaders never hold the train split; config validation then requires modulus hashing,
    # which needs no train ids.
    streams = cfg.data.loader in ("streaming", "binary")
    train_set = None if streams else open_split(data_dir, "train")
    val_set = open_split(data_dir, SELECT)
    check_rows(data_dir, metadata, SELECT, val_set.num_rows)
    check_test_split(data_dir, metadata)  # read only at the end: checked now, not after hours of training
    train_ids = torch.empty(0, NUM_SPARSE, dtype=torch.int64) if train_set is None else train_set.sparse
    kernels = {"mlp_kernel": cfg.mlp_kernel, "sparse_kernel": cfg.sparse_kernel}
    logger.info("building the model ({} backend) on {}", cfg.backend, device)
    if dist.enabled:  # tables sharded over the ranks, the dense part replicated
        model, plan = build_sharded_model(cfg, metadata, train_ids, dist.rank, dist.world_size, device)
    else:
        model = build_model(cfg.model, metadata, train_ids, **kernels).to(device)
    optimizer = make_optimizer(model, cfg)
    lrs = LearningRates(t, optimizer, model.table_archs())  # the base rates: make_optimizer's, the config's
    state = RunState()
    checkpoint = load_resumable(resume, cfg, model, optimizer, dist) if resume is not None else {}
    for key, value in checkpoint.items():
        if key in RunState.__dataclass_fields__:
            setattr(state, key, value)
    if resume is not None:
        state.best_checkpoint = resume.parent / ("best" if resume.is_dir() else "best.pt")
    reduce_grads = parallel.grad_averager(model.dense_parameters(), dist.world_size) if dist.enabled else None
    step_fn = build_step(model, optimizer, cfg, device, reduce_grads)
    train_loader = make_train_loader(
        cfg.data, data_dir, t.seed, device, train_set, dist.rank, dist.world_size
    )
    if len(train_loader) == 0:
        raise ValueError(
            f"data.batch_size: {cfg.data.batch_size} leaves no batch of {train_loader.num_rows} train rows"
        )
    check_rows(data_dir, metadata, "train", train_loader.num_rows)
    if checkpoint.get("loader") is not None:
        train_loader.load_state_dict(checkpoint["loader"])
    val_loader = make_split_loader(val_set, cfg, device, dist)

    make_run_dir(run_dir, overwrite and resume is None and dist.is_main)
    if resume is not None and resume.resolve() == (run_dir / "checkpoints" / "last.pt").resolve():
        state.last_checkpoint_step = state.step
    config_json = json.dumps(cfg.to_dict(), indent=2)
    if dist.is_main:
        (run_dir / "config.json").write_text(config_json)
    if dist.enabled:
        logger.info("{} ranks; embedding tables:\n{}", dist.world_size, plan.describe())
        if dist.is_main:
            (run_dir / "sharding_plan.json").write_text(json.dumps(plan.to_dict(), indent=2))
    logger.info(
        "run {} | backend {} | device {} | train {} rows, val {} rows | {} params",
        run_dir,
        cfg.backend,
        device,
        train_loader.num_rows,
        val_set.num_rows,
        sum(p.numel() for p in model.parameters()),
    )
    # A resumed run's events continue the step axis: TensorBoard drops the earlier events past its step
    # (logged after the checkpoint by the run that was stopped), so no step appears twice.
    purge_step = state.step + 1 if resume is not None else None
    if resume is not None and dist.is_main:
        wait_past_event_files(run_dir)
    writer = SummaryWriter(str(run_dir), purge_step=purge_step) if dist.is_main else ranks.NullWriter()
    writer.add_text("config", "```json\n" + config_json + "\n```")
    run = Run(
        cfg,
        device,
        model,
        optimizer,
        step_fn,
        train_loader,
        val_loader,
        run_dir,
        writer,
        StopSignals(),
        lrs,
        dist=dist,
    )
    run.progress = TrainProgress(progress, t.max_steps or t.epochs * len(train_loader), state.step)
    return run, state


def make_split_loader(
    dataset: ParquetDataset, cfg: RunConfig, device: torch.device, dist: parallel.Dist
) -> BatchLoader | ShardedEvalSplit:
    """How an evaluation reads `dataset` (val or test) in batches of data.eval_batch_size: one process's
    loader (`make_eval_loader`), or under torchrun this rank's part of it (dlrm.parallel.evaluation)."""
    if dist.enabled:
        return ShardedEvalSplit(dataset, cfg.data.eval_batch_size, dist)
    return make_eval_loader(dataset, cfg.data.eval_batch_size, device)


def make_eval_loader(eval_set: ParquetDataset, batch_size: int, device: torch.device) -> BatchLoader:
    """The eval split on the GPU once when it fits (no host copy per batch: evaluation runs at the speed
    of the forward), else in host memory."""
    if device.type == "cuda":
        try:
            return ResidentLoader(eval_set, batch_size, device=device)
        except ValueError as err:
            logger.info("eval split stays in host memory: {}", err)
    return BatchLoader(eval_set, batch_size, device=device)


def check_rows(data_dir: Path, metadata: dict, split: str, rows: int) -> None:
    """Raise ValueError when `split` has no rows, or other row counts than metadata.json says."""
    expected = metadata.get("rows", {}).get(split)
    if expected is not None and expected != rows:
        raise ValueError(
            f"{data_dir}/metadata.json: split {split!r} has {expected} rows, its parquet files hold {rows} "
            "(files changed since preprocessing? preprocess again)"
        )
    if rows == 0:
        raise ValueError(f"{data_dir}: split {split!r} has no rows")


def check_test_split(data_dir: Path, metadata: dict) -> None:
    """Raise ValueError when the test split has no rows or a shard of it is missing (it is read only once
    training ends; see `evaluate_selected`)."""
    missing = [str(p) for p in split_paths(data_dir, REPORT) if not p.is_file()]  # ValueError: no files
    if missing:
        raise ValueError(f"{data_dir}: shards of split {REPORT!r} are missing: {', '.join(missing)}")
    if metadata.get("rows", {}).get(REPORT) == 0:  # shards of bad lines only
        raise ValueError(f"{data_dir}: split {REPORT!r} has no rows")


def load_resumable(
    path: Path,
    cfg: RunConfig,
    model: Model,
    optimizer: torch.optim.Optimizer,
    dist: parallel.Dist = parallel.SINGLE,
) -> dict:
    """Load checkpoint `path` into `model` and `optimizer`; return it (step, best, loader position, ...).
    `path` is a .pt file of one process or a sharded checkpoint directory of many (dlrm.parallel.checkpoint),
    loaded on any number of ranks.

    Raises:
        ValueError: the file is not a checkpoint, or was trained with another model config or optimizer.
    """
    sharded = dist.enabled and path.is_dir()  # read by every rank, each its own rows
    state = sharded_checkpoint.read_meta(path) if sharded else load_checkpoint(path)
    ours, theirs = cfg.to_dict(), state["config"]
    for section, key in [("model", k) for k in ours["model"]] + [("train", "optimizer"), ("data", "loader")]:
        if theirs[section].get(key) != ours[section][key]:
            raise ValueError(
                f"{path}: trained with {section}.{key} = {theirs[section].get(key)!r}, "
                f"the config has {ours[section][key]!r}"
            )
    # The config's hyperparameters win over the checkpoint's (the optimizer's state restores those too).
    ours = [{k: group[k] for k in ("lr", "weight_decay")} for group in optimizer.param_groups]
    if sharded:
        sharded_checkpoint.load_sharded(path, model, optimizer, dist)
    elif dist.enabled:  # a one-process .pt: each rank takes its rows
        sharded_checkpoint.load_full_into_sharded(state, model, optimizer)
    else:
        model.load_state_dict(state["model"])
        if state["optimizer"] is None:  # a sharded checkpoint read whole: optimizer state by parameter name
            sharded_checkpoint.load_optimizer_by_name(
                model, optimizer, state["optimizer_by_name"], state["step"]
            )
        else:
            optimizer.load_state_dict(state["optimizer"])
        for key, tensor in fused_optimizer_states(model).items():
            if tensor is not None and state.get(key) is not None:
                tensor.copy_(state[key])
    # torch.optim.Adagrad's groups hold the scheduled rate of the checkpoint's step (dlrm.lr_schedule), the
    # base rate times the factor: compare base rates. (dlrm.optim.SGD's hold the base rate.)
    scheduled = isinstance(optimizer, torch.optim.Adagrad) and state["step"] > 0
    factor = lr_factor(cfg.train.lr_schedule, state["step"]) if scheduled else 1.0
    for group, values in zip(optimizer.param_groups, ours, strict=True):
        for key, value in values.items():
            held = group[key] / factor if key == "lr" and factor else group[key]
            if not math.isclose(held, value, rel_tol=1e-9):
                logger.info("resuming with the config's {} {} (the checkpoint had {:.6g})", key, value, held)
            group[key] = value
    logger.info("resuming from {} at step {}", path, state["step"])
    return state


def resume_position(loader: TrainLoader, step: int) -> tuple[int, int]:
    """(epoch, batches of it to skip) where a run at `step` goes on. The streaming loaders know their place
    (their restored state); the others replay the epoch's deterministic order and skip the batches done."""
    if isinstance(loader, STATEFUL_LOADERS):
        return loader.epoch, 0
    return divmod(step, len(loader))


def epoch_batches(loader: TrainLoader, skip: int) -> Iterator[Batch]:
    """The batches of the loader's current epoch, after the first `skip`."""
    return itertools.islice(iter(loader), skip, None)


def account_step(
    run: Run, state: RunState, interval: Interval, loss: torch.Tensor, batch: Batch, step_start: float
) -> None:
    """Count a finished step. The first step of the process pays for compilation (Inductor, Triton JIT):
    it is timed apart and kept out of the interval's throughput. Other steps' losses go into the
    interval's device buffer (no host sync)."""
    state.step += 1
    parallel.note_progress(state.step)
    samples = batch.label.numel() * run.dist.world_size  # the global batch
    state.samples += samples
    run.progress.step()
    if state.first_step_s is None:
        if run.device.type == "cuda":
            torch.cuda.synchronize()
        state.first_step_s = time.perf_counter() - step_start
        logger.info("first step {:.2f} s (includes compile / kernel JIT)", state.first_step_s)
        note_losses(run, state, [loss.item()], state.step)
        if state.train_loss is None and math.isfinite(loss.item()):
            state.train_loss = loss.item()
        interval.start = time.perf_counter()
        return
    interval.losses[interval.steps].copy_(loss.detach())
    interval.steps += 1
    interval.samples += samples


def check_finite(run: Run, state: RunState, interval: Interval) -> None:
    """Read the interval's losses not read yet (one host sync) and note them (see `note_losses`)."""
    if interval.read == interval.steps:
        return
    losses = interval.losses[interval.read : interval.steps].tolist()
    first = state.step - interval.steps + interval.read + 1
    interval.read = interval.steps
    finite = [x for x in losses if math.isfinite(x)]
    interval.loss_sum += sum(finite)
    interval.finite += len(finite)
    note_losses(run, state, losses, first)


def note_losses(run: Run, state: RunState, losses: list[float], first_step: int) -> None:
    """Steps `first_step`, ... had `losses`: keep the last finite one; on a non-finite one raise
    NonFiniteLoss (train.on_nonfinite "stop") or count it as skipped ("skip_batch": its update was not
    applied, on the device)."""
    for step, loss in enumerate(losses, first_step):
        if math.isfinite(loss):
            state.last_finite_loss = (step, loss)
        elif run.cfg.train.on_nonfinite == "skip_batch":
            state.skipped_batches += 1
            logger.warning("step {}: loss {}, batch skipped (train.on_nonfinite skip_batch)", step, loss)
        else:
            raise nonfinite_stop(run, state, f"step {step}: the training loss is {loss}")


def nonfinite_stop(run: Run, state: RunState, what: str) -> NonFiniteLoss:
    """The NonFiniteLoss that stops the run: what happened, the last finite loss, what last.pt holds."""
    last = state.last_finite_loss
    last_text = f"last finite loss {last[1]:.6g} at step {last[0]}" if last else "no finite loss before it"
    last_pt = run.run_dir / "checkpoints" / "last.pt"
    kept = (
        f"{last_pt} holds step {state.last_checkpoint_step}, the last finite state"
        if state.last_checkpoint_step is not None
        else "no last.pt was written before it"
    )
    hint = "" if run.cfg.train.on_nonfinite == "skip_batch" else ', or set train.on_nonfinite "skip_batch"'
    return NonFiniteLoss(f"{what} ({last_text}); stopped, {kept}. Lower train.lr{hint}")


def log_interval(run: Run, state: RunState, interval: Interval, epoch: int) -> None:
    """Log the steps since the last log line (its one host sync: the losses not read yet) and start a new
    interval. Raises NonFiniteLoss as `note_losses`, and when every step of the interval was skipped (the
    weights themselves are no longer finite)."""
    if not interval.steps:
        return
    check_finite(run, state, interval)
    if not interval.finite:
        first = state.step - interval.steps + 1
        raise nonfinite_stop(run, state, f"steps {first}-{state.step}: every loss was skipped as non-finite")
    state.train_loss = interval.loss_sum / interval.finite
    if run.dist.enabled:  # the mean of the ranks' means: the global batch's mean loss
        local = torch.tensor(state.train_loss, device=run.device)
        state.train_loss = ranks.mean_over_ranks(local).item()
    elapsed = time.perf_counter() - interval.start
    state.timed_s += elapsed
    state.timed_samples += interval.samples
    state.timed_steps += interval.steps
    writer = run.writer
    writer.add_scalar("train/loss", state.train_loss, state.step)
    writer.add_scalar("perf/samples_per_s", interval.samples / elapsed, state.step)
    writer.add_scalar("train/lr", run.lrs.lr, state.step)  # the dense lr of the interval's last step
    logger.info(
        "epoch {} step {} | loss {:.5f} | {:,.0f} samples/s | {:.2f} ms/step",
        epoch,
        state.step,
        state.train_loss,
        interval.samples / elapsed,
        1000 * elapsed / interval.steps,
    )
    run.progress.interval(epoch, state.train_loss, interval.samples / elapsed)
    interval.steps, interval.samples, interval.start = 0, 0, time.perf_counter()
    interval.read, interval.loss_sum, interval.finite = 0, 0.0, 0


def evaluate_split(run: Run, loader: BatchLoader | ShardedEvalSplit, split: str) -> dict[str, float]:
    """{"auc", "logloss", "ne", "samples"} of the current weights on `split`, read through `loader`
    (`make_split_loader`). Many ranks: every rank must call it (collectives); each scores its part and
    all get the metrics of the whole split. Raises ValueError as dlrm.metrics.evaluate."""
    if run.dist.enabled:
        return evaluate_sharded(run.model, loader, run.device)
    batches = run.progress.eval_batches(loader, split)
    return evaluate(run.model, batches, run.device, run.cfg.train.precision)


def evaluate_and_select(run: Run, state: RunState, interval: Interval) -> bool:
    """Evaluate on the val split, log it, keep the best as checkpoints/best.pt; True when early stopping
    says stop. The evaluation's and the checkpoint's time are kept out of the interval's throughput. The
    losses since the last log line are checked first (NonFiniteLoss), and a non-finite evaluation never
    becomes best. The test split is never read here (see `evaluate_selected`)."""
    check_finite(run, state, interval)
    eval_start = time.perf_counter()
    result = evaluate_split(run, run.val_loader, SELECT)
    # The evaluation alone (its result is on the host, so its GPU work is done); best.pt's write is apart.
    eval_time = time.perf_counter() - eval_start
    state.evals += 1
    state.eval_s += eval_time
    state.first_eval_s = eval_time if state.first_eval_s is None else state.first_eval_s
    state.last_eval, state.last_eval_step = result, state.step
    for key in ("auc", "logloss", "ne"):
        run.writer.add_scalar(f"{SELECT}/{key}", result[key], state.step)
    logger.info(
        "step {} | val auc {:.4f} logloss {:.4f} ne {:.4f} | {:.2f} s",
        state.step,
        result["auc"],
        result["logloss"],
        result["ne"],
        eval_time,
    )
    # AUC can look finite (a rank statistic) on NaN logits: the logloss and the weights tell.
    finite = all(math.isfinite(result[key]) for key in ("auc", "logloss", "ne")) and weights_finite(run.model)
    if not finite:
        logger.warning("step {}: the evaluation is not finite; not a candidate for best.pt", state.step)
    if finite and (state.best is None or result["auc"] > state.best["auc"]):
        state.best, state.evals_since_best = {**result, "step": state.step}, 0
        save_run_checkpoint(run, state, "best.pt")
        state.best_checkpoint = best_checkpoint_path(run)
    else:
        state.evals_since_best += 1
    interval.start += time.perf_counter() - eval_start
    patience = run.cfg.train.patience
    if patience is not None and state.evals_since_best >= patience:
        logger.info("early stop: no better val AUC in {} evaluations", patience)
        return True
    return False


def evaluate_selected(run: Run, state: RunState) -> dict | None:
    """Evaluate the selected weights, best.pt's (the best val evaluation), once on the test split; log it
    and write test/auc, test/logloss, test/ne at the best step. The current weights when they are those
    (no step since the best evaluation), else best.pt's model state loaded into the model (training is
    over). Many ranks: every rank calls it; the same path as the val evaluation.

    Returns:
        {"auc", "logloss", "ne", "samples"}, or None when no val evaluation was finite (no best.pt) or the
        checkpoint with the best weights is gone or holds another step (a warning says which).
    Raises:
        ValueError: the test split cannot be read, or is of one class only (dlrm.metrics.evaluate).
    """
    if state.best is None:
        logger.warning("no finite val evaluation, so no best.pt: no test evaluation")
        return None
    best_step = state.best["step"]
    if state.step != best_step and not load_best_weights(run, state):
        return None
    data_dir = Path(run.cfg.data.path)
    test_set = open_split(data_dir, REPORT)
    check_rows(data_dir, load_metadata(data_dir), REPORT, test_set.num_rows)
    start = time.perf_counter()
    result = evaluate_split(run, make_split_loader(test_set, run.cfg, run.device, run.dist), REPORT)
    for key in ("auc", "logloss", "ne"):
        run.writer.add_scalar(f"{REPORT}/{key}", result[key], best_step)
    logger.info(
        "test (weights of step {}, selected on val) | auc {:.4f} logloss {:.4f} ne {:.4f} | {:.2f} s",
        best_step,
        result["auc"],
        result["logloss"],
        result["ne"],
        time.perf_counter() - start,
    )
    return result


def load_best_weights(run: Run, state: RunState) -> bool:
    """Load the model weights of `state.best_checkpoint` (this run's best.pt, or the resumed run's) into
    the model, through the path a resume takes (a sharded checkpoint on many ranks: a collective; its
    optimizer state comes along, unused). False, with a warning, when it is missing or holds another
    step than `state.best` (a resumed run's directory whose best.pt moved on)."""
    path, step = state.best_checkpoint, state.best["step"]
    if path is None or not path.exists():
        logger.warning("{}: not found, so the weights of step {} are gone: no test evaluation", path, step)
        return False
    sharded = run.dist.enabled and path.is_dir()
    checkpoint = sharded_checkpoint.read_meta(path) if sharded else load_checkpoint(path)
    held = (checkpoint.get("best") or {}).get("step")
    if held != step:
        logger.warning("{} holds the best of step {}, not of step {}: no test evaluation", path, held, step)
        return False
    if sharded:
        sharded_checkpoint.load_sharded(path, run.model, run.optimizer, run.dist)
    elif run.dist.enabled:  # a one-process best.pt of the run resumed from: each rank takes its rows
        sharded_checkpoint.load_full_into_sharded(checkpoint, run.model, run.optimizer)
    else:
        run.model.load_state_dict(checkpoint["model"])
    logger.info("loaded the weights of step {} from {} for the test evaluation", step, path)
    return True


def best_checkpoint_path(run: Run) -> Path:
    """Where `save_run_checkpoint(run, state, "best.pt")` writes: a file, or many ranks' directory."""
    return run.run_dir / "checkpoints" / ("best" if run.dist.enabled else "best.pt")


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
    last, keep = directory / ("last" if run.dist.enabled else "last.pt"), run.cfg.train.keep_last
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


def weights_finite(model: Model) -> bool:
    """Whether every parameter is finite (one sum per parameter, one host sync)."""
    sums = [p.detach().sum(dtype=torch.float32) for p in model.parameters()]
    return bool(torch.isfinite(torch.stack(sums)).all()) if sums else True


def fused_optimizer_states(model: Model) -> dict[str, torch.Tensor | None]:
    """The optimizer state of the "triton" tables, which lives beside them, not in the torch optimizer (None
    for kernel "torch"), by checkpoint key: "embedding_optimizer_state" for `model.sparse_arch` (a logistic
    model's first-order tables), "first_order_optimizer_state" for a DLRM's first-order tables."""
    archs = {"embedding_optimizer_state": model.sparse_arch}
    if isinstance(model, DLRM) and model.first_order is not None:
        archs["first_order_optimizer_state"] = model.first_order.tables
    return {key: a.optimizer_state if a.kernel == "triton" else None for key, a in archs.items()}


def save_run_checkpoint(run: Run, state: RunState, name: str) -> None:
    """checkpoints/`name`: weights, optimizer states, config, table layout, run state, loader position.
    Many ranks: the sharded directory checkpoints/<name without .pt>/ (dlrm.parallel.checkpoint)."""
    sparse_arch = run.model.sparse_arch
    loader = run.train_loader
    if run.dist.enabled:
        meta = {
            "config": run.cfg.to_dict(),
            "table_rows": sparse_arch.table_rows,
            "loader": loader.state_dict() if isinstance(loader, STATEFUL_LOADERS) else None,
            **state.checkpointed(),
        }
        path = run.run_dir / "checkpoints" / name.removesuffix(".pt")
        sharded_checkpoint.save_sharded(path, run.model, run.optimizer, run.dist, meta)
        return
    save_checkpoint(
        run.run_dir / "checkpoints" / name,
        model=run.model.state_dict(),
        optimizer=run.optimizer.state_dict(),
        config=run.cfg.to_dict(),
        table_rows=sparse_arch.table_rows,
        loader=loader.state_dict() if isinstance(loader, STATEFUL_LOADERS) else None,
        **fused_optimizer_states(run.model),
        **state.checkpointed(),
    )


def stop_on_signal(run: Run, state: RunState, interval: Interval) -> None:
    """A stop signal came: write last.pt (a finite state only), flush TensorBoard, raise Interrupted."""
    save_last(run, state, interval)
    run.writer.flush()
    signum = run.signals.received
    checkpoint = run.run_dir / "checkpoints" / "last.pt"
    raise Interrupted(
        f"stopped by {signal.Signals(signum).name} after step {state.step}; {checkpoint} written",
        exit_code=128 + signum,
        checkpoint=checkpoint,
    )


def finish(run: Run, state: RunState, wall_s: float, stopped: RunStopped | None = None) -> dict:
    """Write metrics.json (strict JSON: null for what is undefined), close the writer; return the metrics.
    `stopped`: why the run ended early, recorded as "stopped". First the selected weights are evaluated
    on the test split (`evaluate_selected`), whatever stopped the run."""
    test = evaluate_selected(run, state) or {}
    run.progress.close()
    cfg, best, last_eval = run.cfg, state.best or {}, state.last_eval or {}
    ms_per_step = 1000 * state.timed_s / state.timed_steps if state.timed_steps else None
    per_rank = ranks.gather_floats(ms_per_step) if run.dist.enabled else [ms_per_step]
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
        "world_size": run.dist.world_size,
        # Each rank's mean ms per training step (first step and evaluations excluded): the spread.
        "step_ms_min": min(per_rank) if None not in per_rank else None,
        "step_ms_max": max(per_rank) if None not in per_rank else None,
        "stopped": None if stopped is None else type(stopped).__name__,
    }
    metrics = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}
    if run.dist.is_main:
        write_text_atomically(run.run_dir / "metrics.json", json.dumps(metrics, indent=2, allow_nan=False))
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
