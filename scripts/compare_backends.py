"""Train one config with every backend on the same seed and compare quality and speed.

    python scripts/compare_backends.py --config configs/main.json --backends eager,compile,triton

Prints a table (val AUC of the best evaluation, which selects the weights, and test AUC / logloss of those
weights; final train loss, samples/s excluding the first step, first-step seconds including compilation,
the largest gap between the backend's logged train loss and eager's at the same steps) and appends one row
per backend to scripts/results/backends-val-test.csv with the device name, torch/triton versions and git
sha. The ratio column is samples/s over the eager run of the same invocation. (scripts/results/backends.csv
holds the rows of before the train / val / test protocol, whose eval_auc selected and reported on one
split.)
"compile" is the product's `--use-torch-compile` as a user runs it (on one GPU: the whole-step CUDA graph
around the compiled dense part, dlrm.step.resolve_cuda_graphs); "compile-ro" Inductor's own CUDA graphs of
the compiled part, the tables eager.
"""

import dataclasses
import os
import sys
import tempfile
from pathlib import Path

import click
import torch
from loguru import logger
from results_csv import append_rows, provenance
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dlrm.choices import PRECISIONS
from dlrm.config import load_config, replace
from dlrm.device import resolve_device
from dlrm.run.loop import train

RESULTS = Path(__file__).parent / "results" / "backends-val-test.csv"
FLAGS = {
    "eager": {},
    "compile": {"use_torch_compile": True},
    "compile-ro": {"use_torch_compile": True, "compile_mode": "reduce-overhead"},
    "triton": {"use_triton": True, "cuda_graphs": False},
    "triton_bias_act": {"use_triton": True, "triton_mlp_kernel": "bias_act", "cuda_graphs": False},
    "triton+compile": {"use_triton": True, "use_torch_compile": True, "cuda_graphs": False},
    "triton+graphs": {"use_triton": True, "cuda_graphs": True},
}


def _flags(name: str) -> dict:
    """Train overrides of a backend name, with an optional precision suffix: "triton+graphs@bf16"."""
    backend, _, precision = name.partition("@")
    return {**FLAGS[backend], "precision": precision or "fp32"}


def _loss_curve(run_dir: Path) -> list[float]:
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return [e.value for e in events.Scalars("train/loss")]


@click.command(context_settings={"show_default": True})
@click.option("--config", "config_path", type=click.Path(path_type=Path), default=Path("configs/main.json"))
@click.option(
    "--backends",
    default="eager,compile,triton,triton+compile",
    help="Comma-separated backends, each optionally with a precision: triton+graphs@bf16 (default fp32).",
)
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto")
@click.option("--max-steps", type=click.IntRange(min=2), default=None, help="Overrides train.max_steps.")
@click.option(
    "--log-interval", type=click.IntRange(min=1), default=None, help="Overrides train.log_interval."
)
def main(config_path, backends, device, max_steps, log_interval):
    """Train CONFIG once per backend on the same seed; print and record quality, speed and loss-curve gaps."""
    cfg = load_config(config_path)
    cfg = dataclasses.replace(cfg, profiler=dataclasses.replace(cfg.profiler, enabled=False))
    overrides = {k: v for k, v in (("max_steps", max_steps), ("log_interval", log_interval)) if v is not None}
    cfg = replace(cfg, "train", device=device, **overrides)
    names = backends.split(",")
    unknown = [
        n for n in names if n.partition("@")[0] not in FLAGS or n.partition("@")[2] not in PRECISIONS + ("",)
    ]
    if unknown:
        raise click.BadParameter(
            f"unknown backend {unknown[0]!r}: expected one of {', '.join(FLAGS)}, "
            f"optionally with @{' or @'.join(PRECISIONS)}"
        )
    dev = resolve_device(device)
    if dev.type == "cpu" and any("triton" in name for name in names):
        # Before anything imports triton (the compile backend does): our kernels run in the interpreter.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    keys = ("val_auc", "best_step", "test_auc", "test_logloss", "train_loss", "samples_per_s", "first_step_s")
    rows, curves = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            run_dir = Path(tmp) / name.replace("+", "_").replace("@", "_")
            metrics = train(replace(cfg, "train", **_flags(name)), run_dir)
            curves[name] = _loss_curve(run_dir)
            rows.append({"backend": name, **{k: metrics[k] for k in keys}})
    eager = next((r for r in rows if r["backend"] == "eager"), None)
    for r in rows:
        r["ratio_vs_eager"] = round(r["samples_per_s"] / eager["samples_per_s"], 3) if eager else None
        gaps = [abs(a - b) for a, b in zip(curves[r["backend"]], curves.get("eager", []), strict=False)]
        r["max_loss_gap_vs_eager"] = max(gaps) if eager else None
    common = {**provenance(device_name), "config": config_path.stem, "batch": cfg.data.batch_size}
    common["steps"] = cfg.train.max_steps
    append_rows(RESULTS, [{**common, **r} for r in rows])
    print(f"{config_path.name}, batch {cfg.data.batch_size}, seed {cfg.train.seed}, {device_name}")
    header = ("backend", "val_auc", "best_step", "test_auc", "test_logloss", "train_loss", "samples/s",
              "vs eager", "first_s", "max loss gap")  # fmt: skip
    print(f"{header[0]:<16}" + "".join(f"{h:>13}" for h in header[1:]))
    for r in rows:
        print(
            f"{r['backend']:<16}{_num(r['val_auc'])}{r['best_step']!s:>13}"
            f"{_num(r['test_auc'])}{_num(r['test_logloss'])}"
            f"{r['train_loss']:>13.4f}{r['samples_per_s']:>13,.0f}{r['ratio_vs_eager'] or 0:>13.2f}"
            f"{r['first_step_s']:>13.2f}{r['max_loss_gap_vs_eager'] or 0:>13.2e}"
        )


def _num(value: float | None) -> str:
    return f"{'none':>13}" if value is None else f"{value:>13.4f}"  # null when no evaluation was finite


if __name__ == "__main__":
    main()
