"""Train one config with every backend on the same seed and compare quality and speed.

    python scripts/compare_backends.py --config configs/main.json --backends eager,compile,triton

Prints a table (eval AUC / logloss of the best evaluation, final train loss, samples/s excluding the first
step, first-step seconds including compilation) and appends one row per backend to
scripts/results/backends.csv with the device name, torch/triton versions and git sha. The ratio column is
samples/s over the eager run of the same invocation.
"""

import csv
import dataclasses
import os
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import click
import torch
import triton
from loguru import logger

from dlrm.config import load_config, replace
from dlrm.train import resolve_device, train

RESULTS = Path(__file__).parent / "results" / "backends.csv"
FLAGS = {
    "eager": {},
    "compile": {"use_torch_compile": True},
    "triton": {"use_triton": True},
    "triton_bias_act": {"use_triton": True, "triton_mlp_kernel": "bias_act"},
    "triton+compile": {"use_triton": True, "use_torch_compile": True},
}


def _git_sha() -> str:
    if os.environ.get("GIT_SHA"):
        return os.environ["GIT_SHA"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


@click.command(context_settings={"show_default": True})
@click.option("--config", "config_path", type=click.Path(path_type=Path), default=Path("configs/main.json"))
@click.option("--backends", default="eager,compile,triton,triton+compile", help="Comma-separated backends.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto")
def main(config_path, backends, device):
    cfg = load_config(config_path)
    cfg = dataclasses.replace(cfg, profiler=dataclasses.replace(cfg.profiler, enabled=False))
    names = backends.split(",")
    unknown = [n for n in names if n not in FLAGS]
    if unknown:
        raise click.BadParameter(f"unknown backend {unknown[0]!r}: expected one of {', '.join(FLAGS)}")
    dev = resolve_device(device)
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            run_cfg = replace(cfg, "train", device=device, **FLAGS[name])
            m = train(run_cfg, Path(tmp) / name.replace("+", "_"))
            rows.append(
                {
                    "backend": name,
                    **{
                        k: m[k]
                        for k in (
                            "eval_auc",
                            "eval_logloss",
                            "best_step",
                            "train_loss",
                            "samples_per_s",
                            "first_step_s",
                        )
                    },
                }
            )
    eager = next((r["samples_per_s"] for r in rows if r["backend"] == "eager"), None)
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    common = {
        "date": stamp,
        "config": config_path.stem,
        "batch": cfg.data.batch_size,
        "device": device_name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "git_sha": _git_sha(),
    }
    print(f"{config_path.name}, batch {cfg.data.batch_size}, seed {cfg.train.seed}, {device_name}")
    print(
        f"{'backend':<16}{'eval_auc':>9}{'logloss':>9}{'best_step':>10}{'train_loss':>11}"
        f"{'samples/s':>11}{'vs eager':>9}{'first_step_s':>13}"
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    new_file = not RESULTS.exists()
    with RESULTS.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*common, *rows[0], "ratio_vs_eager"])
        if new_file:
            writer.writeheader()
        for r in rows:
            ratio = r["samples_per_s"] / eager if eager else float("nan")
            writer.writerow({**common, **r, "ratio_vs_eager": round(ratio, 3)})
            print(
                f"{r['backend']:<16}{r['eval_auc']:>9.4f}{r['eval_logloss']:>9.4f}{r['best_step']:>10}"
                f"{r['train_loss']:>11.4f}{r['samples_per_s']:>11,.0f}{ratio:>9.2f}{r['first_step_s']:>13.2f}"
            )


if __name__ == "__main__":
    main()
