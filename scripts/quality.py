"""Model quality over seeds and data windows: settings chosen on val, reported on test.

    python scripts/quality.py --config configs/main.json --config configs/logistic.json --seeds 0,1,2,3,4
    python scripts/quality.py --config configs/main.json --set model.hashing='"vocab"' --set train.lr=0.1
    python scripts/quality.py --config configs/main.json --config configs/logistic.json --windows whole \\
        --report test

Each window of the input's lines (`whole`, `first_half`, `second_half`: the halves are two separate
datasets, for checking that a setting chosen on one carries over to the other) is preprocessed once with
layout "fraction" (the last 20% held out: val then test, 10% each, in file order). Every config x window x
seed is trained by the real loop (dlrm.loop.train: best.pt selected on val); one row per run is appended
to scripts/results/quality.csv and a table of means and standard deviations over seeds is printed.

The protocol this script exists for: compare settings by their val columns (the default, `--report val`),
and only once the settings are fixed, run them with `--report test` to get the numbers to publish. Without
`--report test` the test columns are neither printed nor recorded.
"""

import gzip
import json
import statistics
import sys
from pathlib import Path

import click
from loguru import logger
from results_csv import append_rows, provenance

from dlrm.config import from_dict
from dlrm.data.preprocess import preprocess
from dlrm.loop import train

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "scripts" / "results" / "quality.csv"
WINDOWS = ("whole", "first_half", "second_half")
METRICS = ("auc", "logloss", "ne")


def window_lines(lines: list[bytes], window: str) -> list[bytes]:
    """The lines of one window: all of them, or the first or second half (in file order)."""
    half = len(lines) // 2
    return {"whole": lines, "first_half": lines[:half], "second_half": lines[half:]}[window]


def prepare(input_path: Path, window: str, work_dir: Path) -> Path:
    """Preprocess `window` of `input_path` into work_dir/data/<window> (once: reused when its metadata
    names the same input); return the data directory."""
    out = work_dir / "data" / window
    source = f"{input_path.resolve()}#{window}"
    metadata = out / "metadata.json"
    if metadata.exists() and json.loads(metadata.read_text()).get("quality_source") == source:
        return out
    lines = gzip.decompress(input_path.read_bytes()).splitlines(keepends=True)
    text = work_dir / f"{window}.tsv"
    text.parent.mkdir(parents=True, exist_ok=True)
    text.write_bytes(b"".join(window_lines(lines, window)))
    preprocess([text], out, eval_fraction=0.2, overwrite=True)
    text.unlink()
    meta = json.loads(metadata.read_text())
    metadata.write_text(json.dumps(meta | {"quality_source": source}, indent=2))
    return out


def parse_override(text: str) -> tuple[str, str, object]:
    """`section.key=JSON` -> (section, key, value); raises click.BadParameter naming the override."""
    key, sep, value = text.partition("=")
    section, dot, name = key.partition(".")
    if not sep or not dot or not name:
        raise click.BadParameter(
            f"{text!r}: expected section.key=JSON, e.g. train.lr=0.1", param_hint="--set"
        )
    try:
        return section, name, json.loads(value)
    except json.JSONDecodeError:
        raise click.BadParameter(
            f"{text!r}: the value is not JSON (strings need quotes)", param_hint="--set"
        ) from None


def run_config(
    raw: dict, overrides: list[tuple[str, str, object]], data: Path, seed: int, device: str
) -> dict:
    """The raw config with the data directory, seed, device, profiler off and the overrides applied."""
    raw = {section: dict(value) if isinstance(value, dict) else value for section, value in raw.items()}
    raw.setdefault("data", {})["path"] = str(data)
    raw.setdefault("train", {}).update(seed=seed, device=device)
    raw.setdefault("profiler", {})["enabled"] = False
    for section, key, value in overrides:
        raw.setdefault(section, {})[key] = value
    return from_dict(raw)


def summary(rows: list[dict], splits: tuple[str, ...]) -> str:
    """Mean +- standard deviation over seeds per (label, window)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["label"], row["window"]), []).append(row)
    columns = [f"{split}_{metric}" for split in splits for metric in METRICS]
    lines = ["| label | window | seeds | " + " | ".join(columns) + " |", "|" + " --- |" * (3 + len(columns))]
    for (label, window), group in groups.items():
        cells = []
        for column in columns:
            values = [r[column] for r in group if r[column] is not None]
            std = statistics.stdev(values) if len(values) > 1 else 0.0
            cells.append(f"{statistics.fmean(values):.4f} +- {std:.4f}" if values else "none")
        lines.append(f"| {label} | {window} | {len(group)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@click.command(context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@click.option(
    "--config", "configs", multiple=True, required=True, type=click.Path(exists=True, path_type=Path),
    help="Run config(s) to compare (repeat the option).",
)  # fmt: skip
@click.option("--set", "sets", multiple=True, help="Override for every config: section.key=JSON (repeat).")
@click.option(
    "--label", default=None, help="Name of this setting in the table and CSV [default: config stem]."
)
@click.option("--seeds", default="0,1,2,3,4", help="Comma-separated seeds.")
@click.option(
    "--windows", default="first_half,second_half", help=f"Comma-separated, of {', '.join(WINDOWS)}."
)
@click.option("--input", "input_path", type=click.Path(exists=True, path_type=Path),
              default=REPO / "data" / "day_0_head10k.tsv.gz", help="Raw Criteo TSV.gz.")  # fmt: skip
@click.option("--work-dir", type=click.Path(path_type=Path), default=REPO / "runs" / "quality")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="cpu")
@click.option(
    "--report", type=click.Choice(["val", "test"]), default="val",
    help="val: compare settings (test columns left out); test: the fixed settings' numbers to publish.",
)  # fmt: skip
@click.option("--results", type=click.Path(path_type=Path), default=RESULTS)
def main(configs, sets, label, seeds, windows, input_path, work_dir, device, report, results) -> None:
    """Train configs over seeds and data windows; print val (and with --report test, test) quality."""
    overrides = [parse_override(text) for text in sets]
    windows = windows.split(",")
    for window in windows:
        if window not in WINDOWS:
            raise click.BadParameter(
                f"{window!r}: expected one of {', '.join(WINDOWS)}", param_hint="--windows"
            )
    splits = ("val", "test") if report == "test" else ("val",)
    rows = []
    for config_path in configs:
        raw = json.loads(config_path.read_text())
        name = label or config_path.stem
        for window in windows:
            data = prepare(input_path, window, work_dir)
            for seed in (int(s) for s in seeds.split(",")):
                cfg = run_config(raw, overrides, data, seed, device)
                run_dir = work_dir / "runs" / f"{name}-{window}-seed{seed}"
                if report == "val":  # the loop logs its final test evaluation: not shown while comparing
                    logger.disable("dlrm")
                try:
                    metrics = train(cfg, run_dir, overwrite=True, progress="quiet")
                finally:
                    logger.enable("dlrm")
                row = {
                    **provenance(metrics.get("device", device)),
                    "label": name,
                    "config": str(config_path),
                    "overrides": " ".join(sets),
                    "window": window,
                    "seed": seed,
                    "best_step": metrics["best_step"],
                    "steps": metrics["steps"],
                    **{
                        f"{s}_{m}": metrics[f"{s}_{m}"] if s in splits else None
                        for s in ("val", "test")
                        for m in METRICS
                    },
                    "wall_s": round(metrics["wall_s"], 1),
                }
                shown = " ".join(f"{s}_{m} {row[f'{s}_{m}']}" for s in splits for m in ("auc", "ne"))
                logger.info("{} {} seed {}: best step {} | {}", name, window, seed, row["best_step"], shown)
                rows.append(row)
    append_rows(results, rows)
    print(summary(rows, splits))


if __name__ == "__main__":
    sys.exit(main())
