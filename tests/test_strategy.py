"""dlrm.run.strategy: the one-process and the many-rank strategy answer the same calls (the run never asks
which it has), and the rank-only differences that need no process group. The runs themselves are
tests/test_train.py's (one process) and tests/test_parallel.py's (gloo ranks)."""

import inspect
from pathlib import Path

import pytest

from dlrm.parallel import Dist
from dlrm.run.strategy import Sharded, SingleProcess


def _public(cls) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in vars(cls).items()
        if callable(member) and not name.startswith("_")
    }


def test_both_strategies_have_the_same_methods_and_parameters():
    single, sharded = _public(SingleProcess), _public(Sharded)
    assert single.keys() == sharded.keys()
    for name, signature in single.items():
        assert list(signature.parameters) == list(sharded[name].parameters), name


@pytest.mark.parametrize(("rank", "main"), [(0, True), (1, False)])
def test_only_rank_zero_writes_the_run_files(tmp_path, rank, main):
    strategy = Sharded(Dist(rank=rank, world_size=2))
    assert (strategy.rank, strategy.world_size, strategy.is_main) == (rank, 2, main)
    strategy.write_text(tmp_path / "metrics.json", "{}")
    assert (tmp_path / "metrics.json").exists() == main
    assert strategy.trace_worker == f"rank{rank}"


def test_checkpoints_are_files_of_one_process_and_directories_of_many():
    run_dir = Path("runs/r")
    assert SingleProcess().checkpoint_path(run_dir, "last.pt") == run_dir / "checkpoints" / "last.pt"
    sharded = Sharded(Dist(rank=0, world_size=2))
    assert sharded.checkpoint_path(run_dir, "best.pt") == run_dir / "checkpoints" / "best"


def test_one_process_agrees_with_itself_and_many_ranks_only_at_log_lines():
    assert SingleProcess().agree(15, True, at_log_line=False) == (15, True)
    # Off a log line the ranks do not meet (no collective), so nothing is acted on yet.
    assert Sharded(Dist(rank=0, world_size=2)).agree(15, True, at_log_line=False) == (0, False)
