"""`python -m dlrm.train`: train a DLRM on preprocessed Criteo data (the loop is dlrm.run.loop.train).

Each run writes into its own directory (default `runs/<name>-<timestamp>/`): config.json (resolved config),
TensorBoard events, a profiler trace `*.pt.trace.json`, checkpoints/last.pt and best.pt, and metrics.json.
Watch it with `make tensorboard` (or `.venv/bin/tensorboard --logdir runs`).

Many GPUs: `torchrun --nproc-per-node N -m dlrm.train --config C [flags]` (dlrm.parallel; README "Many GPUs").
"""

import functools
import os
import shlex
import sys
from pathlib import Path

import click

from dlrm import parallel, progress
from dlrm.atomic import disk_full
from dlrm.choices import COMPILE_MODES, DEVICES, PRECISIONS, TRITON_MLP_KERNELS
from dlrm.cli_options import choice_option, command, path_option, set_option
from dlrm.config import apply_overrides, load_config, replace
from dlrm.errors import EXIT_BAD_INPUT, Interrupted, RunStopped, cli_errors, os_error_line
from dlrm.parallel.checkpoint import CheckpointError
from dlrm.run.loop import train


@command
@path_option(
    "--config",
    "config_path",
    required=True,
    help="JSON run config (see configs/).",
)
@set_option
@click.option(
    "--use-torch-compile/--no-use-torch-compile",
    default=None,
    help="Compile the MLPs and interaction with torch.compile. Overrides train.use_torch_compile "
    "[default: the config's].",
)
@choice_option(
    "--compile-mode",
    choices=COMPILE_MODES,
    default=None,
    help="With --use-torch-compile: torch.compile's mode; reduce-overhead adds Inductor's CUDA graphs, "
    "auto takes the one measured faster for the run (the log names it). Overrides train.compile_mode.",
)
@click.option(
    "--use-triton/--no-use-triton",
    default=None,
    help="The model on our Triton kernels, forward and backward: embeddings with the optimizer fused into "
    "backward, interaction, loss, MLP layers. On CPU they run in the Triton interpreter: correct but slow, "
    "meant for tests. Overrides train.use_triton [default: the config's].",
)
@choice_option(
    "--triton-mlp-kernel",
    choices=TRITON_MLP_KERNELS,
    default=None,
    help="With --use-triton: fused GEMM+bias+activation (linear_act), cuBLAS GEMM + fused bias+activation "
    "(bias_act), or the same with the bias+activation in CUDA C++ (cuda_bias_act, built on first use; GPU "
    "only). Overrides train.triton_mlp_kernel.",
)
@click.option(
    "--cuda-graphs/--no-cuda-graphs",
    default=None,
    help="Capture the whole training step once as a CUDA graph and replay it (needs --use-triton and a GPU). "
    "Default (train.cuda_graphs null): on wherever it works, i.e. --use-triton on one GPU; the log "
    "says why when it cannot.",
)
@choice_option(
    "--precision",
    choices=PRECISIONS,
    default=None,
    help="Overrides train.precision: fp32, tf32 (TF32 matmuls) or bf16 (autocast MLPs and interaction).",
)
@path_option(
    "--output-dir",
    help="Run directory [default: runs/<name>-<timestamp>]. One that already holds a run is refused "
    "unless --resume or --overwrite.",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="Delete the earlier run in the run directory before starting; refused for a directory that is not "
    "a run's (.dlrm-run), holds other files, or is the working directory or one above it.",
)
@path_option(
    "--resume",
    help="Go on from this checkpoint (e.g. runs/<run>/checkpoints/last.pt, or .../last of a torchrun run, on "
    "any number of ranks), in its run directory.",
)
@path_option(
    "--kernel-choices",
    help="Launch the kernels that this checkpoint's run tuned (same GPU model and Triton; as many ranks), "
    "to repeat that run bit for bit; a --resume takes its checkpoint's by default.",
)
@click.option("--max-steps", type=click.IntRange(min=1), default=None, help="Stop after N training steps.")
@choice_option(
    "--device",
    choices=DEVICES,
    default=None,
    help="Overrides train.device from the config.",
)
@click.option("--seed", type=int, default=None, help="Overrides train.seed from the config.")
@click.option(
    "--quiet",
    is_flag=True,
    help="No progress bar and no log lines but warnings and errors. Without it: a progress bar (epoch, "
    "step/steps, samples/s, loss, ETA; evaluation) when stdout is a terminal, else a log line per "
    "train.log_interval steps and per evaluation.",
)
def main(
    config_path,
    overrides,
    use_torch_compile,
    compile_mode,
    use_triton,
    triton_mlp_kernel,
    cuda_graphs,
    precision,
    output_dir,
    overwrite,
    resume,
    kernel_choices,
    max_steps,
    device,
    seed,
    quiet,
):
    """Train a DLRM on preprocessed Criteo data; watch it with `.venv/bin/tensorboard --logdir runs`.

    Exit status: 0 done, 2 bad input or a full disk (one line naming the file or key), 3 non-finite loss,
    130 / 143 stopped by SIGINT / SIGTERM (checkpoints/last.pt written; the line says how to go on).
    """
    mode = progress.configure("quiet" if quiet else "auto")
    with cli_errors(report):
        cfg = apply_overrides(load_config(config_path), overrides)
        flags = {}
        for key, value in (
            ("use_torch_compile", use_torch_compile),
            ("use_triton", use_triton),
            ("cuda_graphs", cuda_graphs),
            ("compile_mode", compile_mode),
            ("triton_mlp_kernel", triton_mlp_kernel),
            ("precision", precision),
            ("max_steps", max_steps),
            ("device", device),
            ("seed", seed),
        ):
            if value is not None:
                flags[key] = value
        # Under torchrun, what a rank that ends the job for a dead peer says to go on (dlrm.parallel).
        parallel.set_resume_command(functools.partial(resume_command, click.get_current_context()))
        try:
            train(
                replace(cfg, "train", **flags),
                output_dir,
                resume,
                overwrite=overwrite,
                progress=mode,
                kernel_choices=kernel_choices,
            )
        except RunStopped as err:
            if err.checkpoint is not None:
                command = resume_command(click.get_current_context(), err.checkpoint)
                err.args = (f"{err}; go on with: {command}",)
            if isinstance(err, Interrupted) and parallel.is_distributed():
                stop_every_rank(str(err), err.exit_code)
            raise
        except CheckpointError as err:  # under torchrun, on every rank at once (a full disk, no room)
            if parallel.is_distributed():
                stop_every_rank(os_error_line(err), EXIT_BAD_INPUT)
            raise
        except Exception as err:
            # A full disk on one rank (rank 0 writes metrics.json, TensorBoard) is its one line, as in
            # one process (`report` ends the other ranks); anything else names the rank that failed or
            # stopped (never returns).
            if parallel.is_distributed() and disk_full(err, None) is None:
                parallel.fail(err)
            raise
    parallel.shutdown()


def report(message: str, code: int) -> None:
    """One `error:` line (naming the rank under torchrun); the other ranks are told to end too; exit."""
    click.echo(f"{parallel.rank_prefix()}error: {message}", err=True)
    parallel.abort_peers(f"error: {message}", code)
    parallel.exit_now(code)


def stop_every_rank(message: str, code: int) -> None:
    """End a torchrun job that every rank stops at the same point (a signal: every rank stopped at the
    same step and wrote its part of the checkpoint; a full disk while they wrote one): all leave the
    process group together (no rank is aborted), rank 0 prints `message` as the one line, and every rank
    exits `code`. Never returns."""
    rank, _, _ = parallel.world_from_env()
    parallel.shutdown()
    if rank == 0:
        click.echo(f"error: {message}", err=True)
    # Everything is written and closed; the interpreter's own shutdown takes seconds after gloo's.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def resume_command(ctx: click.Context, checkpoint: Path) -> str:
    """The command line that goes on from `checkpoint`: this one's options (as parsed), without
    --output-dir, --overwrite, --resume and --kernel-choices (the checkpoint holds the run's), plus
    `--resume checkpoint`; under torchrun, a torchrun of as many processes (a sharded checkpoint also
    resumes on any other number, or in one process)."""
    args = [sys.executable, "-m", "dlrm.train"]
    _, world_size, _ = parallel.world_from_env()
    if world_size > 1:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        nodes = ["--nnodes", str(world_size // per_node)] if per_node != world_size else []
        args = ["torchrun", *nodes, "--nproc-per-node", str(per_node), "-m", "dlrm.train"]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if param.name in ("output_dir", "overwrite", "resume", "kernel_choices") or value is None:
            continue
        if value is False:  # an unset flag, or the off side of a pair such as --no-cuda-graphs
            args += param.secondary_opts[:1]
            continue
        if param.multiple:  # --set KEY=VALUE, each as given
            args += [arg for item in value for arg in (param.opts[0], item)]
            continue
        args += [param.opts[0]] if getattr(param, "is_flag", False) else [param.opts[0], str(value)]
    return shlex.join([*args, "--resume", str(checkpoint)])


if __name__ == "__main__":
    main()
