"""`python -m dlrm.predict`: CTR per row of raw TSV and parquet inputs, bad lines, agreement with evaluate."""

import dataclasses
import gzip
import json

import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from dlrm import evaluate as evaluate_cli
from dlrm import predict as predict_cli
from dlrm.checkpoint import save_checkpoint
from dlrm.config import load_config, replace
from dlrm.model import DLRM
from dlrm.run.loop import train
from tests.conftest import REPO, SAMPLE_TSV

TINY = REPO / "configs" / "tiny.json"


@pytest.fixture(scope="module")
def checkpoint(criteo_sample, tmp_path_factory):
    """best.pt of tiny.json trained on the sample for 8 steps (CPU, profiler off)."""
    cfg = load_config(TINY)
    cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, path=str(criteo_sample)),
        profiler=dataclasses.replace(cfg.profiler, enabled=False),
    )
    run = tmp_path_factory.mktemp("predict") / "run"
    train(replace(cfg, "train", device="cpu"), run)
    return run / "checkpoints" / "best.pt"


def _predict(checkpoint, source, output, *extra):
    return CliRunner().invoke(
        predict_cli.main,
        ["--checkpoint", str(checkpoint), "--input", str(source), "--output", str(output), *extra],
    )


def _lines() -> list[bytes]:
    with gzip.open(SAMPLE_TSV, "rb") as f:
        return f.read().splitlines(keepends=True)


def test_tsv_and_parquet_give_the_same_ctr(checkpoint, criteo_sample, tmp_path):
    # The sample's last 1,000 lines are the preprocessed test split (the default --split), the 1,000
    # before them val.
    result = _predict(checkpoint, SAMPLE_TSV, tmp_path / "tsv.parquet", "--block-size", "3000")
    assert result.exit_code == 0, result.output
    result = _predict(checkpoint, criteo_sample, tmp_path / "test.parquet", "--batch-size", "700")
    assert result.exit_code == 0, result.output
    result = _predict(checkpoint, criteo_sample, tmp_path / "val.parquet", "--split", "val")
    assert result.exit_code == 0, result.output
    tsv = pq.read_table(tmp_path / "tsv.parquet")
    split = pq.read_table(tmp_path / "test.parquet")
    assert tsv.column_names == ["row", "logit", "ctr", "label"] == split.column_names
    assert tsv["row"].to_pylist() == list(range(10_000))
    assert split["row"].to_pylist() == list(range(1_000))
    val_ctr = torch.tensor(pq.read_table(tmp_path / "val.parquet")["ctr"].to_numpy())
    labels = [float(line.split(b"\t", 1)[0]) for line in _lines()]
    assert tsv["label"].to_pylist() == labels
    ctr = torch.tensor(tsv["ctr"].to_numpy())
    assert ((ctr > 0) & (ctr < 1)).all()
    torch.testing.assert_close(torch.sigmoid(torch.tensor(tsv["logit"].to_numpy())), ctr)
    torch.testing.assert_close(ctr[9_000:], torch.tensor(split["ctr"].to_numpy()))
    torch.testing.assert_close(ctr[8_000:9_000], val_ctr)


def test_unlabeled_tsv(checkpoint, tmp_path):
    lines = _lines()[:50]
    unlabeled = tmp_path / "test.tsv"
    unlabeled.write_bytes(b"".join(line.split(b"\t", 1)[1] for line in lines))
    labeled = tmp_path / "train.tsv"
    labeled.write_bytes(b"".join(lines))
    for source, name in ((unlabeled, "u.parquet"), (labeled, "l.parquet")):
        result = _predict(checkpoint, source, tmp_path / name)
        assert result.exit_code == 0, result.output
    without, with_label = pq.read_table(tmp_path / "u.parquet"), pq.read_table(tmp_path / "l.parquet")
    assert without.column_names == ["row", "logit", "ctr"]
    assert without["ctr"].to_pylist() == with_label["ctr"].to_pylist()


@pytest.mark.parametrize(
    ("line", "labeled", "message"),
    [
        (b"1\t2\tx\n", True, "line 4: expected 40 tab-separated fields, got 3"),
        (None, True, "line 4: I1: expected an integer, got 'abc'"),
        (b"2\t3\n", False, "line 4: expected 39 tab-separated fields (no label), got 2"),
    ],
)
def test_bad_line_stops_with_the_preprocess_error(checkpoint, tmp_path, line, labeled, message):
    lines = _lines()[:6]
    if line is None:
        fields = lines[3].split(b"\t")
        line = b"\t".join([fields[0], b"abc", *fields[2:]])
    lines[3] = line
    if not labeled:
        lines = [x.split(b"\t", 1)[1] if x is not line else x for x in lines]
    source = tmp_path / "bad.tsv"
    source.write_bytes(b"".join(lines))
    result = _predict(checkpoint, source, tmp_path / "out.parquet")
    assert result.exit_code == 2
    assert f"error: {source} {message}" in result.output
    assert list(tmp_path.glob("*.parquet")) == [] and list(tmp_path.glob(".out*")) == []


def test_missing_input_and_checkpoint(checkpoint, tmp_path):
    result = _predict(checkpoint, tmp_path / "nowhere.tsv", tmp_path / "out.parquet")
    assert result.exit_code == 2 and "nowhere.tsv: no such file" in result.output
    result = _predict(tmp_path / "none.pt", SAMPLE_TSV, tmp_path / "out.parquet")
    assert result.exit_code == 2 and "none.pt: checkpoint not found" in result.output


def test_auc_of_predictions_equals_evaluate(checkpoint, criteo_sample, tmp_path):
    from torchmetrics.functional.classification import binary_auroc

    result = _predict(checkpoint, criteo_sample, tmp_path / "eval.parquet")
    assert result.exit_code == 0, result.output
    table = pq.read_table(tmp_path / "eval.parquet")
    auc = binary_auroc(
        torch.tensor(table["ctr"].to_numpy()), torch.tensor(table["label"].to_numpy()).long()
    ).item()
    result = CliRunner().invoke(
        evaluate_cli.main, ["--checkpoint", str(checkpoint), "--data", str(criteo_sample)]
    )
    assert result.exit_code == 0, result.output
    assert auc == pytest.approx(json.loads(result.output)["auc"], abs=1e-6)


def test_triton_checkpoint_scores_like_its_model(tmp_path):
    """A checkpoint of the table-batched (--use-triton) model loads into the eager model for scoring."""
    cfg = load_config(TINY)
    torch.manual_seed(0)
    model = DLRM(cfg.model, table_rows=[7 + f for f in range(26)], sparse_kernel="triton").eval()
    save_checkpoint(
        tmp_path / "best.pt",
        model=model.state_dict(),
        config=cfg.to_dict(),
        table_rows=model.sparse_arch.table_rows,
    )
    dense, sparse = torch.rand(5, 13), torch.randint(-1, 1000, (5, 26))
    with torch.no_grad():
        expected = model(dense, sparse)
        got = predict_cli.load_model(tmp_path / "best.pt", torch.device("cpu"))[0](dense, sparse)
    torch.testing.assert_close(got, expected)
