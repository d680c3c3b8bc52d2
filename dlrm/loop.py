"""The training loop: `train(cfg)` sets a run up, loops over epochs and steps, evaluates, checkpoints and
writes metrics.json, top to bottom.

Each run writes into its own directory (default `runs/<name>-<timestamp>/`): config.json (resolved config),
TensorBoard events, a profiler trace `*.pt.trace.json`, checkpoints/last.pt and best.pt, and metrics.json.

What changes while a run goes on lives in one `RunState` (step, samples, best evaluation, throughput
sums), which checkpoints save and `--resume` restores; the steps since the last log line live in an
`Interval`. What is fixed once set up (model, optimizer, step, loaders, writer) is a `Run`. Logging,
evaluation and checkpointing are plain functions of those.
"""

import itertools
import json
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from loguru import logger
from torch.utils.tensorboard import SummaryWriter

from dlrm.checkpoint import load_checkpoint, save_checkpoint
from dlrm.config import RunConfig
from dlrm.data.dataset import Batch, BatchLoader, ParquetDataset, load_metadata, open_split
from dlrm.data.loaders import STATEFUL_LOADERS, TrainLoader, make_train_loader
from dlrm.data.resident import ResidentLoader
from dlrm.data.schema import NUM_SPARSE
from dlrm.metrics import evaluate
from dlrm.model import DLRM, build_model
from dlrm.profiling import data_range, make_profiler
from dlrm.progress import TrainProgress
from dlrm.step import (
    StepFn,
    build_step,
    make_optimizer,
    resolve_device,
    set_precision,
    use_interpreter_on_cpu,
)


@dataclass
class RunState:
    """What changes during a run; saved in every checkpoint, restored by `--resume`.

    step: optimization steps done. samples: train samples of those steps. best: the best evaluation so
    far ({"auc", "logloss", "ne", "samples", "step"}), None before the first. evals_since_best: for
    early stopping. The rest are this process's throughput sums and last values, for metrics.json.
    """

    step: int = 0
    samples: int = 0
    best: dict | None = None
    evals_since_best: int = 0
    last_eval: dict | None = None
    last_eval_step: int | None = None
    train_loss: float = float("nan")
    first_step_s: float | None = None  # this process's first step, compilation included
    # Training throughput of this process: the first step (compilation) and evaluations excluded.
    timed_s: float = 0.0
    timed_samples: int = 0
    evals: int = 0  # evaluations of this process
    eval_s: float = 0.0  # their time, in all (best.pt's writes not included)
    first_eval_s: float | None = None  # the first's, which pays for the eval shapes' JIT and tuning

    def checkpointed(self) -> dict[str, Any]:
        """The fields a resumed run goes on from."""
        return {"step": self.step, "best": self.best, "evals_since_best": self.evals_since_best}


@dataclass
class Interval:
    """The steps since the last log line: the device sum of their losses (read once, at the log line)."""

    loss_sum: torch.Tensor
    steps: int = 0
    samples: int = 0
    start: float = field(default_factory=time.perf_counter)


@dataclass
class Run:
    """What a run is set up with, fixed until it ends."""

    cfg: RunConfig
    device: torch.device
    model: DLRM
    optimizer: torch.optim.Optimizer
    step_fn: StepFn
    train_loader: TrainLoader
    eval_loader: BatchLoader
    eval_split: str
    run_dir: Path
    writer: SummaryWriter
    progress: TrainProgress = field(default_factory=lambda: TrainProgress("log", 0))


def train(
    cfg: RunConfig, output_dir: Path | None = None, resume: Path | None = None, progress: str = "auto"
) -> dict:
    """Train per `cfg`, writing everything into the run directory; returns the metrics.json contents:
    {"steps", "samples", "train_loss", "eval_auc", "eval_logloss", "samples_per_s", "wall_s", "backend", ...}.
    "eval_auc"/"eval_logloss" are those of the best evaluation (saved as checkpoints/best.pt).
    With `resume` (a checkpoint of a run of the same model config) training goes on from its step: weights,
    optimizer state, best evaluation and the train loader's position are restored, and the run directory
    defaults to the checkpoint's. "samples" then counts this run's samples only. `progress`: what it shows
    while it runs, "auto", "bar", "log" or "quiet" (dlrm.progress).

    Raises:
        ValueError: bad data directory, config values the data contradicts, no CUDA for device "cuda", or a
            checkpoint that does not fit the config.
    """
    start = time.perf_counter()
    run, state = set_up(cfg, output_dir, resume, progress)
    t = cfg.train
    loader = run.train_loader
    max_steps = t.max_steps or t.epochs * len(loader)
    interval = Interval(torch.zeros((), device=run.device))
    stop = False
    run.model.train()
    with make_profiler(cfg.profiler, run.run_dir, run.device, run.writer, state.step) as profiler:
        first_epoch, skip = resume_position(loader, state.step)
        for epoch in range(first_epoch, t.epochs):
            if stop or state.step >= max_steps:
                break
            loader.set_epoch(epoch)
            batches = epoch_batches(loader, skip if epoch == first_epoch else 0)
            while state.step < max_steps and not stop:
                step_start = time.perf_counter()
                with data_range():
                    batch = next(batches, None)
                if batch is None:
                    break
                loss = run.step_fn(run.model, run.optimizer, batch)
                profiler.step()
                account_step(run, state, interval, loss, batch, step_start)
                if state.step % t.log_interval == 0:
                    log_interval(run, state, interval, epoch)
                if t.eval_interval and state.step % t.eval_interval == 0:
                    stop = evaluate_and_select(run, state, interval)
            log_interval(run, state, interval, epoch)
            if not stop and state.last_eval_step != state.step:
                stop = evaluate_and_select(run, state, interval)  # end of epoch
    if state.last_eval is None:  # a resumed run that had no step left to train
        evaluate_and_select(run, state, interval)
    save_run_checkpoint(run, state, "last.pt")
    return finish(run, state, time.perf_counter() - start)


def set_up(
    cfg: RunConfig, output_dir: Path | None, resume: Path | None, progress: str = "auto"
) -> tuple[Run, RunState]:
    """Data, model, optimizer, step, loaders, run directory, TensorBoard writer and progress bar of a run,
    and its state (restored from `resume` when given). Raises ValueError as `train`."""
    t = cfg.train
    device = resolve_device(t.device)
    use_interpreter_on_cpu(cfg, device)
    set_precision(t.precision)
    torch.manual_seed(t.seed)
    data_dir = Path(cfg.data.path)
    logger.info("reading {} ({} loader)", data_dir, cfg.data.loader)
    metadata = load_metadata(data_dir)
    # Layouts kaggle and terabyte hold out "val" (model selection) and "test"; layout fraction: "eval".
    eval_split = "val" if "val" in metadata.get("files", {}) else "eval"
    # The streaming loaders never hold the train split; config validation then requires modulus hashing,
    # which needs no train ids.
    streams = cfg.data.loader in ("streaming", "binary")
    train_set = None if streams else open_split(data_dir, "train")
    eval_set = open_split(data_dir, eval_split)
    train_ids = torch.empty(0, NUM_SPARSE, dtype=torch.int64) if train_set is None else train_set.sparse
    kernels = {"mlp_kernel": cfg.mlp_kernel, "sparse_kernel": cfg.sparse_kernel}
    logger.info("building the model ({} backend) on {}", cfg.backend, device)
    model = build_model(cfg.model, metadata, train_ids, **kernels).to(device)
    optimizer = make_optimizer(model, cfg)
    state = RunState()
    checkpoint = load_resumable(resume, cfg, model, optimizer) if resume is not None else {}
    for key, value in checkpoint.items():
        if key in RunState.__dataclass_fields__:
            setattr(state, key, value)
    step_fn = build_step(model, optimizer, cfg, device)
    train_loader = make_train_loader(cfg.data, data_dir, t.seed, device, train_set)
    if len(train_loader) == 0:
        raise ValueError(
            f"data.batch_size: {cfg.data.batch_size} leaves no batch of {train_loader.num_rows} train rows"
        )
    if checkpoint.get("loader") is not None:
        train_loader.load_state_dict(checkpoint["loader"])
    eval_loader = make_eval_loader(eval_set, cfg.data.eval_batch_size, device)

    run_dir = make_run_dir(cfg, output_dir if output_dir or resume is None else resume.parent.parent)
    config_json = json.dumps(cfg.to_dict(), indent=2)
    (run_dir / "config.json").write_text(config_json)
    logger.info(
        "run {} | backend {} | device {} | train {} rows, {} {} rows | {} params",
        run_dir,
        cfg.backend,
        device,
        train_loader.num_rows,
        eval_split,
        eval_set.num_rows,
        sum(p.numel() for p in model.parameters()),
    )
    writer = SummaryWriter(str(run_dir))
    writer.add_text("config", "```json\n" + config_json + "\n```")
    run = Run(cfg, device, model, optimizer, step_fn, train_loader, eval_loader, eval_split, run_dir, writer)
    run.progress = TrainProgress(progress, t.max_steps or t.epochs * len(train_loader), state.step)
    return run, state


def make_eval_loader(eval_set: ParquetDataset, batch_size: int, device: torch.device) -> BatchLoader:
    """The eval split on the GPU once when it fits (no host copy per batch: evaluation runs at the speed
    of the forward), else in host memory."""
    if device.type == "cuda":
        try:
            return ResidentLoader(eval_set, batch_size, device=device)
        except ValueError as err:
            logger.info("eval split stays in host memory: {}", err)
    return BatchLoader(eval_set, batch_size, device=device)


def load_resumable(path: Path, cfg: RunConfig, model: DLRM, optimizer: torch.optim.Optimizer) -> dict:
    """Load checkpoint `path` into `model` and `optimizer`; return it (step, best, loader position, ...).

    Raises:
        ValueError: the file is not a checkpoint, or was trained with another model config or optimizer.
    """
    state = load_checkpoint(path)
    ours, theirs = cfg.to_dict(), state["config"]
    for section, key in [("model", k) for k in ours["model"]] + [("train", "optimizer"), ("data", "loader")]:
        if theirs[section].get(key) != ours[section][key]:
            raise ValueError(
                f"{path}: trained with {section}.{key} = {theirs[section].get(key)!r}, "
                f"the config has {ours[section][key]!r}"
            )
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if model.sparse_arch.kernel == "triton" and state.get("embedding_optimizer_state") is not None:
        model.sparse_arch.optimizer_state.copy_(state["embedding_optimizer_state"])
    logger.info("resuming from {} at step {}", path, state["step"])
    return state


def make_run_dir(cfg: RunConfig, output_dir: Path | None) -> Path:
    """`output_dir`, or runs/<name>-<timestamp> when None; created."""
    if output_dir is None:
        output_dir = Path("runs") / f"{cfg.name}-{datetime.now():%Y%m%d-%H%M%S}"
    output_dir.mkdir(parents=True, exist_ok=True)
    return output_dir


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
    it is timed apart and kept out of the interval's throughput."""
    state.step += 1
    state.samples += batch.label.numel()
    run.progress.step()
    if state.first_step_s is None:
        if run.device.type == "cuda":
            torch.cuda.synchronize()
        state.first_step_s = time.perf_counter() - step_start
        logger.info("first step {:.2f} s (includes compile / kernel JIT)", state.first_step_s)
        state.train_loss = loss.item()
        interval.start = time.perf_counter()
        return
    interval.loss_sum += loss.detach()
    interval.steps += 1
    interval.samples += batch.label.numel()


def log_interval(run: Run, state: RunState, interval: Interval, epoch: int) -> None:
    """Log the steps since the last log line (its one host sync, loss_sum.item()), and start a new
    interval."""
    if not interval.steps:
        return
    state.train_loss = interval.loss_sum.item() / interval.steps
    elapsed = time.perf_counter() - interval.start
    state.timed_s += elapsed
    state.timed_samples += interval.samples
    writer = run.writer
    writer.add_scalar("train/loss", state.train_loss, state.step)
    writer.add_scalar("perf/samples_per_s", interval.samples / elapsed, state.step)
    writer.add_scalar("lr", run.optimizer.param_groups[0]["lr"], state.step)
    logger.info(
        "epoch {} step {} | loss {:.5f} | {:,.0f} samples/s | {:.2f} ms/step",
        epoch,
        state.step,
        state.train_loss,
        interval.samples / elapsed,
        1000 * elapsed / interval.steps,
    )
    run.progress.interval(epoch, state.train_loss, interval.samples / elapsed)
    interval.loss_sum.zero_()
    interval.steps, interval.samples, interval.start = 0, 0, time.perf_counter()


def evaluate_and_select(run: Run, state: RunState, interval: Interval) -> bool:
    """Evaluate on the eval split, log it, keep the best as checkpoints/best.pt; True when early stopping
    says stop. The evaluation's and the checkpoint's time are kept out of the interval's throughput."""
    eval_start = time.perf_counter()
    batches = run.progress.eval_batches(run.eval_loader, run.eval_split)
    result = evaluate(run.model, batches, run.device, run.cfg.train.precision)
    # The evaluation alone (its result is on the host, so its GPU work is done); best.pt's write is apart.
    eval_time = time.perf_counter() - eval_start
    state.evals += 1
    state.eval_s += eval_time
    state.first_eval_s = eval_time if state.first_eval_s is None else state.first_eval_s
    state.last_eval, state.last_eval_step = result, state.step
    for key in ("auc", "logloss", "ne"):
        run.writer.add_scalar(f"eval/{key}", result[key], state.step)
    logger.info(
        "step {} | eval auc {:.4f} logloss {:.4f} ne {:.4f} | {:.2f} s",
        state.step,
        result["auc"],
        result["logloss"],
        result["ne"],
        eval_time,
    )
    if state.best is None or result["auc"] > state.best["auc"]:
        state.best, state.evals_since_best = {**result, "step": state.step}, 0
        save_run_checkpoint(run, state, "best.pt")
    else:
        state.evals_since_best += 1
    interval.start += time.perf_counter() - eval_start
    patience = run.cfg.train.patience
    if patience is not None and state.evals_since_best >= patience:
        logger.info("early stop: no better eval AUC in {} evaluations", patience)
        return True
    return False


def save_run_checkpoint(run: Run, state: RunState, name: str) -> None:
    """checkpoints/`name`: weights, optimizer states, config, table layout, run state, loader position."""
    sparse_arch = run.model.sparse_arch
    loader = run.train_loader
    save_checkpoint(
        run.run_dir / "checkpoints" / name,
        model=run.model.state_dict(),
        optimizer=run.optimizer.state_dict(),
        config=run.cfg.to_dict(),
        table_rows=sparse_arch.table_rows,
        loader=loader.state_dict() if isinstance(loader, STATEFUL_LOADERS) else None,
        # The "triton" tables' Adagrad state lives beside them, not in the torch optimizer.
        embedding_optimizer_state=sparse_arch.optimizer_state if sparse_arch.kernel == "triton" else None,
        **state.checkpointed(),
    )


def finish(run: Run, state: RunState, wall_s: float) -> dict:
    """Write metrics.json, close the writer; return the metrics."""
    run.progress.close()
    cfg, best, last_eval = run.cfg, state.best, state.last_eval
    metrics = {
        "steps": state.step,
        "samples": state.samples,
        "train_loss": state.train_loss,
        "eval_auc": best["auc"],
        "eval_logloss": best["logloss"],
        "eval_ne": best["ne"],
        "best_step": best["step"],
        "eval_split": run.eval_split,
        "eval_samples": best["samples"],
        "last_eval_auc": last_eval["auc"],
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
    }
    (run.run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    run.writer.close()
    logger.info(
        "done: {} steps, best eval auc {:.4f} at step {}, metrics in {}",
        state.step,
        best["auc"],
        best["step"],
        run.run_dir / "metrics.json",
    )
    return metrics
