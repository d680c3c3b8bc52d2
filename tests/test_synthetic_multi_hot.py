"""`python -m dlrm.data.synthetic --multi-hot`: bags written in the layout the loaders read, and a planted
model over the bags whose oracle equals a direct computation on the written rows and beats the same
planted weights that see only the one-hot ids."""

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from dlrm.data.bag_source import data_bag_sizes
from dlrm.data.bags import bag_starts
from dlrm.data.dataset import open_split
from dlrm.data.output import load_metadata
from dlrm.data.synthetic import main
from dlrm.data.synthetic_output import write_parquet
from dlrm.data.synthetic_rows import (
    SyntheticConfig,
    generate_rows,
    planted_logit,
    preset_cardinalities,
)
from tests.test_oracle import direct, read_split

# Bags on planted columns (C1, C3, C5, C14) and on others; k = 1 elsewhere.
SIZES = (4, 1, 3, 1, 6, 1, 1, 1, 1, 2, *([1] * 3), 5, *([1] * 12))
CONFIG = SyntheticConfig(preset_cardinalities("kaggle", max_cardinality=50), seed=4, bag_sizes=SIZES)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic") / "bags"
    write_parquet(CONFIG, 6000, out, val_fraction=0.25, test_fraction=0.25)
    return out


def test_bags_are_written_in_the_loaders_layout(written):
    assert data_bag_sizes(load_metadata(written)) == SIZES
    val = open_split(written, "val")
    assert val.sparse.shape == (1500, sum(SIZES))
    rows = generate_rows(CONFIG, 3000, 4500)  # the val rows
    assert torch.equal(val.sparse, torch.from_numpy(rows.sparse))
    # The bags' first ids are the one-hot generator's ids: the same random stream, bags drawn by hash.
    one_hot = generate_rows(SyntheticConfig(CONFIG.cardinalities, seed=4), 3000, 4500)
    assert np.array_equal(rows.sparse[:, bag_starts(SIZES)], one_hot.sparse)
    drawn = np.delete(rows.sparse, bag_starts(SIZES), axis=1)
    assert drawn.min() >= 0 and drawn.max() <= 50  # [0, K + 1)


def test_oracle_reads_the_bags_and_bounds_a_one_hot_view(written):
    metadata = load_metadata(written)
    dense, sparse, labels = read_split(written, "val")  # one-hot columns only
    labels = labels.copy()
    val = open_split(written, "val")
    logits = torch.from_numpy(planted_logit(CONFIG, dense.astype(np.int64), val.sparse.numpy()))
    expected = direct(logits, torch.from_numpy(labels))
    assert metadata["oracle"]["val"]["logloss"] == pytest.approx(expected["logloss"], rel=1e-12)
    assert metadata["oracle"]["val"]["auc"] == pytest.approx(expected["auc"], abs=1e-4)
    # The planted model of the one-hot ids (the same weights, each bag's first id only): the drawn ids
    # carry signal it misses.
    one_hot = SyntheticConfig(CONFIG.cardinalities, seed=CONFIG.seed)
    seen = torch.from_numpy(planted_logit(one_hot, dense.astype(np.int64), sparse))
    assert direct(seen, torch.from_numpy(labels))["auc"] < expected["auc"] - 0.01


def test_cli_multi_hot_needs_the_parquet_output(tmp_path):
    runner = CliRunner()
    result = runner.invoke(
        main, ["--rows", "10", "--output", str(tmp_path / "x.tsv"), "--multi-hot", "mlperf"]
    )
    assert result.exit_code == 2 and "--multi-hot: only with --output-dir" in result.output
    result = runner.invoke(main, ["--rows", "10", "--output-dir", str(tmp_path / "d"), "--multi-hot", "1,2"])
    assert result.exit_code == 2 and "--multi-hot: expected 26 integers" in result.output
    assert not (tmp_path / "d").exists() and not (tmp_path / "x.tsv").exists()
