"""Model quality over seeds and data windows: settings chosen on val, reported on test.

    python scripts/quality.py --config configs/main.json --config configs/logistic.json --seeds 0,1,2,3,4
    python scripts/quality.py --config configs/main.json --set model.hashing='"vocab"' --set train.lr=0.1
    python scripts/quality.py --config configs/main.json --config configs/logistic.json --windows whole \\
        --report test

Each window of the input's lines (`whole`, `first_half`, `second_half`: the halves are two separate
datasets, for checking that a setting chosen on one carries over to the other) is preprocessed once with
layout "fraction" (the last 20% held out: val then test, 10% each, in file order); `--data DIR` (repeat)
takes preprocessed directories instead (e.g. `python -m dlrm.data.synthetic --output-dir DIR --ctr 0.25`),
each a dataset named by its directory. Every config x dataset x seed is trained by the real loop
(dlrm.run.loop.train: best.pt selected on val); one row per run is appended to scripts/results/quality.csv
and a table of means and standard deviations over seeds is printed, then the paired comparison of every
config with `--baseline` (logistic.json by default): per dataset, the differences of each seed's AUC and NE
from the baseline's run of the same seed, their mean +- sd and the seeds won. Each row also records the
train split's click rate, its base-rate loss (the logloss of predicting that rate for every row) and the
largest logged training loss after the lr warm-up (`max_train_loss`), which a stable run keeps below it, the
largest excess of a logged loss over the base-rate loss of its own steps' rows (`max_train_excess`, <= 0 when
every log interval beats predicting the click rate on the rows it trained on; the batches are replayed from
the run's seed), and on synthetic data (dlrm.data.synthetic) the planted model's AUC and NE on the reported
splits (`oracle_*`): the best any model can score there.

`--nproc N` (N > 1) trains each run under `torchrun --standalone --nproc-per-node N` (`python -m dlrm.train`:
NCCL on GPUs, gloo with `--device cpu`; the config's `data.batch_size` is the global batch, split over the
ranks), its row's `world_size` N; the run directory and metrics.json are rank 0's.

`--sklearn` adds scikit-learn's L2-regularised LogisticRegression on logistic.json's features (the dense
features and a one-hot of each sparse feature's hashed row), its C chosen on val from `SKLEARN_C`: a row
labelled `sklearn_l2` per dataset, seed 0 (the fit is deterministic), in the comparison as a baseline too.

The protocol this script exists for: compare settings by their val columns (the default, `--report val`),
and only once the settings are fixed, run them with `--report test` to get the numbers to publish. Without
`--report test` the test columns are neither printed nor recorded.
"""

import gzip
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import torch
from bench_train import launcher
from loguru import logger
from results_csv import append_rows, provenance

from dlrm.config import from_dict, load_config
from dlrm.data.dataset import load_metadata, open_split
from dlrm.data.loaders import make_train_loader
from dlrm.data.preprocess import preprocess
from dlrm.metrics import normalized_entropy
from dlrm.model import build_model
from dlrm.run.loop import train

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "scripts" / "results" / "quality.csv"
LOGISTIC = REPO / "configs" / "logistic.json"
WINDOWS = ("whole", "first_half", "second_half")
METRICS = ("auc", "logloss", "ne")
# scikit-learn's inverse L2 strengths tried on val (C = 1 / (lambda * rows) for a mean loss + lambda/2 |w|^2).
SKLEARN_C = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)
SKLEARN_LABEL = "sklearn_l2"


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


def run_raw(raw: dict, overrides: list[tuple[str, str, object]], data: Path, seed: int, device: str) -> dict:
    """A copy of the raw config with the data directory, seed, device, profiler off and the overrides
    applied (JSON values, not yet checked)."""
    raw = {section: dict(value) if isinstance(value, dict) else value for section, value in raw.items()}
    raw.setdefault("data", {})["path"] = str(data)
    raw.setdefault("train", {}).update(seed=seed, device=device)
    raw.setdefault("profiler", {})["enabled"] = False
    for section, key, value in overrides:
        raw.setdefault(section, {})[key] = value
    return raw


def train_ranks(raw: dict, run_dir: Path, nproc: int) -> dict:
    """`python -m dlrm.train` of the config `raw` under torchrun on `nproc` ranks of this host, in `run_dir`
    (an earlier run there replaced), quiet; rank 0's metrics.json. Raises CalledProcessError when the run
    fails (its error is on stderr)."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps(raw))
        command = [*launcher(nproc), "-m", "dlrm.train", "--config", str(config),
                   "--output-dir", str(run_dir)]  # fmt: skip
        subprocess.run([*command, "--overwrite", "--quiet"], check=True)
    return json.loads((run_dir / "metrics.json").read_text())


def device_name(device: str) -> str:
    """How a row names the device a run used: the GPU's model on CUDA ("NVIDIA H200"), else `device`."""
    return torch.cuda.get_device_name() if device.startswith("cuda") else device


def base_loss(rate: float) -> float:
    """The logloss of predicting the click rate `rate` for every row: the Bernoulli entropy H(rate), nats."""
    return -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))


def logged_losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, train/loss) of every log line of a run, in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir))
    events.Reload()
    return sorted((e.step, e.value) for e in events.Scalars("train/loss"))


def max_train_loss(logged: list[tuple[int, float]], after_step: int) -> float | None:
    """The largest of the `logged_losses` at a step past `after_step` (the warm-up), None if none."""
    return max((loss for step, loss in logged if step > after_step), default=None)


def step_base_losses(cfg, rate: float, steps: int) -> list[float]:
    """The base-rate loss (the logloss of predicting `rate` for every row) of each of a run's first `steps`
    training batches, replayed on the CPU from the run's own train loader: the same seed draws the same
    batches (dlrm.data.loaders), so step i's value is scored on the rows step i trained on."""
    loader = make_train_loader(cfg.data, Path(cfg.data.path), cfg.train.seed, torch.device("cpu"))
    log_p, log_q = math.log(rate), math.log(1 - rate)
    losses: list[float] = []
    for epoch in range(cfg.train.epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            if len(losses) == steps:
                return losses
            clicks, rows = float(batch.label.sum()), len(batch.label)
            losses.append(-(clicks * log_p + (rows - clicks) * log_q) / rows)
    return losses


def max_train_excess(cfg, logged: list[tuple[int, float]], rate: float, after_step: int) -> float | None:
    """The largest difference, over a run's log lines (`logged_losses`) past `after_step`, between the logged
    training loss (the mean loss of the interval's steps) and the base-rate loss of the same steps' rows:
    negative when every interval's loss is below what predicting the click rate scores on its own rows. A
    small interval of a low click rate holds few clicks, so its base-rate loss swings around the split's;
    this pairs each logged loss with its own. None if nothing was logged past `after_step`."""
    if not logged:
        return None
    bases = step_base_losses(cfg, rate, logged[-1][0])
    excess, start = [], 0
    for step, loss in logged:
        if step > after_step:
            excess.append(loss - statistics.fmean(bases[start:step]))
        start = step
    return max(excess, default=None)


def hashed_features(data: Path, split: str, model) -> tuple:
    """(X, y) of a split for scikit-learn: X [rows, N_dense + sum of table rows] sparse CSR, the dense
    features (log1p counts, as the model reads them) then a one-hot of each sparse feature's row in `model`'s
    tables (its hashing); y [rows] 0/1."""
    import numpy as np
    import scipy.sparse

    dataset = open_split(data, split)
    tables = model.sparse_arch
    rows = tables.hash_ids(dataset.sparse)
    offsets = torch.tensor([0, *tables.table_rows[:-1]]).cumsum(0)
    columns = (rows + offsets).numpy().ravel()
    n, f = rows.shape
    one_hot = scipy.sparse.csr_matrix(
        (np.ones(n * f), columns, np.arange(0, n * f + 1, f)), shape=(n, sum(tables.table_rows))
    )
    x = scipy.sparse.hstack([scipy.sparse.csr_matrix(dataset.dense.numpy()), one_hot]).tocsr()
    return x, dataset.label.numpy()


def sklearn_logistic(data: Path, cs: tuple[float, ...] = SKLEARN_C) -> dict:
    """scikit-learn's L2 LogisticRegression (lbfgs) on logistic.json's features of `data`, C chosen on val
    logloss from `cs`: {"C", "val_auc", "val_logloss", "val_ne", "test_auc", "test_logloss", "test_ne"}."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import log_loss, roc_auc_score

    cfg = load_config(LOGISTIC)
    train_set = open_split(data, "train")
    model = build_model(cfg.model, load_metadata(data), train_set.sparse)
    x, y = hashed_features(data, "train", model)
    splits = {split: hashed_features(data, split, model) for split in ("val", "test")}

    def scores(fit, split: str) -> dict:
        xs, ys = splits[split]
        p = fit.predict_proba(xs)[:, 1]
        loss = log_loss(ys, p, labels=[0, 1])
        ne = normalized_entropy(loss, float(ys.mean()))
        return {f"{split}_auc": roc_auc_score(ys, p), f"{split}_logloss": loss, f"{split}_ne": ne}

    best = None
    for c in cs:
        fit = LogisticRegression(C=c, max_iter=2000).fit(x, y)
        val = scores(fit, "val")
        logger.info(
            "{}: scikit-learn C {} | val auc {:.4f} ne {:.4f}", data.name, c, val["val_auc"], val["val_ne"]
        )
        if best is None or val["val_logloss"] < best[1]["val_logloss"]:
            best = (c, val, fit)
    c, val, fit = best
    return {"C": c, **val, **scores(fit, "test")}


def paired(rows: list[dict], baseline: str, split: str) -> str:
    """Per (label, dataset) against `baseline`'s rows of the same dataset: the mean +- sd over seeds of
    each seed's difference in `split` AUC and NE from the baseline's run of the same seed (a baseline of
    one seed, such as sklearn_l2, is every seed's), and the seeds where the label has the higher AUC and the
    lower NE."""
    base = {(r["window"], r["seed"]): r for r in rows if r["label"] == baseline}
    single = {r["window"]: r for r in rows if r["label"] == baseline}
    groups: dict[tuple[str, str], list[tuple[dict, dict]]] = {}
    for row in rows:
        other = base.get((row["window"], row["seed"])) or single.get(row["window"])
        if row["label"] != baseline and other is not None and row[f"{split}_auc"] is not None:
            groups.setdefault((row["label"], row["window"]), []).append((row, other))
    diffs = f"{split} AUC - {baseline} | {split} NE - {baseline}"
    lines = [f"| label | dataset | seeds | {diffs} | AUC wins | NE wins |", "|" + " --- |" * 7]
    for (label, window), pairs in groups.items():
        cells = []
        for metric in ("auc", "ne"):
            diffs = [a[f"{split}_{metric}"] - b[f"{split}_{metric}"] for a, b in pairs]
            std = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
            cells.append(f"{statistics.fmean(diffs):+.4f} +- {std:.4f}")
        auc_wins = sum(a[f"{split}_auc"] > b[f"{split}_auc"] for a, b in pairs)
        ne_wins = sum(a[f"{split}_ne"] < b[f"{split}_ne"] for a, b in pairs)
        lines.append(
            f"| {label} | {window} | {len(pairs)} | {cells[0]} | {cells[1]} | {auc_wins}/{len(pairs)} | "
            f"{ne_wins}/{len(pairs)} |"
        )
    return "\n".join(lines)


def summary(rows: list[dict], splits: tuple[str, ...]) -> str:
    """Mean +- standard deviation over seeds per (label, window), the largest NE of a seed, and the seeds
    whose training loss went above the base-rate loss after the warm-up: the split's, and each log
    interval's own rows' (`max_train_excess`)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["label"], row["window"]), []).append(row)
    columns = [f"{split}_{metric}" for split in splits for metric in METRICS]
    extra = [f"max {split}_ne" for split in splits] + ["loss > base", "loss > its rows' base"]
    lines = [
        "| label | window | seeds | " + " | ".join(columns + extra) + " |",
        "|" + " --- |" * (3 + len(columns) + len(extra)),
    ]
    for (label, window), group in groups.items():
        cells = []
        for column in columns:
            values = [r[column] for r in group if r[column] is not None]
            std = statistics.stdev(values) if len(values) > 1 else 0.0
            cells.append(f"{statistics.fmean(values):.4f} +- {std:.4f}" if values else "none")
        for split in splits:
            values = [r[f"{split}_ne"] for r in group if r[f"{split}_ne"] is not None]
            cells.append(f"{max(values):.4f}" if values else "none")
        above = [
            r for r in group if r.get("max_train_loss") is not None and r["max_train_loss"] > r["base_loss"]
        ]
        cells.append(f"{len(above)}/{len(group)}")
        paired = [r for r in group if r.get("max_train_excess") is not None and r["max_train_excess"] > 0]
        cells.append(f"{len(paired)}/{len(group)}")
        lines.append(f"| {label} | {window} | {len(group)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@click.command(context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@click.option(
    "--config", "configs", multiple=True, type=click.Path(exists=True, path_type=Path),
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
@click.option(
    "--data", "data_dirs", multiple=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Preprocessed data directory to use instead of --input's windows (repeat).",
)  # fmt: skip
@click.option(
    "--sklearn", is_flag=True, help=f"Also fit scikit-learn's L2 logistic regression ({SKLEARN_LABEL})."
)
@click.option("--baseline", default="logistic", help="Label the paired comparison is against.")
@click.option("--work-dir", type=click.Path(path_type=Path), default=REPO / "runs" / "quality")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="cpu")
@click.option(
    "--report", type=click.Choice(["val", "test"]), default="val",
    help="val: compare settings (test columns left out); test: the fixed settings' numbers to publish.",
)  # fmt: skip
@click.option(
    "--nproc", type=click.IntRange(min=1), default=1,
    help="Ranks per run: N > 1 trains under torchrun --standalone --nproc-per-node N (the rows' world_size).",
)  # fmt: skip
@click.option("--results", type=click.Path(path_type=Path), default=RESULTS)
def main(
    configs, sets, label, seeds, windows, input_path, data_dirs, sklearn, baseline, work_dir, device, report,
    nproc, results,
) -> None:  # fmt: skip
    """Train configs over seeds and datasets; print val (and with --report test, test) quality."""
    if not configs and not sklearn:
        raise click.UsageError("nothing to run: give --config (repeat) and / or --sklearn")
    overrides = [parse_override(text) for text in sets]
    if data_dirs:
        datasets = {d.name: d for d in data_dirs}
    else:
        for window in windows.split(","):
            if window not in WINDOWS:
                raise click.BadParameter(
                    f"{window!r}: expected one of {', '.join(WINDOWS)}", param_hint="--windows"
                )
        datasets = {window: prepare(input_path, window, work_dir) for window in windows.split(",")}
    splits = ("val", "test") if report == "test" else ("val",)
    metadata = {window: load_metadata(data) for window, data in datasets.items()}
    rows = []

    def record(name: str, config: str, window: str, seed: int, metrics: dict, **extra) -> None:
        rate = metadata[window]["positive_rate"]["train"]
        oracle = metadata[window].get("oracle", {})  # synthetic data: the planted model's scores per split
        row = {
            **provenance(device_name(metrics.get("device", device))),
            "label": name,
            "config": config,
            "overrides": " ".join(sets) if config != SKLEARN_LABEL else "",
            "window": window,
            "seed": seed,
            "best_step": metrics.get("best_step"),
            "steps": metrics.get("steps"),
            **{
                f"{s}_{m}": metrics[f"{s}_{m}"] if s in splits else None
                for s in ("val", "test")
                for m in METRICS
            },
            "wall_s": round(metrics["wall_s"], 1),
            "train_ctr": rate,
            "base_loss": base_loss(rate),
            "max_train_loss": extra.get("max_train_loss"),
            "max_train_excess": extra.get("max_train_excess"),
            "sklearn_c": extra.get("sklearn_c"),
            **{
                f"oracle_{s}_{m}": oracle[s][m] if s in splits and s in oracle else None
                for s in ("val", "test")
                for m in ("auc", "ne")
            },
            **({"world_size": nproc} if nproc > 1 and config != SKLEARN_LABEL else {}),
        }
        shown = " ".join(f"{s}_{m} {row[f'{s}_{m}']}" for s in splits for m in ("auc", "ne"))
        logger.info("{} {} seed {}: best step {} | {}", name, window, seed, row["best_step"], shown)
        rows.append(row)

    if sklearn:
        for window, data in datasets.items():
            start = time.perf_counter()
            metrics = sklearn_logistic(data)
            metrics["wall_s"] = time.perf_counter() - start
            record(SKLEARN_LABEL, SKLEARN_LABEL, window, 0, metrics, sklearn_c=metrics["C"])
    for config_path in configs:
        raw = json.loads(config_path.read_text())
        name = label or config_path.stem
        for window, data in datasets.items():
            for seed in (int(s) for s in seeds.split(",")):
                merged = run_raw(raw, overrides, data, seed, device)
                cfg = from_dict(merged)  # checked (ValueError naming a bad key) before the run
                run_dir = work_dir / "runs" / f"{name}-{window}-seed{seed}"
                if report == "val":  # the loop logs its final test evaluation: not shown while comparing
                    logger.disable("dlrm")
                try:
                    if nproc == 1:
                        metrics = train(cfg, run_dir, overwrite=True, progress="quiet")
                    else:
                        metrics = train_ranks(merged, run_dir, nproc)
                finally:
                    logger.enable("dlrm")
                warmup = cfg.train.lr_schedule.warmup_steps
                rate = metadata[window]["positive_rate"]["train"]
                logged = logged_losses(run_dir)
                record(
                    name, str(config_path), window, seed, metrics,
                    max_train_loss=max_train_loss(logged, warmup),
                    max_train_excess=max_train_excess(cfg, logged, rate, warmup),
                )  # fmt: skip
    append_rows(results, rows)
    print(summary(rows, splits))
    for base in dict.fromkeys(
        label for label in (baseline, SKLEARN_LABEL) if any(r["label"] == label for r in rows)
    ):
        print()
        print(paired(rows, base, splits[-1]))


if __name__ == "__main__":
    sys.exit(main())
