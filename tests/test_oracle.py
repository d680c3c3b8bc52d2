"""Tests of the planted model's own numbers on synthetic data (dlrm.data.oracle, metadata.json "oracle"):
they equal a direct computation on the written rows with scikit-learn, a model other than the planted one
scores worse, and the binned AUC keeps within its stated bound."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from loguru import logger
from scipy.special import expit
from sklearn.metrics import log_loss, roc_auc_score

from dlrm.data.oracle import BINS, OracleMetrics, SplitOracle, histogram_auc
from dlrm.data.output import load_metadata
from dlrm.data.schema import DENSE_COLUMNS, SPARSE_COLUMNS
from dlrm.data.synthetic_output import write_parquet, write_tsv
from dlrm.data.synthetic_rows import SyntheticConfig, planted_logit, preset_cardinalities
from dlrm.metrics import auc

SMALL = SyntheticConfig(preset_cardinalities("kaggle", max_cardinality=200), seed=11)


def read_split(data_dir, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(raw counts [n, 13] f32, ids [n, 26] i64, labels [n] f32) of a written split, in file order."""
    metadata = load_metadata(data_dir)
    table = pq.read_table([data_dir / f for f in metadata["files"][split]])
    dense = np.stack([table[c].to_numpy() for c in DENSE_COLUMNS], axis=1)
    sparse = np.stack([table[c].to_numpy() for c in SPARSE_COLUMNS], axis=1)
    return dense, sparse, table["label"].to_numpy()


def direct(logits: torch.Tensor, labels: torch.Tensor) -> dict:
    """The metrics of all rows at once by scikit-learn, independent of dlrm.metrics (which the oracle uses):
    roc_auc_score, log_loss of the float64 probabilities [P(0), P(1)], and NE as that over log_loss of the
    constant positive rate (the entropy H(p)). Raises AssertionError where scikit-learn would clip a
    probability (below float64's eps: a logit past -36 for its label), which would change the loss."""
    x, y = logits.double().numpy(), labels.long().numpy()
    probabilities = np.stack([expit(-x), expit(x)], axis=1)
    assert probabilities.min() > np.finfo(np.float64).eps
    logloss = log_loss(y, probabilities)
    return {
        "auc": roc_auc_score(y, x),
        "logloss": logloss,
        "ne": logloss / log_loss(y, np.full(len(y), y.mean())),
    }


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("oracle") / "syn"
    messages = []
    sink = logger.add(messages.append, format="{message}")
    try:
        # Blocks of 1000 rows, val from row 8400, test from row 10,200: blocks straddle both boundaries.
        result = write_parquet(
            SMALL, 12_000, out, val_fraction=0.15, test_fraction=0.15, rows_per_file=5000, block_size=1000
        )
    finally:
        logger.remove(sink)
    return out, result, messages


def test_metadata_oracle_equals_the_planted_model_on_the_written_rows(written):
    out, result, messages = written
    oracle = json.loads((out / "metadata.json").read_text())["oracle"]
    assert oracle == result["oracle"]
    assert list(oracle) == ["train", "val", "test"]
    for split, rows in (("train", 8400), ("val", 1800), ("test", 1800)):
        dense, sparse, labels = read_split(out, split)
        # Recomputed from the parquet rows (raw counts are exact in float32; 0 where missing).
        logits = torch.from_numpy(planted_logit(SMALL, dense.astype(np.int64), sparse))
        expected = direct(logits, torch.from_numpy(labels))
        got = oracle[split]
        assert got["rows"] == rows
        assert got["logloss"] == pytest.approx(expected["logloss"], rel=1e-12)
        assert got["ne"] == pytest.approx(expected["ne"], rel=1e-12)
        assert 0 < got["auc_error_bound"] < 1e-4
        # The stated bound, plus torchmetrics' float32 result.
        assert abs(got["auc"] - expected["auc"]) <= got["auc_error_bound"] + 1e-6
        assert 0.75 < got["auc"] < 0.95 and got["ne"] < 0.95
    line = next(m for m in messages if "oracle" in m)
    assert f"test AUC {oracle['test']['auc']:.4f} logloss {oracle['test']['logloss']:.4f}" in line


def test_models_other_than_the_planted_one_score_worse(written):
    out, result, _ = written
    dense, sparse, labels = read_split(out, "test")
    planted = torch.from_numpy(planted_logit(SMALL, dense.astype(np.int64), sparse))
    labels = torch.from_numpy(labels)
    best = result["oracle"]["test"]
    generator = torch.Generator().manual_seed(0)
    noisy = direct(
        planted + 0.7 * torch.randn(planted.shape, generator=generator, dtype=torch.float64), labels
    )
    assert noisy["auc"] < best["auc"] - 0.01 and noisy["logloss"] > best["logloss"] + 0.005
    # Another seed's planted model: a different signal altogether.
    other = direct(
        torch.from_numpy(planted_logit(SyntheticConfig(SMALL.cardinalities, 12), dense, sparse)), labels
    )
    assert other["auc"] < best["auc"] - 0.1
    # Same ranking, wrong calibration: same AUC, worse logloss and NE.
    shifted = direct(planted + 1.0, labels)
    assert abs(shifted["auc"] - best["auc"]) <= best["auc_error_bound"] + 1e-6
    assert shifted["logloss"] > best["logloss"] + 0.02 and shifted["ne"] > best["ne"]


def test_tsv_reports_the_oracle_over_all_rows(written):
    _, parquet, _ = written
    result = write_tsv(SMALL, 12_000, written[0].parent / "day.tsv", block_size=5000)
    everything, splits = result["oracle"]["all"], parquet["oracle"]
    assert everything["rows"] == 12_000
    # The same rows: the loss of all of them is the row-weighted loss of the three splits.
    assert everything["logloss"] == pytest.approx(
        sum(split["rows"] * split["logloss"] for split in splits.values()) / 12_000
    )


def test_empty_or_one_class_splits_have_no_auc(tmp_path):
    result = write_parquet(SMALL, 500, tmp_path / "syn", eval_fraction=0.0)
    assert result["oracle"]["test"] == {
        "auc": None, "auc_error_bound": None, "logloss": None, "ne": None, "rows": 0
    }  # fmt: skip
    assert load_metadata(tmp_path / "syn")["oracle"]["val"]["rows"] == 0
    negatives = OracleMetrics()
    negatives.update(np.array([-1.0, 2.0]), np.array([0, 0]))
    assert negatives.result()["auc"] is None and negatives.result()["logloss"] > 0


def test_histogram_auc_is_exact_without_shared_bins_and_within_the_bound_with_them():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(5000, generator=generator, dtype=torch.float64) * 3
    labels = (torch.rand(5000, generator=generator, dtype=torch.float64) < torch.sigmoid(logits)).long()
    metrics = OracleMetrics()
    metrics.update(logits.numpy()[:1234], labels.numpy()[:1234])  # in two pieces: counts add up
    metrics.update(logits.numpy()[1234:], labels.numpy()[1234:])
    got = metrics.result()
    assert abs(got["auc"] - auc(logits, labels)) <= got["auc_error_bound"] + 1e-6
    # Coarse: 4 bins, so most pairs share one; the bound still holds and is not trivially loose.
    bins = np.clip(np.floor(logits.numpy()), -2, 1).astype(int) + 2
    pos = np.bincount(bins[labels.numpy() == 1], minlength=4)
    neg = np.bincount(bins[labels.numpy() == 0], minlength=4)
    coarse, bound = histogram_auc(pos, neg)
    assert abs(coarse - auc(logits, labels)) <= bound and bound < 0.2
    assert histogram_auc(np.array([0, 3]), np.array([2, 0])) == (1.0, 0.0)
    with pytest.raises(ValueError, match="undefined"):
        histogram_auc(np.zeros(BINS, np.int64), np.ones(BINS, np.int64))


def test_split_oracle_feeds_each_split_its_rows():
    logits, labels = np.linspace(-3, 3, 10), np.array([0, 1] * 5)
    oracle = SplitOracle({"a": (0, 4), "b": (4, 10), "overlap": (2, 7)})
    for start in range(0, 10, 3):  # blocks of 3 straddle every boundary
        oracle.update(start, logits[start : start + 3], labels[start : start + 3])
    assert {name: m["rows"] for name, m in oracle.result().items()} == {"a": 4, "b": 6, "overlap": 5}
    for name, (lo, hi) in oracle.splits.items():
        expected = F.binary_cross_entropy_with_logits(
            torch.from_numpy(logits[lo:hi]), torch.from_numpy(labels[lo:hi]).double()
        ).item()
        assert oracle.result()[name]["logloss"] == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="bad row range"):
        SplitOracle({"x": (5, 4)})
