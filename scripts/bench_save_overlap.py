"""What a checkpoint written in the background costs the training step beside it, part by part.

    python scripts/bench_save_overlap.py [--gib 4] [--step-ms 20] [--dir /tmp/bench_save_overlap]

A stand-in for the training step runs in the main thread, back to back, the host waiting for each (as
dlrm.train's loop does when it logs every step): on a GPU one CUDA graph of bf16 GEMMs sized to take about
`--step-ms`, on the CPU a loop of fp32 matmuls. Beside it a second thread does one part of what
dlrm.parallel.checkpoint's background save does with a snapshot of `--gib` GiB, chunk by chunk
(dlrm.staging.CHUNK_BYTES), in the thread's own CUDA stream as the save does:

- d2h_pageable: each chunk to a new pageable host tensor (`.cpu()`);
- d2h_nonblocking: each chunk by `.to("cpu", non_blocking=True)` and a wait on the stream, what DCP's file
  writer does with a GPU tensor on a machine with CUDA (the copy lands in page-locked memory from torch's
  caching host allocator: page-locking a new block is a driver call);
- d2h_pinned: each chunk into one reused page-locked buffer (non_blocking, an event waited on);
- sha256: hashlib over a host chunk (the save hashes every byte it writes);
- write_fsync: a host chunk written to a file in `--dir` and fsynced (DCP's sync_files);
- writer: d2h_nonblocking, sha256 and write_fsync of each chunk in turn (the save's writing without DCP);
- dcp: dlrm.parallel.checkpoint's own writing (DCP, each file hashed, meta.json) of a rank's state over
  the snapshot's bytes: TABLES tables' bf16 weights and fp32 Adagrad state as ShardedTensors in pieces of
  CHUNK_BYTES (one gloo rank).

`--switch-interval` sets Python's (sys.setswitchinterval, 5 ms by default): how long a thread that wants
the GIL waits before the one holding it is asked to let go. A step that waits for the GIL after each CUDA
call it makes pays up to that much each time the other thread runs Python.

torch's cache of page-locked blocks is emptied before each condition, so each starts as a process's first
save does. Each condition's row: the median (and the longest) step while the thread worked against the
median step alone, measured right before it in the same process. Which part slows the step says where a fix
belongs (a reused page-locked buffer, the hashing, the disk, DCP's own Python). Rows to
scripts/results/save_overlap.csv.
"""

import hashlib
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import click
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_csv import append_rows, provenance  # noqa: E402

from dlrm.parallel.checkpoint import _save, _sharded, table_key  # noqa: E402
from dlrm.parallel.group import SINGLE  # noqa: E402
from dlrm.parallel.planner import ShardingPlan, plan_tables  # noqa: E402
from dlrm.staging import CHUNK_BYTES  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "save_overlap.csv"
TABLES, DIM = 6, 128  # the dcp part's tables (a rank of dlrm_dcnv2 on 2 GPUs holds about as many)
GIB = 2**30
CONDITIONS = ("d2h_pageable", "d2h_nonblocking", "d2h_pinned", "sha256", "write_fsync", "writer", "dcp")
CUDA_ONLY = ("d2h_pageable", "d2h_nonblocking", "d2h_pinned")
ALONE_STEPS = 30


def make_step(device: torch.device, step_ms: float) -> Callable[[], None]:
    """A call that runs one step and waits for it: a replayed CUDA graph of bf16 [8192, 8192] GEMMs (enough
    of them to take about `step_ms`), or on the CPU fp32 [256, 256] matmuls."""
    if device.type == "cpu":
        x, w = torch.randn(256, 256), torch.randn(256, 256) / 16

        def cpu_step() -> None:
            y = x
            for _ in range(max(1, round(step_ms / 2))):
                y = torch.tanh(y @ w)

        return cpu_step
    x = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    w = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) / 90
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):  # cuBLAS's first call (handle, workspace, heuristics) is no GEMM's time
        torch.tanh(x @ w)
    start.record()
    for _ in range(10):
        torch.tanh(x @ w)
    end.record()
    end.synchronize()
    gemms = max(1, round(step_ms / (start.elapsed_time(end) / 10)))
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graphs asks
        y = x
        for _ in range(gemms):
            y = torch.tanh(y @ w)
    torch.cuda.current_stream(device).wait_stream(side)
    with torch.cuda.graph(graph):
        y = x
        for _ in range(gemms):
            y = torch.tanh(y @ w)

    def gpu_step() -> None:
        graph.replay()
        torch.cuda.current_stream(device).synchronize()

    return gpu_step


def sharded_state(snapshot: torch.Tensor) -> tuple[dict, ShardingPlan]:
    """A rank's checkpoint state as dlrm.parallel.checkpoint writes it, over the snapshot's bytes (uint8
    [n]): TABLES tables of bf16 weights [R, D] and fp32 Adagrad state [R, D] (views of `snapshot`, cut into
    pieces of CHUNK_BYTES as the save cuts them), all on one rank."""
    rows = max(1, snapshot.numel() // (TABLES * DIM * (2 + 4)))
    plan = plan_tables([rows] * TABLES, DIM, "adagrad", 1)
    state, at = {}, 0
    for f in range(TABLES):
        for name, dtype in (("model", torch.bfloat16), ("optim", torch.float32)):
            size = rows * DIM * dtype.itemsize
            local = snapshot[at : at + size].view(dtype).view(rows, DIM)
            state[f"{name}/{table_key(f)}"] = _sharded(plan, 0, f, local, (DIM,), dtype, CHUNK_BYTES)
            at += size
    return state, plan


def to_host_as_dcp(chunk: torch.Tensor) -> torch.Tensor:
    """`chunk` copied to the host as DCP's file writer copies a GPU tensor: into torch's page-locked cache
    (non_blocking), the thread's stream waited on."""
    host = chunk.to("cpu", non_blocking=True)
    torch.cuda.current_stream().synchronize()
    return host


def part(condition: str, snapshot: torch.Tensor, directory: Path) -> Callable[[], None]:
    """The thread's work for `condition` (module docstring) over `snapshot` (uint8 [n]), in CHUNK_BYTES
    pieces."""
    chunks = snapshot.split(CHUNK_BYTES)
    host = [c.cpu() for c in chunks] if condition in ("sha256", "write_fsync") else None

    def d2h_pageable() -> None:
        for c in chunks:
            c.cpu()

    def d2h_nonblocking() -> None:
        for c in chunks:
            to_host_as_dcp(c)

    def d2h_pinned() -> None:
        staging = torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
        for c in chunks:
            staging[: c.numel()].copy_(c, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            done.synchronize()

    def sha256() -> None:
        digest = hashlib.sha256()
        for c in host:
            digest.update(c.numpy())

    def write(data: list, hashing: bool) -> None:
        digest = hashlib.sha256()
        for i, c in enumerate(data):
            array = (to_host_as_dcp(c) if c.device.type == "cuda" else c).numpy()
            if hashing:
                digest.update(array)
            path = directory / f"chunk{i}"
            with path.open("wb") as f:
                f.write(array)
                f.flush()
                os.fsync(f.fileno())
            path.unlink()

    if condition == "dcp":  # built before the thread starts, as the save builds it in the loop's thread
        if not dist.is_initialized():  # one rank: an in-process store, no port
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        state, plan = sharded_state(snapshot)

    def dcp() -> None:
        with tempfile.TemporaryDirectory(dir=directory) as out:
            _save(Path(out) / "checkpoint", state, plan, SINGLE, {"step": 0}, (), None)

    works = {
        "d2h_pageable": d2h_pageable,
        "d2h_nonblocking": d2h_nonblocking,
        "d2h_pinned": d2h_pinned,
        "sha256": sha256,
        "write_fsync": lambda: write(host, hashing=False),
        "writer": lambda: write(chunks, hashing=True),
        "dcp": dcp,
    }
    return works[condition]


def in_thread(work: Callable[[], None], device: torch.device) -> tuple[threading.Thread, list]:
    """`work` started in a thread with its own CUDA stream (as the save's writer); the list gets its time
    in seconds, or what it raised."""
    took: list = []

    def run() -> None:
        start = time.perf_counter()
        try:
            if device.type == "cuda":
                with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
                    work()
            else:
                work()
        except Exception as err:  # noqa: BLE001 - raised again in the main thread
            took.append(err)
            return
        took.append(time.perf_counter() - start)

    thread = threading.Thread(target=run, name="bench-save")
    thread.start()
    return thread, took


def time_steps(step: Callable[[], None], steps: int | None = None, until=None) -> list[float]:
    """The ms of each of `steps` steps, or of each step run while `until()` holds."""
    times = []
    while (steps is not None and len(times) < steps) or (until is not None and until()):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1000)
    return times


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--gib",
    type=click.FloatRange(min=0.001),
    default=4.0,
    show_default=True,
    help="Size of the snapshot the thread works through.",
)
@click.option(
    "--step-ms",
    type=click.FloatRange(min=1),
    default=20.0,
    show_default=True,
    help="About how long the stand-in step takes.",
)
@click.option(
    "--conditions",
    default=",".join(CONDITIONS),
    show_default=True,
    help="Comma-separated, of: " + ", ".join(CONDITIONS) + " (the d2h ones need a GPU).",
)
@click.option(
    "--dir",
    "directory",
    type=click.Path(path_type=Path),
    default=Path("/tmp/bench_save_overlap"),
    show_default=True,
    help="Where write_fsync and dcp write (their files are removed).",
)
@click.option(
    "--switch-interval",
    "switch_ms",
    type=click.FloatRange(min=0.01),
    default=None,
    help="Python's GIL switch interval in ms for the whole run  [default: Python's, 5 ms].",
)
@click.option(
    "--results",
    type=click.Path(path_type=Path),
    default=RESULTS,
    show_default=True,
    help="CSV the rows go to.",
)
def main(
    gib: float, step_ms: float, conditions: str, directory: Path, switch_ms: float | None, results: Path
) -> None:
    """Time a stand-in training step beside each part of a background save; rows to save_overlap.csv."""
    wanted = [c.strip() for c in conditions.split(",") if c.strip()]
    unknown = sorted(set(wanted) - set(CONDITIONS))
    if unknown:
        raise click.BadParameter(
            f"unknown {unknown}; expected some of {', '.join(CONDITIONS)}", param_hint="--conditions"
        )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    directory.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # as under torchrun (OMP_NUM_THREADS=1)
    if switch_ms is not None:
        sys.setswitchinterval(switch_ms / 1000)
    step = make_step(device, step_ms)
    snapshot = torch.randint(0, 256, (int(gib * GIB),), dtype=torch.uint8, device=device)
    time_steps(step, steps=5)  # warm-up
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = []
    for condition in wanted:
        if condition in CUDA_ONLY and device.type != "cuda":
            print(f"{condition}: skipped (needs a GPU)")
            continue
        work = part(condition, snapshot, directory)
        if device.type == "cuda":
            torch._C._host_emptyCache()  # the page-locked blocks of the conditions before
        alone = statistics.median(time_steps(step, steps=ALONE_STEPS))
        thread, took = in_thread(work, device)
        beside = time_steps(step, until=thread.is_alive)
        thread.join()
        if isinstance(took[0], Exception):
            raise took[0]
        median, longest = (statistics.median(beside), max(beside)) if beside else (math.nan, math.nan)
        print(
            f"{condition}: step {median:.2f} ms beside it (longest {longest:.1f}) vs {alone:.2f} alone "
            f"({median / alone:.2f}x, {len(beside)} steps); the part took {took[0]:.2f} s "
            f"({gib / took[0]:.2f} GiB/s)"
        )
        rows.append({
            **provenance(name), "condition": condition, "gib": gib, "chunk_mib": CHUNK_BYTES // 2**20,
            "switch_ms": round(sys.getswitchinterval() * 1000, 3),
            "step_ms_beside": round(median, 3), "step_ms_beside_longest": round(longest, 3),
            "step_ms_alone": round(alone, 3), "ratio": round(median / alone, 3), "steps_beside": len(beside),
            "part_s": round(took[0], 3), "gib_per_s": round(gib / took[0], 3),
        })  # fmt: skip
    append_rows(results, rows)
    print(f"{len(rows)} rows -> {results}")


if __name__ == "__main__":
    main()
