"""Checkpoints of tables of any size (dlrm.run.checkpoints, dlrm.checkpoint, dlrm.staging,
dlrm.parallel.checkpoint's save side): the preflight that refuses a run whose checkpoints cannot fit, the
writers that stage a bounded share of the state on the host, best.pt as a kept step (no second write),
train.checkpoint_policy, and saves written in the background whose failure is one line. One process in
this process (tiny.json on the CPU), and 2 gloo ranks started as torchrun starts them."""

import errno
import json
import os
import re
import shutil
import sys
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dlrm import checkpoint, staging
from dlrm import evaluate as evaluate_cli
from dlrm import train as train_cli
from dlrm.run import checkpoints as run_checkpoints
from tests.test_faults import _cli, _config, _one_error_line
from tests.test_faults_torchrun import _cpu_config, _start_ranks


def _free(nbytes: int):
    """A shutil.disk_usage that reports `nbytes` free."""
    real = shutil.disk_usage

    def disk_usage(path):
        return real(path)._replace(free=nbytes)

    return disk_usage


# ---------------------------------------------------------------------------------------------------------
# The preflight


def test_the_preflight_refuses_a_run_whose_checkpoints_cannot_fit_before_its_first_step(
    criteo_sample, tmp_path, monkeypatch
):
    config = _config(tmp_path, criteo_sample, max_steps=2)
    run = tmp_path / "run"
    # 4 MiB free: room for one checkpoint of tiny.json (1.8 MiB with its allowance for headers) and the
    # next one being written, not for a third.
    monkeypatch.setattr(run_checkpoints.shutil, "disk_usage", _free(4 * 2**20))
    steps = []
    monkeypatch.setattr(train_cli.parallel, "note_progress", steps.append)  # (called at each step)
    code, output = _cli(train_cli.main, ["--config", config, "--output-dir", run])
    line = _one_error_line(output)
    assert code == 2 and not steps and not run.exists()  # before the first step, nothing written
    assert re.fullmatch(
        rf"error: {run}/checkpoints: no room for the checkpoints: each is [\d.]+ MiB and "
        r"train.checkpoint_policy 'best_and_last' keeps up to 3 at once \(last, best and the one being "
        r"written\): [\d.]+ MiB needed, 4.0 MiB free on .+; free space, choose another --output-dir, or "
        r"keep fewer: 'last_only' \([\d.]+ MiB\) or 'none' \(no checkpoints\) "
        r"\(--set train.checkpoint_policy=...\)",
        line,
    ), line
    for policy in ("last_only", "none"):  # what the policy keeps fits
        args = ["--config", config, "--output-dir", run, "--overwrite"]
        code, output = _cli(train_cli.main, [*args, "--set", f'train.checkpoint_policy="{policy}"'])
        assert code == 0, output


def test_the_estimate_bounds_what_a_checkpoint_takes_and_counts_the_checkpoints_a_run_replaces(
    criteo_sample, tmp_path, monkeypatch
):
    config = _config(tmp_path, criteo_sample, max_steps=2, optimizer="adagrad")
    run = tmp_path / "run"
    logged = []
    monkeypatch.setattr(run_checkpoints.logger, "info", lambda text, *args: logged.append(text.format(*args)))
    assert _cli(train_cli.main, ["--config", config, "--output-dir", run])[0] == 0
    line = next(text for text in logged if text.startswith("checkpoints: "))
    each = float(re.match(r"checkpoints: ([\d.]+) MiB each", line).group(1)) * 2**20
    written = (run / "checkpoints" / "last.pt").stat().st_size
    assert written <= each <= written + run_checkpoints.HEADER_BYTES + 2**20, line
    _, held, _ = run_checkpoints.room(run / "checkpoints")
    assert held == written  # best.pt and last.pt: one file, counted once
    # Resumed, the run replaces its own checkpoints: their bytes count as room (the margins: the logged
    # size rounded to 0.1 MiB).
    resume = ["--config", config, "--resume", run / "checkpoints" / "last.pt", "--max-steps", 3]
    monkeypatch.setattr(run_checkpoints.shutil, "disk_usage", _free(int(3 * each) - written - 2**18))
    code, output = _cli(train_cli.main, resume)
    assert code == 2 and "no room for the checkpoints" in _one_error_line(output)
    monkeypatch.setattr(run_checkpoints.shutil, "disk_usage", _free(int(3 * each) - written + 2**18))
    assert _cli(train_cli.main, resume)[0] == 0


# ---------------------------------------------------------------------------------------------------------
# Bounded host memory


def test_a_checkpoint_file_is_written_in_chunks_and_loads_as_torch_save_wrote_it(tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "CHUNK_BYTES", 2**20)
    table = torch.randn(2**21, 8)  # 64 MiB: one storage, as the "triton" tables' weights
    state = {
        "model": {"w": table, "view": table[5:9], "b": torch.arange(7)},
        "embedding_optimizer_state": table.square(),
        "config": {"name": "x"},
        "table_rows": [3],
        "step": 4,
    }
    path, writes, real = tmp_path / "last.pt", [], os.pwrite

    def pwrite(fd, data, offset):
        writes.append(memoryview(data).nbytes)
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    checkpoint.save_checkpoint(path, **state)
    monkeypatch.undo()
    # The tensors' 128 MiB went in as pieces of at most a chunk (torch.save to a file: each storage whole).
    assert sum(writes) >= 2 * table.numel() * 4 and max(writes) <= 2**20
    assert checkpoint.verify_checksum(path)
    loaded = torch.load(path, weights_only=True)  # torch.save's format
    assert torch.equal(loaded["model"]["w"], table) and torch.equal(loaded["model"]["view"], table[5:9])
    view, whole = loaded["model"]["view"], loaded["model"]["w"]
    assert view.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()  # one storage, as saved
    assert torch.equal(loaded["embedding_optimizer_state"], table.square()) and loaded["step"] == 4


def _rss() -> int:
    """This process's resident memory, bytes (/proc/self/status)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.gpu
def test_a_checkpoint_of_gpu_tables_stages_at_most_a_chunk_in_host_memory(tmp_path):
    tables = torch.randn(2**22, 128, device="cuda")  # 2 GiB, and as much of Adagrad's state
    state = {"model": {"w": tables}, "embedding_optimizer_state": tables.square(), "config": {}, "step": 1}
    torch.cuda.synchronize()
    base, peak, writing = _rss(), [0], threading.Event()

    def sample():
        while not writing.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    checkpoint.save_checkpoint(tmp_path / "last.pt", **state)
    writing.set()
    sampler.join()
    # One pinned buffer of CHUNK_BYTES (torch.save: a host copy of each 2 GiB storage).
    assert peak[0] - base < 2 * staging.CHUNK_BYTES + 2**28, (peak[0] - base) / 2**20
    loaded = torch.load(tmp_path / "last.pt", map_location="cpu", mmap=True, weights_only=True)
    assert torch.equal(loaded["model"]["w"][-5:], tables[-5:].cpu())


def test_a_device_storage_goes_through_one_host_buffer_of_at_most_chunk_bytes(monkeypatch):
    monkeypatch.setattr(staging, "CHUNK_BYTES", 1000)
    storage = torch.arange(2600, dtype=torch.int16).to(torch.uint8).untyped_storage()
    chunks = list(checkpoint._host_chunks(storage))
    assert [start for start, _ in chunks] == [0, 1000, 2000]
    assert all(len(chunk) <= 1000 for _, chunk in chunks)
    assert b"".join(bytes(chunk) for _, chunk in chunks) == bytes(storage)


# ---------------------------------------------------------------------------------------------------------
# best.pt: a kept step


def test_best_is_the_checkpoint_of_its_step_kept_not_a_second_write(criteo_sample, tmp_path, monkeypatch):
    config = _config(tmp_path, criteo_sample, max_steps=8, eval_interval=2, checkpoint_interval=3)
    run = tmp_path / "run"
    writes = {}  # step: the inode of the file written for it
    real = checkpoint.write_file

    def counted(path, state):
        assert state["step"] not in writes  # one write per step
        real(path, state)
        writes[state["step"]] = path.stat().st_ino

    monkeypatch.setattr(checkpoint, "write_file", counted)
    assert _cli(train_cli.main, ["--config", config, "--output-dir", run])[0] == 0
    metrics = json.loads((run / "metrics.json").read_text())
    last, best = run / "checkpoints" / "last.pt", run / "checkpoints" / "best.pt"
    assert sorted(p.name for p in last.parent.iterdir()) == ["best.pt", "last.pt"]
    # One write per step checkpointed (the evaluations that improve, at 2, 4, 6 or 8; the periodic ones at
    # 3 and 6, unless an evaluation wrote it): best.pt is the file written for its step, under a second name.
    assert best.stat().st_ino == writes[metrics["best_step"]] and last.stat().st_ino == writes[8]
    assert checkpoint.load_checkpoint(best)["step"] == metrics["best_step"]


def test_the_policies_keep_what_they_say(criteo_sample, tmp_path):
    config = _config(tmp_path, criteo_sample, max_steps=4, eval_interval=2)
    for policy, names in (("last_only", ["last.pt"]), ("none", [])):
        run = tmp_path / policy
        args = ["--config", config, "--output-dir", run, "--set", f'train.checkpoint_policy="{policy}"']
        code, output = _cli(train_cli.main, args)
        assert code == 0, output
        held = run / "checkpoints"
        assert (sorted(p.name for p in held.iterdir()) if held.exists() else []) == names
        metrics = json.loads((run / "metrics.json").read_text())
        assert metrics["best_step"] is not None  # still evaluated and selected
        assert (metrics["test_auc"] is not None) == (metrics["best_step"] == 4)  # the best weights, if kept


# ---------------------------------------------------------------------------------------------------------
# In the background


def _train_on_two_threads(monkeypatch, note, write, args) -> tuple[int, str]:
    """dlrm.train's CLI with `args` on 2 intra-op threads, `note(step)` after each step and `write(path,
    state)` as the checkpoint file writer: (exit code, output); the thread count is 2 again at its end."""
    monkeypatch.setattr(train_cli.parallel, "note_progress", note)
    monkeypatch.setattr(checkpoint, "write_file", write)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        code, output = _cli(train_cli.main, args)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    return code, output


@pytest.mark.parametrize("yields", [False, True], ids=["cpu", "as-on-a-gpu"])
def test_training_goes_on_while_a_checkpoint_is_written(criteo_sample, tmp_path, monkeypatch, yields):
    """The step-3 checkpoint is written in a thread while step 4 trains. A model trained on the CPU keeps its
    intra-op threads meanwhile (`yields_core`: its sums split by the thread count); where the policy yields
    a core (a GPU run's, here forced), step 4 trains on one thread fewer and, once written, the step after
    gives it back (after_step's settle)."""
    if yields:
        monkeypatch.setattr(run_checkpoints, "yields_core", lambda device, compiled: True)
    config = _config(tmp_path, criteo_sample, max_steps=6, checkpoint_interval=3, eval_interval=None)
    run = tmp_path / "run"
    went_on, seen, threads = threading.Event(), [], {}
    real = checkpoint.write_file

    def note(step):
        threads[step] = torch.get_num_threads()
        if step > 3:
            went_on.set()
        if step == 5:  # the step-3 save has ended (its thread, not only its file) before step 5's after_step
            for thread in threading.enumerate():
                if thread.name == "dlrm-save":
                    thread.join(20)

    def slow(path, state):  # the step-3 checkpoint is written only once step 4 ran
        if state["step"] == 3:
            seen.append((threading.current_thread() is not threading.main_thread(), went_on.wait(20)))
        real(path, state)

    code, output = _train_on_two_threads(monkeypatch, note, slow, ["--config", config, "--output-dir", run])
    assert code == 0, output
    assert seen == [(True, True)]  # in a thread, while step 4 trained
    assert (threads[3], threads[4], threads[6]) == (2, 1 if yields else 2, 2)
    assert checkpoint.load_checkpoint(run / "checkpoints" / "last.pt")["step"] == 6


def test_only_a_gpu_run_gives_a_core_to_the_writing():
    """A run on a GPU trains on one intra-op thread fewer while a save writes; one on the CPU (its sums split
    by the thread count) or one that compiles (Dynamo guards on it) keeps its threads."""
    assert run_checkpoints.yields_core(torch.device("cuda", 0), compiled=False)
    assert not run_checkpoints.yields_core(torch.device("cpu"), compiled=False)
    assert not run_checkpoints.yields_core(torch.device("cuda", 0), compiled=True)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_a_compiled_run_saves_without_changing_the_thread_count_and_inductor_graphs_in_the_foreground(
    criteo_sample, tmp_path, monkeypatch, mode
):
    """--use-torch-compile: Dynamo guards on torch's thread count (a change recompiles every compiled
    region), so a background save leaves it as it is; with Inductor's own CUDA graphs ("reduce-overhead",
    recorded at moments the run does not see) the checkpoint is written in the foreground."""
    config = _config(tmp_path, criteo_sample, max_steps=4, checkpoint_interval=3, eval_interval=None)
    threads, writers = {}, []
    real = checkpoint.write_file

    def note(step):
        threads[step] = torch.get_num_threads()

    def record(path, state):
        writers.append(threading.current_thread() is threading.main_thread())
        real(path, state)

    args = ["--config", config, "--output-dir", tmp_path / "run", "--use-torch-compile"]
    code, output = _train_on_two_threads(
        monkeypatch, note, record, [*args, "--set", f'train.compile_mode="{mode}"']
    )
    assert code == 0, output
    assert set(threads.values()) == {2}
    assert writers[0] == (mode == "reduce-overhead")  # step 3's save: in the main thread or not


def test_a_save_takes_one_intra_op_thread_while_it_writes_and_gives_it_back():
    """While a background save writes, the thread that started it runs torch's intra-op pool with one
    thread fewer once it yields a core; `settle()` gives it back once the writing has ended (not before),
    `wait()` in any case, also when the writing failed."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    release = threading.Event()

    def write():
        release.wait(20)

    try:
        for fails in (False, True):
            pending = staging.PendingSave(write if not fails else lambda: release.wait(20) and 1 / 0, "x")
            assert torch.get_num_threads() == 3
            pending.yield_core()
            assert torch.get_num_threads() == 2
            assert not pending.settle() and torch.get_num_threads() == 2
            release.set()
            pending.thread.join()
            if fails:
                with pytest.raises(ZeroDivisionError):
                    pending.wait()
            else:
                assert pending.settle() and torch.get_num_threads() == 3
                pending.wait()
            assert torch.get_num_threads() == 3
            release.clear()
    finally:
        torch.set_num_threads(before)


def test_a_save_shortens_the_thread_switch_interval_while_it_writes():
    """While a background save writes, Python's switch interval is SAVE_SWITCH_INTERVAL_S (a training thread
    takes the GIL back within it); the process's interval is set back once the writing ends, also when it
    failed, and only when the last of two overlapping saves ends."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.003)
    release, seen = threading.Event(), []

    def write():
        seen.append(sys.getswitchinterval())
        release.wait(20)

    def failing():
        write()
        raise OSError("disk")

    try:
        for fn in (write, failing):
            pending = staging.PendingSave(fn, "x")
            assert sys.getswitchinterval() == pytest.approx(staging.SAVE_SWITCH_INTERVAL_S)
            release.set()
            pending.thread.join()
            assert sys.getswitchinterval() == pytest.approx(0.003)
            if fn is failing:
                with pytest.raises(OSError, match="disk"):
                    pending.wait()
            release.clear()
        assert seen == [pytest.approx(staging.SAVE_SWITCH_INTERVAL_S)] * 2
        first_release, second_release = threading.Event(), threading.Event()
        first = staging.PendingSave(lambda: first_release.wait(20), "first")
        second = staging.PendingSave(lambda: second_release.wait(20), "second")
        first_release.set()
        first.wait()
        assert sys.getswitchinterval() == pytest.approx(staging.SAVE_SWITCH_INTERVAL_S)
        second_release.set()
        second.wait()
        assert sys.getswitchinterval() == pytest.approx(0.003)
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO], ids=["full", "io-error"])
def test_a_background_save_that_fails_is_one_line_and_keeps_the_last_good_checkpoint(
    criteo_sample, tmp_path, monkeypatch, code
):
    config = _config(tmp_path, criteo_sample, max_steps=6, checkpoint_interval=3, eval_interval=None)
    run = tmp_path / "run"
    real, threads = checkpoint._pwrite_all, []

    def failing(fd, data, offset):  # the second checkpoint (step 6) fails after some of its bytes
        if threads and threads[0] is not threading.current_thread():
            threads.append(threading.current_thread())
            real(fd, bytes(memoryview(data).cast("B")[:100]), offset)
            raise OSError(code, os.strerror(code))
        threads[:1] = [threading.current_thread()]
        real(fd, data, offset)

    monkeypatch.setattr(checkpoint, "_pwrite_all", failing)
    exit_code, output = _cli(train_cli.main, ["--config", config, "--output-dir", run])
    line = _one_error_line(output)
    assert exit_code == 2, output
    assert len(threads) > 1 and all(t.name == "dlrm-save" for t in threads)  # background threads
    reason, free = re.escape(os.strerror(code)), r"( \([\d,.]+ MiB free on .+\))?"
    assert re.fullmatch(rf"error: {run}/checkpoints/last.pt: {reason}{free}", line), line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.pt"]  # no temporary left
    monkeypatch.undo()
    assert checkpoint.load_checkpoint(run / "checkpoints" / "last.pt")["step"] == 3


# ---------------------------------------------------------------------------------------------------------
# Many ranks: 2 gloo processes

# Run by each rank before dlrm.train: pieces of at most 16 KiB, and the largest buffer each rank hands to
# the file system while it writes DCP's files of tensors, in RUN/write-<rank> (the rank's whole rows of a
# table where they are not cut into pieces).
SMALL_PIECES = """
import contextlib, os
from pathlib import Path
from torch.distributed.checkpoint.filesystem import FileSystem
from dlrm import staging

staging.CHUNK_BYTES = 16384
create_stream, largest = FileSystem.create_stream, [0]

class Measured:
    def __init__(self, stream):
        self.stream = stream
    def write(self, data):
        largest[0] = max(largest[0], memoryview(data).nbytes)
        return self.stream.write(data)
    def __getattr__(self, name):
        return getattr(self.stream, name)

@contextlib.contextmanager
def measured(self, path, mode):
    with create_stream(self, path, mode) as stream:
        if not str(path).endswith(".distcp"):
            yield stream
            return
        yield Measured(stream)
    (Path(path).parent.parent.parent / f"write-{os.environ['RANK']}").write_text(str(largest[0]))

FileSystem.create_stream = measured
"""


def test_a_sharded_checkpoint_is_written_in_pieces_and_its_best_is_a_kept_step(criteo_sample, tmp_path):
    config = _cpu_config(
        tmp_path, criteo_sample, max_steps=4, eval_interval=4, checkpoint_interval=3, optimizer="adagrad"
    )
    raw = json.loads(config.read_text())
    raw["model"].update(embedding_dim=32, bottom_mlp=[32, 32])  # tables of up to 2000 x 32 fp32: 250 KiB
    config.write_text(json.dumps(raw))
    run = tmp_path / "run"
    procs = _start_ranks(config, run, SMALL_PIECES)
    err0, err1 = (p.communicate(timeout=300)[1] for p in procs)
    assert [p.returncode for p in procs] == [0, 0], err0 + err1
    last, best = run / "checkpoints" / "last", run / "checkpoints" / "best"
    stored = dcp.FileSystemReader(last).read_metadata().state_dict_metadata
    plan = json.loads((run / "sharding_plan.json").read_text())
    for f in set(range(26)) - set(plan["replicated"]):  # each table's rows in pieces of at most 16 KiB
        for key in (f"model/sparse_arch.embeddings.{f}.weight", f"optim/sparse_arch.embeddings.{f}.weight"):
            pieces = stored[key].chunks
            assert sum(c.sizes[0] for c in pieces) == plan["table_rows"][f]
            assert all(c.sizes[0] * 32 * 4 <= 16384 for c in pieces), key
    files = list(last.glob("*.distcp"))
    assert {p.name.split("_")[2] for p in files} == {"0", "1"} and len(files) > 200  # one per piece
    for rank in (0, 1):  # no rank handed the file system a table's shard (100 KiB and more) at once
        assert int((run / f"write-{rank}").read_text()) < 64 * 1024  # a piece, or the top MLP's 49 KiB
    meta = json.loads((last / "meta.json").read_text())
    assert set(meta["sha256"]) == {p.name for p in last.iterdir() if p.name != "meta.json"}
    assert len(plan["checkpoint_bytes_per_rank"]) == 2
    tables = 2 * sum(plan["table_rows"]) * 32 * 4  # weights and Adagrad's sums
    assert tables < plan["checkpoint_bytes"] == sum(plan["checkpoint_bytes_per_rank"]) < 2 * tables
    held = json.loads((best / "meta.json").read_text())
    assert held["best"]["step"] == held["step"] == 4  # the one evaluation, at the last step
    assert all((best / p.name).stat().st_ino == p.stat().st_ino for p in last.iterdir())  # not copies
    code, output = _cli(evaluate_cli.main, ["--checkpoint", best, "--data", criteo_sample])
    assert code == 0 and 0 < json.loads(output.splitlines()[-1])["auc"] < 1, output


# Run by each rank before dlrm.train: from the second checkpoint on, rank 1's writes fail with EIO.
IO_ERROR_ON_RANK_1 = """
import contextlib, errno, os
from torch.distributed.checkpoint.filesystem import FileSystem
from dlrm.parallel import checkpoint

saves, save, create_stream = [], checkpoint._save, FileSystem.create_stream

def counted(*args):
    saves.append(1)
    return save(*args)

class Broken:
    def __init__(self, stream):
        self.stream = stream
    def write(self, data):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    def __getattr__(self, name):
        return getattr(self.stream, name)

@contextlib.contextmanager
def broken(self, path, mode):
    with create_stream(self, path, mode) as stream:
        yield Broken(stream) if os.environ["RANK"] == "1" and len(saves) > 1 and "w" in mode else stream

checkpoint._save, FileSystem.create_stream = counted, broken
"""


def test_a_failed_background_save_on_one_rank_is_one_line_from_rank_0_and_exit_2_from_every_rank(
    criteo_sample, tmp_path
):
    config = _cpu_config(tmp_path, criteo_sample, max_steps=4, checkpoint_interval=2, eval_interval=None)
    run = tmp_path / "run"
    procs = _start_ranks(config, run, IO_ERROR_ON_RANK_1)
    err0, err1 = (p.communicate(timeout=300)[1] for p in procs)
    assert [p.returncode for p in procs] == [2, 2], err0 + err1
    line = _one_error_line(err0)
    assert line == f"error: {run}/checkpoints/last: Input/output error", line
    assert "error" not in err1 and "Traceback" not in err1, err1
    assert "in the background" in err0  # (rank 0's log)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last"]
    assert json.loads((run / "checkpoints" / "last" / "meta.json").read_text())["step"] == 2


# Run by each rank before dlrm.train: the disk has 1 MiB free.
LITTLE_FREE_SPACE = """
import shutil
real = shutil.disk_usage
shutil.disk_usage = lambda path: real(path)._replace(free=2**20)
"""


def test_the_preflight_on_many_ranks_is_one_line_from_rank_0_and_exit_2_from_every_rank(
    criteo_sample, tmp_path
):
    config = _cpu_config(tmp_path, criteo_sample, max_steps=2)
    run = tmp_path / "run"
    procs = _start_ranks(config, run, LITTLE_FREE_SPACE)
    err0, err1 = (p.communicate(timeout=300)[1] for p in procs)
    assert [p.returncode for p in procs] == [2, 2], err0 + err1
    line = _one_error_line(err0)
    assert line.startswith(f"error: {run}/checkpoints: no room for the checkpoints: each is "), line
    assert re.search(r"\(ranks [\d.]+ MiB \+ [\d.]+ MiB of tensors\)", line) and "1.0 MiB free" in line, line
    assert "error" not in err1 and "Traceback" not in err1, err1
