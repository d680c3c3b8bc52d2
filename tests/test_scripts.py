"""Every command-line script under scripts/ imports and prints its --help (they need a GPU to run, so CI
would not otherwise notice an import that a refactoring broke)."""

import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPTS = sorted(p for p in (REPO / "scripts").glob("*.py") if "@click.command" in p.read_text())


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_help(script):
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0 and "Usage:" in result.stdout, result.stderr


def test_model_layout(monkeypatch):
    """bench_kernels.model_layout hands the interaction's output width (367 fp32, 479 bf16) over in rows of 16
    bytes, as the dot interaction writes it, with the same values; the dense features and aligned widths as
    they are."""
    import torch

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    from bench_kernels import model_layout

    for k, dtype, stride in ((367, torch.float32, 368), (479, torch.bfloat16, 480)):
        x = torch.randn(5, k).to(dtype)
        padded = model_layout(x)
        assert padded.stride() == (stride, 1)
        assert torch.equal(padded, x)
    for x in (torch.randn(5, 13), torch.randn(5, 512)):
        assert model_layout(x) is x


def test_rows_of_a_device_copy_name_its_commit_only_when_its_files_are_that_commit(monkeypatch, tmp_path):
    """A copy without .git is trusted to be GIT_SHA only when SOURCE_HASH (computed beside the commit)
    equals the copy's own hash; one changed byte, or no hash given, marks the rows."""
    import shutil

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    from results_csv import commit, source_files, source_hash

    for path in source_files(REPO):
        target = tmp_path / path.relative_to(REPO)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    monkeypatch.setenv("GIT_SHA", "abc1234")
    monkeypatch.delenv("SOURCE_HASH", raising=False)
    assert commit(tmp_path) == "abc1234+unverified"
    monkeypatch.setenv("SOURCE_HASH", source_hash(REPO))
    assert commit(tmp_path) == "abc1234"
    config = tmp_path / "configs" / "tiny.json"
    config.write_text(config.read_text() + " ")
    assert commit(tmp_path) == "abc1234+dirty"


def test_clock_samples_parse_nvidia_smi_lines(monkeypatch):
    """bench_clocks.read_samples reads nvidia-smi's csv lines (noheader, nounits) as (epoch seconds, SM MHz,
    W, reasons), the reasons a hex bit mask whose SW power cap bit the rows count."""
    from datetime import datetime

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    from bench_clocks import POWER_CAP, read_samples

    class Stopped:
        def terminate(self):
            pass

        def communicate(self):
            return (
                "2026/12/02 17:42:58.127, 1980, 131.58, 0x0000000000000000\n"
                "2026/12/02 17:42:58.177, 1425, 205.13, 0x0000000000000004\n",
                None,
            )

    first, second = read_samples(Stopped())
    assert second[0] - first[0] == pytest.approx(0.05)
    assert first[0] == datetime(2026, 12, 2, 17, 42, 58, 127000).timestamp()
    assert (first[1:], second[1:]) == ((1980.0, 131.58, 0), (1425.0, 205.13, 4))
    assert not first[3] & POWER_CAP and second[3] & POWER_CAP


def test_rank_lookups_plans_and_ids(monkeypatch):
    """bench_rank_lookups: split:T cuts a table into one row shard a rank covering its rows once
    (split:T:P0:P1: P_q percent of them on rank q), move:T:Q puts a whole table on rank Q, bad changes name
    themselves; a rank's ids are its shards' bag columns,
    each within its table, and `touched` counts the lookups inside its row ranges and their distinct rows."""
    import click
    import torch

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    from bench_rank_lookups import CONFIG_DIR, plan_named, rank_ids, touched

    from dlrm.config import load_config, replace

    cfg = replace(load_config(CONFIG_DIR / "dlrm_dcnv2.json"), "train", use_triton=True)
    planner = plan_named(cfg, 2, "planner")
    cut = plan_named(cfg, 2, "planner+split:20+move:21:1")
    twenty = [s for s in cut.shards if s.table == 20]
    assert sorted(s.rank for s in twenty) == [0, 1]
    assert [(s.row_start, s.rows) for s in twenty] == [(0, 20_000_000), (20_000_000, 20_000_000)]
    assert [s.rank for s in cut.shards if s.table == 21] == [1]
    kept = {s for s in planner.shards if s.table not in (20, 21)}
    assert kept == {s for s in cut.shards if s.table not in (20, 21)}
    uneven = plan_named(cfg, 2, "planner+split:20:15:85+split:0:30:70")
    assert [(s.rank, s.row_start, s.rows) for s in uneven.shards if s.table in (0, 20)] == [
        (0, 0, 12_000_000), (0, 0, 6_000_000), (1, 12_000_000, 28_000_000), (1, 6_000_000, 34_000_000)
    ]  # fmt: skip
    bad_names = ("sharded", "planner+split:26", "planner+move:20:1+split:x", "planner+move:0:1")
    for bad in (*bad_names, "planner+split:20:50:40", "planner+split:20:100", "planner+split"):
        with pytest.raises(click.BadParameter):
            plan_named(cfg, 2, bad)

    generator = torch.Generator().manual_seed(0)
    for rank in (0, 1):
        ids = rank_ids(cut, rank, 500, generator)
        shards = cut.shards_of(rank)
        assert ids.shape == (500, sum(cut.bag_size(s.table) for s in shards))
        limits = torch.tensor([cut.table_rows[s.table] for s in shards for _ in range(cut.bag_size(s.table))])
        assert bool(((ids >= 0) & (ids < limits)).all())
        inside, distinct = touched(cut, rank, ids)
        expected_inside, expected_distinct, col = 0, 0, 0
        for s in shards:
            block = ids[:, col : col + cut.bag_size(s.table)].flatten().tolist()
            mine = [r for r in block if s.row_start <= r < s.row_start + s.rows]
            expected_inside, expected_distinct = (
                expected_inside + len(mine),
                expected_distinct + len(set(mine)),
            )
            col += cut.bag_size(s.table)
        assert (inside, distinct) == (expected_inside, expected_distinct)
        assert 0 < inside < ids.numel()  # the cut tables' ids fall on both sides
