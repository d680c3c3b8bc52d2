"""`python -m dlrm.evaluate`: what it says about a split it cannot score."""

import json
import shutil

import pyarrow.parquet as pq
from click.testing import CliRunner

from dlrm import evaluate as evaluate_cli
from tests.test_predict import checkpoint  # noqa: F401 - a fixture: tiny.json's best.pt


def test_a_split_without_rows_names_the_data_directory_and_the_split(checkpoint, criteo_sample, tmp_path):  # noqa: F811
    data = tmp_path / "data"
    shutil.copytree(criteo_sample, data)
    for shard in (data / "val").glob("*.parquet"):  # its shard kept, its rows gone
        pq.write_table(pq.read_table(shard).slice(0, 0), shard)
    metadata = json.loads((data / "metadata.json").read_text())
    metadata["rows"]["val"] = 0
    (data / "metadata.json").write_text(json.dumps(metadata))
    args = ["--checkpoint", str(checkpoint), "--data", str(data), "--split", "val", "--quiet"]
    result = CliRunner().invoke(evaluate_cli.main, args)
    assert result.exit_code == 2
    assert (
        result.output.strip().splitlines()[-1]
        == f"error: split 'val' of {data} has no rows: nothing to evaluate"
    )
