"""End-to-end training throughput per loader, data included, against the bare step of the same config.

    python scripts/bench_e2e.py --config kaggle --rows 16000000 --batch 65536 --precision bf16 \
        [--loaders gpu_resident,memory,streaming,binary] [--graphs on,off] [--steps 200] [--data DIR] \
        [--nproc 1,2] [--train-settings bench|config] [--set KEY=VALUE ...] [--keep-runs DIR] \
        [--val-fraction 0.025]

Generates `--rows` synthetic rows (python -m dlrm.data.synthetic --output-dir, Kaggle cardinalities; a
`--val-fraction` share of them val, a fortieth test) into `--data` once, writes their binary splits
(python -m dlrm.data.binary), then per loader and with/without `--cuda-graphs` runs the real
`python -m dlrm.train --use-triton` in a subprocess for `--steps` steps
(evaluating the eval split every steps / 4; the config's tables modulus-hashed, the hashing every loader
takes: binary and streaming hold no train vocabulary) and reads its metrics.json and profiler trace: samples/s
with the data path included (first step and evaluations excluded, as the training log reports it), the first
evaluation's time and the samples/s of the later ones, the peak host RSS of the training process, and the
GPU's idle share in the profiled window (1 - the union of kernel and copy intervals over the window's span).
The same invocation also times the bare training step on GPU-resident random batches whose ids have the
synthetic data's skew (scripts/bench_train.py --ids zipf; backend triton+graphs for the runs with graphs,
triton for those without: like with like) and reports each run's ratio to it and to the gpu_resident run of
the same graph setting (whatever the loaders' order), and profiles 10 such bare steps for their GPU idle
share: the gaps between the kernels of a replayed graph, which no data path can remove (`step_gpu_idle_share`;
what a run's share has above it is what its loop and data path leave idle).
`--nproc 1,2` runs each training once per GPU count, N > 1 under `torchrun --standalone --nproc-per-node N`
(weak scaling: `--batch` is the batch per GPU, `data.batch_size` the global N x `--batch`, as
scripts/bench_train.py's `--nproc` counts it), beside the bare step of the same N (bench_train under
torchrun, its W=N row); a row's `time` is the run's own breakdown of its wall time (metrics.json's
`time_per_rank`, dlrm.run.timing's line: rank 0 and the range over the ranks), where a sharded rank's loader
waits, exchanges, logging and evaluations show.
`--train-settings config` trains with the config's own train and profiler sections instead (its epochs, log
and evaluation cadence, checkpoint policy, profiler window; `--steps` unused): the run a user launches, with
only the data (path, batch, loader) and the hashing set, as `--set` would. The default, "bench", runs
`--steps` steps with a log line every 50, an evaluation every steps / 4 (each better one a background save of
best.pt) and the profiler's window mid-run: the same run for every loader. `--set KEY=VALUE` (repeatable)
goes to every run's `dlrm.train --set`, after those settings (e.g. `train.checkpoint_policy="none"`: the same
run with no save beside its steps); a row's `train_settings` names the settings and the overrides.
`--keep-runs DIR` keeps each run's directory (its log, metrics.json, TensorBoard events and rank 0's profiler
trace, where the host's part of each step shows) under DIR; the runs' checkpoints are left out.
Rows go to scripts/results/e2e.csv.
"""

import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import click
import torch
from bench_train import bench, build, launch_each, launcher
from profile_step import profile_steps
from results_csv import append_rows, provenance

from dlrm.config import load_config
from dlrm.run.timing import describe

RESULTS = Path(__file__).parent / "results" / "e2e.csv"
# The bare step each train run is compared with: graph replays with graph replays, launches with launches.
BARE_STEP = {"on": "triton+graphs", "off": "triton"}
TEST_FRACTION = 0.025  # the generated rows' test split (the runs report its AUC once, at the end)
REPO = Path(__file__).parents[1]


def bare_step(config: str, backend: str, batch: int, precision: str, nproc: int) -> float:
    """Samples/s of the bare step (bench_train's `bench`, GPU-resident random batches with Zipf ids, 50 timed
    steps) on `nproc` GPUs, `batch` each: in this process for one, bench_train under torchrun for more (its
    W=N row handed back, not written to train.csv)."""
    if nproc == 1:
        return bench(config, backend, batch, 50, None, precision, ids="zipf")["samples_per_s"]
    args = ["--configs", config, "--batches", str(batch), "--precisions", precision, "--backends", backend,
            "--ids", "zipf", "--steps", "50"]  # fmt: skip
    (row,) = launch_each([nproc], args)
    return row["samples_per_s"]


def gpu_idle_share(trace: Path) -> float:
    """1 - (union of GPU kernel/memcpy/memset intervals) / (first GPU start .. last GPU end) of a trace."""
    events = json.loads(trace.read_text())["traceEvents"]
    spans = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    if not spans:
        return float("nan")
    busy, (start, end) = 0.0, spans[0]
    first = start
    for lo, hi in spans[1:]:
        if lo > end:
            busy += end - start
            start, end = lo, hi
        else:
            end = max(end, hi)
    busy += end - start
    return 1 - busy / (end - first)


def step_idle_share(config: str, batch: int, precision: str) -> float:
    """`gpu_idle_share` of 10 bare steps (profile_step's, backend triton+graphs, Zipf ids): the idle share a
    run has with no data path and no loop at all, the floor of the runs' (the few-microsecond gaps between
    the kernels of a replayed graph)."""
    prof = profile_steps(build(config, "triton+graphs", batch, None, precision, "zipf"), 10)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "step.pt.trace.json"
        prof.export_chrome_trace(str(trace))
        return gpu_idle_share(trace)


def ensure_data(data: Path, rows: int, val_fraction: float) -> None:
    if not (data / "metadata.json").is_file():
        synthetic = [
            sys.executable,
            "-m",
            "dlrm.data.synthetic",
            "--rows",
            str(rows),
            "--output-dir",
            str(data),
        ]
        splits = ["--val-fraction", str(val_fraction), "--test-fraction", str(TEST_FRACTION)]
        subprocess.run([*synthetic, *splits, "--overwrite"], check=True)
    if not (data / "binary" / "train" / "format.json").is_file():
        subprocess.run([sys.executable, "-m", "dlrm.data.binary", "--data", str(data)], check=True)


def run_config(
    config: str, data: Path, loader: str, batch: int, steps: int, nproc: int = 1, settings: str = "bench"
) -> dict:
    """configs/<config>.json as a training run on `data` takes it, `batch` rows a GPU on `nproc` GPUs
    (data.batch_size the global batch): with `settings` "bench", `steps` steps at the bench's cadence
    (module docstring); with "config", the config's own train and profiler sections."""
    cfg = load_config(REPO / "configs" / f"{config}.json").to_dict()
    global_batch = batch * nproc
    cfg["data"] |= {"path": str(data), "batch_size": global_batch, "eval_batch_size": global_batch}
    cfg["data"]["loader"] = loader
    cfg["model"] |= {"hashing": "modulus", "min_frequency": 1}
    if settings == "config":
        return cfg
    train_rows = json.loads((data / "metadata.json").read_text())["rows"]["train"]
    # As many epochs as `steps` needs: a one-epoch run of a small split is over before its start-up (the
    # loader's first reads, the graph's capture) stops weighing on its samples/s.
    epochs = -(-steps * global_batch // train_rows)
    cfg["train"] |= {"epochs": epochs, "max_steps": steps, "log_interval": 50}
    cfg["profiler"] = {"enabled": True, "wait": steps // 2, "warmup": 3, "active": 10}
    cfg["train"]["eval_interval"] = steps // 4  # several evaluations: the first pays for JIT, the rest not
    return cfg


def train_run(
    config: str,
    data: Path,
    loader: str,
    graphs: bool,
    batch: int,
    precision: str,
    steps: int,
    nproc: int = 1,
    settings: str = "bench",
    overrides: tuple[str, ...] = (),
    keep: Path | None = None,
) -> dict:
    """One `python -m dlrm.train` run on `nproc` GPUs (`batch` each, `settings` as `run_config`'s, then each
    KEY=VALUE of `overrides` as `--set`); its metrics.json plus the GPU idle share of its (rank 0's) trace
    (NaN when the run ended before the profiler's window). With `keep`, the run directory is copied there,
    its checkpoints left out (gigabytes of tables)."""
    cfg = run_config(config, data, loader, batch, steps, nproc, settings)
    with tempfile.TemporaryDirectory() as tmp:
        config_path, run_dir = Path(tmp) / "config.json", Path(tmp) / "run"
        config_path.write_text(json.dumps(cfg))
        command = [*launcher(nproc), "-m", "dlrm.train", "--config", str(config_path), "--use-triton",
                   "--precision", precision, "--output-dir", str(run_dir),
                   *(arg for override in overrides for arg in ("--set", override))]  # fmt: skip
        subprocess.run([*command, "--cuda-graphs" if graphs else "--no-cuda-graphs"], check=True)
        metrics = json.loads((run_dir / "metrics.json").read_text())
        traces = sorted(run_dir.glob("*.pt.trace.json"))
        metrics["gpu_idle_share"] = gpu_idle_share(traces[0]) if traces else float("nan")
        if keep is not None:
            shutil.copytree(run_dir, keep, ignore=shutil.ignore_patterns("checkpoints"), dirs_exist_ok=True)
    return metrics


@click.command(context_settings={"show_default": True})
@click.option("--config", default="kaggle", help="configs/<name>.json (architecture and tables).")
@click.option("--rows", type=click.IntRange(min=1), default=16_000_000, help="Synthetic rows to generate.")
@click.option(
    "--data", type=click.Path(path_type=Path), default=None, help="[default: /tmp/e2e-<rows>-val<F>]"
)
@click.option("--batch", type=click.IntRange(min=1), default=65536)
@click.option("--precision", type=click.Choice(["fp32", "tf32", "bf16"]), default="bf16")
@click.option("--loaders", default="gpu_resident,memory,streaming,binary", help="Comma-separated.")
@click.option("--graphs", default="on,off", help="Comma-separated: on (--cuda-graphs), off.")
@click.option("--steps", type=click.IntRange(min=20), default=200, help="Training steps per run.")
@click.option(
    "--nproc", default="1", help="Comma-separated GPU counts (N > 1: torchrun; --batch per GPU, N x global)."
)
@click.option(
    "--train-settings",
    type=click.Choice(["bench", "config"]),
    default="bench",
    help="bench: --steps steps at the bench's log and evaluation cadence; config: the config's own.",
)
@click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE", help="dlrm.train --set for every run, last."
)
@click.option(
    "--keep-runs",
    type=click.Path(path_type=Path),
    default=None,
    help="Keep each run's directory (log, metrics.json, events, profiler traces; no checkpoints) under "
    "DIR/w<N>_<loader>_graphs-<on|off>.",
)
@click.option(
    "--val-fraction", type=click.FloatRange(0.0, 0.5, min_open=True), default=0.025, show_default=True,
    help="Share of the generated rows in the val split, which every evaluation scores: a larger one times "
    "the evaluations' samples/s above their fixed costs.",
)  # fmt: skip
def main(
    config, rows, data, batch, precision, loaders, graphs, steps, nproc, train_settings, overrides, keep_runs,
    val_fraction,
):  # fmt: skip
    """Train per loader with data included; compare with the bare step; append to scripts/results/e2e.csv."""
    if not torch.cuda.is_available():
        raise click.UsageError("bench_e2e.py needs a CUDA GPU")
    counts = [int(n) for n in nproc.split(",")]
    if max(counts) > torch.cuda.device_count() or min(counts) < 1:
        raise click.UsageError(f"--nproc {nproc}: this host has {torch.cuda.device_count()} GPUs")
    data = data or Path(tempfile.gettempdir()) / f"e2e-{rows}-val{val_fraction}"
    ensure_data(data, rows, val_fraction)
    # The bare step on random batches with the data's id skew (dlrm.data.synthetic's Zipf ranks), so that
    # the ratios compare the same embedding traffic: uniform ids have no hot rows.
    bare = {
        (graph, n): bare_step(config, BARE_STEP[graph], batch, precision, n)
        for graph in graphs.split(",")
        for n in counts
    }
    step_idle = step_idle_share(config, batch, precision)
    print(
        f"bare step (resident random batches, Zipf ids): {bare} samples/s by (graphs, GPUs), one GPU idle "
        f"{step_idle:.1%} with graphs (the gaps between the replayed graph's kernels)",
        flush=True,
    )
    common = provenance(torch.cuda.get_device_name()) | {"cpus": os.cpu_count(), "config": config}
    common |= {"rows": rows, "batch": batch, "precision": precision}
    out = []
    for n, graph, loader in itertools.product(counts, graphs.split(","), loaders.split(",")):
        keep = keep_runs / f"w{n}_{loader}_graphs-{graph}" if keep_runs else None
        m = train_run(
            config, data, loader, graph == "on", batch, precision, steps, n, train_settings, overrides, keep
        )
        step = bare[graph, n]
        later_evals = m["evals"] - 1
        later_s = m["eval_s"] - m["first_eval_s"]
        row = {
            **common, "step_samples_per_s": step, "loader": loader, "cuda_graphs": graph,
            "steps": m["steps"], "samples_per_s": round(m["samples_per_s"]),
            "vs_step": round(m["samples_per_s"] / step, 3), "vs_gpu_resident": "",
            "gpu_idle_share": round(m["gpu_idle_share"], 4),
            "step_gpu_idle_share": round(step_idle, 4),
            "first_eval_s": round(m["first_eval_s"], 2),
            "eval_samples_per_s": round(later_evals * m["val_samples"] / later_s) if later_evals else "",
            "peak_rss_gib": round(m["peak_rss_gib"], 2),
            "first_step_s": round(m["first_step_s"], 1),
            "world_size": n, "global_batch": batch * n, "time": describe(m["time_per_rank"]),
            "train_settings": " ".join([train_settings, *overrides]),
        }  # fmt: skip
        out.append(row)
        # At once, not only in the table at the end: a call cut by its deadline still shows the runs it made.
        rate = f"{row['samples_per_s']:,} samples/s, {row['vs_step']:.3f}x step"
        print(f"W={n} {loader} graphs {graph}: {rate}", flush=True)
    resident = {
        (r["cuda_graphs"], r["world_size"]): r["samples_per_s"] for r in out if r["loader"] == "gpu_resident"
    }
    for row in out:
        if (key := (row["cuda_graphs"], row["world_size"])) in resident:
            row["vs_gpu_resident"] = round(row["samples_per_s"] / resident[key], 3)
        later = row["eval_samples_per_s"]
        evals = f"then {later:,} samples/s" if later else "no later evaluation"
        print(
            f"W={row['world_size']} {row['loader']:<13} graphs {row['cuda_graphs']:<4} "
            f"{row['samples_per_s']:>12,} samples/s  "
            f"{row['vs_step']:.3f}x step  {row['vs_gpu_resident'] or float('nan'):.3f}x resident  "
            f"GPU idle {row['gpu_idle_share']:.1%}  "
            f"first eval {row['first_eval_s']} s, {evals}  "
            f"RSS {row['peak_rss_gib']} GiB\n  {row['time']}",
            flush=True,
        )
    append_rows(RESULTS, out)


if __name__ == "__main__":
    main()
