"""The best AUC a model with a config's tables can reach on synthetic data, where hashing merges ids.

    python scripts/hashing_ceiling.py --data DIR --config configs/dlrm_dcnv2.json \
        --set model.max_rows=4000000 [--split test|val]

DIR is a data directory of `python -m dlrm.data.synthetic --output-dir` (its metadata.json's "synthetic"
says how its rows were made). The planted model gives every id of its columns its own weight w(id); a
table row that several ids share (modulus hashing, dlrm.model.tables.shared_row_shares) holds one vector for
all of them, so a one-hot model can at best give each of them the weight

    E[w | row] = sum of p(id) w(id) over the row's ids / sum of p(id) over them

(p: the generator's own law of the ids, dlrm.data.synthetic_rows.power_law_ranks, missing ids weight 0).
The split's rows (`--split`, test by default) are generated again (their labels checked against DIR's) and
scored with the planted logit whose one-hot planted columns take E[w | row] for w: the AUC of that logit is
the ceiling written beside the planted model's own (`oracle_auc`). A planted column with bags
(model.multi_hot_sizes > 1) keeps its own weights: a bag's other rows may tell ids apart, so the ceiling
there is an upper bound.

One row per call is appended to scripts/results/hashing_ceiling.csv: the config, its overrides, the
data's generator settings, the AUCs, and per merged column the share of its planted weights' variance lost
(`lost`: sum of p (w - E[w | row])^2 over sum of p w^2).
"""

import json
from pathlib import Path

import click
import numpy as np
import pyarrow.parquet as pq
from results_csv import append_rows, provenance

from dlrm.cli_options import data_option, path_option, set_option
from dlrm.config import apply_overrides, load_config
from dlrm.data import synthetic_rows as sr
from dlrm.data.dataset import load_metadata, split_paths
from dlrm.data.oracle import OracleMetrics
from dlrm.data.schema import LABEL, MISSING_CATEGORY, SPARSE_COLUMNS
from dlrm.data.synthetic_output import config_from_metadata
from dlrm.errors import cli_errors
from dlrm.model.tables import resolve_table_rows, shared_row_shares

RESULTS = Path(__file__).resolve().parent / "results" / "hashing_ceiling.csv"


def rank_probabilities(cardinality: int, missing_rate: float) -> np.ndarray:
    """[K] float64 P(rank k) of a column's present ids: (1 - missing_rate) (F(k + 1) - F(k)), F the CDF of
    the continuous power law of `power_law_ranks` at rank + 1."""
    k = np.arange(cardinality, dtype=np.float64)
    s = 1.0 - sr.ZIPF_EXPONENT
    law = ((k + 1.0) ** s - (k + 2.0) ** s) / (1.0 - (cardinality + 1.0) ** s)
    return (1.0 - missing_rate) * law


def row_weights(config: sr.SyntheticConfig, column: int, rows: int) -> tuple[np.ndarray, np.ndarray, float]:
    """(ids [K + 1] sorted, the missing id among them; E[w | row] of each [K + 1]; the share of the planted
    weights' variance lost, sum p (w - E[w | row])^2 / sum p w^2) of 0-based sparse `column` hashed into
    `rows` rows by (x + 1) % rows."""
    k = config.cardinalities[column]
    ids = sr.ids_of_ranks(config, np.arange(k)[:, None], [column])[:, 0]
    p = rank_probabilities(k, sr.SPARSE_MISSING_RATE[column])
    w = sr.planted_weights(config.seed, [column], ids[:, None])[:, 0]
    ids, p = np.append(ids, MISSING_CATEGORY), np.append(p, sr.SPARSE_MISSING_RATE[column])
    w = np.append(w, 0.0)
    row = (ids + 1) % rows
    mass = np.bincount(row, p, minlength=rows)
    mean = np.bincount(row, p * w, minlength=rows)[row] / np.where(mass[row] > 0, mass[row], 1.0)
    lost = float(p @ (w - mean) ** 2) / float(p @ w**2)
    order = np.argsort(ids)
    return ids[order], mean[order], lost


def regenerated_split(data_dir: Path, metadata: dict, split: str) -> tuple[sr.SyntheticConfig, sr.Rows]:
    """The generator's config and `split`'s rows ("val" or "test") made again (the generator's layout
    "fraction": test the last rows, val the ones before), their labels checked against the split's own.
    Raises ValueError where they differ, or where the metadata is not synthetic data's."""
    config, total = config_from_metadata(metadata, str(data_dir / "metadata.json"))
    stop = total - (metadata["rows"]["test"] if split == "val" else 0)
    rows = sr.generate_rows(config, stop - metadata["rows"][split], stop)
    files = split_paths(data_dir, split)
    labels = np.concatenate([pq.read_table(f, columns=[LABEL])[LABEL].to_numpy() for f in files])
    if not np.array_equal(labels.astype(np.int8), rows.label):
        raise ValueError(f"{data_dir}: its {split} labels differ from the rows generated again")
    return config, rows


def ceiling_row(data_dir: Path, config_path: Path, overrides: tuple[str, ...], split: str) -> dict:
    """The results row of `main`. Raises ValueError: a bad config or override, data that is not synthetic or
    whose labels the generator does not make again, hashing other than modulus."""
    cfg = apply_overrides(load_config(config_path), overrides)
    if cfg.model.hashing != "modulus":
        raise ValueError(f"{config_path}: hashing {cfg.model.hashing!r}; the ceiling is modulus hashing's")
    metadata = load_metadata(data_dir)
    config, rows = regenerated_split(data_dir, metadata, split)
    table_rows = resolve_table_rows(cfg.model, metadata)
    sizes = cfg.model.multi_hot_sizes or (1,) * len(SPARSE_COLUMNS)
    logit, lost = rows.logit.copy(), {}
    for column in sr.PLANTED_INDEX:
        if sizes[column] > 1 or config.bag_sizes is not None:
            continue
        ids, mean, lost[SPARSE_COLUMNS[column]] = row_weights(config, column, table_rows[column])
        present = rows.sparse[:, column]
        own = sr.planted_weights(config.seed, [column], present[:, None])[:, 0]
        logit += mean[np.searchsorted(ids, present)] - own
    planted, ceiling = OracleMetrics(), OracleMetrics()
    planted.update(rows.logit, rows.label)
    ceiling.update(logit, rows.label)
    shares = shared_row_shares(cfg.model, metadata)
    return {
        **provenance("cpu"),
        "data": str(data_dir),
        "config": str(config_path),
        "overrides": " ".join(overrides),
        "generator": json.dumps(metadata["synthetic"] | {"cardinalities": None}),
        "max_cardinality": max(config.cardinalities),
        "split": split,
        "rows": rows.num_rows,
        "oracle_auc": planted.result()["auc"],
        "ceiling_auc": ceiling.result()["auc"],
        "lost": json.dumps({c: round(v, 4) for c, v in lost.items()}),
        "shared_rows": json.dumps({c: round(shares[c], 4) for c in lost}),
    }


@click.command()
@data_option("A data directory of python -m dlrm.data.synthetic --output-dir.")
@path_option("--config", "config_path", required=True, help="The run config whose tables to apply.")
@set_option
@click.option("--split", type=click.Choice(["test", "val"]), default="test", show_default=True)
def main(data_dir: Path, config_path: Path, overrides: tuple[str, ...], split: str) -> None:
    """Print and record the ceiling of a config's tables on synthetic data (module docstring)."""
    with cli_errors():  # a bad config, key or data directory: one line, exit 2
        row = ceiling_row(data_dir, config_path, overrides, split)
    append_rows(RESULTS, [row])
    click.echo(
        f"{split} rows {row['rows']:,}: planted model AUC {row['oracle_auc']:.4f}, ceiling of "
        f"{config_path.name}'s tables {row['ceiling_auc']:.4f} (variance lost by merged column: "
        f"{row['lost']})"
    )


if __name__ == "__main__":
    main()
