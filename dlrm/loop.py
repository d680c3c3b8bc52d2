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
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from loguru import logger
from torch.profiler import record_function
from torch.utils.tensorboard import SummaryWriter

from dlrm import parallel
from dlrm.checkpoint import load_checkpoint, save_checkpoint
from dlrm.config import RunConfig
from dlrm.data.dataset import Batch, BatchLoader, load_metadata, open_split
from dlrm.data.loaders import TrainLoader, make_train_loader
from dlrm.data.schema import NUM_SPARSE
from dlrm.data.streaming import StreamingLoader
from dlrm.metrics import evaluate
from dlrm.model import DLRM, build_model
from dlrm.parallel import checkpoint as sharded_checkpoint
from dlrm.parallel import run as ranks
from dlrm.parallel.evaluation import ShardedEvalSplit, evaluate_sharded
from dlrm.parallel.sharded import build_sharded_model
from dlrm.profiling import make_profiler
from dlrm.step import (
    StepFn,
    build_step,
    make_optimizer,
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
    timed_steps: int = 0

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
    eval_loader: BatchLoader | ShardedEvalSplit  # many ranks: each scores its part of the split
    eval_split: str
    run_dir: Path
    writer: SummaryWriter | ranks.NullWriter
    dist: parallel.Dist = parallel.SINGLE  # this process's rank; SINGLE without torchrun


def train(cfg: RunConfig, output_dir: Path | None = None, resume: Path | None = None) -> dict:
    """Train per `cfg`, writing everything into the run directory; returns the metrics.json contents:
    {"steps", "samples", "train_loss", "eval_auc", "eval_logloss", "samples_per_s", "wall_s", "backend", ...}.
    "eval_auc"/"eval_logloss" are those of the best evaluation (saved as checkpoints/best.pt).
    With `resume` (a checkpoint of a run of the same model config) training goes on from its step: weights,
    optimizer state, best evaluation and the train loader's position are restored, and the run directory
    defaults to the checkpoint's. "samples" then counts this run's samples only.

    Under torchrun (dlrm.parallel) every rank runs this same loop on its part of each global batch; rank 0
    writes the run directory's files (checkpoints: every rank, sharded).

    Raises:
        ValueError: bad data directory, config values the data contradicts, no CUDA for device "cuda", or a
            checkpoint that does not fit the config.
    """
    start = time.perf_counter()
    run, state = set_up(cfg, output_dir, resume)
    t = cfg.train
    loader = run.train_loader
    max_steps = t.max_steps or t.epochs * len(loader)
    interval = Interval(torch.zeros((), device=run.device))
    stop = False
    run.model.train()
    worker = f"rank{run.dist.rank}" if run.dist.enabled else None  # one trace per rank
    with make_profiler(cfg.profiler, run.run_dir, run.device, worker) as profiler:
        first_epoch, skip = resume_position(loader, state.step)
        for epoch in range(first_epoch, t.epochs):
            if stop or state.step >= max_steps:
                break
            loader.set_epoch(epoch)
            batches = epoch_batches(loader, skip if epoch == first_epoch else 0)
            while state.step < max_steps and not stop:
                step_start = time.perf_counter()
                with record_function("data"):
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


def set_up(cfg: RunConfig, output_dir: Path | None, resume: Path | None) -> tuple[Run, RunState]:
    """Data, model, optimizer, step, loaders, run directory and TensorBoard writer of a run, and its state
    (restored from `resume` when given). Raises ValueError as `train`."""
    t = cfg.train
    _, world_size, _ = parallel.world_from_env()
    if world_size > 1:  # config / world-size mismatches: one-line errors before the process group
        ranks.check_world(cfg, world_size)
    dist, device = parallel.init_distributed(t.device, cfg.parallel.timeout_s)  # single process: no-op
    use_interpreter_on_cpu(cfg, device)
    set_precision(t.precision)
    torch.manual_seed(t.seed)
    data_dir = Path(cfg.data.path)
    metadata = load_metadata(data_dir)
    # Layouts kaggle and terabyte hold out "val" (model selection) and "test"; layout fraction: "eval".
    eval_split = "val" if "val" in metadata.get("files", {}) else "eval"
    # The streaming loader never holds the train split; config validation then requires modulus hashing,
    # which needs no train ids.
    train_set = None if cfg.data.loader == "streaming" else open_split(data_dir, "train")
    eval_set = open_split(data_dir, eval_split)
    train_ids = torch.empty(0, NUM_SPARSE, dtype=torch.int64) if train_set is None else train_set.sparse
    kernels = {"mlp_kernel": cfg.mlp_kernel, "sparse_kernel": cfg.sparse_kernel}
    if dist.enabled:  # tables sharded over the ranks, the dense part replicated
        model, plan = build_sharded_model(cfg, metadata, train_ids, dist.rank, dist.world_size, device)
    else:
        model = build_model(cfg.model, metadata, train_ids, **kernels).to(device)
    optimizer = make_optimizer(model, cfg)
    state = RunState()
    checkpoint = load_resumable(resume, cfg, model, optimizer, dist) if resume is not None else {}
    for key, value in checkpoint.items():
        if key in RunState.__dataclass_fields__:
            setattr(state, key, value)
    reduce_grads = parallel.grad_averager(model.dense_parameters(), dist.world_size) if dist.enabled else None
    step_fn = build_step(model, optimizer, cfg, device, reduce_grads)
    train_loader = make_train_loader(
        cfg.data, data_dir, t.seed, device, train_set, dist.rank, dist.world_size
    )
    if len(train_loader) == 0:
        raise ValueError(
            f"data.batch_size: {cfg.data.batch_size} leaves no batch of {train_loader.num_rows} train rows"
        )
    if checkpoint.get("loader") is not None:
        train_loader.load_state_dict(checkpoint["loader"])
    if dist.enabled:
        eval_loader = ShardedEvalSplit(eval_set, cfg.data.eval_batch_size, dist)
    else:
        eval_loader = BatchLoader(eval_set, cfg.data.eval_batch_size, device=device)

    run_dir = make_run_dir(cfg, output_dir if output_dir or resume is None else resume.parent.parent, dist)
    config_json = json.dumps(cfg.to_dict(), indent=2)
    if dist.is_main:
        (run_dir / "config.json").write_text(config_json)
    if dist.enabled:
        logger.info("{} ranks; embedding tables:\n{}", dist.world_size, plan.describe())
        if dist.is_main:
            (run_dir / "sharding_plan.json").write_text(json.dumps(plan.to_dict(), indent=2))
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
    writer = SummaryWriter(str(run_dir)) if dist.is_main else ranks.NullWriter()
    writer.add_text("config", "```json\n" + config_json + "\n```")
    run = Run(
        cfg, device, model, optimizer, step_fn, train_loader, eval_loader, eval_split, run_dir, writer, dist
    )
    return run, state


def load_resumable(
    path: Path,
    cfg: RunConfig,
    model: DLRM,
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
        if model.sparse_arch.kernel == "triton" and state.get("embedding_optimizer_state") is not None:
            model.sparse_arch.optimizer_state.copy_(state["embedding_optimizer_state"])
    logger.info("resuming from {} at step {}", path, state["step"])
    return state


def make_run_dir(cfg: RunConfig, output_dir: Path | None, dist: parallel.Dist = parallel.SINGLE) -> Path:
    """`output_dir`, or runs/<name>-<timestamp> when None (rank 0's on every rank); created."""
    if output_dir is None:
        output_dir = Path("runs") / f"{cfg.name}-{datetime.now():%Y%m%d-%H%M%S}"
    if dist.enabled:
        output_dir = ranks.same_path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    return output_dir


def resume_position(loader: TrainLoader, step: int) -> tuple[int, int]:
    """(epoch, batches of it to skip) where a run at `step` goes on. The streaming loader knows its place
    (its restored state); the others replay the epoch's deterministic order and skip the batches done."""
    if isinstance(loader, StreamingLoader):
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
    parallel.note_progress(state.step)
    samples = batch.label.numel() * run.dist.world_size  # the global batch
    state.samples += samples
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
    interval.samples += samples


def log_interval(run: Run, state: RunState, interval: Interval, epoch: int) -> None:
    """Log the steps since the last log line (its one host sync, loss_sum.item()), and start a new
    interval."""
    if not interval.steps:
        return
    loss_sum = ranks.mean_over_ranks(interval.loss_sum) if run.dist.enabled else interval.loss_sum
    state.train_loss = loss_sum.item() / interval.steps
    elapsed = time.perf_counter() - interval.start
    state.timed_s += elapsed
    state.timed_samples += interval.samples
    state.timed_steps += interval.steps
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
    interval.loss_sum.zero_()
    interval.steps, interval.samples, interval.start = 0, 0, time.perf_counter()


def evaluate_and_select(run: Run, state: RunState, interval: Interval) -> bool:
    """Evaluate on the eval split, log it, keep the best as checkpoints/best.pt; True when early stopping
    says stop. The evaluation's time is kept out of the interval's throughput."""
    eval_start = time.perf_counter()
    if run.dist.enabled:  # every rank scores its part; all get the metrics of the whole split
        result = evaluate_sharded(run.model, run.eval_loader, run.device)
    else:
        result = evaluate(run.model, run.eval_loader, run.device)
    state.last_eval, state.last_eval_step = result, state.step
    for key in ("auc", "logloss", "ne"):
        run.writer.add_scalar(f"eval/{key}", result[key], state.step)
    logger.info(
        "step {} | eval auc {:.4f} logloss {:.4f} ne {:.4f}",
        state.step,
        result["auc"],
        result["logloss"],
        result["ne"],
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
    """checkpoints/`name`: weights, optimizer states, config, table layout, run state, loader position.
    Many ranks: the sharded directory checkpoints/<name without .pt>/ (dlrm.parallel.checkpoint)."""
    sparse_arch = run.model.sparse_arch
    loader = run.train_loader
    if run.dist.enabled:
        meta = {
            "config": run.cfg.to_dict(),
            "table_rows": sparse_arch.table_rows,
            "loader": loader.state_dict() if isinstance(loader, StreamingLoader) else None,
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
        loader=loader.state_dict() if isinstance(loader, StreamingLoader) else None,
        # The "triton" tables' Adagrad state lives beside them, not in the torch optimizer.
        embedding_optimizer_state=sparse_arch.optimizer_state if sparse_arch.kernel == "triton" else None,
        **state.checkpointed(),
    )


def finish(run: Run, state: RunState, wall_s: float) -> dict:
    """Write metrics.json (rank 0), close the writer; return the metrics (on every rank)."""
    cfg, best, last_eval = run.cfg, state.best, state.last_eval
    ms_per_step = 1000 * state.timed_s / state.timed_steps if state.timed_steps else None
    per_rank = ranks.gather_floats(ms_per_step) if run.dist.enabled else [ms_per_step]
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
        "wall_s": wall_s,
        "backend": cfg.backend,
        "mlp_kernel": cfg.mlp_kernel,
        "sparse_kernel": cfg.sparse_kernel,
        "device": str(run.device),
        "world_size": run.dist.world_size,
        # Each rank's mean ms per training step (first step and evaluations excluded): the spread.
        "step_ms_min": min(per_rank) if None not in per_rank else None,
        "step_ms_max": max(per_rank) if None not in per_rank else None,
    }
    if run.dist.is_main:
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
