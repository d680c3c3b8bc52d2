"""Benchmark preprocessing on this machine's CPUs against `gzip -dc` of the same file and pandas' way.

    python scripts/bench_preprocess.py [--input synthetic|sample] [--rows 5000000] [--repeats 5] \
        [--baseline-rows 1000000 | --no-pandas] [--workers N] [--block-size 65536]

Makes the input TSV.gz (`synthetic`: python -m dlrm.data.synthetic, Kaggle cardinalities; `sample`: the
shipped 10k real rows of data/day_0_head10k.tsv.gz repeated to --rows, `gzip -1`), then times, each in its
own process so that peak RSS is that process's own:
    gzip -dc  gzip -dc FILE > /dev/null: the floor of reading the file once
    ours      python -m dlrm.data.preprocess --input FILE --output-dir DIR [--workers N] [--block-size B]
              (TSV.gz -> parquet + metadata), the whole process: start-up, imports and exit included
    pandas    pandas.read_csv of the same file, then int(x, 16) per category cell (the plain pandas way),
              on the first --baseline-rows rows only: it is slow; its rows/s is what is compared
`gzip -dc` and ours run alternately --repeats times each (so that both see the same load from other
processes on the machine) and the medians are reported, and the fastest runs (those least slowed down by
other processes); pandas runs once. Prints seconds, rows/s, peak RSS, CPU seconds (user + system: what the
run costs whatever else shares the CPUs), the ratio of the time per row to gzip -dc's (of the medians,
and of the fastest runs) and of rows/s to pandas', and appends the rows to scripts/results/preprocess.csv
with the 1-minute load average before the first run.
"""

import gzip
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import click
from results_csv import append_rows, provenance

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "preprocess.csv"
SAMPLE = REPO / "data" / "day_0_head10k.tsv.gz"

PANDAS_BASELINE = """
import sys, pandas as pd
from dlrm.data.schema import RAW_COLUMNS, SPARSE_COLUMNS
frame = pd.read_csv(sys.argv[1], sep="\\t", header=None, names=RAW_COLUMNS, nrows=int(sys.argv[2]))
for name in SPARSE_COLUMNS:
    frame[name] = frame[name].map(lambda x: int(x, 16) if isinstance(x, str) else -1)
frame.to_parquet(sys.argv[3])
"""

# Runs its arguments as a child (stdout to /dev/null) and prints that child's wall seconds, peak RSS (KiB)
# and CPU seconds: a fresh wrapper per measurement, so RUSAGE_CHILDREN holds no other process, and the wall
# clock covers the child alone, not the wrapper's start-up.
_MEASURE = (
    "import resource, subprocess, sys, time; t = time.perf_counter(); "
    "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); t = time.perf_counter() - t; "
    "r = resource.getrusage(resource.RUSAGE_CHILDREN); print(t, r.ru_maxrss, r.ru_utime + r.ru_stime)"
)


def run_timed(args: list[str]) -> dict:
    """{"seconds", "peak_rss_mib", "cpu_s"} of a command run from the repository root (so that
    `python -m dlrm...` imports this checkout); raises CalledProcessError when it fails."""
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, *args], cwd=REPO, check=True, capture_output=True, text=True
    )
    seconds, rss_kib, cpu_s = out.stdout.split()[-3:]
    return {"seconds": float(seconds), "peak_rss_mib": int(rss_kib) / 1024, "cpu_s": float(cpu_s)}


def median_run(runs: list[dict]) -> dict:
    """The medians of `runs` (each of seconds, peak RSS and CPU seconds on its own), and "seconds_min": the
    fastest run, the one least slowed down by other processes."""
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]} | {
        "seconds_min": min(r["seconds"] for r in runs)
    }


def write_sample_input(path: Path, rows: int) -> str:
    """The shipped 10k real rows repeated to `rows` lines, compressed by `gzip -1`, into `path`; returns
    a description."""
    lines = gzip.decompress(SAMPLE.read_bytes()).splitlines(keepends=True)
    if rows % len(lines):
        raise click.BadParameter(f"--input sample needs a multiple of {len(lines)} rows, got {rows}")
    text = b"".join(lines)
    with path.open("wb") as f:
        gzip_1 = subprocess.Popen(["gzip", "-1", "-c"], stdin=subprocess.PIPE, stdout=f)
        for _ in range(rows // len(lines)):
            gzip_1.stdin.write(text)
        gzip_1.stdin.close()
        if gzip_1.wait():
            raise subprocess.CalledProcessError(gzip_1.returncode, gzip_1.args)
    return f"{SAMPLE.name} x{rows // len(lines)}, gzip -1"


@click.command(context_settings={"show_default": True})
@click.option(
    "--input",
    "input_kind",
    type=click.Choice(["synthetic", "sample"]),
    default="synthetic",
    help="synthetic: Kaggle-like generated rows; sample: the shipped 10k real rows repeated.",
)
@click.option("--rows", type=click.IntRange(min=1000), default=5_000_000, help="Rows of the input.")
@click.option(
    "--repeats", type=click.IntRange(min=1), default=5, help="Runs of gzip -dc and of ours, alternately."
)
@click.option(
    "--baseline-rows", type=click.IntRange(min=1000), default=1_000_000, help="Rows the pandas way reads."
)
@click.option("--pandas/--no-pandas", default=True, help="Also time the pandas way (~25 s per 1M rows).")
@click.option("--workers", type=click.IntRange(min=1), default=os.cpu_count(), help="preprocess --workers.")
@click.option("--block-size", type=click.IntRange(min=1), default=1 << 16, help="preprocess --block-size.")
def main(input_kind, rows, repeats, baseline_rows, pandas, workers, block_size):
    """Time preprocess against gzip -dc (and pandas + per-cell int(x, 16)) on a TSV.gz."""
    with tempfile.TemporaryDirectory() as tmp:
        tsv = Path(tmp) / f"{input_kind}.tsv.gz"
        if input_kind == "sample":
            described = write_sample_input(tsv, rows)
        else:
            subprocess.run(
                [sys.executable, "-m", "dlrm.data.synthetic", "--rows", str(rows), "--output", str(tsv)],
                cwd=REPO,
                check=True,
                stderr=subprocess.DEVNULL,
            )
            described = "synthetic kaggle, Python gzip level 1"
        load = os.getloadavg()[0]
        flags = ["--workers", str(workers), "--block-size", str(block_size)]
        out = Path(tmp) / "out"
        gzip_runs, our_runs = [], []
        for _ in range(repeats):
            gzip_runs.append(run_timed(["gzip", "-dc", str(tsv)]))
            shutil.rmtree(out, ignore_errors=True)
            command = ["-m", "dlrm.data.preprocess", "--input", str(tsv), "--output-dir", str(out), *flags]
            our_runs.append(run_timed([sys.executable, *command]))
        pairs = list(zip(gzip_runs, our_runs, strict=True))
        print("gzip -dc / ours (s):", ", ".join(f"{g['seconds']:.2f} / {o['seconds']:.2f}" for g, o in pairs))
        print(
            "ours / gzip -dc, run by run:", ", ".join(f"{o['seconds'] / g['seconds']:.2f}" for g, o in pairs)
        )
        methods = [
            (f"gzip -dc {input_kind}.tsv.gz > /dev/null", rows, median_run(gzip_runs), repeats),
            (f"dlrm.data.preprocess {' '.join(flags)}", rows, median_run(our_runs), repeats),
        ]
        if pandas:
            parquet = Path(tmp) / "p.parquet"
            pandas_run = run_timed(
                [sys.executable, "-c", PANDAS_BASELINE, str(tsv), str(baseline_rows), str(parquet)]
            )
            pandas_run["seconds_min"] = pandas_run["seconds"]
            methods.insert(0, ("pandas read_csv + int(x, 16) per cell", baseline_rows, pandas_run, 1))
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs"
    common = provenance(machine)
    results = [
        {
            **common,
            "method": method,
            "input": described,
            "rows": n,
            "runs": runs,
            "seconds": round(m["seconds"], 2),
            "seconds_min": round(m["seconds_min"], 2),
            "rows_per_s": round(n / m["seconds"]),
            "peak_rss_mib": round(m["peak_rss_mib"]),
            "cpu_us_per_row": round(m["cpu_s"] / n * 1e6, 2),
            "load_1m": round(load, 2),
        }
        for method, n, m, runs in methods
    ]
    gzip = next(m | {"rows": n} for method, n, m, _ in methods if method.startswith("gzip"))
    for r, (_, n, m, _) in zip(results, methods, strict=True):
        r["ratio_vs_pandas"] = round(r["rows_per_s"] / results[0]["rows_per_s"], 2) if pandas else None
        # Time per row against gzip -dc's: of the medians, and of the fastest runs.
        r["ratio_vs_gzip_dc"] = round(m["seconds"] / n / (gzip["seconds"] / gzip["rows"]), 2)
        r["ratio_vs_gzip_dc_min"] = round(m["seconds_min"] / n / (gzip["seconds_min"] / gzip["rows"]), 2)
        pandas_ratio = f"{r['ratio_vs_pandas']:6.2f}x pandas' rows/s" if pandas else ""
        print(f"{r['method']:<50} {r['rows']:>9,} rows {r['seconds']:>7.2f} s {r['rows_per_s']:>9,} rows/s "
              f"peak RSS {r['peak_rss_mib']:>6,} MiB  CPU {r['cpu_us_per_row']:>5.2f} us/row  "
              f"load {r['load_1m']:.2f}  {r['ratio_vs_gzip_dc']:.2f}x gzip -dc's time "
              f"({r['ratio_vs_gzip_dc_min']:.2f}x fastest to fastest)  "
              f"{pandas_ratio}")  # fmt: skip
    append_rows(RESULTS, results)


if __name__ == "__main__":
    main()
