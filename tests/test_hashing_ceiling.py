"""scripts/hashing_ceiling.py: the planted model's AUC where a config's tables merge the ids of a row."""

import csv
import json

import numpy as np
import pytest
from click.testing import CliRunner

from dlrm.data.synthetic_output import write_parquet
from dlrm.data.synthetic_rows import PLANTED_INDEX, SyntheticConfig, preset_cardinalities
from tests.conftest import REPO

TINY = str(REPO / "configs" / "tiny.json")


@pytest.fixture
def ceiling(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import hashing_ceiling

    monkeypatch.setattr(hashing_ceiling, "RESULTS", tmp_path / "hashing_ceiling.csv")
    return hashing_ceiling


def _run(ceiling, data, *overrides: str, split: str = "test") -> dict:
    args = [
        "--data",
        str(data),
        "--config",
        TINY,
        "--split",
        split,
        *(a for o in overrides for a in ("--set", o)),
    ]
    result = CliRunner().invoke(ceiling.main, args)
    assert result.exit_code == 0, result.output
    with ceiling.RESULTS.open() as f:
        return list(csv.DictReader(f))[-1]


def _data(tmp_path, ids: str):
    config = SyntheticConfig(preset_cardinalities("kaggle", max_cardinality=300), seed=6, ids=ids)
    write_parquet(config, 20_000, tmp_path / ids)
    return tmp_path / ids


def test_tables_that_keep_every_id_apart_reach_the_planted_model(ceiling, tmp_path):
    data = _data(tmp_path, "index")
    for split in ("test", "val"):  # each split made again, its labels the data's own
        row = _run(ceiling, data, "model.max_rows=302", split=split)  # ids 0 .. 299 and the missing one
        assert row["split"] == split and int(row["rows"]) == 2000
        assert float(row["ceiling_auc"]) == float(row["oracle_auc"])
        assert json.loads(row["lost"]) == {f"C{c + 1}": 0.0 for c in PLANTED_INDEX}


def test_merged_rows_lower_the_ceiling_the_more_they_merge(ceiling, tmp_path):
    data = _data(tmp_path, "hash")
    hashed = _run(ceiling, data, "model.max_rows=302")  # raw hashes share rows even where they would fit
    merged = _run(ceiling, data, "model.max_rows=3")
    oracle = float(hashed["oracle_auc"])
    assert float(merged["ceiling_auc"]) < float(hashed["ceiling_auc"]) < oracle
    assert oracle - float(merged["ceiling_auc"]) > 0.02
    assert merged["oracle_auc"] == hashed["oracle_auc"]


def test_a_rows_weight_is_its_ids_mean_by_the_generators_law(ceiling):
    """E[w | row] of a column: the weights of the ids of each row averaged by the generator's law; here a
    column of 3 ids in 2 rows."""
    config = SyntheticConfig(preset_cardinalities("kaggle", max_cardinality=3), seed=1, ids="index")
    ids, mean, lost = ceiling.row_weights(config, 0, 2)
    assert ids.tolist() == [-1, 0, 1, 2]  # the missing id (C1 is never missing), then 0 .. K - 1
    p = np.zeros(4)
    id_of_rank = ceiling.sr.ids_of_ranks(config, np.arange(3)[:, None], [0])[:, 0]
    p[1 + id_of_rank] = ceiling.rank_probabilities(3, 0.0)
    w = np.append(0.0, ceiling.sr.planted_weights(1, [0], np.arange(3)[:, None])[:, 0])
    rows = (ids + 1) % 2  # missing and id 1 on row 0, ids 0 and 2 on row 1
    for r in (0, 1):
        on = rows == r
        assert mean[on] == pytest.approx(np.full(on.sum(), (p[on] @ w[on]) / p[on].sum()))
    assert lost == pytest.approx((p @ (w - mean) ** 2) / (p @ w**2))


def test_data_of_another_kind_is_refused_in_one_line(ceiling, tmp_path):
    data = _data(tmp_path, "index")
    metadata = (data / "metadata.json").read_text()
    (data / "metadata.json").write_text(metadata.replace('"synthetic"', '"generated_by"'))
    result = CliRunner().invoke(ceiling.main, ["--data", str(data), "--config", TINY])
    assert result.exit_code == 2 and 'no "synthetic" key' in result.output.strip().splitlines()[-1]
    assert not ceiling.RESULTS.exists()
