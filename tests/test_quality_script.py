"""scripts/quality.py: its windows, overrides and summary (the training is dlrm.loop's, tested there)."""

import click
import pytest

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


def test_run_config_points_at_the_window_and_applies_the_overrides(quality, tmp_path):
    raw = {"model": {"hashing": "modulus"}, "train": {"lr": 0.3}}
    overrides = [("model", "hashing", "vocab"), ("model", "min_frequency", 2)]
    cfg = quality.run_config(raw, overrides, tmp_path, seed=4, device="cpu")
    assert (cfg.data.path, cfg.train.seed, cfg.train.lr, cfg.profiler.enabled) == (
        str(tmp_path),
        4,
        0.3,
        False,
    )
    assert (cfg.model.hashing, cfg.model.min_frequency) == ("vocab", 2)
    assert raw == {"model": {"hashing": "modulus"}, "train": {"lr": 0.3}}  # the file's config, untouched
    with pytest.raises(ValueError, match="model.min_frequency"):
        quality.run_config(raw, [("model", "min_frequency", 0)], tmp_path, seed=0, device="cpu")


def test_summary_gives_mean_and_spread_per_setting_and_window(quality):
    rows = [
        {"label": "a", "window": "w", "val_auc": auc, "val_logloss": 0.1, "val_ne": None}
        for auc in (0.70, 0.72, 0.74)
    ]
    table = quality.summary(rows, ("val",))
    assert "| a | w | 3 | 0.7200 +- 0.0200 | 0.1000 +- 0.0000 | none |" in table
