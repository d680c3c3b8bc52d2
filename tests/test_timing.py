"""Where a run's wall time goes (dlrm.run.timing): the clock's parts, and real runs of `dlrm.train` on the
CPU (one process, and 2 gloo ranks) whose metrics.json, log line and TensorBoard scalars say it."""

import dataclasses
import json
import math
import time

import pytest
import torch
from loguru import logger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dlrm import train as train_cli
from dlrm.config import load_config, replace
from dlrm.run import selection
from dlrm.run import setup as run_setup
from dlrm.run.loop import train
from dlrm.run.timing import PARTS, TimeSpent, describe
from tests.conftest import REPO
from tests.test_parallel import _config, _spawn

TINY = REPO / "configs" / "tiny.json"
KEYS = ["wall_s", *(f"{part}_s" for part in PARTS)]


def _tiny(data_dir, profiler: bool = False, **train):
    """tiny.json on `data_dir` on the CPU (8 steps of 256 rows, a log line every 4), `train` keys set; the
    profiler window only with `profiler`."""
    cfg = load_config(TINY)
    cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, path=str(data_dir)),
        profiler=dataclasses.replace(cfg.profiler, enabled=profiler),
    )
    return replace(cfg, "train", device="cpu", **train)


def _assert_adds_up(breakdown: dict) -> None:
    """Every part there, none negative, together at most the wall time ("other" is the rest)."""
    assert list(breakdown) == KEYS, breakdown
    assert all(value >= 0 for value in breakdown.values()), breakdown
    parts = math.fsum(breakdown[key] for key in KEYS[1:])
    assert parts <= breakdown["wall_s"] * (1 + 1e-9), breakdown
    assert math.isclose(parts, breakdown["wall_s"], rel_tol=1e-6), breakdown


def _train(cfg, run_dir) -> tuple[dict, list[str]]:
    """metrics.json of `train(cfg)` into `run_dir` and its log lines."""
    lines = []
    sink = logger.add(lines.append, format="{message}")
    try:
        train_cli.train(cfg, run_dir)
    finally:
        logger.remove(sink)
    return json.loads((run_dir / "metrics.json").read_text()), lines


def test_each_moment_goes_to_the_innermost_part(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    spent = TimeSpent(90.0)  # 10 s of set-up before it was made
    spent.switch("step")
    now[0] += 2
    with spent.part("eval"):
        now[0] += 3
        with spent.part("checkpoint"):
            now[0] += 4
        now[0] += 1
    now[0] += 0.5
    spent.move(0.25, "log")  # of the step's time
    spent.switch("other")
    now[0] += 1
    totals = spent.totals()
    assert totals["wall"] == 21.5
    expected = {"setup": 10.0, "step": 2.25, "eval": 4.0, "checkpoint": 4.0, "log": 0.25, "other": 1.0}
    assert {part: s for part, s in totals.items() if s and part != "wall"} == expected
    _assert_adds_up(spent.breakdown())
    assert spent.shares()["setup"] == 100 * 10 / 21.5
    now[0] += 2
    assert spent.shares()["other"] == 100.0  # since the last call


def test_the_line_names_each_part_and_the_ranks_spread():
    one = dict.fromkeys(KEYS, 0.0) | {"wall_s": 10.0, "data_s": 2.5, "step_s": 5.0, "other_s": 2.5}
    line = "time: wall 10.0 s | data 2.50 s (25%) | step launch 5.00 s (50%) | other 2.50 s (25%)"
    assert describe([one]) == line
    other = one | {"wall_s": 12.0, "data_s": 4.5, "collectives_s": 1.0}
    line = describe([one, other])
    assert line.startswith("time (rank 0; min-max over the ranks): wall 10.0 s (10.00-12.00 s) | data 2.50 s")
    assert "data 2.50 s (25%; 2.50-4.50 s)" in line and "collectives 0.00 s (0%; 0.00-1.00 s)" in line
    assert "\n" not in line and "eval" not in line  # 0 on every rank: left out
    assert "data" not in describe([one | {"data_s": 0.004}])  # under 5 ms: left out too


def test_a_run_accounts_for_its_wall_time(criteo_sample, tmp_path):
    cfg = _tiny(criteo_sample, profiler=True, eval_interval=4, checkpoint_interval=4)
    metrics, lines = _train(cfg, tmp_path / "run")
    spent = metrics["time"]
    _assert_adds_up(spent)
    assert metrics["time_per_rank"] == [spent]
    assert spent["wall_s"] >= metrics["wall_s"]  # the test evaluation too
    for part in ("setup", "data", "step", "first_steps", "device_wait", "eval", "checkpoint", "log"):
        assert spent[f"{part}_s"] > 0, part
    assert spent["collectives_s"] < 0.005  # one process: calls that return at once
    line = next(line.rstrip("\n") for line in lines if line.startswith("time: "))
    assert f"wall {spent['wall_s']:.1f} s | setup " in line and "| eval " in line and "\n" not in line
    assert "collectives" not in line  # under 5 ms
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    assert {f"time/{part}_pct" for part in PARTS} <= set(events.Tags()["scalars"])
    for log_step in (4, 8):
        shares = {part: events.Scalars(f"time/{part}_pct")[log_step // 4 - 1] for part in PARTS}
        assert all(s.step == log_step for s in shares.values())
        assert math.isclose(sum(s.value for s in shares.values()), 100.0, rel_tol=1e-3)
    # The sums are this process's: no checkpoint holds them (older checkpoints load as before).
    assert "time_spent" not in torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=False)


# A slow loader or evaluation is a clock that jumps while it runs: JUMP seconds, far more than the rest of
# these runs take, so that the machine's load cannot decide what the part holds.
JUMP = 1000.0


@pytest.fixture
def jumps(monkeypatch):
    """A call `jump()` moves time.perf_counter (the run's clock) on by JUMP seconds."""
    real, ahead = time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real() + ahead[0])

    def jump() -> None:
        ahead[0] += JUMP

    return jump


class _SlowLoader:
    """A train loader whose batches each take JUMP seconds more to come (`jump`)."""

    def __init__(self, loader, jump):
        self._loader, self._jump = loader, jump

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self):
        for batch in self._loader:
            self._jump()
            yield batch


def _all_but(spent: dict, part: str) -> float:
    return sum(value for key, value in spent.items() if key not in ("wall_s", f"{part}_s"))


def test_a_slow_loader_is_data_time(criteo_sample, tmp_path, monkeypatch, jumps):
    make = run_setup.make_train_loader
    monkeypatch.setattr(run_setup, "make_train_loader", lambda *a, **k: _SlowLoader(make(*a, **k), jumps))
    metrics, _ = _train(_tiny(criteo_sample), tmp_path / "run")
    spent = metrics["time"]
    _assert_adds_up(spent)
    assert metrics["steps"] == 8
    assert spent["data_s"] >= 8 * JUMP, spent
    assert _all_but(spent, "data") < JUMP, spent


def test_evaluation_is_eval_time(criteo_sample, tmp_path, monkeypatch, jumps):
    real = selection.evaluate_split

    def slow(run, loader, split):
        jumps()
        return real(run, loader, split)

    monkeypatch.setattr(selection, "evaluate_split", slow)
    metrics, _ = _train(_tiny(criteo_sample, eval_interval=4), tmp_path / "run")
    spent = metrics["time"]
    _assert_adds_up(spent)
    assert metrics["evals"] == 2
    assert spent["eval_s"] >= 3 * JUMP, spent  # 2 val evaluations and the test evaluation
    assert spent["eval_s"] >= metrics["eval_s"]
    assert _all_but(spent, "eval") < JUMP, spent


def _train_on_a_rank(cfg, run_dir: str) -> None:
    train(cfg, run_dir)


def test_two_ranks_breakdowns_are_in_metrics_json(criteo_sample, tmp_path):
    run_dir = tmp_path / "run"
    cfg = _config(criteo_sample, max_steps=4, eval_interval=2)  # log every step: the mean loss's all-reduce
    _spawn(2, [(_train_on_a_rank, (cfg, run_dir))])
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["world_size"] == 2
    per_rank = metrics["time_per_rank"]
    assert len(per_rank) == 2 and metrics["time"] == per_rank[0]
    for spent in per_rank:
        _assert_adds_up(spent)
        assert spent["collectives_s"] > 0 and spent["eval_s"] > 0 and spent["data_s"] > 0, spent
