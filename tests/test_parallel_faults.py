"""A rank that dies or hangs mid-run under torchrun (CPU, gloo, real processes): every rank ends with one
message naming it, within the collectives' timeout."""

import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from tests.test_parallel import TINY, _free_port

FAULT_WORKER = """
import os, sys, time
import dlrm.run.loop
from dlrm.train import main

account_step = dlrm.run.loop.account_step
def faulty_account_step(run, state, *args):
    account_step(run, state, *args)
    if state.step == 3 and run.strategy.rank == 1:  # mid-run, between two steps' collectives
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), 9)
        time.sleep(3600)
dlrm.run.loop.account_step = faulty_account_step
main(sys.argv[2:])
"""


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_a_dead_or_hung_rank_ends_every_rank_with_a_message(criteo_sample, tmp_path, fault):
    config = tmp_path / "c.json"
    raw = json.loads(TINY.read_text())
    raw["data"].update(path=str(criteo_sample), batch_size=240)
    raw["train"].update(max_steps=50, device="cpu")
    raw["profiler"]["enabled"] = False
    config.write_text(json.dumps(raw))
    port = _free_port()
    timeout_s = 6
    procs = []
    for rank in range(2):
        env = {
            **os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
            "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "DLRM_TIMEOUT_S": str(timeout_s),
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }  # fmt: skip
        args = [
            sys.executable,
            "-c",
            FAULT_WORKER,
            fault,
            "--config",
            str(config),
            "--output-dir",
            str(tmp_path / "run"),
        ]
        procs.append(subprocess.Popen(args, env=env, cwd=REPO, stderr=subprocess.PIPE, text=True))
    start = time.monotonic()
    _, err0 = procs[0].communicate(timeout=120)
    _, err1 = procs[1].communicate(timeout=30)
    elapsed = time.monotonic() - start
    assert procs[0].returncode == 1 and "Traceback" not in err0
    if fault == "kill":
        assert procs[1].returncode == -9
        assert "rank 0: ending: rank 1 stopped: no heartbeat" in err0, err0[-3000:]
    else:  # rank 0's all_to_all times out: rank 1 is alive but not in it
        assert procs[1].returncode == 1
        assert "rank 0: ending: rank 1 hung: alive, but not in the collective that failed on rank 0" in err0
        assert "rank 1: ending: rank 1 hung" in err1
    assert elapsed < 60  # start-up (imports, data), the timeout, the heartbeat window
