"""What a run on many ranks (dlrm.run.strategy.Sharded) needs from the process group: the checks before any
work, one run directory for all ranks, rank-0-only writers, and the reductions of logged numbers."""

from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from dlrm.config import RunConfig
from dlrm.data.schema import NUM_SPARSE

T = TypeVar("T")


def check_world(cfg: RunConfig, world_size: int) -> None:
    """Config values that cannot work on `world_size` ranks, as one-line errors before any work.

    Raises:
        ValueError: W does not divide data.batch_size, more ranks than tables with row-wise off, or a
            failure setting not supported on many ranks yet (train.on_nonfinite "skip_batch": each rank
            would decide alone; train.keep_last: the sharded checkpoint is a directory; model.arch
            "logistic": the planner shards the DLRM's tables only).
    """
    if cfg.train.on_nonfinite == "skip_batch":
        raise ValueError(
            'train.on_nonfinite: "skip_batch" is not supported on many ranks yet (each rank would skip on '
            'its own loss); use "stop"'
        )
    if cfg.train.keep_last:
        raise ValueError("train.keep_last: not supported on many ranks yet (sharded checkpoints); use 0")
    if cfg.model.arch != "dlrm":
        raise ValueError(f"model.arch: {cfg.model.arch!r} is not supported on many ranks yet; use one GPU")
    if cfg.data.batch_size % world_size:
        raise ValueError(
            f"data.batch_size: {cfg.data.batch_size} (the global batch) is not divisible by the "
            f"{world_size} ranks"
        )
    if not cfg.parallel.row_wise and world_size > NUM_SPARSE:
        raise ValueError(
            f"parallel.row_wise: {world_size} ranks but {NUM_SPARSE} tables: with row-wise sharding off "
            "every rank must hold a whole table; set parallel.row_wise true or use fewer ranks"
        )


def same_path(path: Path) -> Path:
    """Rank 0's `path` on every rank (e.g. the run directory, whose default name has a timestamp)."""
    holder = [str(path)]
    dist.broadcast_object_list(holder, src=0)
    return Path(holder[0])


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean of a tensor over all ranks (a new tensor; all_reduce SUM / W)."""
    total = value.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def max_over_ranks(values: list[int]) -> list[int]:
    """Each value's maximum over the ranks, on every rank (one all_reduce MAX of len(values) values): a
    flag true on any rank, the signal that any rank received."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor(values, dtype=torch.int32, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def gather_values(value: T) -> list[T]:
    """`value` (any picklable value: a number, None, a dict of them) of every rank, in rank order (on every
    rank; all_gather_object)."""
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


class NullWriter:
    """The TensorBoard writer of ranks other than 0: takes everything, writes nothing."""

    def add_scalar(self, *args, **kwargs) -> None:
        pass

    def add_text(self, *args, **kwargs) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
