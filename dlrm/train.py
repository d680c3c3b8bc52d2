"""`python -m dlrm.train`: train a DLRM on preprocessed Criteo data.

Each run writes into its own directory (default `runs/<name>-<timestamp>/`): config.json (resolved config),
TensorBoard events, a profiler trace `*.pt.trace.json`, checkpoints/last.pt and best.pt, and metrics.json.
Watch it with `tensorboard --logdir runs`.
"""

import functools
import itertools
import json
import os
import sys
import time
from datetime import datetime
from pathlib import Path

import click
import torch
from loguru import logger
from torch.profiler import record_function
from torch.utils.tensorboard import SummaryWriter

from dlrm.checkpoint import load_checkpoint, save_checkpoint
from dlrm.config import RunConfig, load_config, replace
from dlrm.data.dataset import Batch, BatchLoader, load_metadata, open_split
from dlrm.data.loaders import make_train_loader
from dlrm.data.schema import NUM_SPARSE
from dlrm.data.streaming import StreamingLoader
from dlrm.graphs import GraphedTrainStep
from dlrm.metrics import evaluate
from dlrm.model import DLRM, build_model
from dlrm.profiling import make_profiler


def resolve_device(name: str) -> torch.device:
    """ "auto" -> cuda when available else cpu. Raises ValueError for "cuda" without a GPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device: 'cuda' requested but no CUDA GPU is available (use auto or cpu)")
    return torch.device(name)


def make_optimizer(model: DLRM, cfg: RunConfig) -> torch.optim.Optimizer:
    """SGD or Adagrad with two parameter groups: the MLPs (weight decay) and the embedding tables (sparse
    gradients, `embedding_lr`, no weight decay: decaying every row each step would make the update dense).
    With the "triton" sparse kernel the tables are not in the torch optimizer: the same update (lr
    `embedding_lr`, Adagrad's default eps) is fused into the embedding kernel's backward."""
    t = cfg.train
    embedding_lr = t.embedding_lr or t.lr
    groups = [{"params": model.dense_parameters(), "lr": t.lr, "weight_decay": t.weight_decay}]
    if model.sparse_arch.kernel == "triton":
        model.sparse_arch.configure_optimizer(t.optimizer, embedding_lr)
    else:
        groups.append({"params": model.embedding_parameters(), "lr": embedding_lr, "weight_decay": 0.0})
    if t.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=t.lr)
    return torch.optim.Adagrad(groups, lr=t.lr)


def compile_dense_part(model: DLRM, mode: str = "default") -> None:
    """Compile the MLPs and the interaction with Inductor, in place, in torch.compile's `mode` ("default"
    or "reduce-overhead": CUDA graphs of the compiled part, one per batch size). The embedding lookups
    stay eager: their sparse gradients do not compile. The batch dimension is dynamic from the start, so
    the last partial batch and the eval batch size do not trigger recompiles."""
    for module in (model.dense_arch, model.interaction_arch, model.over_arch):
        module.compile(dynamic=True, mode=mode)


def set_precision(precision: str) -> None:
    """TF32 tensor-core matmuls on for "tf32", off otherwise (process-wide torch flags; linear_act follows
    them too)."""
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"


def train_step(
    model: DLRM, optimizer: torch.optim.Optimizer, batch: Batch, precision: str = "fp32"
) -> torch.Tensor:
    """One optimization step on `batch`; returns the mean BCE-with-logits loss, a device scalar (no sync).
    With precision "bf16" the forward runs under bf16 autocast (the loss is computed in fp32)."""
    # A new iteration for Inductor's CUDA graphs (compile_mode "reduce-overhead"), whose outputs of the
    # last step may be overwritten from here on; without them this is a no-op.
    torch.compiler.cudagraph_mark_step_begin()
    with (
        record_function("forward"),
        torch.autocast(batch.dense.device.type, torch.bfloat16, precision == "bf16"),
    ):
        logits = model(batch.dense, batch.sparse)
    with record_function("loss"):
        loss = model.loss(logits, batch.label)
    with record_function("backward"):
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
    with record_function("optimizer"):
        optimizer.step()
    return loss


def _use_interpreter_on_cpu(cfg: RunConfig, device: torch.device) -> None:
    """On a CPU our Triton kernels run in the interpreter, which works only when TRITON_INTERPRET=1 is set
    before triton is first imported. Raises ValueError when triton was imported without it."""
    if not (cfg.train.use_triton and device.type == "cpu") or os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "triton" in sys.modules:
        raise ValueError(
            "--use-triton on the CPU needs the Triton interpreter, but triton was imported before it could "
            "be switched on: set TRITON_INTERPRET=1 in the environment before starting Python"
        )
    os.environ["TRITON_INTERPRET"] = "1"


def _load_resumable(path: Path, cfg: RunConfig, model: DLRM, optimizer: torch.optim.Optimizer) -> dict:
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


def _make_run_dir(cfg: RunConfig, output_dir: Path | None) -> Path:
    if output_dir is None:
        output_dir = Path("runs") / f"{cfg.name}-{datetime.now():%Y%m%d-%H%M%S}"
    output_dir.mkdir(parents=True, exist_ok=True)
    return output_dir


def train(cfg: RunConfig, output_dir: Path | None = None, resume: Path | None = None) -> dict:
    """Train per `cfg`, writing everything into the run directory; returns the metrics.json contents:
    {"steps", "samples", "train_loss", "eval_auc", "eval_logloss", "samples_per_s", "wall_s", "backend", ...}.
    "eval_auc"/"eval_logloss" are those of the best evaluation (saved as checkpoints/best.pt).
    With `resume` (a checkpoint of a run of the same model config) training goes on from its step: weights,
    optimizer state, best evaluation and the train loader's position are restored, and the run directory
    defaults to the checkpoint's. "samples" then counts this run's samples only.

    Raises:
        ValueError: bad data directory, config values the data contradicts, no CUDA for device "cuda", or a
            checkpoint that does not fit the config.
    """
    t = cfg.train
    device = resolve_device(t.device)
    _use_interpreter_on_cpu(cfg, device)
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
    model = build_model(cfg.model, metadata, train_ids, **kernels).to(device)
    optimizer = make_optimizer(model, cfg)
    state = _load_resumable(resume, cfg, model, optimizer) if resume is not None else {}
    if t.use_torch_compile:
        compile_dense_part(model, t.compile_mode)
    step_fn = functools.partial(train_step, precision=t.precision)
    if t.cuda_graphs:
        if device.type != "cuda":
            raise ValueError(f"train.cuda_graphs needs a CUDA device, the run is on {device}")
        step_fn = GraphedTrainStep(model, optimizer, step_fn)
    train_loader = make_train_loader(cfg.data, data_dir, t.seed, device, train_set)
    eval_loader = BatchLoader(eval_set, cfg.data.eval_batch_size, device=device)
    if len(train_loader) == 0:
        raise ValueError(
            f"data.batch_size: {cfg.data.batch_size} leaves no batch of {train_loader.num_rows} train rows"
        )

    if state.get("loader") is not None:
        train_loader.load_state_dict(state["loader"])
    run_dir = _make_run_dir(cfg, output_dir if output_dir or resume is None else resume.parent.parent)
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
    table_rows = model.sparse_arch.table_rows

    triton_tables = model.sparse_arch.kernel == "triton"

    def checkpoint(name: str, step: int) -> None:
        save_checkpoint(
            run_dir / "checkpoints" / name,
            model=model.state_dict(),
            optimizer=optimizer.state_dict(),
            step=step,
            config=cfg.to_dict(),
            table_rows=table_rows,
            loader=train_loader.state_dict() if isinstance(train_loader, StreamingLoader) else None,
            # The "triton" tables' Adagrad state lives beside them, not in the torch optimizer.
            embedding_optimizer_state=model.sparse_arch.optimizer_state if triton_tables else None,
            best=best,
            evals_since_best=evals_since_best,
        )

    max_steps = t.max_steps or t.epochs * len(train_loader)
    step, samples, steps_run, first_step_s = state.get("step", 0), 0, 0, 0.0
    best, evals_since_best = state.get("best"), state.get("evals_since_best", 0)
    last_eval, last_eval_step = None, None
    loss_sum = torch.zeros((), device=device)
    interval_steps, interval_samples, interval_start = 0, 0, time.perf_counter()
    timed_s, timed_samples = 0.0, 0  # training throughput: first step and evaluations excluded
    train_loss = float("nan")
    start = time.perf_counter()

    def log_interval(epoch: int) -> None:
        """Log the steps since the last log line; the one host sync (loss.item()) of the interval."""
        nonlocal train_loss, timed_s, timed_samples, interval_steps, interval_samples, interval_start
        if not interval_steps:
            return
        train_loss = loss_sum.item() / interval_steps
        elapsed = time.perf_counter() - interval_start
        timed_s, timed_samples = timed_s + elapsed, timed_samples + interval_samples
        writer.add_scalar("train/loss", train_loss, step)
        writer.add_scalar("perf/samples_per_s", interval_samples / elapsed, step)
        writer.add_scalar("lr", optimizer.param_groups[0]["lr"], step)
        logger.info(
            "epoch {} step {} | loss {:.5f} | {:,.0f} samples/s | {:.2f} ms/step",
            epoch,
            step,
            train_loss,
            interval_samples / elapsed,
            1000 * elapsed / interval_steps,
        )
        loss_sum.zero_()
        interval_steps, interval_samples, interval_start = 0, 0, time.perf_counter()

    def run_eval() -> bool:
        """Evaluate, log, keep the best checkpoint; True when early stopping says stop."""
        nonlocal best, last_eval, last_eval_step, evals_since_best, interval_start
        eval_start = time.perf_counter()
        last_eval, last_eval_step = evaluate(model, eval_loader, device), step
        for key in ("auc", "logloss", "ne"):
            writer.add_scalar(f"eval/{key}", last_eval[key], step)
        logger.info(
            "step {} | eval auc {:.4f} logloss {:.4f} ne {:.4f}",
            step,
            last_eval["auc"],
            last_eval["logloss"],
            last_eval["ne"],
        )
        if best is None or last_eval["auc"] > best["auc"]:
            best, evals_since_best = {**last_eval, "step": step}, 0
            checkpoint("best.pt", step)
        else:
            evals_since_best += 1
        interval_start += time.perf_counter() - eval_start
        if t.patience is not None and evals_since_best >= t.patience:
            logger.info("early stop: no better eval AUC in {} evaluations", t.patience)
            return True
        return False

    model.train()
    stop = False
    with make_profiler(cfg.profiler, run_dir, device) as profiler:
        # A resumed run starts inside an epoch: the streaming loader knows where (its restored state); the
        # others replay the epoch's deterministic order and skip the batches already trained on.
        if isinstance(train_loader, StreamingLoader):
            first_epoch, skip = train_loader.epoch, 0
        else:
            first_epoch, skip = divmod(step, len(train_loader))
        for epoch in range(first_epoch, t.epochs):
            if stop or step >= max_steps:
                break
            train_loader.set_epoch(epoch)
            batches = itertools.islice(iter(train_loader), skip if epoch == first_epoch else 0, None)
            while step < max_steps and not stop:
                step_start = time.perf_counter()
                with record_function("data"):
                    batch = next(batches, None)
                if batch is None:
                    break
                loss = step_fn(model, optimizer, batch)
                profiler.step()
                step += 1
                steps_run += 1
                samples += batch.label.numel()
                if steps_run == 1:
                    # The first step pays for compilation (Inductor, Triton JIT): reported apart.
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    first_step_s = time.perf_counter() - step_start
                    logger.info("first step {:.2f} s (includes compile / kernel JIT)", first_step_s)
                    train_loss = loss.item()
                    interval_start = time.perf_counter()
                else:
                    loss_sum += loss.detach()
                    interval_steps += 1
                    interval_samples += batch.label.numel()
                if step % t.log_interval == 0:
                    log_interval(epoch)
                if t.eval_interval and step % t.eval_interval == 0:
                    stop = run_eval()
            log_interval(epoch)
            if not stop and last_eval_step != step:
                stop = run_eval()  # end of epoch
    if last_eval is None:  # a resumed run that had no step left to train
        run_eval()
    wall_s = time.perf_counter() - start
    checkpoint("last.pt", step)
    metrics = {
        "steps": step,
        "samples": samples,
        "train_loss": train_loss,
        "eval_auc": best["auc"],
        "eval_logloss": best["logloss"],
        "eval_ne": best["ne"],
        "best_step": best["step"],
        "eval_split": eval_split,
        "eval_samples": best["samples"],
        "last_eval_auc": last_eval["auc"],
        "samples_per_s": timed_samples / timed_s if timed_s else None,
        "first_step_s": first_step_s,
        "wall_s": wall_s,
        "backend": cfg.backend,
        "mlp_kernel": cfg.mlp_kernel,
        "sparse_kernel": cfg.sparse_kernel,
        "device": str(device),
    }
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    writer.close()
    logger.info(
        "done: {} steps, best eval auc {:.4f} at step {}, metrics in {}",
        step,
        best["auc"],
        best["step"],
        run_dir / "metrics.json",
    )
    return metrics


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    required=True,
    help="JSON run config (see configs/).",
)
@click.option(
    "--use-torch-compile", is_flag=True, help="Compile the MLPs and interaction with torch.compile."
)
@click.option(
    "--compile-mode",
    type=click.Choice(["default", "reduce-overhead"]),
    default=None,
    help="With --use-torch-compile: torch.compile's mode; reduce-overhead adds Inductor's CUDA graphs. "
    "Overrides train.compile_mode.",
)
@click.option(
    "--use-triton",
    is_flag=True,
    help="The model on our Triton kernels, forward and backward: embeddings with the optimizer fused into "
    "backward, interaction, loss, MLP layers. On CPU they run in the Triton interpreter: correct but slow, "
    "meant for tests.",
)
@click.option(
    "--triton-mlp-kernel",
    type=click.Choice(["linear_act", "bias_act"]),
    default=None,
    help="With --use-triton: fused GEMM+bias+activation (linear_act) or cuBLAS GEMM + fused bias+activation "
    "(bias_act). Overrides train.triton_mlp_kernel.",
)
@click.option(
    "--cuda-graphs",
    is_flag=True,
    help="Capture the whole training step once as a CUDA graph and replay it (needs --use-triton, SGD, GPU).",
)
@click.option(
    "--precision",
    type=click.Choice(["fp32", "tf32", "bf16"]),
    default=None,
    help="Overrides train.precision: fp32, tf32 (TF32 matmuls) or bf16 (autocast MLPs and interaction).",
)
@click.option(
    "--output-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Run directory [default: runs/<name>-<timestamp>].",
)
@click.option(
    "--resume",
    type=click.Path(path_type=Path),
    default=None,
    help="Go on from this checkpoint (e.g. runs/<run>/checkpoints/last.pt), in its run directory.",
)
@click.option("--max-steps", type=click.IntRange(min=1), default=None, help="Stop after N training steps.")
@click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default=None,
    help="Overrides train.device from the config.",
)
@click.option("--seed", type=int, default=None, help="Overrides train.seed from the config.")
def main(
    config_path,
    use_torch_compile,
    compile_mode,
    use_triton,
    triton_mlp_kernel,
    cuda_graphs,
    precision,
    output_dir,
    resume,
    max_steps,
    device,
    seed,
):
    """Train a DLRM on preprocessed Criteo data, then `tensorboard --logdir runs`."""
    try:
        cfg = load_config(config_path)
        overrides = {
            "use_torch_compile": use_torch_compile or cfg.train.use_torch_compile,
            "use_triton": use_triton or cfg.train.use_triton,
            "cuda_graphs": cuda_graphs or cfg.train.cuda_graphs,
        }
        for key, value in (
            ("compile_mode", compile_mode),
            ("triton_mlp_kernel", triton_mlp_kernel),
            ("precision", precision),
            ("max_steps", max_steps),
            ("device", device),
            ("seed", seed),
        ):
            if value is not None:
                overrides[key] = value
        train(replace(cfg, "train", **overrides), output_dir, resume)
    except (ValueError, FileNotFoundError) as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
