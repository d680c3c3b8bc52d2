"""One process or many ranks: the run's one object that knows which (`SingleProcess` or `Sharded`, the same
methods), so set-up, loop, selection and checkpoints never branch on the world size.

    strategy, device = start(cfg)     # under torchrun: the process group, this rank's device
    model = strategy.build_model(cfg, metadata, train_ids, device)

`Sharded` runs each rank's part through dlrm.parallel (sharded tables, the dense gradients' all-reduce,
sharded evaluation and DCP checkpoints); rank 0 alone writes the run directory's files and TensorBoard.
"""

import json
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from loguru import logger

from dlrm import atomic, parallel
from dlrm.checkpoint import load_checkpoint, start_save
from dlrm.config import RunConfig
from dlrm.data.bag_source import loader_bags
from dlrm.data.dataset import BatchLoader, ParquetDataset
from dlrm.data.resident import ResidentLoader
from dlrm.metrics import evaluate
from dlrm.model import DLRM, Model, build_model, model_from_checkpoint
from dlrm.model.tables import resolve_table_rows
from dlrm.optim import RunOptimizer
from dlrm.out_of_memory import check_tables_fit
from dlrm.parallel import checkpoint as sharded_checkpoint
from dlrm.parallel import run as ranks
from dlrm.parallel.evaluation import ShardedEvalSplit, evaluate_sharded
from dlrm.parallel.sharded import build_sharded_model
from dlrm.progress import TrainProgress
from dlrm.run.directory import check_run_dir, make_run_dir, wait_past_event_files
from dlrm.run.events import EventWriter
from dlrm.staging import PendingSave, tensor_bytes

T = TypeVar("T")


def start(cfg: RunConfig) -> tuple["SingleProcess | Sharded", torch.device]:
    """The strategy of this process and its device: `Sharded` under torchrun (joins the process group,
    after checking the config against the world size), else `SingleProcess`.

    Raises:
        ValueError: config values that cannot work on the torchrun job's ranks
            (dlrm.parallel.run.check_world), a bad torchrun environment, "cuda" without a GPU
            (dlrm.parallel.init_distributed).
    """
    _, world_size, _ = parallel.world_from_env()
    if world_size > 1:  # config / world-size mismatches: one-line errors before the process group
        ranks.check_world(cfg, world_size)
    dist, device = parallel.init_distributed(cfg.train.device, cfg.parallel.timeout_s)
    return (Sharded(dist) if dist.enabled else SingleProcess()), device


class SingleProcess:
    """One process holds the whole model and writes every file."""

    dist = parallel.SINGLE
    rank, world_size, is_main = 0, 1, True
    trace_worker: str | None = None  # one profiler trace, named by the profiler

    def run_dir(self, cfg: RunConfig, run_dir: Path | None, resume: Path | None, overwrite: bool) -> Path:
        """The checked run directory (dlrm.run.directory.check_run_dir)."""
        return check_run_dir(cfg, run_dir, resume, overwrite)

    def build_model(
        self, cfg: RunConfig, metadata: dict, train_ids: torch.Tensor, device: torch.device
    ) -> Model:
        """The model the run starts from, on `device`: fresh (`build_model`, its tables checked to fit the
        device first where their sizes are known before building, and drawn for train.seed as on any number
        of ranks: dlrm.model.sparse.init_tables), or with `model.lora.base` (LoRA
        fine-tuning) the base checkpoint's model, its table layout and weights, with fresh adapters.

        Raises:
            ValueError: a base checkpoint that is missing or does not fit the config.
            OutOfMemory: tables that cannot fit the device (dlrm.out_of_memory.check_tables_fit).
        """
        if cfg.model.hashing == "modulus":  # sizes known before building (vocab: from the train ids)
            check_tables_fit(cfg, resolve_table_rows(cfg.model, metadata), device)
        kernels = {"mlp_kernel": cfg.mlp_kernel, "sparse_kernel": cfg.sparse_kernel}
        if cfg.model.lora.base is None:
            return build_model(cfg.model, metadata, train_ids, **kernels, seed=cfg.train.seed).to(device)
        base = load_checkpoint(Path(cfg.model.lora.base))
        table_rows, weights = base["table_rows"], base["model"]
        model = model_from_checkpoint(cfg.model, table_rows, weights, adapters_missing=True, **kernels)
        return model.to(device)

    def grad_reducer(self, model: Model) -> Callable[[], None] | None:
        """What the step runs between backward and the optimizer (dlrm.step.train_step's `reduce_grads`)."""
        return None

    def split_loader(self, dataset: ParquetDataset, cfg: RunConfig, device: torch.device) -> BatchLoader:
        """How an evaluation reads `dataset` (val or test) in batches of data.eval_batch_size: on the GPU
        once when it fits (no host copy per batch: evaluation runs at the speed of the forward), else in
        host memory; bags made on the fly from each batch with data.multi_hot."""
        bags = loader_bags(cfg, cfg.data.path)  # made on the fly from each batch (data.multi_hot)
        if device.type == "cuda":
            try:
                return ResidentLoader(dataset, cfg.data.eval_batch_size, device=device, bags=bags)
            except ValueError as err:
                logger.info("eval split stays in host memory: {}", err)
        return BatchLoader(dataset, cfg.data.eval_batch_size, device=device, bags=bags)

    def evaluate(
        self,
        model: Model,
        loader: BatchLoader,
        device: torch.device,
        precision: str,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
        progress: TrainProgress,
        split: str,
    ) -> dict[str, float]:
        """{"auc", "logloss", "ne", "samples"} of `model` on `split` read through `loader` (`forward`: the
        CUDA-graphed evaluation forward, or None). Raises ValueError as dlrm.metrics.evaluate."""
        return evaluate(model, progress.eval_batches(loader, split), device, precision, forward)

    def write_text(self, path: Path, text: str) -> None:
        """Write a file of the run directory whole."""
        atomic.write_text(path, text)

    def make_run_dir(self, run_dir: Path, clear: bool, config_json: str, resumed: bool) -> None:
        """Create (or empty, `clear`) the run directory and write config.json; on a resume, wait until new
        TensorBoard event files sort after the earlier run's (dlrm.run.directory)."""
        make_run_dir(run_dir, clear)
        self.write_text(run_dir / "config.json", config_json)
        if resumed:
            wait_past_event_files(run_dir)

    def writer(self, run_dir: Path, purge_step: int | None) -> EventWriter | ranks.NullWriter:
        """The run's TensorBoard writer."""
        return EventWriter(str(run_dir), purge_step=purge_step)

    def checkpoint_path(self, run_dir: Path, name: str) -> Path:
        """Where checkpoint `name` ("last.pt", "best.pt") of the run goes: a file."""
        return run_dir / "checkpoints" / name

    def save_checkpoint(
        self,
        path: Path,
        model: Model,
        optimizer: RunOptimizer,
        meta: dict,
        links: tuple[Path, ...] = (),
        background: bool = False,
    ) -> PendingSave | None:
        """Write `path` (dlrm.checkpoint.start_save): weights, optimizer states (the dense optimizer's and
        the "triton" tables', `RunOptimizer.state_dict`) and `meta` (config, table layout, run state,
        loader); then `links` name the same file. With `background`, in a thread when the device has room
        for a snapshot (the PendingSave returned), else now (None)."""
        state = {"model": model.state_dict(), **optimizer.state_dict(), **meta}
        return start_save(path, state, links, background)

    def checkpoint_bytes(self, model: Model, optimizer: RunOptimizer) -> list[int]:
        """Bytes of the tensors a checkpoint holds, per rank (here one)."""
        return [tensor_bytes({"model": model.state_dict(), **optimizer.state_dict()})]

    def read_checkpoint(self, path: Path) -> dict:
        """Checkpoint `path` (a .pt file, or a sharded directory read whole). Raises ValueError as
        dlrm.checkpoint.load_checkpoint."""
        return load_checkpoint(path)

    def load_checkpoint(
        self,
        path: Path,
        checkpoint: dict,
        model: Model,
        optimizer: RunOptimizer,
        with_optimizer: bool = True,
    ) -> None:
        """Load `checkpoint` (`read_checkpoint(path)`) into `model`, and with `with_optimizer` into
        `optimizer` (the dense optimizer's and the "triton" tables' states)."""
        model.load_state_dict(checkpoint["model"])
        if not with_optimizer:
            return
        if checkpoint["optimizer"] is None:  # a sharded checkpoint read whole: optimizer state by name
            by_name = checkpoint["optimizer_by_name"]
            sharded_checkpoint.load_optimizer_by_name(model, optimizer, by_name, checkpoint["step"])
        optimizer.load_state_dict(checkpoint)

    def agree(self, signum: int, timed: bool, at_log_line: bool) -> tuple[int, bool]:
        """(signal received, checkpoint due by time) as the run acts on them after a step."""
        return signum, timed

    def mean_loss(self, loss: float, device: torch.device) -> float:
        """The mean loss of the global batch, from this process's mean."""
        return loss

    def per_rank(self, value: T) -> list[T]:
        """`value` (a number, None, or a dict of them) of every rank, in rank order."""
        return [value]


class Sharded:
    """Many ranks under torchrun (dlrm.parallel): the tables sharded by the planner, the dense part
    replicated, collectives at the points where the ranks must agree; rank 0 writes the run's files."""

    def __init__(self, dist: parallel.Dist):
        self.dist = dist
        self.rank, self.world_size, self.is_main = dist.rank, dist.world_size, dist.is_main
        self.trace_worker = f"rank{dist.rank}"  # one trace per rank
        self.plan = None  # the sharding plan, once `build_model` made it
        self.batch_per_rank = 0  # the planner's b, once `build_model` knows the config

    def run_dir(self, cfg: RunConfig, run_dir: Path | None, resume: Path | None, overwrite: bool) -> Path:
        """Rank 0's checked run directory, on every rank (its default name has a timestamp)."""
        if self.is_main:
            run_dir = check_run_dir(cfg, run_dir, resume, overwrite)
        run_dir = ranks.same_path(run_dir)
        parallel.note_checkpoints(self.checkpoint_path(run_dir, "last.pt"), resume)  # for a dead rank's line
        return run_dir

    def build_model(
        self, cfg: RunConfig, metadata: dict, train_ids: torch.Tensor, device: torch.device
    ) -> DLRM:
        """This rank's model: its shards of the tables, the whole dense part (equal on every rank).
        Raises ValueError as dlrm.parallel.sharded.build_sharded_model."""
        model, self.plan = build_sharded_model(cfg, metadata, train_ids, self.rank, self.world_size, device)
        self.batch_per_rank = cfg.data.batch_size // self.world_size
        return model

    def grad_reducer(self, model: Model) -> Callable[[], None]:
        return parallel.grad_averager(parallel.averaged_parameters(model), self.world_size)

    def split_loader(self, dataset: ParquetDataset, cfg: RunConfig, device: torch.device) -> ShardedEvalSplit:
        """This rank's part of `dataset` (dlrm.parallel.evaluation)."""
        return ShardedEvalSplit(dataset, cfg.data.eval_batch_size, self.dist, loader_bags(cfg, cfg.data.path))

    def evaluate(
        self,
        model: Model,
        loader: ShardedEvalSplit,
        device: torch.device,
        precision: str,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
        progress: TrainProgress,
        split: str,
    ) -> dict[str, float]:
        """The metrics of the whole split on every rank, each rank scoring its part (collectives: every
        rank must call it)."""
        return evaluate_sharded(model, loader, device, precision, forward)

    def write_text(self, path: Path, text: str) -> None:
        if self.is_main:
            atomic.write_text(path, text)

    def make_run_dir(self, run_dir: Path, clear: bool, config_json: str, resumed: bool) -> None:
        """Rank 0 creates the run directory and writes config.json and sharding_plan.json; the other ranks
        write only their checkpoint shards and traces, later."""
        logger.info(
            "{} ranks; embedding tables:\n{}", self.world_size, self.plan.describe(self.batch_per_rank)
        )
        if self.is_main:
            make_run_dir(run_dir, clear)
            atomic.write_text(run_dir / "config.json", config_json)
            if resumed:
                wait_past_event_files(run_dir)
            atomic.write_text(
                run_dir / "sharding_plan.json", json.dumps(self.plan.to_dict(self.batch_per_rank), indent=2)
            )

    def writer(self, run_dir: Path, purge_step: int | None) -> EventWriter | ranks.NullWriter:
        return EventWriter(str(run_dir), purge_step=purge_step) if self.is_main else ranks.NullWriter()

    def checkpoint_path(self, run_dir: Path, name: str) -> Path:
        """A sharded directory, checkpoints/<name without .pt>/."""
        return run_dir / "checkpoints" / name.removesuffix(".pt")

    def save_checkpoint(
        self,
        path: Path,
        model: Model,
        optimizer: RunOptimizer,
        meta: dict,
        links: tuple[Path, ...] = (),
        background: bool = False,
    ) -> PendingSave | None:
        """Every rank writes its shards of `path` (dlrm.parallel.checkpoint.save_sharded; a collective), in
        the background when every rank has room for a snapshot."""
        return sharded_checkpoint.save_sharded(path, model, optimizer, self.dist, meta, links, background)

    def checkpoint_bytes(self, model: Model, optimizer: RunOptimizer) -> list[int]:
        """Bytes of the tensors each rank writes into a checkpoint (the dense part and replicated tables
        counted on rank 0), in rank order (a collective); recorded in the plan (sharding_plan.json)."""
        mine = sharded_checkpoint.checkpoint_bytes(model, optimizer, self.dist)
        sizes = [int(n) for n in ranks.gather_values(mine)]
        self.plan = self.plan.with_checkpoint_bytes(sizes)
        return sizes

    def read_checkpoint(self, path: Path) -> dict:
        """A sharded checkpoint's metadata (every rank reads its own rows later), or a one-process .pt."""
        return sharded_checkpoint.read_meta(path) if path.is_dir() else load_checkpoint(path)

    def load_checkpoint(
        self,
        path: Path,
        checkpoint: dict,
        model: Model,
        optimizer: RunOptimizer,
        with_optimizer: bool = True,
    ) -> None:
        """Each rank takes its rows of the weights and optimizer state (a sharded checkpoint: a collective;
        the optimizer state comes along whether `with_optimizer` or not)."""
        if path.is_dir():
            sharded_checkpoint.load_sharded(path, model, optimizer, self.dist)
        else:
            sharded_checkpoint.load_full_into_sharded(checkpoint, model, optimizer)

    def agree(self, signum: int, timed: bool, at_log_line: bool) -> tuple[int, bool]:
        """The signal of any rank (torchrun forwards it to all; a kill may reach one) and a checkpoint by
        wall time, decided by each rank's handler and clock, are acted on at log lines only, where the
        ranks agree on them (one small all-reduce): the sharded checkpoint is a collective that every rank
        must enter at the same step."""
        if not at_log_line:
            return 0, False
        signum, timed = ranks.max_over_ranks([signum, timed])
        return signum, bool(timed)

    def mean_loss(self, loss: float, device: torch.device) -> float:
        """The mean of the ranks' means: the global batch's mean loss."""
        return ranks.mean_over_ranks(torch.tensor(loss, device=device)).item()

    def per_rank(self, value: T) -> list[T]:
        return ranks.gather_values(value)


Strategy = SingleProcess | Sharded
