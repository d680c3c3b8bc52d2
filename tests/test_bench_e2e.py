"""scripts/bench_e2e.py's runs: weak scaling over GPUs (the batch a GPU, the global batch N times it)."""

import json
import math
import sys
from pathlib import Path

from dlrm.config import load_config
from dlrm.run.timing import PARTS
from tests.conftest import load_script

e2e = load_script("bench_e2e")


def test_a_run_of_n_gpus_trains_n_times_the_batch_for_as_many_steps(tmp_path):
    (tmp_path / "metadata.json").write_text(json.dumps({"rows": {"train": 1000}}))
    one = e2e.run_config("kaggle", tmp_path, "binary", 64, 40, nproc=1)
    two = e2e.run_config("kaggle", tmp_path, "binary", 64, 40, nproc=2)
    assert (one["data"]["batch_size"], two["data"]["batch_size"]) == (64, 128)
    assert two["data"]["eval_batch_size"] == 128 and two["data"]["loader"] == "binary"
    # 40 steps of 64 rows over 1,000 train rows: 3 epochs; of 128: 6.
    assert (one["train"]["epochs"], two["train"]["epochs"]) == (3, 6)
    assert two["train"]["max_steps"] == 40
    path = tmp_path / "two.json"
    path.write_text(json.dumps(two))
    assert load_config(path).data.batch_size == 128  # a config dlrm.train takes


def test_many_gpus_launch_under_torchrun():
    assert e2e.launcher(1) == [sys.executable]
    assert e2e.launcher(2)[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]


def test_the_config_settings_keep_the_configs_own_cadence(tmp_path):
    (tmp_path / "metadata.json").write_text(json.dumps({"rows": {"train": 1000}}))
    own = load_config(e2e.REPO / "configs" / "kaggle.json").to_dict()
    cfg = e2e.run_config("kaggle", tmp_path, "binary", 64, 40, nproc=2, settings="config")
    assert cfg["train"] == own["train"] and cfg["profiler"] == own["profiler"]
    assert (cfg["data"]["batch_size"], cfg["data"]["path"], cfg["model"]["hashing"]) == (
        128,
        str(tmp_path),
        "modulus",
    )
    assert e2e.run_config("kaggle", tmp_path, "binary", 64, 40, nproc=2)["train"] != own["train"]


def test_each_override_reaches_the_run_as_set_and_the_run_directory_is_kept(tmp_path, monkeypatch):
    (tmp_path / "metadata.json").write_text(json.dumps({"rows": {"train": 1000}}))
    seen = {}

    def run(command, check):
        seen["command"] = command
        run_dir = Path(command[command.index("--output-dir") + 1])
        run_dir.mkdir()
        (run_dir / "metrics.json").write_text(json.dumps({"steps": 40}))
        (run_dir / "checkpoints").mkdir()
        (run_dir / "checkpoints" / "last.pt").write_bytes(b"tables")

    monkeypatch.setattr(e2e.subprocess, "run", run)
    policy = 'train.checkpoint_policy="none"'
    kept = tmp_path / "kept" / "w1_binary_graphs-on"
    metrics = e2e.train_run(
        "kaggle", tmp_path, "binary", True, 64, "tf32", 40, overrides=(policy,), keep=kept
    )
    command = seen["command"]
    assert command[command.index("--set") : command.index("--set") + 2] == ["--set", policy]
    assert metrics["steps"] == 40 and math.isnan(metrics["gpu_idle_share"])  # no trace: no window
    # The run directory is kept, without its checkpoints.
    assert (kept / "metrics.json").is_file() and not (kept / "checkpoints").exists()


def test_keep_runs_gives_each_run_its_own_directory(tmp_path, monkeypatch):
    """`--keep-runs DIR` reaches every training run as DIR/w<N>_<loader>_graphs-<on|off>."""
    from click.testing import CliRunner

    kept = []

    def train_run(*args):
        kept.append(args[-1])
        spent = {"wall_s": 1.0} | {f"{part}_s": 0.1 for part in PARTS}
        return {"evals": 1, "eval_s": 0.1, "first_eval_s": 0.1, "steps": 20, "samples_per_s": 10.0,
                "gpu_idle_share": 0.0, "val_samples": 5, "peak_rss_gib": 1.0, "first_step_s": 1.0,
                "time_per_rank": [spent]}  # fmt: skip

    monkeypatch.setattr(e2e.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(e2e.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(e2e.torch.cuda, "get_device_name", lambda: "fake")
    for name, fake in {"ensure_data": lambda data, rows, val_fraction: None, "bare_step": lambda *args: 10.0,
                       "step_idle_share": lambda *args: 0.0, "train_run": train_run,
                       "append_rows": lambda path, rows: None}.items():  # fmt: skip
        monkeypatch.setattr(e2e, name, fake)
    args = ["--loaders", "binary", "--graphs", "on,off", "--nproc", "1,2", "--keep-runs", str(tmp_path)]
    result = CliRunner().invoke(e2e.main, args)
    assert result.exit_code == 0, result.output
    names = ["w1_binary_graphs-on", "w1_binary_graphs-off", "w2_binary_graphs-on", "w2_binary_graphs-off"]
    assert kept == [tmp_path / name for name in names]
