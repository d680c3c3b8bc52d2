"""A run's kernel choices (kernels.gemm.tuning): each rank's, written with every checkpoint, and taken back
by a run that resumes from it (or names it with --kernel-choices), so it launches the kernels the run it
continues launched.

Why: our GEMMs choose their tile config and, for some shapes, between our kernel and cuBLAS by timing the
candidates on first use. Two processes can time apart (a busy GPU, a close race) and choose apart, and two
implementations of one GEMM sum in different orders: a resumed run that chose anew would drift from the run
it continues in the last bits and, over steps, further. The choices are per rank (each rank times its own
GPU) and of the ranks' shapes: a checkpoint of another number of ranks has other GEMM sizes, so such a run
(and one on another GPU model or Triton version) times its kernels anew, as it says.
"""

import sys
from pathlib import Path

from loguru import logger

KEY = "kernel_choices"  # the checkpoint's entry: one kernels.gemm.tuning.chosen() a rank, in rank order
TUNING = "kernels.gemm.tuning"  # imported where a kernel is first called, never here (tests/test_imports.py)


def record(strategy) -> list[dict | None]:
    """Every rank's kernel choices so far, in rank order; None for a rank that has launched no tuned kernel
    (under torchrun a collective: every rank calls it at the same point, as it does a checkpoint save)."""
    tuning = sys.modules.get(TUNING)
    return strategy.per_rank(tuning.chosen() if tuning is not None else None)


def take(checkpoint: dict, source: Path, strategy) -> None:
    """Make this rank launch the kernels that `checkpoint` (read from `source`) records for its rank, where
    it was written by as many ranks on the same GPU model with the same Triton; otherwise the kernels are
    timed anew, and rank 0 says why in one line (nothing for a checkpoint that records no tuned kernel).
    Call it once the Triton interpreter is settled (dlrm.device.use_interpreter_on_cpu): it imports our
    kernels' tuning."""
    records = checkpoint.get(KEY) or []
    if not any(records):
        return
    reason = None
    if len(records) != strategy.world_size:
        reason = f"they are of {len(records)} ranks' GEMM sizes, this run has {strategy.world_size}"
    elif records[strategy.rank] is not None:
        from kernels.gemm import tuning

        if not tuning.use_chosen(records[strategy.rank]):
            theirs = records[strategy.rank]
            reason = f"they were timed on {theirs.get('device')} with Triton {theirs.get('triton')}"
    if not strategy.is_main:
        return
    if reason is None:
        count = sum(len(table) for table in (records[0] or {}).get("choices", {}).values())
        logger.info("kernels: the {} tuned choices of {} (its GPU model and Triton)", count, source)
    else:
        logger.info("kernels: timed anew, not taken from {}: {}", source, reason)
