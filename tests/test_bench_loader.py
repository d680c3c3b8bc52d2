"""scripts/bench_loader.py's data: the binary mode's column files are written beside the parquet split."""

import json

from dlrm.data.binary import binary_dir, open_binary
from tests.conftest import load_script

bench_loader = load_script("bench_loader")


def test_the_binary_mode_gets_the_train_splits_binary_files(tmp_path):
    path = bench_loader.synthetic_dir(2000, tmp_path / "data", binary=True)
    train_rows = json.loads((path / "metadata.json").read_text())["rows"]["train"]
    assert open_binary(binary_dir(path, "train")).rows == train_rows > 0
    # Without the binary mode, none are written.
    other = bench_loader.synthetic_dir(2000, tmp_path / "other")
    assert not binary_dir(other, "train").exists()
