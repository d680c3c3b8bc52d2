"""`python -m dlrm.train`: train a DLRM on preprocessed Criteo data (the loop is dlrm.loop.train).

Each run writes into its own directory (default `runs/<name>-<timestamp>/`): config.json (resolved config),
TensorBoard events, a profiler trace `*.pt.trace.json`, checkpoints/last.pt and best.pt, and metrics.json.
Watch it with `tensorboard --logdir runs`.

Many GPUs: `torchrun --nproc-per-node N -m dlrm.train --config C [flags]` (dlrm.parallel; README "Many GPUs").
"""

from pathlib import Path

import click

from dlrm import parallel
from dlrm.config import load_config, replace
from dlrm.loop import train


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
    help="Go on from this checkpoint (e.g. runs/<run>/checkpoints/last.pt, or .../last of a torchrun run, on "
    "any number of ranks), in its run directory.",
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
        click.echo(f"{parallel.rank_prefix()}error: {err}", err=True)
        parallel.abort_peers(f"error: {err}")  # under torchrun: the other ranks end too, at once
        parallel.exit_now(2)
    except Exception as err:
        if parallel.is_distributed():
            parallel.fail(err)  # one message naming the rank that failed or stopped; never returns
        raise
    parallel.shutdown()


if __name__ == "__main__":
    main()
