"""Benchmark the train loaders alone (no model): samples/s of each `data.loader` mode per batch size.

    python scripts/bench_loader.py [--rows 4000000] [--device cuda|cpu] [--batches 2048,16384,65536] \
        [--modes memory,gpu_resident,streaming,binary,streaming_sync] [--shuffle-buffer 1000000] \
        [--prefetch 8] \
        [--repeats 3] [--data-dir DIR]

Writes (once, reused after) a synthetic parquet data directory of `--rows` rows with the Kaggle cardinalities
(python -m dlrm.data.synthetic; row groups of 65,536 rows in shards of 1M rows) and times shuffled epochs
of its train split (80% of the rows) per mode:
    memory          BatchLoader: split in host memory, a pinned copy + host-to-device copy per batch
    gpu_resident    ResidentLoader: split in device memory, device randperm, a device gather per batch
    streaming       StreamingLoader with a background thread `--prefetch` batches ahead (the row-group reads,
                    decoding, shuffle buffer, pinning and side-stream copies all in that thread)
    binary          BinaryLoader: the split's binary column files (python -m dlrm.data.binary, written once
                    beside the parquet), read by threads a window at a time into pinned memory, one
                    host-to-device copy a window, the shuffle and batch gathers on the device
    streaming_sync  StreamingLoader without the thread (prefetch 0): the same work in the consumer
A mode's epoch is timed by the wall clock from the first `next` to the last batch on the device
(synchronized), after one untimed warm-up epoch (page cache, allocator, CUDA context); the median of
`--repeats` epochs is reported, as samples/s and as a ratio to memory's in the same invocation. On CUDA
the bare training step of the same batch is timed in the same invocation (scripts/bench_train.py's
triton+graphs on GPU-resident random batches of `--config` in `--precision`, ids with the synthetic data's
skew) and each loader's rate is given as a ratio to it, `vs_step` (the targets: gpu_resident >= 2x the
step, streaming >= 3M samples/s on 16 cores). Rows go to scripts/results/loader_step.csv. Loading the split
into memory (memory, gpu_resident) is reported apart (setup_s), as is the streaming loader's footer scan.
"""

import statistics
import tempfile
import time
from pathlib import Path

import click
import torch
from bench_train import bench as bench_step
from results_csv import append_rows, provenance

from dlrm.choices import LOADERS
from dlrm.config import DataConfig
from dlrm.data.binary import binary_dir, write_binary
from dlrm.data.dataset import open_split
from dlrm.data.loaders import make_train_loader
from dlrm.data.synthetic_output import write_parquet
from dlrm.data.synthetic_rows import SyntheticConfig

RESULTS = Path(__file__).parent / "results" / "loader_step.csv"
# Bench modes: the config's loaders, plus streaming without its prefetch thread.
MODES = (*LOADERS, "streaming_sync")
ROW_GROUP_ROWS = 1 << 16


def synthetic_dir(rows: int, data_dir: Path | None, binary: bool = False) -> Path:
    """A synthetic parquet data directory of `rows` rows (written when missing), with its train split's
    binary column files where `binary` (written when missing)."""
    path = data_dir or Path(tempfile.gettempdir()) / f"dlrm-bench-loader-{rows}"
    if not (path / "metadata.json").is_file():
        print(f"writing {rows:,} synthetic rows to {path} ...", flush=True)
        write_parquet(SyntheticConfig(), rows, path, block_size=ROW_GROUP_ROWS, overwrite=True)
    if binary and not (binary_dir(path, "train") / "format.json").is_file():
        print(f"writing the train split's binary files under {path} ...", flush=True)
        write_binary(path, ["train"])
    return path


def time_epochs(loader, device: torch.device, repeats: int) -> list[float]:
    """Seconds of each of `repeats` epochs of `loader`, after one warm-up epoch."""
    seconds = []
    for epoch in range(repeats + 1):
        loader.set_epoch(epoch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in loader:
            pass
        if device.type == "cuda":
            torch.cuda.synchronize()
        if epoch:
            seconds.append(time.perf_counter() - start)
    return seconds


def bench(mode: str, data_dir: Path, batch: int, device: torch.device, args: dict, train_set) -> dict:
    """Time shuffled epochs of the train split with `mode` at batch size `batch`."""
    loader_name = "streaming" if mode == "streaming_sync" else mode
    prefetch = 0 if mode == "streaming_sync" else args["prefetch"]
    cfg = DataConfig(
        path=str(data_dir),
        batch_size=batch,
        loader=loader_name,
        shuffle_buffer=args["shuffle_buffer"],
        prefetch=prefetch,
    )
    start = time.perf_counter()
    loader = make_train_loader(cfg, data_dir, seed=0, device=device, train_set=train_set)
    setup_s = time.perf_counter() - start
    seconds = time_epochs(loader, device, args["repeats"])
    epoch_s = statistics.median(seconds)
    rows = len(loader) * batch if cfg.drop_last else loader.num_rows
    result = {
        "mode": mode,
        "batch": batch,
        "rows": rows,
        "shuffle_buffer": args["shuffle_buffer"] if loader_name == "streaming" else "",
        "prefetch": prefetch if loader_name == "streaming" else "",
        "setup_s": round(setup_s, 3),
        "epoch_s": round(epoch_s, 4),
        "samples_per_s": round(rows / epoch_s),
    }
    del loader
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


@click.command(context_settings={"show_default": True})
@click.option("--rows", type=click.IntRange(min=1000), default=4_000_000, help="Synthetic rows (80% train).")
@click.option("--data-dir", type=click.Path(path_type=Path), default=None, help="[default: $TMPDIR/...]")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda")
@click.option("--batches", default="2048,16384,65536", help="Comma-separated batch sizes.")
@click.option("--modes", default=",".join(MODES), help="Comma-separated; memory first for the ratios.")
@click.option("--shuffle-buffer", type=click.IntRange(min=0), default=1_000_000, help="Streaming: rows.")
@click.option("--prefetch", type=click.IntRange(min=1), default=8, help="Streaming: batches read ahead.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, help="Timed epochs per measurement.")
@click.option("--config", default="kaggle", help="CUDA: configs/<name>.json of the bare step compared with.")
@click.option(
    "--precision", type=click.Choice(["fp32", "tf32", "bf16"]), default="bf16", help="CUDA: its precision."
)
def main(rows, data_dir, device, batches, modes, shuffle_buffer, prefetch, repeats, config, precision):
    """Time each loader mode alone; append rows to scripts/results/loader_step.csv."""
    modes = modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise click.BadParameter(f"unknown {', '.join(unknown)} (expected some of {', '.join(MODES)})")
    if device == "cuda" and not torch.cuda.is_available():
        raise click.UsageError("--device cuda needs a CUDA GPU (use --device cpu)")
    dev = torch.device(device)
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    data_dir = synthetic_dir(rows, data_dir, binary="binary" in modes)
    start = time.perf_counter()
    train_set = open_split(data_dir, "train") if {"memory", "gpu_resident"} & set(modes) else None
    load_s = time.perf_counter() - start
    common = provenance(device_name) | {"cpu_threads": torch.get_num_threads(), "load_s": round(load_s, 2)}
    common |= {"step_config": config if device == "cuda" else "", "step_precision": precision}
    args = {"shuffle_buffer": shuffle_buffer, "prefetch": prefetch, "repeats": repeats}
    results = []
    for batch in (int(b) for b in batches.split(",")):
        step_rate = None
        if device == "cuda":  # the step of this batch, in this invocation (ids skewed as the data's)
            step_rate = bench_step(config, "triton+graphs", batch, 50, None, precision, ids="zipf")[
                "samples_per_s"
            ]
        memory = None
        for mode in modes:
            r = bench(mode, data_dir, batch, dev, args, train_set)
            memory = r["samples_per_s"] if mode == "memory" else memory
            ratio = round(r["samples_per_s"] / memory, 3) if memory else None
            vs_step = round(r["samples_per_s"] / step_rate, 3) if step_rate else None
            results.append(
                {**common, **r, "vs_memory": ratio, "step_samples_per_s": step_rate, "vs_step": vs_step}
            )
            print(
                f"{mode:<16}B={batch:<7}{r['samples_per_s']:>14,} samples/s  epoch {r['epoch_s']:>8.3f} s  "
                f"vs memory {ratio or float('nan'):>6.2f}x  vs step {vs_step or float('nan'):>6.2f}x  "
                f"setup {r['setup_s']:.2f} s",
                flush=True,
            )
    append_rows(RESULTS, results)


if __name__ == "__main__":
    main()
