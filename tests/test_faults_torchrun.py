"""Nothing lost under torchrun (2 gloo processes on the CPU, started as torchrun starts them): a stop
signal gives one line from rank 0 with the torchrun command that resumes, exit 128 + the signal from every
rank; a sharded checkpoint is refused when changed, and `--resume .../last.pt` points at `last/`."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dlrm import evaluate as evaluate_cli
from dlrm import train as train_cli
from tests.conftest import REPO
from tests.test_faults import TINY, _cli, _one_error_line
from tests.test_faults_disk import _whole_records
from tests.test_parallel import _free_port


def _cpu_config(tmp_path: Path, criteo_sample: Path, **train) -> Path:
    """tiny.json on the sample, global batch 240, on the CPU without the profiler, `train` keys set."""
    config = tmp_path / "c.json"
    raw = json.loads(TINY.read_text())
    raw["data"].update(path=str(criteo_sample), batch_size=240)
    raw["train"].update(**train, device="cpu")
    raw["profiler"]["enabled"] = False
    config.write_text(json.dumps(raw))
    return config


def _start_ranks(
    config: Path, run: Path, prelude: str | None = None, options: tuple = ()
) -> list[subprocess.Popen]:
    """Two ranks of `python -m dlrm.train` (and `options`); with `prelude`, Python code each runs before it
    (a fault)."""
    port, procs = _free_port(), []
    for rank in range(2):
        env = {
            **os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
            "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }  # fmt: skip
        train = ["-m", "dlrm.train"]
        if prelude is not None:
            train = ["-c", f"{prelude}\nimport runpy; runpy.run_module('dlrm.train', run_name='__main__')"]
        args = [sys.executable, *train, "--config", str(config), "--output-dir", str(run), *map(str, options)]
        procs.append(subprocess.Popen(args, env=env, cwd=REPO, stderr=subprocess.PIPE, text=True))
    return procs


@pytest.mark.parametrize(
    ("signum", "to"),
    [(signal.SIGTERM, (0, 1)), (signal.SIGINT, (1,))],
    ids=["sigterm-to-every-rank", "sigint-to-rank-1"],  # torchrun forwards it; a kill reaches one
)
def test_a_signal_stops_every_rank_with_one_line_and_the_torchrun_resume_command(
    criteo_sample, tmp_path, signum, to
):
    config = _cpu_config(
        tmp_path, criteo_sample, max_steps=None, epochs=50, log_interval=1, eval_interval=None
    )
    run = tmp_path / "run"
    procs = _start_ranks(config, run)
    lines = []
    for line in procs[0].stderr:
        lines.append(line)
        if re.search(r"step 3 \|", line):
            break
    else:
        pytest.fail("".join(lines))
    for rank in to:
        procs[rank].send_signal(signum)
    err0, err1 = procs[0].stderr.read(), procs[1].communicate(timeout=120)[1]
    assert [p.wait(timeout=120) for p in procs] == [128 + signum] * 2, err0 + err1
    line = _one_error_line(err0)
    step = int(re.search(r"after step (\d+)", line).group(1))
    last = run / "checkpoints" / "last"
    assert f"stopped by {signal.Signals(signum).name} after step {step}; {last} written" in line
    assert line.endswith(
        f"go on with: torchrun --nproc-per-node 2 -m dlrm.train --config {config} --resume {last}"
    )
    assert "error" not in err1 and "received" not in err1 and "Traceback" not in err0 + err1, err1
    meta = json.loads((last / "meta.json").read_text())
    assert meta["step"] == step and set(meta["sha256"]) == {p.name for p in last.iterdir()} - {"meta.json"}

    # --resume last.pt of this sharded run points at last/
    code, output = _cli(train_cli.main, ["--config", config, "--resume", run / "checkpoints" / "last.pt"])
    assert code == 2 and _one_error_line(output).endswith(
        f"is the sharded checkpoint of this torchrun run: --resume {last}"
    )
    # a changed shard is refused with one line naming it, by every reader
    shard = next(p for p in sorted(last.iterdir()) if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, output = _cli(evaluate_cli.main, ["--checkpoint", last, "--data", criteo_sample])
    assert code == 2 and _one_error_line(output).startswith(f"error: {shard}: checksum mismatch")


def test_a_changed_shard_on_resume_is_one_line_from_rank_0_and_exit_2_from_every_rank(
    criteo_sample, tmp_path
):
    config = _cpu_config(tmp_path, criteo_sample, max_steps=2, eval_interval=None)
    run = tmp_path / "run"
    procs = _start_ranks(config, run)
    assert [p.communicate(timeout=300) and p.returncode for p in procs] == [0, 0]
    last = run / "checkpoints" / "last"
    # The ranks split the check of the files, in meta.json's order: this one is rank 1's, rank 0 names it.
    names = list(json.loads((last / "meta.json").read_text())["sha256"])
    shard = last / next(name for name in names[1::2] if name.endswith(".distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    procs = _start_ranks(config, run, options=("--resume", last, "--max-steps", 4))
    err0, err1 = (p.communicate(timeout=300)[1] for p in procs)
    assert [p.returncode for p in procs] == [2, 2], err0 + err1
    assert _one_error_line(err0).startswith(f"error: {shard}: checksum mismatch: the file changed"), err0
    assert "error" not in err1 and "Traceback" not in err1, err1


# Run by each rank before dlrm.train: from the second sharded checkpoint on, the disk (a shared one) is
# full, either for every file DCP writes, after half of its first write ("dcp", every rank), or for
# meta.json, which rank 0 alone writes once DCP's files are complete ("meta").
FULL_DISK_FROM_THE_SECOND_CHECKPOINT = """
import contextlib, errno, os, pathlib
from torch.distributed.checkpoint.filesystem import FileSystem
from dlrm.parallel import checkpoint

WHERE = "@WHERE@"
saves, save = [], checkpoint.save_sharded
create_stream, write_text = FileSystem.create_stream, pathlib.Path.write_text

def full():
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

def counted(*args, **kwargs):
    saves.append(1)
    return save(*args, **kwargs)

class Full:
    def __init__(self, stream):
        self.stream = stream
    def write(self, data):
        data = bytes(memoryview(data).cast("B"))
        self.stream.write(data[: len(data) // 2])
        full()
    def __getattr__(self, name):
        return getattr(self.stream, name)

@contextlib.contextmanager
def full_stream(self, path, mode):
    with create_stream(self, path, mode) as stream:
        yield Full(stream) if WHERE == "dcp" and len(saves) > 1 else stream

def full_meta(self, text, *args, **kwargs):
    if WHERE == "meta" and self.name == "meta.json" and len(saves) > 1:
        write_text(self, text[:10])
        full()
    return write_text(self, text, *args, **kwargs)

checkpoint.save_sharded, FileSystem.create_stream, pathlib.Path.write_text = counted, full_stream, full_meta
"""


@pytest.mark.parametrize("where", ["dcp", "meta"], ids=["dcp-files-every-rank", "meta-json-rank-0"])
def test_a_full_disk_while_the_sharded_checkpoint_is_written_is_one_line_and_keeps_the_last_good_one(
    criteo_sample, tmp_path, where
):
    config = _cpu_config(tmp_path, criteo_sample, max_steps=2, checkpoint_interval=1, eval_interval=None)
    run = tmp_path / "run"
    procs = _start_ranks(config, run, FULL_DISK_FROM_THE_SECOND_CHECKPOINT.replace("@WHERE@", where))
    err0, err1 = (p.communicate(timeout=300)[1] for p in procs)
    assert [p.returncode for p in procs] == [2, 2], err0 + err1
    line = _one_error_line(err0)
    assert re.fullmatch(
        rf"error: {run}/checkpoints/(last|best): No space left on device \([\d,.]+ MiB free on .+\)", line
    ), line
    assert "error" not in err1 and "Traceback" not in err1, err1
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last"]  # no temporary left
    meta = json.loads((checkpoints / "last" / "meta.json").read_text())
    assert meta["step"] == 1
    code, output = _cli(evaluate_cli.main, ["--checkpoint", checkpoints / "last", "--data", criteo_sample])
    assert code == 0 and 0 < json.loads(output.splitlines()[-1])["auc"] < 1, output


# Run by each rank before dlrm.train: the disk fills while rank 0 (which alone writes TensorBoard) appends
# its fifth event.
FULL_DISK_FOR_THE_EVENTS = """
import errno, os
from dlrm.run import events

appended, write = [], os.write

def full(fd, data):
    if os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[-1].startswith("events.out.tfevents."):
        appended.append(1)
        if len(appended) == 5:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return write(fd, data)

events.os.write = full
"""


def test_a_full_disk_for_rank_0s_tensorboard_events_is_one_line_and_ends_every_rank(criteo_sample, tmp_path):
    config = _cpu_config(tmp_path, criteo_sample, max_steps=3, log_interval=1, eval_interval=None)
    run = tmp_path / "run"
    procs = _start_ranks(config, run, FULL_DISK_FOR_THE_EVENTS)
    err0, err1 = (p.communicate(timeout=300)[1] for p in procs)
    assert procs[0].returncode == 2 and procs[1].returncode != 0, err0 + err1
    line = _one_error_line(err0)
    [events] = run.glob("events.out.tfevents.*")
    expected = rf"error: {events}: No space left on device \([\d,.]+ MiB free on {run}\)"
    assert re.fullmatch(expected, line), line
    assert f"rank 1: ending: {line}" in err1 and "Traceback" not in err1, err1
    assert _whole_records(events) == 4
