"""Nothing lost on disk: --overwrite deletes only a run's own files, and a full disk (or a read-only one)
is one line naming the file and the space left, exit 2, with no temporary left behind. Each case: run,
inject, the exit code, the one line, and that nothing outside the run directory changed."""

import errno
import json
import os
import re
import struct
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

from dlrm import atomic, checkpoint, profiling
from dlrm import train as train_cli
from dlrm.run import directory as run_dir
from dlrm.run import events
from tests.test_faults import _cli, _config, _one_error_line


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` with its bytes (what must not change)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def config(criteo_sample, tmp_path) -> Path:
    return _config(tmp_path, criteo_sample, max_steps=2)


# ---------------------------------------------------------------------------------------------------------
# --overwrite


def test_overwrite_of_a_run_directory_deletes_the_earlier_run(config, tmp_path):
    run = tmp_path / "run"
    assert _cli(train_cli.main, ["--config", config, "--output-dir", run])[0] == 0
    assert (run / run_dir.MARKER).is_file()
    first = {p.name for p in run.glob("events.out.tfevents.*")}
    assert _cli(train_cli.main, ["--config", config, "--output-dir", run, "--overwrite"])[0] == 0
    second = {p.name for p in run.glob("events.out.tfevents.*")}
    assert len(second) == 1 and not first & second


def test_overwrite_refuses_a_directory_that_is_not_a_run(config, tmp_path):
    notes = tmp_path / "x"
    (notes / "important").mkdir(parents=True)
    (notes / "notes.txt").write_text("mine")
    (notes / "important" / "thesis.tex").write_text("mine too")
    before = _tree(tmp_path)
    code, output = _cli(train_cli.main, ["--config", config, "--output-dir", notes, "--overwrite"])
    line = _one_error_line(output)
    assert code == 2 and str(notes) in line and "not a run directory" in line
    assert _tree(tmp_path) == before


def test_overwrite_refuses_a_run_directory_holding_other_files(config, tmp_path):
    run = tmp_path / "run"
    assert _cli(train_cli.main, ["--config", config, "--output-dir", run])[0] == 0
    (run / "notes.txt").write_text("mine")
    (run / "checkpoints" / "my_model.pt").write_bytes(b"mine")
    before = _tree(tmp_path)
    code, output = _cli(train_cli.main, ["--config", config, "--output-dir", run, "--overwrite"])
    line = _one_error_line(output)
    assert code == 2 and "notes.txt" in line and "checkpoints/my_model.pt" in line
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("where", [".", ".."])
def test_overwrite_never_deletes_the_working_directory_or_one_above_it(config, tmp_path, monkeypatch, where):
    work = tmp_path / "work"
    work.mkdir()
    (work / run_dir.MARKER).write_text("{}")  # even one that looks like a run directory
    (work / "config.json").write_text("{}")
    monkeypatch.chdir(work)
    before = _tree(tmp_path)
    code, output = _cli(train_cli.main, ["--config", config, "--output-dir", where, "--overwrite"])
    line = _one_error_line(output)
    assert code == 2 and "working directory" in line
    assert _tree(tmp_path) == before


def test_overwrite_of_an_empty_or_missing_directory_trains(config, tmp_path):
    (tmp_path / "empty").mkdir()
    for target in (tmp_path / "empty", tmp_path / "missing"):
        assert _cli(train_cli.main, ["--config", config, "--output-dir", target, "--overwrite"])[0] == 0
        assert (target / "metrics.json").is_file()


def test_stale_temporaries_of_a_killed_run_are_removed_at_start(config, tmp_path):
    run = tmp_path / "run"
    assert _cli(train_cli.main, ["--config", config, "--output-dir", run])[0] == 0
    dead = 2**22 + 1  # above the default pid_max: no such process
    stale = run / "checkpoints" / f".last.pt.tmp-{dead}"
    stale.write_bytes(b"half a checkpoint")
    (run / "checkpoints" / ".last.tmp").mkdir()  # a sharded checkpoint's, half written
    (run / "checkpoints" / ".last.tmp" / "__0_0.distcp").write_bytes(b"half")
    (run / "host_1.123.pt.trace.json.tmp").write_text('{"traceEvents": [')  # the profiler's own
    live = run / f".metrics.json.tmp-{os.getppid()}"  # a live process's write in progress: kept
    live.write_text("{")
    args = ["--config", config, "--resume", run / "checkpoints" / "last.pt", "--max-steps", 3]
    code, output = _cli(train_cli.main, args)
    assert code == 0, output
    assert not stale.exists() and live.exists()
    assert not (run / "checkpoints" / ".last.tmp").exists() and not list(run.glob("*.tmp"))


# ---------------------------------------------------------------------------------------------------------
# Full disk


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_while_writing_a_checkpoint_is_one_line_and_keeps_the_last_good_one(
    config, tmp_path, monkeypatch
):
    run = tmp_path / "run"
    assert _cli(train_cli.main, ["--config", config, "--output-dir", run])[0] == 0
    good = _tree(run / "checkpoints")
    before = {k: v for k, v in _tree(tmp_path).items() if not k.startswith("run/")}

    real_write = checkpoint._pwrite_all

    def full_after_some_bytes(fd, data, offset):  # the tensors' bytes go in, then the disk fills
        real_write(fd, bytes(memoryview(data).cast("B")[:100]), offset)
        _enospc()

    monkeypatch.setattr(checkpoint, "_pwrite_all", full_after_some_bytes)
    args = ["--config", config, "--resume", run / "checkpoints" / "last.pt", "--max-steps", 4]
    code, output = _cli(train_cli.main, args)
    line = _one_error_line(output)
    assert code == 2
    # best.pt (the evaluation at step 4 is the best) or last.pt, whichever is written first
    assert re.fullmatch(
        rf"error: {run}/checkpoints/(best|last)\.pt: No space left on device \([\d,.]+ MiB free on .+\)", line
    )
    assert _tree(run / "checkpoints") == good  # no temporary left, the last good checkpoints unchanged
    assert {k: v for k, v in _tree(tmp_path).items() if not k.startswith("run/")} == before
    monkeypatch.undo()
    assert checkpoint.load_checkpoint(run / "checkpoints" / "last.pt")["step"] == 2


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS])
def test_atomic_writes_map_a_full_or_read_only_disk_to_one_line(tmp_path, monkeypatch, code):
    path = tmp_path / "metrics.json"
    path.write_text("old")

    def fail(self, text):
        Path.write_bytes(self, b"half")
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(Path, "write_text", fail)
    with pytest.raises(atomic.DiskFull) as raised:
        atomic.write_text(path, "new")
    monkeypatch.undo()
    assert raised.value.errno == code and raised.value.filename == str(path)
    assert "MiB free on" in raised.value.strerror
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["metrics.json"]


def test_a_full_disk_while_writing_metrics_json_is_one_line(config, tmp_path, monkeypatch):
    run = tmp_path / "run"
    real = atomic.write_text

    def full_for_metrics(path, text):
        if path.name == "metrics.json":
            with atomic.replacing(path) as tmp:
                tmp.write_text(text[:10])
                _enospc()
        real(path, text)

    monkeypatch.setattr(atomic, "write_text", full_for_metrics)
    code, output = _cli(train_cli.main, ["--config", config, "--output-dir", run])
    line = _one_error_line(output)
    assert code == 2 and line.startswith(f"error: {run / 'metrics.json'}: No space left on device (")
    assert not (run / "metrics.json").exists() and not list(run.glob(".*tmp*"))


def test_a_full_disk_while_the_profiler_writes_its_trace_is_one_line_and_leaves_nothing(
    criteo_sample, tmp_path, monkeypatch
):
    config = _config(tmp_path, criteo_sample, max_steps=4)
    raw = json.loads(config.read_text())
    raw["profiler"] = {"enabled": True, "wait": 0, "warmup": 1, "active": 1}
    config.write_text(json.dumps(raw))
    run = tmp_path / "run"

    def half_written(self, path, *args, **kwargs):  # what the profiler does on a full disk: logs, keeps .tmp
        Path(f"{path}.tmp").write_text('{"traceEvents": [')

    monkeypatch.setattr(profiling.profile, "export_chrome_trace", half_written)
    monkeypatch.setattr(atomic, "free_space", lambda path: "0.0 MiB free on /full")
    code, output = _cli(train_cli.main, ["--config", config, "--output-dir", run])
    line = _one_error_line(output)
    assert code == 2 and ".pt.trace.json: the profiler could not write its trace" in line
    assert "0.0 MiB free on /full" in line
    assert not list(run.glob("*trace*")) and not list(run.glob(".*tmp*"))


def _whole_records(path: Path) -> int:
    """The number of TFRecords in event file `path`, asserting that it holds whole ones only (each length
    and payload matching its CRC) and nothing after the last."""
    data, at, count = path.read_bytes(), 0, 0
    while at < len(data):
        (length,) = struct.unpack_from("<Q", data, at)
        (length_crc,) = struct.unpack_from("<I", data, at + 8)
        assert length_crc == masked_crc32c(data[at : at + 8]) and at + 16 + length <= len(data), at
        (payload_crc,) = struct.unpack_from("<I", data, at + 12 + length)
        assert payload_crc == masked_crc32c(data[at + 12 : at + 12 + length]), at
        at, count = at + 16 + length, count + 1
    return count


@pytest.mark.parametrize("full_at", [1, 4], ids=["opening", "training"])
def test_a_full_disk_while_writing_tensorboard_events_is_one_line_and_leaves_whole_records(
    config, tmp_path, monkeypatch, full_at
):
    run = tmp_path / "run"
    real_write, records = os.write, []

    def full_from_record(fd, data):  # the disk fills in the middle of record `full_at` of the event file
        if not os.readlink(f"/proc/self/fd/{fd}").startswith(str(run / "events.out.tfevents.")):
            return real_write(fd, data)
        if len(records) == full_at:  # what is left of the record after the part that fitted
            _enospc()
        records.append(bytes(data))
        return real_write(fd, data[: len(data) // 2] if len(records) == full_at else data)

    monkeypatch.setattr(events.os, "write", full_from_record)
    code, output = _cli(train_cli.main, ["--config", config, "--output-dir", run])
    monkeypatch.undo()
    line = _one_error_line(output)  # (no traceback of a writer thread either)
    assert code == 2 and len(records) == full_at
    assert re.fullmatch(
        rf"error: {run}/events\.out\.tfevents\.\S+: No space left on device \([\d,.]+ MiB free on .+\)", line
    )
    files = list(run.glob("events.out.tfevents.*"))
    assert len(files) == (full_at > 1) and not list(run.glob(".*tmp*"))
    if files:  # the events before the full disk, whole, and TensorBoard reads them
        assert _whole_records(files[0]) == full_at - 1
        accumulator = EventAccumulator(str(run))
        accumulator.Reload()
        assert "config/text_summary" in accumulator.Tags()["tensors"]


def test_a_killed_runs_logged_events_are_on_disk_and_its_resume_replaces_those_after_the_checkpoint(tmp_path):
    killed = events.EventWriter(str(tmp_path))
    for step in range(1, 6):
        killed.add_scalar("train/loss", 10.0 - step, step)
    # SIGKILL here: no flush, no close. Its checkpoint holds step 3; the resumed run starts at step 4.
    run_dir.wait_past_event_files(tmp_path)
    resumed = events.EventWriter(str(tmp_path), purge_step=4)
    for step in range(4, 7):
        resumed.add_scalar("train/loss", 100.0 + step, step)
    resumed.close()
    accumulator = EventAccumulator(str(tmp_path))
    accumulator.Reload()
    logged = [(e.step, e.value) for e in accumulator.Scalars("train/loss")]
    assert logged == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 104.0), (5, 105.0), (6, 106.0)]
