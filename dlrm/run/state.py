"""What a training run is made of (dlrm.run.loop): `Run`, what it is set up with, fixed until it ends;
`RunState`, what changes while it goes on (step, samples, best evaluation, throughput sums), which
checkpoints save and `--resume` restores; `Interval`, the steps since the last log line."""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.tensorboard import SummaryWriter

from dlrm.config import RunConfig
from dlrm.data.dataset import BatchLoader
from dlrm.data.loaders import TrainLoader
from dlrm.lr_schedule import LearningRates
from dlrm.model import Model
from dlrm.optim import RunOptimizer
from dlrm.parallel import run as ranks
from dlrm.parallel.evaluation import ShardedEvalSplit
from dlrm.progress import TrainProgress
from dlrm.run.strategy import SingleProcess, Strategy
from dlrm.run.timing import TimeSpent
from dlrm.signals import StopSignals
from dlrm.step import (
    StepFn,
)


@dataclass
class RunState:
    """What changes during a run; saved in every checkpoint, restored by `--resume`.

    step: optimization steps done. samples: train samples of those steps, over the whole run (resumes
    included). best: the best val evaluation so far ({"auc", "logloss", "ne", "samples", "step"}), None
    before the first finite one. evals_since_best: for early stopping. skipped_batches: steps whose
    non-finite loss was skipped (train.on_nonfinite "skip_batch"). last_finite_loss: (step, loss) of the
    last finite step loss read. train_loss: the last log line's mean loss (None before one). interval_steps,
    interval_finite, interval_loss_sum: the log interval's steps so far, read when the checkpoint was written
    (dlrm.run.loop.keep_interval), its finite losses and their sum (many ranks: the mean over ranks of the
    sums), from which a resumed run's first log line goes on as an uninterrupted run's. The rest are
    this process's: the step whose loss stopped the run as non-finite (nonfinite_step; the losses are read
    at log lines, so the run has done a few steps more), throughput sums, the last evaluation, when
    last.pt was written, where best's weights are, where its wall time went (time_spent: not in
    checkpoints, so a resumed run counts its own process's time, as wall_s).
    """

    step: int = 0
    samples: int = 0
    best: dict | None = None
    evals_since_best: int = 0
    skipped_batches: int = 0
    last_finite_loss: tuple[int, float] | None = None
    train_loss: float | None = None
    interval_steps: int = 0
    interval_finite: int = 0
    interval_loss_sum: float = 0.0
    nonfinite_step: int | None = None
    last_eval: dict | None = None
    last_eval_step: int | None = None
    first_step_s: float | None = None  # this process's first step, compilation included
    # The batch sizes this process has trained on: the first step of a new one (an epoch's partial last
    # batch) compiles and tunes kernels for its shape, and is timed apart like the first step.
    batch_sizes: set[int] = field(default_factory=set)
    # Training throughput of this process: the steps timed apart (compilation, the CUDA graph's warm-up and
    # capture: dlrm.run.loop.drain_before_apart_step) and evaluations excluded.
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
    # This process's wall time by part (dlrm.run.timing): the loop's data, step, host syncs, evaluations,
    # checkpoints and logging; `train` starts it at its own start.
    time_spent: TimeSpent = field(default_factory=TimeSpent)

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
            "interval_steps",
            "interval_finite",
            "interval_loss_sum",
        )
        return {key: getattr(self, key) for key in keys}


@dataclass
class Interval:
    """The steps since the last log line. Their losses are copied into the device buffer `losses` (one
    slot per step, no host sync) and read at the log line, or earlier where an evaluation or checkpoint
    needs to know they are finite (`read` of them already checked). A step timed apart (the first, the first
    of a batch size) has its loss here but is not in `timed_steps` and `samples`, the throughput's count."""

    losses: torch.Tensor
    steps: int = 0
    timed_steps: int = 0
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
    optimizer: RunOptimizer
    step_fn: StepFn
    train_loader: TrainLoader
    val_loader: BatchLoader | ShardedEvalSplit  # many ranks: each scores its part of the split
    run_dir: Path
    writer: SummaryWriter | ranks.NullWriter
    signals: StopSignals
    lrs: LearningRates  # train.lr_schedule: set before each step
    progress: TrainProgress = field(default_factory=lambda: TrainProgress("log", 0))
    strategy: Strategy = field(default_factory=SingleProcess)  # one process or many ranks (torchrun)
    # The evaluation forward as CUDA graph replays under train.cuda_graphs (dlrm.graphs.GraphedForward);
    # None: launched from Python.
    eval_forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # Steps between evaluations (train.eval_interval, or an epoch over train.evals_per_epoch); None: at
    # each epoch's end only.
    eval_every: int | None = None
