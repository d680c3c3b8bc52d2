"""Many GPUs (or CPU processes) with torchrun: one model, the dense part data parallel, the embedding
tables model parallel (sharded by the planner, exchanged by all_to_all), sharded DCP checkpoints.

    torchrun --nproc-per-node N -m dlrm.train --config C [flags]

Modules, one job each: group (the process group from torchrun's environment), faults (the heartbeats, a
rank that died or hung, each rank's one exit line), planner (which rank holds which table rows), sharded
(the sharded SparseArch and its all_to_all exchange), dense (the dense gradients' all-reduce inside the
step), evaluation (exact metrics over all ranks), checkpoint (DCP, resharding N -> M ranks, and one-process
reads), run (the run's rank-aware checks and collectives). The training run calls these through its Sharded
strategy (dlrm.run.strategy); they never call the run. Without torchrun nothing here runs.
"""

from dlrm.parallel.dense import averaged_parameters, grad_averager
from dlrm.parallel.faults import (
    abort_peers,
    exit_now,
    fail,
    is_distributed,
    note_checkpoints,
    note_progress,
    peers_ended,
    rank_prefix,
    resume_hint,
    set_resume_command,
)
from dlrm.parallel.group import SINGLE, Dist, init_distributed, shutdown, world_from_env

__all__ = [
    "SINGLE",
    "Dist",
    "abort_peers",
    "averaged_parameters",
    "exit_now",
    "fail",
    "grad_averager",
    "init_distributed",
    "is_distributed",
    "note_checkpoints",
    "note_progress",
    "peers_ended",
    "rank_prefix",
    "resume_hint",
    "set_resume_command",
    "shutdown",
    "world_from_env",
]
