"""Setting a run up (dlrm.run.loop): data, model, optimizer, step, loaders, run directory, TensorBoard writer
and progress bar, and the state a `--resume` checkpoint restores. Under torchrun: the process group, the
sharded tables and rank-aware loaders, through the run's strategy (dlrm.run.strategy)."""

import functools
import json
import math
from pathlib import Path

import torch
from loguru import logger

from dlrm.config import RunConfig
from dlrm.data.bag_source import loader_bags
from dlrm.data.dataset import ParquetDataset, load_metadata, open_split, split_paths
from dlrm.data.loaders import TrainLoader, make_train_loader
from dlrm.data.position import EpochPosition
from dlrm.data.schema import NUM_SPARSE
from dlrm.data.splits import REPORT, SELECT, require_val_test
from dlrm.device import set_precision, use_interpreter_on_cpu
from dlrm.graphs import GraphedForward
from dlrm.lr_schedule import LearningRates
from dlrm.metrics import forward_logits
from dlrm.model import Model
from dlrm.model.dlrm import log_odds
from dlrm.model.tables import shared_rows_warning
from dlrm.optim import RunOptimizer
from dlrm.progress import TrainProgress
from dlrm.run.checkpoints import preflight
from dlrm.run.kernel_choices import take as take_kernel_choices
from dlrm.run.state import Run, RunState
from dlrm.run.strategy import Strategy, start
from dlrm.signals import StopSignals
from dlrm.step import build_step, resolve_cuda_graphs


def set_up(
    cfg: RunConfig,
    output_dir: Path | None,
    resume: Path | None,
    overwrite: bool = False,
    progress: str = "auto",
    kernel_choices: Path | None = None,
) -> tuple[Run, RunState]:
    """Data, model, optimizer, step, loaders, run directory, TensorBoard writer and progress bar of a run,
        and its state (restored from `resume` when given). Under torchrun: the process group, the sharded
        tables and rank-aware loaders (dlrm.run.strategy). The run directory is checked first and written only
        once all else is set up; a `resume` checkpoint is read and checked against the config before the data
        and the model. Raises ValueError as `train`, and RunFinished for a `resume` of a run with no step left
        in its own directory (nothing written). The kernels' tuned choices come from `kernel_choices` (a
    checkpoint), else from `resume` (dlrm.run.kernel_choices)."""
    strategy, device = start(cfg)
    cfg = resolve_cuda_graphs(cfg, device, strategy.world_size)
    t = cfg.train
    run_dir = output_dir if output_dir or resume is None else resume.parent.parent
    run_dir = strategy.run_dir(cfg, run_dir, resume, overwrite)
    state = RunState()
    checkpoint = read_resumable(resume, cfg, strategy) if resume is not None else {}
    for key, value in checkpoint.items():
        if key in RunState.__dataclass_fields__:
            setattr(state, key, value)
    if resume is not None:
        state.best_checkpoint = resume.parent / ("best" if resume.is_dir() else "best.pt")
        check_not_stopped_early(resume, state, t.patience)
    use_interpreter_on_cpu(cfg, device)
    if kernel_choices is not None:
        take_kernel_choices(strategy.read_checkpoint(kernel_choices), kernel_choices, strategy)
    elif resume is not None:
        take_kernel_choices(checkpoint, resume, strategy)
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
    train_loader = make_train_loader(
        cfg.data,
        data_dir,
        t.seed,
        device,
        train_set,
        strategy.rank,
        strategy.world_size,
        loader_bags(cfg, data_dir),
    )
    if len(train_loader) == 0:
        raise ValueError(
            f"data.batch_size: {cfg.data.batch_size} leaves no batch of {train_loader.num_rows} train rows"
        )
    check_rows(data_dir, metadata, "train", train_loader.num_rows)
    # Into another run directory a finished checkpoint goes on as any: evaluated, saved there (resharded).
    if resume is not None and run_dir.resolve() == resume.parent.parent.resolve():
        check_not_finished(resume, state, cfg, train_loader, strategy.is_main)
    train_ids = torch.empty(0, NUM_SPARSE, dtype=torch.int64) if train_set is None else train_set.sparse
    logger.info("building the model ({} backend) on {}", cfg.backend, device)
    if cfg.model.lora.base is None and (warning := shared_rows_warning(cfg.model, metadata)):
        logger.warning(warning)
    model = strategy.build_model(cfg, metadata, train_ids, device)
    if cfg.model.lora.base is None:  # a fine-tuned model starts as its base, whose bias was learned
        rate = train_positive_rate(data_dir, metadata, train_set)
        model.start_at_base_rate(rate)
        logger.info("the logit starts at the train click rate {:.4f} (bias {:.4f})", rate, log_odds(rate))
    optimizer = RunOptimizer(model, t)
    lrs = LearningRates(t.lr_schedule, optimizer)
    if resume is not None:
        load_resumable(resume, checkpoint, cfg, model, optimizer, strategy)
    step_fn = build_step(model, optimizer, cfg, device, strategy.grad_reducer(model))
    if checkpoint.get("loader") is not None:
        restore_loader(train_loader, checkpoint["loader"], strategy.is_main)
    val_loader = strategy.split_loader(val_set, cfg, device)

    if resume is not None and resume.resolve() == (run_dir / "checkpoints" / "last.pt").resolve():
        state.last_checkpoint_step = state.step
    config_json = json.dumps(cfg.to_dict(), indent=2)
    preflight(cfg, strategy, model, optimizer, run_dir)  # the checkpoints fit on the disk, or one line
    strategy.make_run_dir(run_dir, overwrite and resume is None, config_json, resume is not None)
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
    writer = strategy.writer(run_dir, purge_step)
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
        StopSignals(announce=strategy.is_main),
        lrs,
        strategy=strategy,
    )
    run.progress = TrainProgress(progress, t.max_steps or t.epochs * len(train_loader), state.step)
    run.eval_every = t.eval_interval or (
        t.evals_per_epoch and math.ceil(len(train_loader) / t.evals_per_epoch)
    )
    if t.cuda_graphs:
        run.eval_forward = GraphedForward(functools.partial(forward_logits, model, t.precision))
    return run, state


def check_not_stopped_early(resume: Path, state: RunState, patience: int | None) -> None:
    """Raise ValueError when checkpoint `resume` is of a run that early stopping ended (its evaluations
    since the best reached train.patience): it is done, and going on would train past its own stop."""
    if patience is not None and state.evals_since_best >= patience:
        raise ValueError(
            f"{resume}: this run is done: early stopping ended it at step {state.step} (no better val "
            f"evaluation in {patience} evaluations; best at step {(state.best or {}).get('step')}); its "
            "result is metrics.json and checkpoints/best.pt. To train on, raise train.patience"
        )


def train_positive_rate(data_dir: Path, metadata: dict, train_set: ParquetDataset | None) -> float:
    """The click rate of the train split: the mean of its labels when the run holds them (every loader but
    "streaming" and "binary"), else metadata.json's positive_rate.train, which preprocessing counted from
    the same labels (all of them: under torchrun every rank gets the rate of the whole split). Raises
    ValueError when neither is there, or the split holds one class only."""
    if train_set is not None:
        rate = train_set.label.double().mean().item()
    else:
        rate = metadata.get("positive_rate", {}).get("train")
        if rate is None:
            raise ValueError(f"{data_dir}/metadata.json: no positive_rate.train (preprocess the data again)")
    if not 0.0 < rate < 1.0:
        raise ValueError(f"{data_dir}: the train split's click rate is {rate}; it needs clicks and others")
    return rate


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


def read_resumable(path: Path, cfg: RunConfig, strategy: Strategy) -> dict:
    """Checkpoint `path` (step, best, loader position, ...; the weights of a .pt file too), read and checked
    against `cfg` before any data or model is set up: a .pt file of one process or a sharded checkpoint
    directory of many (dlrm.parallel.checkpoint; there, only its meta.json).

    Raises:
        ValueError: the file is not a checkpoint, or was trained with another model config, optimizer,
            loader or batch size (one line naming the key and both values).
    """
    checkpoint = strategy.read_checkpoint(path)
    ours, theirs = cfg.to_dict(), checkpoint["config"]
    keys = [("model", k) for k in ours["model"]] + [("train", "optimizer"), ("data", "loader")]
    # The step count and the loader's position are in batches of data.batch_size: another size would go
    # on from another place in the data (and change the lr's meaning per sample).
    for section, key in [*keys, ("data", "batch_size")]:
        if theirs[section].get(key) != ours[section][key]:
            raise ValueError(
                f"{path}: trained with {section}.{key} = {theirs[section].get(key)!r}, "
                f"the config has {ours[section][key]!r}"
            )
    return checkpoint


def total_steps(cfg: RunConfig, loader: TrainLoader) -> int:
    """The steps a run of `cfg` trains in all: train.max_steps, else train.epochs passes over `loader`."""
    return cfg.train.max_steps or cfg.train.epochs * len(loader)


class RunFinished(Exception):
    """`--resume` of a run with no step left to train: nothing to do, nothing written. `metrics`: the run
    directory's metrics.json ({} when it has none)."""

    def __init__(self, message: str, metrics: dict):
        super().__init__(message)
        self.metrics = metrics


def check_not_finished(
    resume: Path, state: RunState, cfg: RunConfig, loader: TrainLoader, announce: bool
) -> None:
    """Raise RunFinished when checkpoint `resume` (restored into `state`) of the run being resumed in its
    own directory is at or past the run's last step (`total_steps`): the run is finished, and going on
    would only rewrite its files. One warning line says so first, where `announce` (rank 0)."""
    steps = total_steps(cfg, loader)
    if state.step < steps:
        return
    if cfg.train.max_steps:
        limit, raise_it = f"train.max_steps {steps}", "train.max_steps (--max-steps)"
    else:
        limit, raise_it = f"train.epochs {cfg.train.epochs} ({steps} steps)", "train.epochs"
    metrics_path = resume.parent.parent / "metrics.json"  # the directory of the run the checkpoint is of
    try:
        metrics = json.loads(metrics_path.read_text())
    except (OSError, ValueError):
        metrics = {}
    results = f" (its results: {metrics_path})" if metrics else ""
    message = (
        f"{resume}: this run is finished: step {state.step} of {limit}; nothing to train, nothing "
        f"written{results}. To train on, raise {raise_it}"
    )
    if announce:
        logger.warning(message)
    raise RunFinished(message, metrics)


def load_resumable(
    path: Path,
    checkpoint: dict,
    cfg: RunConfig,
    model: Model,
    optimizer: RunOptimizer,
    strategy: Strategy,
) -> None:
    """Load `checkpoint` (`read_resumable(path, ...)`) into `model` and `optimizer`, on any number of ranks
    (`strategy`). The config's hyperparameters (lr, weight decay) win over the checkpoint's: one log line
    names each config key whose value differs from the checkpoint's."""
    ours = [{k: group[k] for k in ("lr", "weight_decay")} for group in optimizer.param_groups]
    strategy.load_checkpoint(path, checkpoint, model, optimizer)
    # Group 0 is the dense parameters', group 1 the tables' (dlrm.optim.RunOptimizer), whose lr is
    # train.embedding_lr, or train.lr when that is null.
    table_lr = "train.embedding_lr" if cfg.train.embedding_lr is not None else "train.lr"
    names = [{"lr": "train.lr", "weight_decay": "train.weight_decay"}, {"lr": table_lr}]
    changed: dict[str, tuple[float, float]] = {}
    # The groups hold base rates (the schedule scales them through the optimizer's device tensors).
    for group, values, keys in zip(optimizer.param_groups, ours, names, strict=False):
        for key, value in values.items():
            if key in keys and not math.isclose(group[key], value, rel_tol=1e-9):
                changed.setdefault(keys[key], (value, group[key]))
            group[key] = value
    for key, (value, held) in changed.items():
        logger.info("resuming with the config's {} {} (the checkpoint had {:.6g})", key, value, held)
    logger.info("resuming from {} at step {}", path, checkpoint["step"])


def restore_loader(loader: TrainLoader, state: dict, log: bool) -> None:
    """Put `loader` at the checkpoint's position `state` (its load_state_dict: ValueError for a state it
    cannot go on from). A position of another number of ranks (dlrm.data.position.EpochPosition) gets one
    warning line (where `log`): this epoch's remaining rows are not the saved run's."""
    loader.load_state_dict(state)
    if log and isinstance(loader, EpochPosition) and loader.other_ranks(state):
        logger.warning(
            "the checkpoint's loader position is of {} ranks, this run has {}: epoch {} goes on at global "
            "batch {} in {} ranks' order (its remaining rows are not exactly the saved run's); later epochs "
            "are whole",
            state["world_size"],
            loader.world_size,
            state["epoch"],
            state["batches"],
            loader.world_size,
        )
