"""Tests of dlrm.data.synthetic: raw TSV that preprocess accepts, parquet that the loader reads, determinism,
Zipf-like ids within the cardinalities, a learnable planted signal, and one-line CLI errors."""

import gzip
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner
from torchmetrics.functional.classification import binary_auroc

from dlrm.data import synthetic_output
from dlrm.data.dataset import BatchLoader, open_split
from dlrm.data.output import load_metadata
from dlrm.data.preprocess import preprocess
from dlrm.data.schema import MISSING_CATEGORY, NUM_DENSE, NUM_SPARSE, RAW_COLUMNS, SPARSE_COLUMNS
from dlrm.data.synthetic import main
from dlrm.data.synthetic_output import config_from_metadata, to_raw_table, write_parquet, write_tsv
from dlrm.data.synthetic_rows import (
    KAGGLE_CARDINALITIES,
    TERABYTE_CARDINALITIES,
    ZIPF_EXPONENT,
    SyntheticConfig,
    SyntheticError,
    generate_rows,
    ids_of_ranks,
    iter_blocks,
    planted_logit,
    power_law_ranks,
    preset_cardinalities,
)

HEX_ID = re.compile(r"^[0-9a-f]{8}$")
SMALL = SyntheticConfig(preset_cardinalities("kaggle", max_cardinality=100), seed=3)


def test_presets():
    assert len(KAGGLE_CARDINALITIES) == len(TERABYTE_CARDINALITIES) == NUM_SPARSE
    assert sum(KAGGLE_CARDINALITIES) == 33_762_577
    assert sum(TERABYTE_CARDINALITIES) == 177_944_275
    assert preset_cardinalities("terabyte", 1000) == tuple(min(k, 1000) for k in TERABYTE_CARDINALITIES)


def test_tsv_is_raw_criteo_that_preprocess_reads(tmp_path):
    path = tmp_path / "day.tsv.gz"
    write_tsv(SyntheticConfig(seed=1), 4000, path, block_size=1500)
    fields = [line.split("\t") for line in gzip.decompress(path.read_bytes()).decode().splitlines()]
    assert len(fields) == 4000
    assert {len(f) for f in fields} == {len(RAW_COLUMNS)}
    labels = np.array([int(f[0]) for f in fields])
    assert set(labels) <= {0, 1}
    assert 0.05 < labels.mean() < 0.2  # ctr 0.1
    dense = [f[1 : 1 + NUM_DENSE] for f in fields]
    sparse = [f[1 + NUM_DENSE :] for f in fields]
    assert all(re.fullmatch(r"-?[0-9]+", v) for row in dense for v in row if v)
    assert all(HEX_ID.match(v) for row in sparse for v in row if v)
    assert sum(v == "" for row in dense for v in row) > 1000  # I1, I10, I12 are missing about half the time
    assert sum(v == "" for row in sparse for v in row) > 1000
    assert any(row[1].startswith("-") for row in dense)  # I2 may be negative

    metadata = preprocess([path], tmp_path / "pre", eval_fraction=0.25)
    assert metadata["rows"] == {"train": 3000, "val": 500, "test": 500}
    assert metadata["skipped_lines"] == 0


def test_parquet_is_what_preprocess_makes_of_the_tsv(tmp_path):
    config = SyntheticConfig(preset_cardinalities("terabyte", 5000), seed=2, ctr=0.2)
    write_tsv(config, 3000, tmp_path / "day.tsv", block_size=700)
    # Uneven fractions and a block size that cuts through the split points: 2100 / 600 / 300 rows.
    fractions = {"val_fraction": 0.2, "test_fraction": 0.1}
    preprocess([tmp_path / "day.tsv"], tmp_path / "pre", rows_per_file=1000, **fractions)
    written = write_parquet(config, 3000, tmp_path / "syn", rows_per_file=1000, block_size=900, **fractions)
    assert written["rows"] == {"train": 2100, "val": 600, "test": 300}

    expected, actual = load_metadata(tmp_path / "pre"), load_metadata(tmp_path / "syn")
    assert actual.pop("oracle").keys() == {"train", "val", "test"}  # what preprocess cannot know
    assert config_from_metadata({"synthetic": actual.pop("synthetic")}) == (config, 3000)
    assert actual.keys() == expected.keys()
    assert {k: v for k, v in actual.items() if k != "source"} == {
        k: v for k, v in expected.items() if k != "source"
    }
    assert {k: written[k] for k in ("rows", "files", "categorical")} == {
        k: actual[k] for k in ("rows", "files", "categorical")
    }
    for split in ("train", "val", "test"):
        for file in actual["files"][split]:
            assert pq.read_table(tmp_path / "syn" / file).equals(pq.read_table(tmp_path / "pre" / file))


def test_parquet_loads_with_the_dataset_and_loader(tmp_path):
    write_parquet(SMALL, 5000, tmp_path / "syn", block_size=2048)
    train, val, test = (open_split(tmp_path / "syn", s) for s in ("train", "val", "test"))
    assert (train.num_rows, val.num_rows, test.num_rows) == (4000, 500, 500)
    batches = list(BatchLoader(train, batch_size=512, shuffle=True))
    assert len(batches) == 8
    assert batches[0].dense.shape == (512, NUM_DENSE) and batches[0].dense.dtype == torch.float32
    assert batches[0].sparse.shape == (512, NUM_SPARSE) and batches[0].sparse.dtype == torch.int64
    assert batches[-1].label.shape == (4000 - 7 * 512,)
    assert torch.isfinite(train.dense).all() and (train.dense >= 0).all()
    assert set(train.label.unique().tolist()) == {0.0, 1.0}
    assert ((train.sparse == MISSING_CATEGORY) | ((train.sparse >= 0) & (train.sparse < 2**32))).all()


def test_rows_depend_on_the_seed_only(tmp_path):
    rows = 40_000  # more than two random-number chunks, so blocks straddle chunk boundaries
    whole = generate_rows(SMALL, 0, rows)
    for block_size in (1000, 7777, 16384, 65536):
        blocks = list(iter_blocks(SMALL, rows, block_size))
        assert [b.num_rows for b in blocks[:-1]] == [block_size] * (len(blocks) - 1)
        for field, a in zip(whole._fields, whole, strict=True):
            np.testing.assert_array_equal(
                np.concatenate([getattr(b, field) for b in blocks]), a, err_msg=field
            )
    part = generate_rows(SMALL, 12_345, 23_456)
    for a, b in zip(part, whole.slice(12_345, 23_456), strict=True):
        np.testing.assert_array_equal(a, b)

    write_tsv(SMALL, 3000, tmp_path / "a.tsv", block_size=3000)
    write_tsv(SMALL, 3000, tmp_path / "b.tsv", block_size=256)
    write_tsv(SyntheticConfig(SMALL.cardinalities, seed=4), 3000, tmp_path / "c.tsv")
    assert (tmp_path / "a.tsv").read_bytes() == (tmp_path / "b.tsv").read_bytes()
    a_lines = (tmp_path / "a.tsv").read_text().splitlines()
    c_lines = (tmp_path / "c.tsv").read_text().splitlines()
    assert sum(a != c for a, c in zip(a_lines, c_lines, strict=True)) > 2900


def test_ids_follow_the_cardinalities_and_are_skewed():
    config = SyntheticConfig(preset_cardinalities("kaggle", max_cardinality=50), seed=5)
    sparse = generate_rows(config, 0, 20_000).sparse
    for c, cardinality in enumerate(config.cardinalities):
        ids = sparse[:, c][sparse[:, c] != MISSING_CATEGORY]
        _, counts = np.unique(ids, return_counts=True)
        assert len(counts) <= cardinality
        if cardinality == 50:
            assert len(counts) == 50  # 20k draws reach every rank of a 50-id column
            assert counts.max() > 10 * np.median(counts)
    # Uncapped: big columns are long-tailed and spread over 32-bit ids.
    big = generate_rows(SyntheticConfig(seed=5), 0, 20_000).sparse[:, 2]  # C3, 10M ids
    ids, counts = np.unique(big[big != MISSING_CATEGORY], return_counts=True)
    assert 2000 < len(ids) < 20_000 and counts.max() > 500
    assert ids.max() > 2**31


def test_index_ids_are_a_permutation_of_the_ranks_per_column():
    """ids "index": rank k of a column of cardinality K maps one-to-one onto [0, K), the same ranks draw the
    same rows as "hash" ids (only the names differ), and the written metadata records the max id."""
    cardinalities = (1, 2, 3, 4, 6, 12, 97, 1000, 4096, 65_536, *preset_cardinalities("terabyte", 5000)[10:])
    config = SyntheticConfig(cardinalities, seed=9, ids="index")
    for c, k in enumerate(cardinalities):
        ids = ids_of_ranks(config, np.arange(k)[:, None], [c])[:, 0]
        assert sorted(ids.tolist()) == list(range(k)), c
    hashed = generate_rows(SyntheticConfig(cardinalities, seed=9), 0, 5000)
    index = generate_rows(config, 0, 5000)
    missing = hashed.sparse == MISSING_CATEGORY
    np.testing.assert_array_equal(index.sparse == MISSING_CATEGORY, missing)
    for c in range(NUM_SPARSE):  # one name per id: the two columns pair up one-to-one
        pairs = set(
            zip(
                hashed.sparse[~missing[:, c], c].tolist(),
                index.sparse[~missing[:, c], c].tolist(),
                strict=True,
            )
        )
        assert len(pairs) == len({a for a, _ in pairs}) == len({b for _, b in pairs}), c
    assert (index.sparse < np.array(cardinalities)).all()


def test_metadata_gives_back_the_generators_config(tmp_path):
    config = SyntheticConfig(preset_cardinalities("terabyte", 300), seed=2, ctr=0.2, ids="index")
    written = write_parquet(config, 2000, tmp_path / "d", rows_per_file=700)
    metadata = load_metadata(tmp_path / "d")
    assert config_from_metadata(metadata) == (config, 2000)
    rows = generate_rows(config, 0, 2000)
    train = rows.sparse[: metadata["rows"]["train"]]
    for c, name in enumerate(SPARSE_COLUMNS):
        present = train[:, c][train[:, c] != MISSING_CATEGORY]
        assert metadata["categorical"][name]["max_id"] == (present.max() if len(present) else None), name
    assert written["synthetic"]["ids"] == "index"
    with pytest.raises(SyntheticError, match='no "synthetic" key'):
        config_from_metadata({k: v for k, v in metadata.items() if k != "synthetic"})


def test_planted_signal_is_learnable(tmp_path):
    torch.manual_seed(0)
    write_parquet(SMALL, 20_000, tmp_path / "syn", val_fraction=0.0, test_fraction=0.2)  # 4000 held out
    train, eval_ = open_split(tmp_path / "syn", "train"), open_split(tmp_path / "syn", "test")

    # Logistic regression: one weight per (column, id mod P) plus a linear term in the dense features,
    # full-batch Adam.
    buckets = 1009

    def model(dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(NUM_SPARSE) * (buckets + 1) + torch.where(sparse < 0, buckets, sparse % buckets)
        return torch.nn.functional.embedding(rows, table).sum(dim=(1, 2)) + linear(dense).squeeze(1)

    table = torch.zeros(NUM_SPARSE * (buckets + 1), 1, requires_grad=True)
    linear = torch.nn.Linear(NUM_DENSE, 1)
    optimizer = torch.optim.Adam([table, *linear.parameters()], lr=0.2)
    for _ in range(60):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model(train.dense, train.sparse), train.label
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        auc = binary_auroc(model(eval_.dense, eval_.sparse), eval_.label.long()).item()

    # The planted model itself, on the raw counts (the loader's dense is log1p of them).
    oracle = planted_logit(SMALL, torch.expm1(eval_.dense).round().numpy(), eval_.sparse.numpy())
    oracle_auc = binary_auroc(torch.from_numpy(oracle), eval_.label.long()).item()
    assert oracle_auc > 0.78
    assert auc > 0.7, (auc, oracle_auc)


def test_no_partial_output_on_failure(tmp_path, monkeypatch):
    calls = []

    def fail_on_second_block(rows):
        calls.append(rows.num_rows)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real(rows)

    real = to_raw_table
    monkeypatch.setattr(synthetic_output, "to_raw_table", fail_on_second_block)
    with pytest.raises(RuntimeError, match="boom"):
        write_tsv(SMALL, 3000, tmp_path / "x.tsv.gz", block_size=1000)
    assert list(tmp_path.iterdir()) == []


def test_cli_writes_tsv_and_parquet(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["--rows", "1000", "--output", str(tmp_path / "a.tsv"), "--seed", "7"])
    assert result.exit_code == 0, result.output
    assert len((tmp_path / "a.tsv").read_text().splitlines()) == 1000
    args = ["--rows", "1000", "--output-dir", str(tmp_path / "d"), "--eval-fraction", "0.1"]
    result = runner.invoke(main, [*args, "--cardinalities", "terabyte", "--max-cardinality", "1000"])
    assert result.exit_code == 0, result.output
    assert load_metadata(tmp_path / "d")["rows"] == {"train": 900, "val": 50, "test": 50}
    # An existing output is kept unless --overwrite.
    assert runner.invoke(main, args).exit_code == 2
    assert runner.invoke(main, [*args, "--overwrite", "--seed", "1"]).exit_code == 0
    assert runner.invoke(main, ["--help"]).exit_code == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rows", "10"], "exactly one of --output"),
        (["--rows", "10", "--output", "a.tsv", "--output-dir", "d"], "exactly one of --output"),
        (["--rows", "0", "--output", "a.tsv"], "rows must be at least 1"),
        (["--rows", "ten", "--output", "a.tsv"], "'ten' is not a valid integer"),
        (["--rows", "10", "--output", "a.tsv", "--block-size", "0"], "block size must be at least 1"),
        (["--rows", "10", "--output", "a.tsv", "--max-cardinality", "0"], "max cardinality"),
        (["--rows", "10", "--output", "a.tsv", "--ctr", "1.5"], "ctr must be in (0, 1)"),
        (["--rows", "10", "--output", "a.tsv", "--seed", "-1"], "seed must be non-negative"),
        (["--rows", "10", "--output-dir", "d", "--eval-fraction", "1"], "--eval-fraction must be in"),
        (["--rows", "10", "--output-dir", "d", "--test-fraction", "-1"], "--test-fraction must be in"),
        (["--rows", "10", "--output-dir", "d", "--val-fraction", "0.6", "--test-fraction", "0.4"], "below 1"),
        (
            ["--rows", "10", "--output-dir", "d", "--eval-fraction", "0.2", "--val-fraction", "0.1"],
            "shorthand",
        ),
        (
            ["--rows", "10", "--output", "a.tsv", "--val-fraction", "0.1"],
            "--val-fraction: only with --output-dir",
        ),
        (["--rows", "1", "--output-dir", "d", "--eval-fraction", "0.9"], "no train rows"),
        (["--rows", "10", "--output", "missing/a.tsv"], "no such directory"),
        (["--rows", "10", "--output", "a.tsv", "--cardinalities", "huge"], "huge"),
        (["--rows", "10", "--output", "a.tsv", "--ids", "names"], "names"),
    ],
)
def test_cli_bad_arguments(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    # Click's usage errors in click's format (as every CLI's, dlrm.errors); ours are one line.
    last = result.stderr.strip().splitlines()[-1]
    assert message in last, result.stderr
    if not last.startswith("Error: "):
        assert result.stderr == f"{last}\n" and last.startswith("error: "), result.stderr
    assert list(tmp_path.iterdir()) == []


def test_module_entry_point_error(tmp_path):
    out = tmp_path / "a.tsv"
    result = subprocess.run(
        [sys.executable, "-m", "dlrm.data.synthetic", "--rows", "0", "--output", str(out)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[1],
    )
    assert result.returncode == 2
    assert result.stderr == "error: rows must be at least 1, got 0\n"
    assert not out.exists()


@pytest.mark.parametrize("cardinality", [3, 1000, 10_000_000])
def test_power_law_ranks_follow_the_power_law(cardinality):
    """Ranks lie in [0, K) and rank k has the continuous power law's mass on [k + 1, k + 2): for rank 0,
    (1 - 2^(1-s)) / (1 - (K+1)^(1-s)) (about 0.11 at K = 10M, the hot row the benchmarks' Zipf ids have)."""
    u = np.random.default_rng(0).random((400_000, 1))
    ranks = power_law_ranks(u, [cardinality])
    assert ranks.min() == 0 and ranks.max() < cardinality
    a = 1 - ZIPF_EXPONENT
    for k in (0, 1):
        expected = ((k + 2) ** a - (k + 1) ** a) / ((cardinality + 1) ** a - 1)
        assert (ranks == k).mean() == pytest.approx(expected, abs=5 * (expected / len(u)) ** 0.5)
