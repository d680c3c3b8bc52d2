"""Sustained load on one GPU: the SM clock, the power draw and the power cap beside each workload's time.

    python scripts/bench_clocks.py [--workloads gemm,cross,cross-compile,dlrm_dcnv2] [--seconds 3]

A GPU that reaches its power limit lowers its SM clock (nvidia-smi's clocks_event_reasons "SW power cap"),
so a kernel runs slower in a long run than in a short one: a benchmark's median over hundreds of
milliseconds, and training, see the capped clock. Each workload runs back to back for `--seconds`, after
a few idle seconds (the GPU starts cool), in windows of one unit each, timed with CUDA events, while
nvidia-smi samples the clock, the power draw and the reasons for a lowered clock every 50 ms. Workloads
(bf16, batch B = 65,536 unless said):
    gemm           the GEMM of bench_timing's ceiling (8192 x 8192 x 8192), 20 a unit, one CUDA graph
    cross          one cross layer forward + backward, ours (bench_cross's triton path, MLPerf's
                   N = 3456, r = 512), 10 a unit, one CUDA graph, inputs rotated as bench_cross does
    cross-compile  the same with torch.compile (bench_cross's compile path)
    dlrm_dcnv2     the training step of configs/dlrm_dcnv2.json, triton+graphs, tables capped at 4M rows in
                   bf16, Adagrad (bench_train's build), 2 steps a unit
Per workload it prints each window (ms a repeat, SM clock, power, reasons) and appends one row to
scripts/results/clocks.csv: the first window's ms a repeat (cool) and the median of the last half's
(steady), their ratio, the median SM clock and power draw over the last half, and the share of its samples
with the power cap active. nvidia-smi's power.draw is a one-second average; the clock and the reasons are
instantaneous.
"""

import statistics
import subprocess
import time
from datetime import datetime
from pathlib import Path

import click
import torch
from bench_cross import layer_fn, layer_sets
from bench_timing import captured, rotating_passes
from results_csv import append_rows, provenance

RESULTS = Path(__file__).parent / "results" / "clocks.csv"
WORKLOADS = ("gemm", "cross", "cross-compile", "dlrm_dcnv2")
BATCH = 65536
SAMPLE_MS = 50
POWER_CAP = 0x4  # nvidia-smi clocks_event_reasons: SW power cap
IDLE_S = 3.0


def workload(name: str):
    """(unit, repeats): a callable that runs `repeats` repeats of workload `name` (WORKLOADS)."""
    if name == "gemm":
        a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        return captured(lambda: a @ b, 20), 20
    if name in ("cross", "cross-compile"):
        path = "triton" if name == "cross" else "compile"
        sets = layer_sets(BATCH, 3456, 512, 1, torch.bfloat16)
        _, fwd_bwd = rotating_passes(layer_fn(path, 1), sets)
        return captured(fwd_bwd, 10), 10
    from bench_train import POOL, build

    model, optimizer, step, pool, _ = build(
        "dlrm_dcnv2", "triton+graphs", BATCH, 4_000_000, "bf16", "uniform", cardinalities="config",
        optimizer="adagrad", table_dtype="bf16",
    )  # fmt: skip
    i = iter(range(10**9))

    def two_steps():
        for _ in range(2):
            step(model, optimizer, pool[next(i) % POOL])

    for _ in range(POOL):
        two_steps()
    return two_steps, 2


def sampler(index: int) -> subprocess.Popen:
    """nvidia-smi printing timestamp, SM MHz, power W and the clock-event reasons every SAMPLE_MS."""
    query = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active"
    command = ["nvidia-smi", "-i", str(index), f"--query-gpu={query}", "--format=csv,noheader,nounits"]
    try:
        return subprocess.Popen([*command, "-lms", str(SAMPLE_MS)], stdout=subprocess.PIPE, text=True)
    except FileNotFoundError as err:
        raise click.UsageError(
            "bench_clocks.py needs nvidia-smi on the PATH (the NVIDIA driver's tools)"
        ) from err


def read_samples(proc: subprocess.Popen) -> list[tuple[float, float, float, int]]:
    """(seconds since the epoch, SM MHz, W, reasons) of each line `proc` printed, once it is stopped."""
    proc.terminate()
    samples = []
    for line in proc.communicate()[0].splitlines():
        stamp, mhz, watts, reasons = (cell.strip() for cell in line.split(","))
        when = datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
        samples.append((when, float(mhz), float(watts), int(reasons, 16)))
    return samples


def run(name: str, seconds: float) -> dict:
    """Windows of workload `name` for `seconds` with nvidia-smi's samples beside; its row of clocks.csv."""
    unit, repeats = workload(name)
    torch.cuda.synchronize()
    time.sleep(IDLE_S)
    proc = sampler(torch.cuda.current_device())
    time.sleep(2 * SAMPLE_MS / 1000)  # nvidia-smi's first sample before the load
    windows = []  # (host seconds at the window's end, ms a repeat)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start = time.time()
    while time.time() - start < seconds:
        begin.record()
        unit()
        end.record()
        end.synchronize()
        windows.append((time.time(), begin.elapsed_time(end) / repeats))
    samples = read_samples(proc)
    print(f"{name}: window end s, ms a repeat, SM MHz, W, reasons")
    for when, ms in windows:
        _, mhz, watts, reasons = min(samples, key=lambda s: abs(s[0] - when))
        print(f"  {when - start:6.3f}  {ms:8.4f}  {mhz:6.0f}  {watts:6.1f}  {reasons:#x}")
    half = start + seconds / 2
    steady = [ms for when, ms in windows if when >= half]
    late = [s for s in samples if half <= s[0] <= windows[-1][0]]
    if not steady or not late:
        raise click.UsageError(f"{name}: no windows or samples in the last half; raise --seconds")
    cool_ms, steady_ms = windows[0][1], statistics.median(steady)
    return {
        "workload": name, "batch": "" if name == "gemm" else BATCH, "seconds": seconds,
        "cool_ms": round(cool_ms, 4), "steady_ms": round(steady_ms, 4),
        "steady_vs_cool": round(steady_ms / cool_ms, 3),
        "steady_sm_mhz": statistics.median(s[1] for s in late),
        "steady_power_w": round(statistics.median(s[2] for s in late), 1),
        "power_capped_pct": round(100 * sum(bool(s[3] & POWER_CAP) for s in late) / len(late), 1),
    }  # fmt: skip


@click.command(context_settings={"show_default": True})
@click.option("--workloads", default=",".join(WORKLOADS), help=f"Comma-separated, of {', '.join(WORKLOADS)}.")
@click.option("--seconds", type=click.FloatRange(min=0.5), default=3.0, help="Load per workload.")
def main(workloads, seconds):
    """Run each workload back to back on this GPU, nvidia-smi sampling; rows to scripts/results/clocks.csv."""
    names = workloads.split(",")
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        raise click.BadParameter(
            f"{', '.join(unknown)}: expected some of {', '.join(WORKLOADS)}", param_hint="--workloads"
        )
    if not torch.cuda.is_available():
        raise click.UsageError("bench_clocks.py needs a CUDA GPU")
    common = provenance(torch.cuda.get_device_name())
    rows = [dict(common, **run(name, seconds)) for name in names]
    for row in rows:
        print(", ".join(f"{k} {v}" for k, v in row.items() if k not in common))
    append_rows(RESULTS, rows)


if __name__ == "__main__":
    main()
