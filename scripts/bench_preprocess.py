"""Benchmark preprocessing on this machine's CPUs: our pyarrow pipeline against the lecture's pandas way.

    python scripts/bench_preprocess.py [--rows 5000000] [--baseline-rows 1000000] [--workers N] \
        [--block-size 65536]

Generates a synthetic Criteo TSV.gz (python -m dlrm.data.synthetic, Kaggle cardinalities), then times, each
in its own process so that peak RSS is that process's own:
    ours      python -m dlrm.data.preprocess --input FILE --output-dir DIR [--workers N] [--block-size B]
              (TSV.gz -> parquet + metadata)
    pandas    pandas.read_csv of the same file, then int(x, 16) per category cell (the lecture's approach),
              on the first --baseline-rows rows only: it is slow; its rows/s is what is compared
Prints rows/s, peak RSS, CPU seconds (user + system: what the run costs whatever else shares the CPUs)
and the ratio, and appends the rows to scripts/results/preprocess.csv with the 1-minute load average
before each run (other processes on the machine slow the wall-clock numbers down).
"""

import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
from results_csv import append_rows, provenance

RESULTS = Path(__file__).parent / "results" / "preprocess.csv"

PANDAS_BASELINE = """
import sys, pandas as pd
from dlrm.data.schema import RAW_COLUMNS, SPARSE_COLUMNS
frame = pd.read_csv(sys.argv[1], sep="\\t", header=None, names=RAW_COLUMNS, nrows=int(sys.argv[2]))
for name in SPARSE_COLUMNS:
    frame[name] = frame[name].map(lambda x: int(x, 16) if isinstance(x, str) else -1)
frame.to_parquet(sys.argv[3])
"""


# Runs its arguments as a child and prints that child's peak RSS (KiB) and CPU seconds: a fresh wrapper per
# measurement, so RUSAGE_CHILDREN holds no other process.
_PEAK_RSS = (
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
    "r = resource.getrusage(resource.RUSAGE_CHILDREN); print(r.ru_maxrss, r.ru_utime + r.ru_stime)"
)


def run_timed(args: list[str]) -> dict:
    """{"seconds", "peak_rss_mib", "cpu_s", "load_1m"} of a command (load_1m: the 1-minute load average
    before it); raises CalledProcessError when it fails."""
    load = os.getloadavg()[0]
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _PEAK_RSS, *args], check=True, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    rss_kib, cpu_s = out.stdout.split()[-2:]
    return {"seconds": seconds, "peak_rss_mib": int(rss_kib) / 1024, "cpu_s": float(cpu_s), "load_1m": load}


@click.command(context_settings={"show_default": True})
@click.option("--rows", type=click.IntRange(min=1000), default=5_000_000, help="Rows of the synthetic input.")
@click.option(
    "--baseline-rows", type=click.IntRange(min=1000), default=1_000_000, help="Rows the pandas way reads."
)
@click.option("--workers", type=click.IntRange(min=1), default=os.cpu_count(), help="preprocess --workers.")
@click.option("--block-size", type=click.IntRange(min=1), default=1 << 16, help="preprocess --block-size.")
def main(rows, baseline_rows, workers, block_size):
    """Time preprocess against pandas + per-cell int(x, 16) on a synthetic TSV.gz."""
    with tempfile.TemporaryDirectory() as tmp:
        tsv = Path(tmp) / "synthetic.tsv.gz"
        subprocess.run(
            [sys.executable, "-m", "dlrm.data.synthetic", "--rows", str(rows), "--output", str(tsv)],
            check=True,
            stderr=subprocess.DEVNULL,
        )
        pandas = run_timed(
            [
                sys.executable,
                "-c",
                PANDAS_BASELINE,
                str(tsv),
                str(baseline_rows),
                str(Path(tmp) / "p.parquet"),
            ]
        )
        flags = ["--workers", str(workers), "--block-size", str(block_size)]
        out = Path(tmp) / "out"
        ours = run_timed(
            [
                sys.executable,
                "-m",
                "dlrm.data.preprocess",
                "--input",
                str(tsv),
                "--output-dir",
                str(out),
                *flags,
            ]
        )
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs"
    common = provenance(machine)
    methods = (
        ("pandas read_csv + int(x, 16) per cell", baseline_rows, pandas),
        (f"dlrm.data.preprocess {' '.join(flags)}", rows, ours),
    )
    results = [
        {
            **common,
            "method": method,
            "rows": n,
            "seconds": round(m["seconds"], 2),
            "rows_per_s": round(n / m["seconds"]),
            "peak_rss_mib": round(m["peak_rss_mib"]),
            "cpu_us_per_row": round(m["cpu_s"] / n * 1e6, 2),
            "load_1m": round(m["load_1m"], 2),
        }
        for method, n, m in methods
    ]
    for r in results:
        r["ratio_vs_pandas"] = round(r["rows_per_s"] / results[0]["rows_per_s"], 2)
        print(f"{r['method']:<58} {r['rows']:>10,} rows {r['seconds']:>7.1f} s {r['rows_per_s']:>9,} rows/s "
              f"peak RSS {r['peak_rss_mib']:>6,} MiB  CPU {r['cpu_us_per_row']:>5.2f} us/row  "
              f"load {r['load_1m']:.2f}  {r['ratio_vs_pandas']:.2f}x")  # fmt: skip
    append_rows(RESULTS, results)


if __name__ == "__main__":
    main()
