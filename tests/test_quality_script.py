"""scripts/quality.py: its windows, overrides and summary (the training is dlrm.run.loop's, tested there)."""

import csv
import json
import math

import click
import pytest
from click.testing import CliRunner

from dlrm.data.synthetic import main as synthetic
from tests.conftest import REPO


@pytest.fixture
def quality(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import quality

    return quality


def test_windows_are_the_whole_file_and_its_two_halves_in_order(quality):
    lines = [f"{i}\n".encode() for i in range(7)]
    assert quality.window_lines(lines, "whole") == lines
    first, second = quality.window_lines(lines, "first_half"), quality.window_lines(lines, "second_half")
    assert first + second == lines and len(first) == 3


def test_overrides_are_json_values_of_section_keys(quality):
    assert quality.parse_override('model.hashing="vocab"') == ("model", "hashing", "vocab")
    assert quality.parse_override("train.lr=0.1") == ("train", "lr", 0.1)
    with pytest.raises(click.BadParameter, match="expected section.key=JSON"):
        quality.parse_override("lr=0.1")
    with pytest.raises(click.BadParameter, match="strings need quotes"):
        quality.parse_override("model.hashing=vocab")


def test_run_raw_points_at_the_window_and_applies_the_overrides(quality, tmp_path):
    raw = {"model": {"hashing": "modulus"}, "train": {"lr": 0.3}}
    overrides = [("model", "hashing", "vocab"), ("model", "min_frequency", 2)]
    cfg = quality.from_dict(quality.run_raw(raw, overrides, tmp_path, seed=4, device="cpu"))
    assert (cfg.data.path, cfg.train.seed, cfg.train.lr, cfg.profiler.enabled) == (
        str(tmp_path),
        4,
        0.3,
        False,
    )
    assert (cfg.model.hashing, cfg.model.min_frequency) == ("vocab", 2)
    assert raw == {"model": {"hashing": "modulus"}, "train": {"lr": 0.3}}  # the file's config, untouched
    with pytest.raises(ValueError, match="model.min_frequency"):
        quality.from_dict(
            quality.run_raw(raw, [("model", "min_frequency", 0)], tmp_path, seed=0, device="cpu")
        )


def test_summary_gives_mean_and_spread_per_setting_and_window(quality):
    rows = [
        {"label": "a", "window": "w", "val_auc": auc, "val_logloss": 0.1, "val_ne": None}
        for auc in (0.70, 0.72, 0.74)
    ]
    table = quality.summary(rows, ("val",))
    assert "| a | w | 3 | 0.7200 +- 0.0200 | 0.1000 +- 0.0000 | none |" in table


def test_paired_compares_each_seed_with_the_baseline_run_of_the_same_seed(quality):
    rows = [
        {"label": "logistic", "window": "w", "seed": s, "test_auc": 0.70, "test_ne": 0.95} for s in (0, 1)
    ]
    rows += [
        {"label": "main", "window": "w", "seed": 0, "test_auc": 0.72, "test_ne": 0.94},
        {"label": "main", "window": "w", "seed": 1, "test_auc": 0.69, "test_ne": 0.93},
    ]
    # AUC differences +0.02 and -0.01, NE differences -0.01 and -0.02
    assert "| main | w | 2 | +0.0050 +- 0.0212 | -0.0150 +- 0.0071 | 1/2 | 2/2 |" in quality.paired(
        rows, "logistic", "test"
    )
    # A baseline of one seed (scikit-learn's fit) is every seed's.
    single = [{"label": "sklearn_l2", "window": "w", "seed": 0, "test_auc": 0.71, "test_ne": 0.96}]
    table = quality.paired(single + rows[2:], "sklearn_l2", "test")
    assert "| main | w | 2 | -0.0050 +- 0.0212 | -0.0250 +- 0.0071 | 1/2 | 2/2 |" in table


def test_base_loss_is_the_entropy_of_the_click_rate(quality):
    assert quality.base_loss(0.5) == pytest.approx(math.log(2))
    assert quality.base_loss(0.25) == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))


@pytest.fixture
def synthetic_data(tmp_path):
    """A 3,000-row synthetic dataset (dlrm.data.synthetic --output-dir), with its planted model's scores."""
    data = tmp_path / "synthetic"
    made = CliRunner().invoke(
        synthetic, ["--rows", "3000", "--max-cardinality", "50", "--output-dir", str(data)]
    )
    assert made.exit_code == 0, made.output
    return data


def _run(quality, tmp_path, data, *args) -> list[dict]:
    """scripts/quality.py on `data` with logistic.json and `args`; the rows it appended."""
    results = tmp_path / "quality.csv"
    common = ["--data", str(data), "--config", str(REPO / "configs" / "logistic.json")]
    common += ["--work-dir", str(tmp_path / "work"), "--results", str(results)]
    ran = CliRunner().invoke(quality.main, [*common, *args])
    assert ran.exit_code == 0, ran.output
    return list(csv.DictReader(results.open()))


def test_a_row_on_synthetic_data_records_the_planted_optimum_of_the_reported_splits(
    quality, tmp_path, synthetic_data
):
    oracle = json.loads((synthetic_data / "metadata.json").read_text())["oracle"]
    for report in ("val", "test"):
        rows = _run(
            quality, tmp_path, synthetic_data, "--seeds", "0", "--set", "train.epochs=1", "--report", report
        )
    val_row, test_row = rows
    assert float(val_row["oracle_val_auc"]) == pytest.approx(oracle["val"]["auc"])
    assert val_row["oracle_test_auc"] == "" and val_row["test_auc"] == ""
    assert float(test_row["oracle_test_ne"]) == pytest.approx(oracle["test"]["ne"])


def test_the_paired_base_rate_loss_replays_the_runs_own_batches(quality, tmp_path, synthetic_data):
    # lr ~0: the model keeps predicting the train click rate, so each logged loss is its rows' base-rate loss.
    settings = ["--set", "train.lr=1e-12", "--set", "train.epochs=2", "--set", "train.log_interval=3"]
    (row,) = _run(quality, tmp_path, synthetic_data, "--seeds", "3", *settings)
    assert abs(float(row["max_train_excess"])) < 1e-5
    # ...while the split's base-rate loss, the intervals' average, is off by the intervals' click counts.
    assert float(row["max_train_loss"]) - float(row["base_loss"]) > 1e-3


def test_two_ranks_train_under_torchrun_and_their_row_says_so(quality, tmp_path, synthetic_data):
    """--nproc 2: the run is `python -m dlrm.train` under torchrun (gloo on the CPU: the tables sharded, a
    sharding plan in its directory); its row records world_size 2 and its metrics, those of the same global
    batches as one process's (the sharded math is the one process's: tests/test_parallel.py)."""
    results = tmp_path / "quality.csv"
    common = ["--data", str(synthetic_data), "--config", str(REPO / "configs" / "tiny.json"), "--seeds", "0"]
    common += ["--work-dir", str(tmp_path / "work"), "--results", str(results), "--set", "train.max_steps=6"]
    for nproc in (
        "2",
        "1",
    ):  # the file the 2-rank run starts has the world_size column; one process's is empty
        ran = CliRunner().invoke(quality.main, [*common, "--nproc", nproc, "--label", f"tiny{nproc}"])
        assert ran.exit_code == 0, ran.output
    two, one = list(csv.DictReader(results.open()))
    assert (one["world_size"], two["world_size"]) == ("", "2") and two["steps"] == one["steps"] == "6"
    assert float(two["val_auc"]) == pytest.approx(float(one["val_auc"]), abs=1e-4)
    assert (tmp_path / "work" / "runs" / "tiny2-synthetic-seed0" / "sharding_plan.json").is_file()
