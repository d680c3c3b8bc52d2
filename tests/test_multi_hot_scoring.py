"""Multi-hot and DCNv2 runs scored after training: `dlrm.evaluate`, `dlrm.predict` and `dlrm.export` take
their bags the way the run read its data: made by the run's `data.multi_hot` from one-hot data (a data
directory, raw TSV, a parquet shard), or read as `python -m dlrm.data.multi_hot` wrote them."""

import json

import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from dlrm import aoti as aoti_cli
from dlrm import evaluate as evaluate_cli
from dlrm import export as export_cli
from dlrm import predict as predict_cli
from dlrm.config import apply_overrides, load_config
from dlrm.data import multi_hot as multi_hot_cli
from dlrm.data.bags import MLPERF_SIZES, BagMaker, bag_columns, id_ranges
from dlrm.data.dataset import open_split
from dlrm.data.output import load_metadata
from dlrm.metrics import auc
from dlrm.run.loop import train
from tests.conftest import REPO, SAMPLE_TSV

SMALL = [  # seconds on a CPU
    "model.embedding_dim=8",
    "model.bottom_mlp=[16,8]",
    "model.top_mlp=[16,1]",
    "train.max_steps=3",
    "train.epochs=1",
    "train.device=cpu",
    "profiler.enabled=false",
]
# configs/main_multi_hot.json (pareto bags) and configs/dlrm_dcnv2.json (uniform bags, the dcn interaction,
# bf16), shrunk; the bags are MLPerf's (214 ids a sample) in both.
RUNS = {
    "main_multi_hot": ("main_multi_hot.json", []),
    "dlrm_dcnv2": (
        "dlrm_dcnv2.json",
        [
            "data.loader=memory",
            "data.batch_size=256",
            "data.eval_batch_size=1024",
            "model.table_rows=null",
            "model.max_rows=1000",
            "model.dcn.low_rank=8",
        ],
    ),
}


def _train(name: str, data, run_dir, *overrides: str):
    config, changes = RUNS[name]
    cfg = apply_overrides(load_config(REPO / "configs" / config), [*SMALL, *changes, *overrides])
    cfg = apply_overrides(cfg, [f"data.path={data}"])
    train(cfg, run_dir)
    return run_dir / "checkpoints" / "best.pt"


@pytest.fixture(scope="module")
def runs(criteo_sample, tmp_path_factory):
    """name -> (best.pt, the sample written with the run's bags by python -m dlrm.data.multi_hot)."""
    root = tmp_path_factory.mktemp("multi_hot_scoring")
    out = {}
    for name in RUNS:
        checkpoint = _train(name, criteo_sample, root / name)
        made = load_config(REPO / "configs" / RUNS[name][0]).data.multi_hot
        written = root / f"{name}_bags"
        multi_hot_cli.write_multi_hot(criteo_sample, written, MLPERF_SIZES, made.distribution, made.seed)
        out[name] = (checkpoint, written)
    return out


def _evaluate(checkpoint, data, *extra) -> dict:
    result = CliRunner().invoke(
        evaluate_cli.main, ["--checkpoint", str(checkpoint), "--data", str(data), "--quiet", *extra]
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])


def _predict(checkpoint, source, output, *extra):
    result = CliRunner().invoke(
        predict_cli.main,
        ["--checkpoint", str(checkpoint), "--input", str(source), "--output", str(output), "--quiet", *extra],
    )
    assert result.exit_code == 0, result.output
    return pq.read_table(output)


@pytest.mark.parametrize("name", list(RUNS))
def test_evaluate_reads_one_hot_data_and_written_bags_alike(runs, criteo_sample, name):
    checkpoint, written = runs[name]
    for split in ("test", "val"):
        one_hot = _evaluate(checkpoint, criteo_sample, "--split", split)
        bags = _evaluate(checkpoint, written, "--split", split)
        assert one_hot["samples"] == 1000 and 0.0 < one_hot["auc"] < 1.0
        assert {k: v for k, v in bags.items() if k != "checkpoint"} == {
            k: v for k, v in one_hot.items() if k != "checkpoint"
        }


@pytest.mark.parametrize("name", list(RUNS))
def test_predict_scores_raw_text_one_hot_parquet_and_written_bags_alike(runs, criteo_sample, tmp_path, name):
    checkpoint, written = runs[name]
    tsv = _predict(checkpoint, SAMPLE_TSV, tmp_path / "tsv.parquet", "--block-size", "3000")
    one_hot = _predict(checkpoint, criteo_sample, tmp_path / "one_hot.parquet", "--batch-size", "700")
    shard = sorted((criteo_sample / "test").glob("*.parquet"))[0]
    single = _predict(checkpoint, shard, tmp_path / "shard.parquet")
    bags = _predict(checkpoint, written, tmp_path / "bags.parquet")
    bag_shards = _predict(checkpoint, written / "test", tmp_path / "bag_shards.parquet")
    assert tsv.num_rows == 10_000 and one_hot.num_rows == 1000
    # The sample's last 1,000 lines are the test split.
    logits = torch.tensor(tsv["logit"].to_numpy())[9_000:]
    for table in (one_hot, single, bags, bag_shards):
        torch.testing.assert_close(torch.tensor(table["logit"].to_numpy()), logits)
    # The logits are the model's on the bags the run made (pareto or uniform, its seed, the data's ranges).
    made = load_config(REPO / "configs" / RUNS[name][0]).data.multi_hot
    maker = BagMaker(MLPERF_SIZES, id_ranges(load_metadata(criteo_sample)), made.distribution, made.seed)
    split = open_split(criteo_sample, "test")
    model, scoring = predict_cli.load_model(checkpoint, torch.device("cpu"), "run", "run")
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, scoring.precision == "bf16"):
        expected = model(split.dense, maker(split.sparse)).float()
    torch.testing.assert_close(logits, expected)
    evaluated = _evaluate(checkpoint, criteo_sample)
    assert auc(logits, split.label) == pytest.approx(evaluated["auc"], abs=1e-9)


@pytest.mark.parametrize("name", list(RUNS))
def test_exported_program_takes_bags(runs, criteo_sample, tmp_path, name):
    checkpoint, written = runs[name]
    output = tmp_path / "model.pt2"
    result = CliRunner().invoke(export_cli.main, ["--checkpoint", str(checkpoint), "--output", str(output)])
    assert result.exit_code == 0, result.output
    extra = {"dlrm.json": ""}
    program = torch.export.load(str(output), extra_files=extra)
    info = json.loads(extra["dlrm.json"])
    assert info["bag_sizes"] == list(MLPERF_SIZES)
    assert info["inputs"]["sparse_ids"] == bag_columns(MLPERF_SIZES)
    assert export_cli.program_columns(program) == sum(MLPERF_SIZES) == 214
    # The written test split holds the bags in the program's column order; the counts are raw.
    table = pq.read_table(sorted((written / "test").glob("*.parquet"))[0])
    counts = torch.tensor(table.select([f"I{i}" for i in range(1, 14)]).to_pandas().fillna(0).to_numpy())
    bags = torch.tensor(table.select(info["inputs"]["sparse_ids"]).to_pandas().fillna(-1).to_numpy())
    ctr = program.module()(counts.float(), bags.long())
    split = open_split(written, "test")
    model, _ = predict_cli.load_model(checkpoint, torch.device("cpu"))  # fp32, as the program
    with torch.no_grad():
        expected = torch.sigmoid(model(split.dense, split.sparse))
    assert ctr.shape == (1000,)
    torch.testing.assert_close(ctr, expected)


def test_export_help_documents_the_bags():
    result = CliRunner().invoke(export_cli.main, ["--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "sparse_ids [B,S]" in text and "sum of its bag sizes" in text


def test_ids_that_the_model_does_not_take_are_one_line(runs, criteo_sample, tmp_path):
    checkpoint, written = runs["main_multi_hot"]
    other = tmp_path / "other_bags"
    multi_hot_cli.write_multi_hot(criteo_sample, other, (2,) * 26, "pareto", 0)
    result = CliRunner().invoke(evaluate_cli.main, ["--checkpoint", str(checkpoint), "--data", str(other)])
    assert result.exit_code == 2
    assert f"{other}/metadata.json holds bags of sizes [2, 2," in result.output
    # A run that read bags written in its data (no data.multi_hot) cannot make them from one-hot rows.
    read = _train("main_multi_hot", written, tmp_path / "read", "data.multi_hot.distribution=null")
    for main, args in (
        (evaluate_cli.main, ["--data", str(criteo_sample)]),
        (predict_cli.main, ["--input", str(SAMPLE_TSV), "--output", str(tmp_path / "p.parquet")]),
    ):
        result = CliRunner().invoke(main, ["--checkpoint", str(read), *args])
        assert result.exit_code == 2, result.output
        assert "the run read bags written in its data" in result.output
        assert f"give bags of sizes {list(MLPERF_SIZES)}" in result.output
    assert _evaluate(read, written)["samples"] == 1000


def test_aoti_times_a_program_of_bags_on_bags(runs, tmp_path, monkeypatch):
    """dlrm.aoti's latency table feeds the program inputs of its own width (the compile itself, minutes on
    a CPU, is tests/test_export.py's: here the program stands in for its package)."""
    program = tmp_path / "model.pt2"
    args = ["--checkpoint", str(runs["dlrm_dcnv2"][0]), "--output", str(program)]
    assert CliRunner().invoke(export_cli.main, args).exit_code == 0
    monkeypatch.setattr(aoti_cli, "compile_package", lambda exported, path: exported.module())
    monkeypatch.setattr(aoti_cli, "LATENCY_BATCHES", (1, 3))
    result = CliRunner().invoke(
        aoti_cli.main, ["--program", str(program), "--output", str(tmp_path / "a.pt2")]
    )
    assert result.exit_code == 0, result.output
    assert "| 3 |" in result.output
