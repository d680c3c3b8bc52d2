"""Benchmark preprocessing on this machine's CPUs: our pyarrow pipeline against the lecture's pandas way.

    python scripts/bench_preprocess.py [--rows 5000000] [--baseline-rows 1000000]

Generates a synthetic Criteo TSV.gz (python -m dlrm.data.synthetic, Kaggle cardinalities), then times, each
in its own process so that peak RSS is that process's own:
    ours      python -m dlrm.data.preprocess --input FILE --output-dir DIR (TSV.gz -> parquet + metadata)
    pandas    pandas.read_csv of the same file, then int(x, 16) per category cell (the lecture's approach),
              on the first --baseline-rows rows only: it is slow; its rows/s is what is compared
Prints rows/s, peak RSS and the ratio, and appends the rows to scripts/results/preprocess.csv.
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


# Runs its arguments as a child and prints that child's peak RSS (KiB): a fresh wrapper per measurement, so
# RUSAGE_CHILDREN holds no other process.
_PEAK_RSS = (
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def run_timed(args: list[str]) -> tuple[float, float]:
    """(seconds, peak RSS in MiB) of a command; raises CalledProcessError when it fails."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _PEAK_RSS, *args], check=True, capture_output=True, text=True)
    return time.perf_counter() - start, int(out.stdout.split()[-1]) / 1024


@click.command(context_settings={"show_default": True})
@click.option("--rows", type=click.IntRange(min=1000), default=5_000_000, help="Rows of the synthetic input.")
@click.option(
    "--baseline-rows", type=click.IntRange(min=1000), default=1_000_000, help="Rows the pandas way reads."
)
def main(rows, baseline_rows):
    """Time preprocess against pandas + per-cell int(x, 16) on a synthetic TSV.gz."""
    with tempfile.TemporaryDirectory() as tmp:
        tsv = Path(tmp) / "synthetic.tsv.gz"
        subprocess.run(
            [sys.executable, "-m", "dlrm.data.synthetic", "--rows", str(rows), "--output", str(tsv)],
            check=True,
            stderr=subprocess.DEVNULL,
        )
        pandas_s, pandas_mib = run_timed(
            [
                sys.executable,
                "-c",
                PANDAS_BASELINE,
                str(tsv),
                str(baseline_rows),
                str(Path(tmp) / "p.parquet"),
            ]
        )
        ours_s, ours_mib = run_timed(
            [
                sys.executable,
                "-m",
                "dlrm.data.preprocess",
                "--input",
                str(tsv),
                "--output-dir",
                str(Path(tmp) / "out"),
            ]
        )
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs"
    common = provenance(machine)
    methods = (
        ("pandas read_csv + int(x, 16) per cell", baseline_rows, pandas_s, pandas_mib),
        ("dlrm.data.preprocess", rows, ours_s, ours_mib),
    )
    results = [
        {**common, "method": m, "rows": n, "seconds": sec, "rows_per_s": n / sec, "peak_rss_mib": mib}
        for m, n, sec, mib in methods
    ]
    for r in results:
        r["ratio_vs_pandas"] = round(r["rows_per_s"] / results[0]["rows_per_s"], 2)
        r["seconds"], r["rows_per_s"], r["peak_rss_mib"] = (
            round(r["seconds"], 2),
            round(r["rows_per_s"]),
            round(r["peak_rss_mib"]),
        )
        print(f"{r['method']:<40} {r['rows']:>10,} rows {r['seconds']:>8.1f} s {r['rows_per_s']:>10,} rows/s "
              f"peak RSS {r['peak_rss_mib']:>6,} MiB  {r['ratio_vs_pandas']:.2f}x")  # fmt: skip
    append_rows(RESULTS, results)


if __name__ == "__main__":
    main()
