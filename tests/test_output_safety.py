"""Nothing lost: every command that writes a directory or a file refuses, before any work, an output path
that holds anything but its own earlier output (user files, the input, a directory holding the input, the
working directory), with one line and exit 2, and deletes nothing; --overwrite replaces only an earlier
output; `.` and relative paths work; temporaries of killed runs are removed on the next run
(dlrm.data.output.check_output_dir, dlrm.atomic.check_output_file)."""

import gzip
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from dlrm import aoti as aoti_cli
from dlrm import export as export_cli
from dlrm import finetune as finetune_cli
from dlrm import predict as predict_cli
from dlrm.data import binary as binary_cli
from dlrm.data import multi_hot as multi_hot_cli
from dlrm.data import preprocess as preprocess_cli
from dlrm.data import synthetic as synthetic_cli
from dlrm.data.output import INCOMPLETE_MARK, METADATA_FILE, load_metadata
from dlrm.data.preprocess import preprocess
from tests.conftest import REPO, SAMPLE_TSV
from tests.test_faults import _cli, _one_error_line

SIZES = ",".join(["2", *["1"] * 25])  # one bag of 2: the multi-hot tool at its cheapest
DEAD_PID = 2**22 + 1  # above the default pid_max: no such process
TOOLS = ("preprocess", "synthetic", "multi_hot")


@pytest.fixture(scope="module")
def raw_lines() -> bytes:
    """The first 300 real Criteo lines of the shipped sample."""
    with gzip.open(SAMPLE_TSV, "rb") as f:
        return b"".join(f.readline() for _ in range(300))


@pytest.fixture(scope="module")
def small_data(raw_lines, tmp_path_factory) -> Path:
    """Those lines preprocessed (240 train, 30 val, 30 test): the multi-hot tool's input."""
    root = tmp_path_factory.mktemp("small")
    (root / "raw.tsv").write_bytes(raw_lines)
    preprocess([root / "raw.tsv"], root / "data", eval_fraction=0.2)
    return root / "data"


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and directory (None) under `root`: what a refused command must not change."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))
    }


def _put_input(tool: str, where: Path, raw_lines: bytes, small_data: Path) -> list:
    """Place `tool`'s input in directory `where` (created); return the arguments naming it."""
    where.mkdir(parents=True, exist_ok=True)
    if tool == "preprocess":
        (where / "raw.tsv").write_bytes(raw_lines)
        return ["--input", where / "raw.tsv", "--eval-fraction", "0.2"]
    if tool == "multi_hot":
        shutil.copytree(small_data, where / "cs")
        return ["--data", where / "cs", "--sizes", SIZES]
    return ["--rows", "300", "--max-cardinality", "50", "--eval-fraction", "0.2"]  # synthetic: no input


def _run(tool: str, input_args: list, output_dir, *extra) -> tuple[int, str]:
    main = {"preprocess": preprocess_cli, "synthetic": synthetic_cli, "multi_hot": multi_hot_cli}[tool].main
    return _cli(main, [*input_args, "--output-dir", output_dir, *extra])


def _user_files(directory: Path) -> Path:
    (directory / "sub").mkdir(parents=True, exist_ok=True)
    (directory / "notes.txt").write_text("mine")
    (directory / "sub" / "thesis.tex").write_text("mine too")
    return directory


# ---------------------------------------------------------------------------------------------------------
# Data directories: preprocess, synthetic, multi_hot


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("tool", TOOLS)
def test_a_directory_of_user_files_is_refused(tool, overwrite, tmp_path, raw_lines, small_data):
    args = _put_input(tool, tmp_path / "in", raw_lines, small_data)
    mine = _user_files(tmp_path / "mine")
    before = _tree(tmp_path)
    code, output = _run(tool, args, mine, *(["--overwrite"] if overwrite else []))
    line = _one_error_line(output)
    assert code == 2 and str(mine) in line and "not a data directory" in line, line
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("tool", TOOLS)
def test_the_parent_of_the_input_is_refused(tool, tmp_path, raw_lines, small_data):
    parent = _user_files(tmp_path / "parent")
    args = _put_input(tool, parent, raw_lines, small_data)
    (parent / METADATA_FILE).write_text("{}")  # even one that looks like an earlier output
    before = _tree(tmp_path)
    code, output = _run(tool, args, parent, "--overwrite")
    line = _one_error_line(output)
    assert code == 2 and str(parent) in line, line
    assert ("holds the input" in line) if tool != "synthetic" else ("notes.txt" in line), line
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("tool", ["preprocess", "multi_hot"])
def test_the_inputs_own_directory_is_refused(tool, tmp_path, raw_lines, small_data):
    args = _put_input(tool, tmp_path / "d", raw_lines, small_data)
    own = tmp_path / "d" if tool == "preprocess" else tmp_path / "d" / "cs"  # raw.tsv's directory; DATA
    before = _tree(tmp_path)
    code, output = _run(tool, args, own, "--overwrite")
    line = _one_error_line(output)
    assert code == 2 and str(own) in line and ("holds the input" in line or "is the input" in line), line
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("tool", TOOLS)
def test_the_working_directory_of_user_files_is_refused(tool, tmp_path, raw_lines, small_data, monkeypatch):
    args = _put_input(tool, tmp_path / "in", raw_lines, small_data)
    work = _user_files(tmp_path / "w" / "work")  # (.. holds nothing but the working directory)
    monkeypatch.chdir(work)
    before = _tree(tmp_path)
    for target in (".", "./", "../work"):
        code, output = _run(tool, args, target, "--overwrite")
        line = _one_error_line(output)
        assert code == 2 and str(work) in line and "not a data directory" in line, line
    code, output = _run(tool, args, "..", "--overwrite")  # a directory above the working directory
    assert code == 2 and "holds the working directory" in _one_error_line(output)
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("tool", TOOLS)
def test_dot_and_relative_paths_are_written_and_overwritten_in_place(
    tool, tmp_path, raw_lines, small_data, monkeypatch
):
    args = _put_input(tool, tmp_path / "in", raw_lines, small_data)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert _run(tool, args, ".")[0] == 0
    assert load_metadata(work)["rows"]["train"] == 240
    assert Path.cwd() == work and (Path.cwd() / METADATA_FILE).is_file()  # the same directory, filled

    code, output = _run(tool, args, ".")  # an earlier output: kept without --overwrite
    line = _one_error_line(output)
    assert code == 2 and "pass --overwrite" in line and str(work) in line, line
    assert _run(tool, args, ".", "--overwrite")[0] == 0
    assert sorted(p.name for p in work.iterdir()) == [METADATA_FILE, "test", "train", "val"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "work"]  # no temporary left beside it

    assert _run(tool, args, "rel/out")[0] == 0  # a relative path whose parent does not exist yet
    assert load_metadata(work / "rel" / "out")["rows"]["train"] == 240


@pytest.mark.parametrize("tool", TOOLS)
def test_overwrite_refuses_an_earlier_output_holding_user_files(tool, tmp_path, raw_lines, small_data):
    args = _put_input(tool, tmp_path / "in", raw_lines, small_data)
    out = tmp_path / "out"
    assert _run(tool, args, out)[0] == 0
    (out / "notes.txt").write_text("mine")
    (out / "train" / "my_features.parquet").write_bytes(b"mine")
    before = _tree(tmp_path)
    code, output = _run(tool, args, out, "--overwrite")
    line = _one_error_line(output)
    assert code == 2 and "notes.txt" in line and "train/my_features.parquet" in line, line
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("tool", TOOLS)
def test_stale_temporaries_of_a_killed_run_are_removed(tool, tmp_path, raw_lines, small_data):
    args = _put_input(tool, tmp_path / "in", raw_lines, small_data)
    out = tmp_path / "out"
    stale = [tmp_path / f".out.tmp-{DEAD_PID}", tmp_path / f".out.partial.tmp-{DEAD_PID}"]
    for directory in stale:
        (directory / "train").mkdir(parents=True)
        (directory / "train" / "part-00000.parquet").write_bytes(b"half a shard" * 1000)
    live = tmp_path / f".out.tmp-{os.getppid()}"  # a live process's write in progress: kept
    live.mkdir()
    assert _run(tool, args, out)[0] == 0
    assert not any(p.exists() for p in stale) and live.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "in", "out"]


def test_an_interrupted_replacement_is_recognized_and_replaced(tmp_path, raw_lines, small_data):
    """A replacement that stopped midway leaves the mark and no metadata.json: an earlier output, which
    --overwrite replaces."""
    args = _put_input("preprocess", tmp_path / "in", raw_lines, small_data)
    out = tmp_path / "out"
    (out / "train").mkdir(parents=True)
    (out / INCOMPLETE_MARK).write_text("{}")
    (out / "train" / "part-00000.parquet").write_bytes(b"from the earlier output")
    code, output = _run("preprocess", args, out)
    assert code == 2 and "pass --overwrite" in _one_error_line(output)
    assert _run("preprocess", args, out, "--overwrite")[0] == 0
    assert not (out / INCOMPLETE_MARK).exists() and load_metadata(out)["rows"]["train"] == 240


def test_an_output_that_is_a_file_is_refused(tmp_path, raw_lines, small_data):
    args = _put_input("multi_hot", tmp_path / "in", raw_lines, small_data)
    (tmp_path / "f").write_text("mine")
    code, output = _run("multi_hot", args, tmp_path / "f", "--overwrite")
    assert code == 2 and "is not a directory" in _one_error_line(output)
    assert (tmp_path / "f").read_text() == "mine"


# ---------------------------------------------------------------------------------------------------------
# Binary splits (written inside the data directory)


def test_binary_refuses_a_split_directory_holding_other_files_and_removes_stale_temporaries(
    small_data, tmp_path
):
    data = tmp_path / "data"
    shutil.copytree(small_data, data)
    assert _cli(binary_cli.main, ["--data", data, "--split", "val"])[0] == 0  # an earlier split: replaced
    stale = data / "binary" / f".val.tmp-{DEAD_PID}"
    stale.mkdir()
    (stale / "label.bin").write_bytes(b"half")
    assert _cli(binary_cli.main, ["--data", data, "--split", "val"])[0] == 0
    assert not stale.exists()
    assert sorted(p.name for p in (data / "binary").iterdir()) == ["val"]

    _user_files(data / "binary" / "train")
    before = _tree(tmp_path)
    code, output = _cli(binary_cli.main, ["--data", data])
    line = _one_error_line(output)
    assert code == 2 and str(data / "binary" / "train") in line and "notes.txt" in line, line
    assert _tree(tmp_path) == before


# ---------------------------------------------------------------------------------------------------------
# Files: predict, finetune --merge, aoti


def _never(*args, **kwargs):
    raise AssertionError("the output path was not checked first")


def test_predict_checks_the_output_before_scoring(small_data, tmp_path, monkeypatch):
    monkeypatch.setattr(predict_cli, "resolve_device", _never)  # the first step after the check
    shard = small_data / "test" / "part-00000.parquet"
    existing = _user_files(tmp_path / "existing")
    (tmp_path / "a_file").write_text("mine")
    cases = [  # (input, output, what the line says)
        (shard, existing, "is a directory"),
        (shard, shard, "is the input"),
        (small_data, small_data / "val" / "part-00000.parquet", "is a file of the input"),
        (shard, tmp_path / "a_file" / "p.parquet", "is not a directory"),
    ]
    before = _tree(tmp_path)
    data_before = _tree(small_data)
    for source, output, message in cases:
        args = ["--checkpoint", tmp_path / "best.pt", "--input", source, "--output", output]
        code, text = _cli(predict_cli.main, args)
        line = _one_error_line(text)
        assert code == 2 and str(output) in line and message in line, line
    assert _tree(tmp_path) == before and _tree(small_data) == data_before


def test_finetune_merge_checks_the_output_before_merging(tmp_path, monkeypatch):
    monkeypatch.setattr(finetune_cli, "merge_checkpoint", _never)
    checkpoint = tmp_path / "best.pt"
    checkpoint.write_bytes(b"a fine-tuned checkpoint")
    existing = _user_files(tmp_path / "existing")
    before = _tree(tmp_path)
    for output, message in ((existing, "is a directory"), (checkpoint, "is the input")):
        code, text = _cli(finetune_cli.main, ["--checkpoint", checkpoint, "--merge", "--output", output])
        line = _one_error_line(text)
        assert code == 2 and str(output) in line and message in line, line
    assert _tree(tmp_path) == before


def test_aoti_checks_the_output_before_compiling(tmp_path):
    program = tmp_path / "model.pt2"
    program.write_bytes(b"not read: the output is checked first")
    existing = _user_files(tmp_path / "existing")
    before = _tree(tmp_path)
    for output, message in ((existing, "is a directory"), (program, "is the input")):
        code, text = _cli(aoti_cli.main, ["--program", program, "--output", output])
        line = _one_error_line(text)
        assert code == 2 and str(output) in line and message in line, line
    assert _tree(tmp_path) == before


def test_export_checks_both_outputs_before_loading(tmp_path, monkeypatch):
    monkeypatch.setattr(export_cli, "resolve_device", _never)  # the first step after the checks
    checkpoint = tmp_path / "best.pt"
    checkpoint.write_bytes(b"not read: the outputs are checked first")
    existing = _user_files(tmp_path / "existing")
    program = tmp_path / "model.pt2"
    before = _tree(tmp_path)
    cases = [  # (arguments after --checkpoint, the option named, what the line says)
        (["--output", existing], existing, "is a directory"),
        (["--output", checkpoint], checkpoint, "is the input"),
        (["--output", program, "--aoti-output", existing], existing, "is a directory"),
        (["--output", program, "--aoti-output", program], program, "is the input"),
    ]
    for args, named, message in cases:
        code, text = _cli(export_cli.main, ["--checkpoint", checkpoint, *args])
        line = _one_error_line(text)
        assert code == 2 and str(named) in line and message in line, line
    assert _tree(tmp_path) == before


# ---------------------------------------------------------------------------------------------------------
# make evaluate


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
def test_make_evaluate_picks_the_newest_best_checkpoint_of_either_kind(tmp_path):
    single = tmp_path / "runs" / "single" / "checkpoints" / "best.pt"
    sharded = tmp_path / "runs" / "torchrun" / "checkpoints" / "best"  # a torchrun run's DCP directory
    single.parent.mkdir(parents=True)
    single.write_bytes(b"")
    sharded.mkdir(parents=True)
    (sharded / "meta.json").write_text(json.dumps({}))
    now = time.time()

    def chosen() -> str:
        command = [
            "make", "-s", "-C", str(tmp_path), "-f", str(REPO / "Makefile"),
            "--eval", "print-checkpoint: ; @echo $(CHECKPOINT)", "print-checkpoint",
        ]  # fmt: skip
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()

    os.utime(single, (now - 100, now - 100))
    os.utime(sharded, (now, now))
    assert chosen() == "runs/torchrun/checkpoints/best"
    os.utime(single, (now + 100, now + 100))
    assert chosen() == "runs/single/checkpoints/best.pt"
