"""scripts/bench_train.py keeps each row as soon as it is measured (train.csv, or the file a `launch_each`
parent reads), so an invocation stopped, failed or killed partway keeps every whole row before it. The GPU
and the timed steps are stood in for: `bench` returns made-up measurements, and its third call stops
(KeyboardInterrupt) or fails (an error a later batch can meet: out of memory)."""

import json
import signal

import click
import pytest
import torch

from dlrm import parallel
from tests.conftest import load_script

ARGS = ["--configs", "kaggle", "--batches", "128,2048", "--backends", "torch-graphed,triton+graphs"]


@pytest.fixture(params=[KeyboardInterrupt, torch.OutOfMemoryError])
def bench_train(request, monkeypatch, tmp_path):
    module = load_script("bench_train")
    calls = []

    def bench(config, backend, batch, *args):
        calls.append(backend)
        if len(calls) == 3:  # the second batch's first backend: stopped, or failed, while it runs
            raise request.param
        return {
            "config": config, "backend": backend, "batch": batch, "table_rows_total": 10,
            "ms_per_step": 1.0 + len(calls), "samples_per_s": 1000 * len(calls), "peak_mem_gib": 1.0,
            "first_step_s": 1.0, "capture_s": 0.01, "world_size": 1, "global_batch": batch,
            "step_ms_min": 1.0, "step_ms_max": 1.0,
        }  # fmt: skip

    monkeypatch.setattr(module, "bench", bench)
    monkeypatch.setattr(module, "RESULTS", tmp_path / "train.csv")
    monkeypatch.setattr(module.parallel, "init_distributed", lambda *_: (parallel.SINGLE, None))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "stand-in GPU")
    handler = signal.getsignal(signal.SIGTERM)  # main() takes SIGTERM as Ctrl-C
    # click answers KeyboardInterrupt with Abort; an error goes on as it is
    yield module, click.exceptions.Abort if request.param is KeyboardInterrupt else request.param
    signal.signal(signal.SIGTERM, handler)


def test_a_stopped_or_failed_run_keeps_each_row_measured_before_it(bench_train, tmp_path, monkeypatch):
    bench_train, ended = bench_train
    monkeypatch.delenv(bench_train.ROWS_ENV, raising=False)
    with pytest.raises(ended):
        bench_train.main.main(ARGS, standalone_mode=False)
    lines = (tmp_path / "train.csv").read_text().splitlines()
    assert len(lines) == 3  # the header and the first batch's two rows
    assert "torch-graphed,128," in lines[1] and "triton+graphs,128," in lines[2]


def test_under_launch_each_the_parents_file_holds_every_row_so_far(bench_train, tmp_path, monkeypatch):
    bench_train, ended = bench_train
    handed = tmp_path / "rows.json"
    monkeypatch.setenv(bench_train.ROWS_ENV, str(handed))
    with pytest.raises(ended):
        bench_train.main.main(ARGS, standalone_mode=False)
    rows = json.loads(handed.read_text())
    assert [(r["backend"], r["batch"]) for r in rows] == [("torch-graphed", 128), ("triton+graphs", 128)]
    assert not (tmp_path / "train.csv").exists()
    assert not list(tmp_path.glob("*.part"))
