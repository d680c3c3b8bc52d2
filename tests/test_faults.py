"""Nothing lost (issue 15): non-finite losses, hard kills, signals, reused run directories, unreadable
checkpoints and paths, out-of-memory, bad data. Each case: its exit code, its one line, what is on disk.

The kill and signal cases run `python -m dlrm.train` in subprocesses on tiny configs. The tests marked
`gpu` check skip_batch inside the whole-step CUDA graph and a real CUDA out-of-memory.
"""

import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner
from loguru import logger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dlrm import evaluate as evaluate_cli
from dlrm import out_of_memory as out_of_memory_module
from dlrm import train as train_cli
from dlrm.config import load_config, replace
from dlrm.data import preprocess as preprocess_cli
from dlrm.data import synthetic as synthetic_cli
from dlrm.errors import OutOfMemory
from dlrm.optim import RunOptimizer
from dlrm.out_of_memory import out_of_memory
from dlrm.run import loop, strategy
from dlrm.run import setup as run_setup
from dlrm.signals import StopSignals
from dlrm.step import NonFiniteGuard, train_step
from tests.conftest import REPO

TINY = REPO / "configs" / "tiny.json"


def _config(tmp_path: Path, data_dir: Path, name: str = "c.json", **train) -> Path:
    """tiny.json on `data_dir`, profiler off, with `train` overrides, written to tmp_path/name."""
    raw = json.loads(TINY.read_text())
    raw["data"]["path"] = str(data_dir)
    raw["profiler"]["enabled"] = False
    raw["train"].update({"device": "cpu", **train})
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return path


def _cli(main, args: list) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, result.output


def _one_error_line(output: str) -> str:
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in output, output
    return errors[0]


def _strict_json(path: Path) -> dict:
    def refuse(token):
        raise ValueError(f"{path}: {token} is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


# ---------------------------------------------------------------------------------------------------------
# 1. Non-finite losses


def test_nonfinite_loss_stops_with_exit_3_and_keeps_the_last_finite_checkpoint(criteo_sample, tmp_path):
    config = _config(tmp_path, criteo_sample, lr=1e6, checkpoint_interval=1, eval_interval=1)
    run = tmp_path / "run"
    code, output = _cli(train_cli.main, ["--config", config, "--output-dir", run])
    line = _one_error_line(output)
    assert code == 3
    assert re.search(r"step (\d+): the training loss is nan \(last finite loss .* at step \d+\)", line), line
    bad_step = int(re.search(r"step (\d+):", line).group(1))
    last = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert last["step"] == bad_step - 1 and f"holds step {bad_step - 1}" in line
    assert all(torch.isfinite(v).all() for v in last["model"].values())
    if (run / "checkpoints" / "best.pt").exists():  # only a finite evaluation may become best
        best = torch.load(run / "checkpoints" / "best.pt", weights_only=True)
        assert all(torch.isfinite(v).all() for v in best["model"].values())
    metrics = _strict_json(run / "metrics.json")
    assert metrics["stopped"] == "NonFiniteLoss" and metrics["steps"] == bad_step
    # The test split scores best.pt's finite weights, not the non-finite last ones; none without best.pt.
    assert (metrics["best_step"] is None) == (not (run / "checkpoints" / "best.pt").exists())
    assert metrics["best_step"] is None or metrics["test_auc"] is not None


def test_nonfinite_loss_before_any_checkpoint_writes_no_last_pt(criteo_sample, tmp_path):
    config = _config(tmp_path, criteo_sample, lr=1e6)
    code, output = _cli(train_cli.main, ["--config", config, "--output-dir", tmp_path / "run"])
    assert code == 3 and "no last.pt was written before it" in _one_error_line(output)
    assert not (tmp_path / "run" / "checkpoints" / "last.pt").exists()
    _strict_json(tmp_path / "run" / "metrics.json")


@pytest.mark.parametrize(
    ("sparse_kernel", "optimizer", "weight_decay"),
    [("torch", "sgd", 0.0), ("torch", "adagrad", 0.01), ("triton", "sgd", 0.01), ("triton", "adagrad", 0.0)],
)
def test_skip_batch_leaves_weights_and_optimizer_state_untouched(sparse_kernel, optimizer, weight_decay):
    from dlrm.data.dataset import Batch
    from dlrm.model import DLRM

    cfg = load_config(TINY)
    cfg = replace(cfg, "train", optimizer=optimizer, weight_decay=weight_decay, on_nonfinite="skip_batch")
    torch.manual_seed(0)
    model = DLRM(cfg.model, [50] * 26, sparse_kernel=sparse_kernel, mlp_kernel="torch")
    opt = RunOptimizer(model, cfg.train)
    guard = NonFiniteGuard(model, opt, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)

    def batch(poison: bool) -> Batch:
        dense = torch.rand(8, 13, generator=gen)
        if poison:
            dense[3, 5] = float("nan")
        return Batch(
            dense, torch.randint(0, 1000, (8, 26), generator=gen), torch.rand(8, generator=gen).round()
        )

    def snapshot():
        # Adagrad's "step" count still advances; it only scales lr through lr_decay, which is 0 here.
        state = [
            t.clone() for s in opt.state.values() for k, t in s.items() if torch.is_tensor(t) and k != "step"
        ]
        extra = [model.sparse_arch.optimizer_state.clone()] if sparse_kernel == "triton" else []
        return [p.detach().clone() for p in model.parameters()], state + extra

    train_step(model, opt, batch(False), guard=guard)  # a good step first: optimizer state exists
    before = snapshot()
    loss = train_step(model, opt, batch(True), guard=guard)
    assert not torch.isfinite(loss) and not bool(guard.ok)
    after = snapshot()
    for old, new in zip(before[0] + before[1], after[0] + after[1], strict=True):
        assert torch.equal(old, new)
    train_step(model, opt, batch(False), guard=guard)
    assert bool(guard.ok) and not torch.equal(before[0][0], next(model.parameters()))


@pytest.mark.gpu
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_skip_batch_under_the_cuda_graph_leaves_the_state_untouched_gpu(weight_decay):
    """The guard captured in the whole-step CUDA graph: a replay on a NaN batch changes no weight and no
    embedding row; the next replay on a good batch trains."""
    from dlrm.data.dataset import Batch
    from dlrm.graphs import WARMUP_STEPS, GraphedTrainStep
    from dlrm.model import DLRM
    from dlrm.step import build_step

    cfg = load_config(TINY)
    cfg = replace(cfg, "train", use_triton=True, cuda_graphs=True, on_nonfinite="skip_batch",
                  weight_decay=weight_decay)  # fmt: skip
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = DLRM(cfg.model, [50] * 26, sparse_kernel=cfg.sparse_kernel, mlp_kernel=cfg.mlp_kernel).to(device)
    opt = RunOptimizer(model, cfg.train)
    step = build_step(model, opt, cfg, device)
    gen = torch.Generator().manual_seed(1)

    def batch(poison: bool) -> Batch:
        dense = torch.rand(64, 13, generator=gen)
        if poison:
            dense[3, 5] = float("nan")
        sparse = torch.randint(0, 1000, (64, 26), generator=gen)
        return Batch(dense, sparse, torch.rand(64, generator=gen).round()).to(device)

    def snapshot() -> list[torch.Tensor]:
        return [p.detach().clone() for p in model.parameters()] + [model.sparse_arch.optimizer_state.clone()]

    for _ in range(WARMUP_STEPS + 1):  # warm-up steps, then the capture and its first replay
        step(model, opt, batch(False))
    assert isinstance(step, GraphedTrainStep) and step.graph is not None
    before = snapshot()
    assert not torch.isfinite(step(model, opt, batch(True)))
    for old, new in zip(before, snapshot(), strict=True):
        assert torch.equal(old, new)
    assert torch.isfinite(step(model, opt, batch(False)))
    assert not torch.equal(before[0], next(model.parameters()))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_skip_batch_run_counts_the_skipped_batch_and_goes_on(criteo_sample, tmp_path, monkeypatch, device):
    """A NaN appears in one batch (after the loader's checks, as a device fault would): that step is
    skipped, counted in metrics.json, and training goes on. On the GPU the step is `--use-triton` in its
    CUDA graph and the NaN batch is a replay."""
    build_step = run_setup.build_step
    poison_at = 3 if device == "cpu" else 6  # on the GPU: after the warm-up steps and the capture

    def poisoning_build_step(model, optimizer, cfg, device, reduce_grads=None):
        step, calls = build_step(model, optimizer, cfg, device, reduce_grads), [0]

        def poisoned(model, optimizer, batch):
            calls[0] += 1
            if calls[0] == poison_at:
                batch = batch._replace(dense=batch.dense.clone().fill_(float("nan")))
            return step(model, optimizer, batch)

        return poisoned

    monkeypatch.setattr(run_setup, "build_step", poisoning_build_step)
    options = {} if device == "cpu" else {"use_triton": True, "cuda_graphs": True}
    cfg = load_config(_config(tmp_path, criteo_sample, on_nonfinite="skip_batch", device=device, **options))
    metrics = loop.train(cfg, tmp_path / "run")
    assert metrics["skipped_batches"] == 1 and metrics["steps"] == 8 and metrics["stopped"] is None
    assert _strict_json(tmp_path / "run" / "metrics.json")["skipped_batches"] == 1
    last = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert last["skipped_batches"] == 1 and all(torch.isfinite(v).all() for v in last["model"].values())


def test_infinite_config_values_are_refused(tmp_path):
    config = tmp_path / "inf.json"
    config.write_text(TINY.read_text().replace('"lr": 0.1', '"lr": Infinity'))
    code, output = _cli(train_cli.main, ["--config", config])
    assert code == 2 and "train.lr: expected a finite number, got inf" in _one_error_line(output)
    config.write_text(TINY.read_text().replace('"lr": 0.1', '"lr": NaN'))
    assert _cli(train_cli.main, ["--config", config])[0] == 2


# ---------------------------------------------------------------------------------------------------------
# 2. Periodic checkpoints


def test_periodic_checkpoints_keep_the_last_ones(criteo_sample, tmp_path):
    cfg = load_config(_config(tmp_path, criteo_sample, checkpoint_interval=2, keep_last=2))
    loop.train(cfg, tmp_path / "run")
    directory = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in directory.iterdir()) == ["best.pt", "last.pt", "step-4.pt", "step-6.pt"]
    for name, step in (("last.pt", 8), ("step-4.pt", 4), ("step-6.pt", 6)):
        assert torch.load(directory / name, weights_only=True)["step"] == step


def test_checkpoints_by_wall_time(criteo_sample, tmp_path):
    """checkpoint_every_s: due after each step once that much time has passed (here: always)."""
    cfg = load_config(_config(tmp_path, criteo_sample, max_steps=3, checkpoint_every_s=1e-6, keep_last=5))
    loop.train(cfg, tmp_path / "run")
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == ["best.pt", "last.pt", "step-1.pt", "step-2.pt"]


# ---------------------------------------------------------------------------------------------------------
# 3, 4. Signals and hard kills (subprocesses)


def _start(config: Path, *args) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "dlrm.train", "--config", str(config), *map(str, args)]
    return subprocess.Popen(command, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)


def _wait_for(proc: subprocess.Popen, pattern: str) -> tuple[re.Match, list[str]]:
    """Read the child's log until a line matches `pattern`."""
    lines = []
    for line in proc.stderr:
        lines.append(line)
        match = re.search(pattern, line)
        if match:
            return match, lines
    pytest.fail(f"{pattern!r} never logged:\n{''.join(lines)}")


def _sigterm_after_step_3(config: Path, run: Path) -> str:
    """Train `config` into `run` in a child, send it SIGTERM once step 3 is logged; its one error line (exit
    143 checked)."""
    proc = _start(config, "--output-dir", run)
    _wait_for(proc, r"step 3 \|")
    proc.send_signal(signal.SIGTERM)
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 143, rest
    return _one_error_line(rest)


def test_sigterm_under_checkpoint_policy_none_names_no_checkpoint_to_resume(criteo_sample, tmp_path):
    config = _config(
        tmp_path, criteo_sample, epochs=200, max_steps=None, log_interval=1, checkpoint_policy="none"
    )
    run = tmp_path / "run"
    line = _sigterm_after_step_3(config, run)
    assert "SIGTERM" in line and "wrote no checkpoint" in line and "--resume" not in line, line
    assert not list((run / "checkpoints").glob("*"))  # nothing written, nothing to resume


def test_sigterm_writes_last_pt_and_prints_the_resume_command(criteo_sample, tmp_path):
    config = _config(tmp_path, criteo_sample, epochs=200, max_steps=None, log_interval=1, eval_interval=2)
    run = tmp_path / "run"
    line = _sigterm_after_step_3(config, run)
    step = int(re.search(r"after step (\d+)", line).group(1))
    resume = f"{sys.executable} -m dlrm.train --config {config} --resume {run}/checkpoints/last.pt"
    assert "SIGTERM" in line and line.endswith(f"go on with: {resume}")
    assert torch.load(run / "checkpoints" / "last.pt", weights_only=True)["step"] == step
    metrics = _strict_json(run / "metrics.json")
    assert metrics["stopped"] == "Interrupted"
    # A signal stop still reports the selected weights on test (best.pt: an evaluation every 2 steps).
    assert metrics["best_step"] in range(2, step + 1, 2) and 0 < metrics["test_auc"] < 1
    events = EventAccumulator(str(run))
    events.Reload()
    assert events.Scalars("train/loss")  # flushed
    assert [e.step for e in events.Scalars("test/auc")] == [metrics["best_step"]]


def test_sigint_stops_after_the_step_with_exit_130(criteo_sample, tmp_path, monkeypatch):
    """Ctrl-C, delivered in-process (this process signals itself during step 3)."""
    build_step = run_setup.build_step

    def interrupting_build_step(model, optimizer, cfg, device, reduce_grads=None):
        step, calls = build_step(model, optimizer, cfg, device, reduce_grads), [0]

        def interrupted(model, optimizer, batch):
            calls[0] += 1
            if calls[0] == 3:
                os.kill(os.getpid(), signal.SIGINT)
            return step(model, optimizer, batch)

        return interrupted

    monkeypatch.setattr(run_setup, "build_step", interrupting_build_step)
    config = _config(tmp_path, criteo_sample)
    run = tmp_path / "run"
    # Python's KeyboardInterrupt handler, or SIG_IGN where this process started with SIGINT ignored (a
    # shell's background job): the run hands back whichever it found.
    before = signal.getsignal(signal.SIGINT)
    code, output = _cli(train_cli.main, ["--config", config, "--output-dir", run])
    line = _one_error_line(output)
    assert code == 130 and "stopped by SIGINT after step 3" in line
    assert line.endswith(
        f"go on with: {sys.executable} -m dlrm.train --config {config} --resume {run}/checkpoints/last.pt"
    )
    assert torch.load(run / "checkpoints" / "last.pt", weights_only=True)["step"] == 3
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_a_second_signal_stops_at_once():
    signals = StopSignals()
    signals.handle(signal.SIGINT, None)
    assert signals.received == signal.SIGINT
    with pytest.raises(KeyboardInterrupt):
        signals.handle(signal.SIGINT, None)


@pytest.mark.parametrize(("loader", "optimizer"), [("memory", "sgd"), ("streaming", "adagrad")])
def test_resume_after_sigkill_gives_the_weights_of_an_uninterrupted_run(
    criteo_sample, tmp_path, loader, optimizer
):
    """Three SIGKILLs at random steps, each after a periodic checkpoint; the resumed run ends bit-identical to
    an uninterrupted one, and its TensorBoard losses have each step once."""
    settings = {"epochs": 2, "max_steps": None, "log_interval": 1, "checkpoint_interval": 4}
    config = _config(tmp_path, criteo_sample, optimizer=optimizer, lr=0.05, **settings)
    raw = json.loads(config.read_text())
    raw["data"].update(loader=loader, shuffle_buffer=1000)
    config.write_text(json.dumps(raw))
    whole = loop.train(load_config(config), tmp_path / "whole")
    expected = torch.load(tmp_path / "whole" / "checkpoints" / "last.pt", weights_only=True)

    run, rng, kills = tmp_path / "run", random.Random(15), []
    args = ["--output-dir", run]
    for _ in range(3):
        proc = _start(config, *args)
        start = int(_wait_for(proc, r"step (\d+) \|")[0].group(1)) - 1
        match, lines = _wait_for(proc, r"step (\d+): checkpoint")
        checkpoint = int(match.group(1))
        assert checkpoint > start
        # A checkpoint written in the background says so once written, after the steps that ran meanwhile.
        logged = [int(m.group(1)) for m in (re.search(r"step (\d+) \|", line) for line in lines) if m]
        target = max([checkpoint, *logged]) + rng.randint(1, 8)
        _wait_for(proc, rf"step {target} \|")
        proc.kill()
        proc.communicate()
        assert proc.returncode == -signal.SIGKILL
        kills.append(target)
        args = ["--resume", run / "checkpoints" / "last.pt"]
    assert _cli(train_cli.main, ["--config", config, *args])[0] == 0  # in-process: one start-up less
    assert kills[-1] < whole["steps"]
    resumed = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert resumed["step"] == expected["step"]
    for key, value in expected["model"].items():
        assert torch.equal(resumed["model"][key], value), key
    metrics = _strict_json(run / "metrics.json")
    assert metrics["steps"] == whole["steps"] and metrics["samples"] == whole["samples"]
    for key in ("val_auc", "best_step", "test_auc", "test_logloss", "test_ne"):
        assert metrics[key] == whole[key], key
    events = EventAccumulator(str(run))
    events.Reload()
    steps = [e.step for e in events.Scalars("train/loss")]
    assert steps == sorted(set(steps)) and steps[-1] == whole["steps"]


# ---------------------------------------------------------------------------------------------------------
# 5. Run directories


def test_a_directory_holding_a_run_is_refused_unless_overwrite(criteo_sample, tmp_path):
    config = _config(tmp_path, criteo_sample, max_steps=2)
    run = tmp_path / "run"
    assert _cli(train_cli.main, ["--config", config, "--output-dir", run])[0] == 0
    before = sorted(p.name for p in run.iterdir())
    code, output = _cli(train_cli.main, ["--config", config, "--output-dir", run])
    assert code == 2
    assert _one_error_line(output) == (
        f"error: {run} holds a run; use --resume {run}/checkpoints/last.pt or --overwrite"
    )
    assert sorted(p.name for p in run.iterdir()) == before
    assert _cli(train_cli.main, ["--config", config, "--output-dir", run, "--overwrite"])[0] == 0
    assert len(list(run.glob("events.out.tfevents.*"))) == 1  # the first run's events are gone


@pytest.mark.parametrize("where", ["user_files", "working_directory"])
def test_a_directory_of_user_files_is_refused_and_left_as_it_was(criteo_sample, tmp_path, where, monkeypatch):
    config = _config(tmp_path, criteo_sample, max_steps=2)
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("my notes")
    args = ["--config", config, "--output-dir", target]
    if where == "working_directory":
        monkeypatch.chdir(target)
        args[-1] = "."
    code, output = _cli(train_cli.main, args)
    line = _one_error_line(output)
    assert code == 2 and "holds no run" in line and "notes.txt" in line, line
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt"]
    assert (target / "notes.txt").read_text() == "my notes"


@pytest.mark.parametrize("where", ["file", "proc", "under_file"])
def test_an_unusable_output_dir_is_refused_before_training(criteo_sample, tmp_path, where):
    config = _config(tmp_path, criteo_sample, max_steps=2)
    (tmp_path / "a_file").write_text("x")
    target = {
        "file": tmp_path / "a_file",
        "proc": Path("/proc/dlrm-run"),
        "under_file": tmp_path / "a_file" / "run",
    }[where]
    code, output = _cli(train_cli.main, ["--config", config, "--output-dir", target])
    assert code == 2 and str(target) in _one_error_line(output)
    assert "first step" not in output and not target.is_dir()


# ---------------------------------------------------------------------------------------------------------
# 6, 9. Checkpoints, paths, resumed hyperparameters


@pytest.fixture(scope="module")
def trained(criteo_sample, tmp_path_factory):
    run = tmp_path_factory.mktemp("trained") / "run"
    cfg = load_config(TINY)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(criteo_sample)))
    loop.train(replace(cfg, "train", max_steps=4, device="cpu"), run)
    return run


@pytest.mark.parametrize("kind", ["truncated", "empty", "json", "directory"])
def test_unreadable_checkpoints_are_one_line_naming_the_file(criteo_sample, trained, tmp_path, kind):
    bad = tmp_path / "bad.pt"
    if kind == "truncated":
        data = (trained / "checkpoints" / "last.pt").read_bytes()
        bad.write_bytes(data[: len(data) // 2])
    elif kind == "empty":
        bad.write_bytes(b"")
    elif kind == "json":
        bad.write_text('{"model": 1}')
    else:
        bad.mkdir()
    code, output = _cli(evaluate_cli.main, ["--checkpoint", bad, "--data", criteo_sample])
    assert code == 2 and _one_error_line(output).startswith(f"error: {bad}: ")
    config = _config(tmp_path, criteo_sample, max_steps=6)
    code, output = _cli(train_cli.main, ["--config", config, "--resume", bad, "--output-dir", tmp_path / "r"])
    assert code == 2 and _one_error_line(output).startswith(f"error: {bad}: ")
    assert not (tmp_path / "r").exists()


def test_missing_last_pt_names_the_checkpoints_that_exist(criteo_sample, trained, tmp_path):
    (trained / "checkpoints" / "last.pt").rename(tmp_path / "away.pt")
    try:
        config = _config(tmp_path, criteo_sample, max_steps=6)
        code, output = _cli(
            train_cli.main, ["--config", config, "--resume", trained / "checkpoints" / "last.pt"]
        )
        assert code == 2 and "checkpoint not found" in output and "best.pt" in _one_error_line(output)
    finally:
        (tmp_path / "away.pt").rename(trained / "checkpoints" / "last.pt")


def test_resume_takes_the_configs_hyperparameters(criteo_sample, trained, tmp_path):
    config = _config(tmp_path, criteo_sample, max_steps=6, lr=0.02)
    run = tmp_path / "resumed"
    args = ["--config", config, "--resume", trained / "checkpoints" / "last.pt", "--output-dir", run]
    assert _cli(train_cli.main, args)[0] == 0
    state = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert [g["lr"] for g in state["optimizer"]["param_groups"]] == [0.02, 0.02]
    assert _strict_json(run / "metrics.json")["samples"] == 6 * 256  # the whole run, 4 + 2 steps


def test_resume_with_another_batch_size_is_one_line_naming_both_before_any_work(
    criteo_sample, trained, tmp_path
):
    config = _config(tmp_path, criteo_sample, max_steps=6)
    raw = json.loads(config.read_text())
    raw["data"]["batch_size"] = 128  # trained with 256
    config.write_text(json.dumps(raw))
    last, run = trained / "checkpoints" / "last.pt", tmp_path / "resumed"
    lines: list[str] = []
    sink = logger.add(lines.append, format="{message}")
    try:
        code, output = _cli(train_cli.main, ["--config", config, "--resume", last, "--output-dir", run])
    finally:
        logger.remove(sink)
    assert code == 2
    assert _one_error_line(output) == f"error: {last}: trained with data.batch_size = 256, the config has 128"
    assert lines == [] and not run.exists()  # no data read, no model built


def test_a_checkpoint_older_than_a_model_key_resumes_as_trained_with_its_default(
    criteo_sample, trained, tmp_path
):
    state = torch.load(trained / "checkpoints" / "last.pt", weights_only=True)
    for key in ("arch", "first_order", "min_frequency"):  # keys added after such checkpoints were written
        del state["config"]["model"][key]
    old = tmp_path / "old.pt"
    torch.save(state, old)
    config = _config(tmp_path, criteo_sample, max_steps=6)
    args = ["--config", config, "--resume", old, "--output-dir", tmp_path / "resumed"]
    assert _cli(train_cli.main, args)[0] == 0
    wide = _config(tmp_path, criteo_sample, "wide.json", max_steps=6)
    raw = json.loads(wide.read_text())
    raw["model"]["first_order"] = True
    wide.write_text(json.dumps(raw))
    args = ["--config", wide, "--resume", old, "--output-dir", tmp_path / "wide"]
    code, output = _cli(train_cli.main, args)
    assert code == 2 and "trained with model.first_order = False, the config has True" in _one_error_line(
        output
    )


def test_adagrad_resumed_under_a_schedule_keeps_its_rates_silently(criteo_sample, tmp_path):
    schedule = {"warmup_steps": 10}
    config = _config(tmp_path, criteo_sample, max_steps=4, optimizer="adagrad", lr=0.05, lr_schedule=schedule)
    assert _cli(train_cli.main, ["--config", config, "--output-dir", tmp_path / "run"])[0] == 0
    lines: list[str] = []
    sink = logger.add(lines.append, format="{message}")
    try:
        resumed = _config(tmp_path, criteo_sample, "r.json", max_steps=6, optimizer="adagrad", lr=0.05,
                          lr_schedule=schedule)  # fmt: skip
        args = ["--config", resumed, "--resume", tmp_path / "run" / "checkpoints" / "last.pt"]
        assert _cli(train_cli.main, args)[0] == 0
        changed = _config(tmp_path, criteo_sample, "c2.json", max_steps=8, optimizer="adagrad", lr=0.1,
                          lr_schedule=schedule)  # fmt: skip
        args = ["--config", changed, "--resume", tmp_path / "run" / "checkpoints" / "last.pt"]
        assert _cli(train_cli.main, args)[0] == 0
    finally:
        logger.remove(sink)
    notes = [line.strip() for line in lines if line.startswith("resuming with the config's")]
    assert notes == ["resuming with the config's train.lr 0.1 (the checkpoint had 0.05)"]  # once, of 2 groups


@pytest.mark.parametrize(
    ("main", "args", "expected"),
    [
        (train_cli.main, ["--config", REPO / "configs"], "is a directory"),
        (evaluate_cli.main, ["--checkpoint", "CKPT", "--data", REPO / "configs" / "tiny.json"], "tiny.json"),
        (preprocess_cli.main, ["--input", REPO / "data", "--output-dir", "TMP/out"], "data"),
        (
            preprocess_cli.main,
            ["--input", REPO / "data" / "day_0_head10k.tsv.gz", "--output-dir", "/proc/dlrm"],
            "/proc/dlrm",
        ),
        (synthetic_cli.main, ["--rows", "10", "--output", "/proc/dlrm.tsv"], "/proc/dlrm"),
    ],
)
def test_os_errors_on_user_paths_are_one_line(trained, tmp_path, main, args, expected):
    args = [str(a).replace("CKPT", str(trained / "checkpoints" / "last.pt")) for a in args]
    args = [a.replace("TMP", str(tmp_path)) for a in args]
    code, output = _cli(main, args)
    assert code == 2 and expected in _one_error_line(output), output


# ---------------------------------------------------------------------------------------------------------
# 7. Out of memory


@pytest.mark.parametrize("when", ["set-up", "step"])
def test_out_of_memory_is_one_line_with_the_numbers(criteo_sample, tmp_path, monkeypatch, when):
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has ...\nmore")

    if when == "set-up":
        monkeypatch.setattr(strategy, "build_model", oom)
    else:
        monkeypatch.setattr(run_setup, "build_step", lambda *a: oom)
    config = _config(tmp_path, criteo_sample, max_steps=2)
    code, output = _cli(train_cli.main, ["--config", config, "--output-dir", tmp_path / "run"])
    line = _one_error_line(output)
    assert code == 2
    assert "out of memory" in line and "Tried to allocate 20.00 GiB" in line and "batch 256" in line
    assert "embedding tables" in line and "lower data.batch_size" in line
    assert ("during set-up" if when == "set-up" else "at step 1") in line
    assert (tmp_path / "run").exists() == (when == "step")


@pytest.mark.gpu
def test_a_real_cuda_out_of_memory_is_one_line_gpu(criteo_sample, tmp_path):
    """Too large a batch for the GPU: a top-MLP layer 2^22 wide at batch 4096 needs 64 GiB per activation
    (its weights, 6 GiB, fit). The first step fails; one line with the numbers and exit 2."""
    raw = json.loads(_config(tmp_path, criteo_sample, max_steps=2, device="cuda").read_text())
    raw["model"]["top_mlp"] = [2**22, 1]
    raw["data"]["batch_size"] = 4096
    config = tmp_path / "huge.json"
    config.write_text(json.dumps(raw))
    code, output = _cli(train_cli.main, ["--config", config, "--output-dir", tmp_path / "run"])
    line = _one_error_line(output)
    assert code == 2 and "out of memory at step 1" in line and "GiB GPU memory free" in line, line
    assert "batch 4096" in line and "lower data.batch_size" in line


def test_tables_past_the_host_memory_are_refused_before_they_are_built(criteo_sample, tmp_path, monkeypatch):
    """Tables larger than the host's available memory: one line before any allocation (else the kernel's
    OOM killer ends the process while the weights are initialized, with no message); nothing written."""
    monkeypatch.setattr(out_of_memory_module, "host_available_bytes", lambda: 2**16)
    config = _config(tmp_path, criteo_sample, max_steps=2)
    code, output = _cli(train_cli.main, ["--config", config, "--output-dir", tmp_path / "run"])
    line = _one_error_line(output)
    assert code == 2 and "out of memory during set-up: embedding tables of" in line, line
    assert "x D=8" in line and "0.00 GiB available" in line and "lower model.max_rows" in line
    assert not (tmp_path / "run").exists()


def test_tables_past_the_free_gpu_memory_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**30, 80 * 2**30))
    cfg = replace(load_config(TINY), "train", optimizer="adagrad")
    out_of_memory_module.check_tables_fit(cfg, [2**24], torch.device("cuda"))  # 0.5 + 0.5 GiB: fits
    expected = r"plus 0.50 GiB of Adagrad state, on a GPU with 1.00 GiB of 80.00 GiB free"
    with pytest.raises(OutOfMemory, match=expected):
        out_of_memory_module.check_tables_fit(cfg, [2**24 + 1], torch.device("cuda"))


def test_out_of_memory_message_names_free_gpu_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (2 * 2**30, 80 * 2**30))
    cfg = load_config(TINY)
    err = out_of_memory(
        cfg, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB"), "at step 1"
    )
    assert isinstance(err, OutOfMemory) and "2.00 of 80.00 GiB GPU memory free" in str(err)


# ---------------------------------------------------------------------------------------------------------
# 8. Bad data


def _copy_data(criteo_sample: Path, tmp_path: Path) -> Path:
    import shutil

    data = tmp_path / "data"
    shutil.copytree(criteo_sample, data)
    return data


def _rewrite(path: Path, change) -> None:
    table = pq.read_table(path)
    pq.write_table(change(table), path)


@pytest.mark.parametrize(
    "fault",
    ["missing_column", "mistyped_column", "nan_dense", "label", "rows", "empty_val", "empty_test", "no_test"],
)
@pytest.mark.parametrize("loader", ["memory", "streaming"])
def test_bad_data_is_one_line_naming_the_file_and_nothing_is_written(criteo_sample, tmp_path, fault, loader):
    data = _copy_data(criteo_sample, tmp_path)
    shard = sorted((data / "train").glob("*.parquet"))[0]
    expected = str(shard)
    if fault == "missing_column":
        _rewrite(shard, lambda t: t.drop_columns(["C7"]))
        expected += ": missing columns C7"
    elif fault == "mistyped_column":
        _rewrite(
            shard, lambda t: t.set_column(t.schema.get_field_index("C3"), "C3", pa.array(["x"] * t.num_rows))
        )
        expected += ": column C3 has type string"
    elif fault == "nan_dense":
        column = pa.array([float("nan")] + [1.0] * 7999, pa.float32())
        _rewrite(shard, lambda t: t.set_column(t.schema.get_field_index("I4"), "I4", column))
        expected += ": column I4: 1 NaN or infinite value(s)"
    elif fault == "label":
        column = pa.array([0.0, 2.0, 1.0] + [0.0] * 7997, pa.float32())
        _rewrite(shard, lambda t: t.set_column(t.schema.get_field_index("label"), "label", column))
        expected += ": column label: 1 value(s) other than 0 and 1, expected clicks"
    elif fault == "rows":
        metadata = json.loads((data / "metadata.json").read_text())
        metadata["rows"]["train"] += 1
        (data / "metadata.json").write_text(json.dumps(metadata))
        expected = f"{data}/metadata.json: split 'train' has 8001 rows, its parquet files hold 8000"
    elif fault in ("empty_val", "empty_test"):
        split = fault.removeprefix("empty_")
        metadata = json.loads((data / "metadata.json").read_text())
        metadata["files"][split] = []
        (data / "metadata.json").write_text(json.dumps(metadata))
        expected = f"split {split!r} of {data} is empty"
    else:  # the test split's shard gone: found at set-up, not when training ends
        shard = data / "test" / "part-00000.parquet"
        shard.unlink()
        expected = f"{data}: shards of split 'test' are missing: {shard}"
    config = _config(tmp_path, data, max_steps=2)
    raw = json.loads(config.read_text())
    raw["data"]["loader"] = loader
    config.write_text(json.dumps(raw))
    code, output = _cli(train_cli.main, ["--config", config, "--output-dir", tmp_path / "run"])
    if fault in ("nan_dense", "label") and loader == "streaming":  # found when its row group is read, mid-run
        assert code == 2 and expected in _one_error_line(output)
        return
    assert code == 2 and expected in _one_error_line(output)
    assert not (tmp_path / "run").exists()
