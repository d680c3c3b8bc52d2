"""Nothing unnamed: damaged data files, data paths that are not data directories, a resume of a finished
run, a non-finite stop's step in metrics.json, and `make test-gpu` without a GPU. Each case: the exit code
and the one line naming what to fix."""

import errno
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from loguru import logger

from dlrm import evaluate as evaluate_cli
from dlrm import predict as predict_cli
from dlrm import train as train_cli
from dlrm.config import load_config
from dlrm.data import binary_loader
from dlrm.data.binary import write_binary_split
from dlrm.run import selection
from tests.conftest import REPO, SAMPLE_TSV
from tests.test_faults import _cli, _config, _copy_data, _one_error_line, _strict_json, trained  # noqa: F401
from tests.test_streaming import write_id_files


@pytest.fixture
def truncated(criteo_sample, tmp_path):
    """A copy of the sample whose first train and test shards are cut to half their bytes."""
    data = _copy_data(criteo_sample, tmp_path)
    for split in ("train", "test"):
        shard = sorted((data / split).glob("*.parquet"))[0]
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return data


@pytest.mark.parametrize("cli", ["train-memory", "train-streaming", "evaluate", "predict"])
def test_a_truncated_parquet_shard_is_one_line_naming_it(truncated, trained, tmp_path, cli):  # noqa: F811
    split = "test" if cli in ("evaluate", "predict") else "train"
    shard = sorted((truncated / split).glob("*.parquet"))[0]
    out = tmp_path / "out"
    if cli.startswith("train"):
        config = _config(tmp_path, truncated, max_steps=2)
        raw = json.loads(config.read_text())
        raw["data"]["loader"] = cli.removeprefix("train-")
        config.write_text(json.dumps(raw))
        main, args = train_cli.main, ["--config", config, "--output-dir", out]
    elif cli == "evaluate":
        main, args = (
            evaluate_cli.main,
            ["--checkpoint", trained / "checkpoints" / "last.pt", "--data", truncated],
        )
    else:
        checkpoint = trained / "checkpoints" / "last.pt"
        main, args = (
            predict_cli.main,
            ["--checkpoint", checkpoint, "--input", truncated, "--output", out / "p.pq"],
        )
    code, output = _cli(main, args)
    line = _one_error_line(output)
    assert code == 2 and line.startswith(f"error: {shard}: not a readable parquet file ("), line
    assert not out.exists()


def test_a_failed_binary_read_names_the_file_and_the_offset(tmp_path, monkeypatch):
    split = tmp_path / "train"
    write_binary_split(write_id_files(tmp_path / "parquet"), split)

    def failing_preadv(fd, buffers, offset):
        if offset >= 16:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset)

    real = os.preadv
    monkeypatch.setattr(binary_loader.os, "preadv", failing_preadv)
    loader = binary_loader.BinaryLoader(split, batch_size=8, window_rows=24, chunk_rows=16, readers=1)
    with pytest.raises(OSError) as raised:
        list(loader)
    assert raised.value.filename.startswith(str(split)) and raised.value.errno == errno.EIO
    assert re.fullmatch(r"Input/output error reading at byte \d+", raised.value.strerror)
    assert int(raised.value.strerror.rsplit(" ", 1)[1]) >= 16


def test_a_raw_file_as_data_path_says_to_preprocess_it(tmp_path):
    config = _config(tmp_path, SAMPLE_TSV)
    code, output = _cli(train_cli.main, ["--config", config, "--output-dir", tmp_path / "run"])
    line = _one_error_line(output)
    assert code == 2 and line.startswith(
        f"error: {SAMPLE_TSV}: a raw file, not a preprocessed data directory"
    )
    assert f"--input {SAMPLE_TSV}" in line and not (tmp_path / "run").exists()


def test_a_relative_data_path_names_the_directory_it_looked_in(tmp_path, monkeypatch):
    config = _config(tmp_path, "data/criteo_sample")
    monkeypatch.chdir(tmp_path)
    code, output = _cli(train_cli.main, ["--config", config, "--output-dir", tmp_path / "run"])
    line = _one_error_line(output)
    assert code == 2 and f"(looked in {tmp_path / 'data' / 'criteo_sample'})" in line


def test_resuming_a_run_that_early_stopping_ended_says_it_is_done(criteo_sample, tmp_path, monkeypatch):
    aucs = iter([0.7, 0.6, 0.6, 0.6])  # no better val AUC after the first: patience 2 stops at step 3

    def scripted(run, loader, split):
        return {"auc": next(aucs, 0.5), "logloss": 0.5, "ne": 1.0, "samples": 1000}

    monkeypatch.setattr(selection, "evaluate_split", scripted, raising=True)
    config = _config(tmp_path, criteo_sample, max_steps=8, eval_interval=1, patience=2)
    run = tmp_path / "run"
    assert _cli(train_cli.main, ["--config", config, "--output-dir", run])[0] == 0
    metrics = _strict_json(run / "metrics.json")
    assert metrics["steps"] == 3
    files = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    code, output = _cli(train_cli.main, ["--config", config, "--resume", run / "checkpoints" / "last.pt"])
    line = _one_error_line(output)
    assert code == 2 and "this run is done: early stopping ended it at step 3" in line
    assert {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == files


@pytest.mark.parametrize("limit", ["max_steps", "epochs"])
def test_resuming_a_finished_run_says_so_in_one_line_and_writes_nothing(criteo_sample, tmp_path, limit):
    config = _config(tmp_path, criteo_sample, max_steps=2)
    if limit == "epochs":  # one epoch of 4 batches
        raw = json.loads(config.read_text())
        raw["data"]["batch_size"], raw["train"]["max_steps"] = 2000, None
        config.write_text(json.dumps(raw))
    run = tmp_path / "run"
    assert _cli(train_cli.main, ["--config", config, "--output-dir", run])[0] == 0
    metrics = _strict_json(run / "metrics.json")
    files = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(run.rglob("*")) if p.is_file()}
    last = run / "checkpoints" / "last.pt"
    lines: list[str] = []
    sink = logger.add(lines.append, format="{message}")
    try:
        code, output = _cli(train_cli.main, ["--config", config, "--resume", last])
        resumed = train_cli.train(load_config(config), resume=last)  # the API: the run's metrics
    finally:
        logger.remove(sink)
    assert code == 0 and "error" not in output, output
    finished = [line.strip() for line in lines if "this run is finished" in line]
    limit_text = "train.max_steps 2" if limit == "max_steps" else "train.epochs 1 (4 steps)"
    assert finished[0] == (
        f"{last}: this run is finished: step {metrics['steps']} of {limit_text}; nothing to train, nothing "
        f"written (its results: {run / 'metrics.json'}). To train on, raise "
        + ("train.max_steps (--max-steps)" if limit == "max_steps" else "train.epochs")
    )
    assert len(finished) == 2 and resumed == metrics
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(run.rglob("*")) if p.is_file()} == files
    # Into another run directory it goes on as any checkpoint: evaluated, saved there (how one reshards).
    copy = train_cli.train(load_config(config), tmp_path / "copy", resume=last)
    assert copy["steps"] == metrics["steps"] and (tmp_path / "copy" / "checkpoints" / "last.pt").is_file()


def test_metrics_json_of_a_nonfinite_stop_names_the_step_the_loss_went_nonfinite(criteo_sample, tmp_path):
    config = _config(tmp_path, criteo_sample, lr=1e6, log_interval=8, max_steps=8)
    run = tmp_path / "run"
    code, output = _cli(train_cli.main, ["--config", config, "--output-dir", run])
    bad_step = int(re.search(r"step (\d+): the training loss is", _one_error_line(output)).group(1))
    metrics = _strict_json(run / "metrics.json")
    assert code == 3 and metrics["nonfinite_step"] == bad_step
    assert bad_step < metrics["steps"]  # the losses were read at the log line, after step 8


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_test_gpu_without_a_gpu_fails(tmp_path):
    stamp = tmp_path / "installed"  # newer than pyproject.toml: make installs nothing
    stamp.touch()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        ["make", "-s", "test-gpu", f"PY={sys.executable}", f"STAMP={stamp}", "GPU_WORKERS=0"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0 and "no CUDA GPU here" in result.stderr, result.stdout + result.stderr
    assert "passed" not in result.stdout and "skipped" not in result.stdout
    np.testing.assert_equal(stamp.exists(), True)
