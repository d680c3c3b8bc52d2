"""A rank that dies or hangs mid-run under torchrun (CPU, gloo, real processes): every rank ends with one
message naming it, within seconds for a dead rank, within the collectives' timeout for a hung one; a dead
rank's message says how to resume from the last complete checkpoint."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from tests.test_faults import _one_error_line
from tests.test_parallel import TINY, _free_port

FAULT_WORKER = """
import os, sys, time
import dlrm.run.loop
from dlrm.train import main

account_step = dlrm.run.loop.account_step
def faulty_account_step(run, state, *args):
    account_step(run, state, *args)
    if state.step == 3 and run.strategy.rank == 1:  # mid-run, between two steps' collectives
        with open(os.environ["FAULT_AT"], "w") as f:  # when the fault came (wall clock, seconds)
            f.write(repr(time.time()))
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), 9)
        time.sleep(3600)
dlrm.run.loop.account_step = faulty_account_step
main(sys.argv[2:])
"""


def _config(tmp_path, criteo_sample, **train) -> str:
    """tiny.json on the sample, global batch 240, on the CPU without the profiler, `train` keys set."""
    config = tmp_path / "c.json"
    raw = json.loads(TINY.read_text())
    raw["data"].update(path=str(criteo_sample), batch_size=240)
    raw["train"].update(**train, device="cpu")
    raw["profiler"]["enabled"] = False
    config.write_text(json.dumps(raw))
    return str(config)


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_a_dead_or_hung_rank_ends_every_rank_with_a_message(criteo_sample, tmp_path, fault):
    config, run = _config(tmp_path, criteo_sample, max_steps=50), tmp_path / "run"
    port = _free_port()
    timeout_s = 6
    procs = []
    for rank in range(2):
        env = {
            **os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
            "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "DLRM_TIMEOUT_S": str(timeout_s),
            "FAULT_AT": str(tmp_path / "fault_at"),
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }  # fmt: skip
        args = [sys.executable, "-c", FAULT_WORKER, fault, "--config", config, "--output-dir", str(run)]
        procs.append(subprocess.Popen(args, env=env, cwd=REPO, stderr=subprocess.PIPE, text=True))
    _, err0 = procs[0].communicate(timeout=180)
    _, err1 = procs[1].communicate(timeout=30)
    # From the fault, not the start: start-up (imports, data) stretches on a loaded machine.
    after_fault = time.time() - float((tmp_path / "fault_at").read_text())
    assert "Traceback" not in err0
    if fault == "kill":  # its process ended (a zombie until this test reaps it): dead at once
        assert procs[0].returncode == 2 and procs[1].returncode == -9, err0[-3000:]
        line = _one_error_line(err0)
        assert re.match(rf"error: rank 1 died at step \d+: its process {procs[1].pid} ended; ", line), line
        assert line.endswith(f"no checkpoint was written yet ({run}): start the run again")
    else:  # rank 0's all_to_all times out: rank 1 is alive but not in it
        assert procs[0].returncode == 1 and procs[1].returncode == 1
        assert "rank 0: ending: rank 1 hung: alive, but not in the collective that failed on rank 0" in err0
        assert "rank 1: ending: rank 1 hung" in err1
    assert after_fault < 60  # the collectives' timeout, the heartbeat window, the ranks' ending


# Run by each rank under torchrun: rank 1 is killed (SIGKILL) as it starts writing its part of the second
# sharded checkpoint, so checkpoints/last stays the first one (step 2).
DIES_IN_THE_SECOND_CHECKPOINT = """
import os, runpy
from torch.distributed.checkpoint.filesystem import FileSystem
from dlrm.parallel import checkpoint

saves, save, create_stream = [], checkpoint.save_sharded, FileSystem.create_stream

def counted(*args, **kwargs):
    saves.append(1)
    return save(*args, **kwargs)

def dying(self, path, mode):
    if os.environ["RANK"] == "1" and len(saves) == 2:
        os.kill(os.getpid(), 9)
    return create_stream(self, path, mode)

checkpoint.save_sharded, FileSystem.create_stream = counted, dying
runpy.run_module("dlrm.train", run_name="__main__", alter_sys=True)
"""


def test_a_killed_rank_under_torchrun_is_named_at_once_with_the_resume_command(criteo_sample, tmp_path):
    config = _config(tmp_path, criteo_sample, max_steps=50, log_interval=1, checkpoint_interval=2)
    worker, logs, run = tmp_path / "worker.py", tmp_path / "logs", tmp_path / "run"
    worker.write_text(DIES_IN_THE_SECOND_CHECKPOINT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("DLRM_TIMEOUT_S", None)  # the default timeout (300 s): a dead rank is found without it
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    args = [*torchrun, "--log-dir", logs, "--redirects", "3", worker, "--config", config, "--output-dir", run]
    start = time.monotonic()
    args = [str(a) for a in args]
    agent = subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    # torchrun's agent reports each worker's exit code (and, for any but 0, its own traceback)
    codes = dict(re.findall(r"rank\s*: (\d) \(local_rank: \d\)\s+exitcode\s*: (-?\d+)", agent.stderr))
    assert codes == {"0": "2", "1": "-9"}, agent.stderr[-3000:]
    [err0] = logs.glob("*/attempt_0/0/stderr.log")
    err0 = err0.read_text()
    last = run / "checkpoints" / "last"
    line = _one_error_line(err0)  # one line, no traceback, no "SIGTERM received" (the agent's SIGTERM)
    assert re.match(r"error: rank 1 died at step \d+: its process \d+ ended; ", line), line
    assert line.endswith(
        f"{last} holds step 2; go on with: torchrun --nproc-per-node 2 -m dlrm.train --config {config} "
        f"--resume {last}"
    )
    assert "received" not in err0, err0
    assert json.loads((last / "meta.json").read_text())["step"] == 2
    assert elapsed < 60  # start-up (imports, data), 4 steps, and seconds to name the dead rank
