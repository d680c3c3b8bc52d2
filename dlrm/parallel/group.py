"""The process group of a `torchrun` launch: this process's place in it (`Dist`), joining and leaving it.

    dist, device = init_distributed("auto", cfg.parallel)   # from torchrun's RANK, WORLD_SIZE, LOCAL_RANK
    dist.enabled                                              # False without torchrun: nothing changes

Without torchrun (no WORLD_SIZE, or WORLD_SIZE=1) this returns `SINGLE` and the device of
`dlrm.device.resolve_device`, and starts nothing. With it: NCCL on CUDA (device cuda:LOCAL_RANK), gloo on the
CPU; the collectives' timeout is `parallel.timeout_s` (env DLRM_TIMEOUT_S overrides it). NVLink multicast
stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 are set before the
group is created, unless the environment already sets them). Joining starts this rank's heartbeat thread,
leaving stops it (dlrm.parallel.faults: what ends every rank when one dies or hangs).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from loguru import logger

from dlrm.device import resolve_device
from dlrm.parallel.faults import start_watchdog, stop_watchdog

# NVLink multicast (NVLS) off: set before the process group is created, unless the environment says.
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
TIMEOUT_ENV = "DLRM_TIMEOUT_S"


@dataclass(frozen=True)
class Dist:
    """This process's place in the job: rank in [0, world_size), local_rank on its host (its GPU)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    timeout_s: float = 300.0

    @property
    def enabled(self) -> bool:
        """True when several processes train one model (a process group exists)."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs, writes TensorBoard, config.json, metrics.json."""
        return self.rank == 0


SINGLE = Dist()


def world_from_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment; (0, 1, 0) without it.

    Raises:
        ValueError: a variable that is not an integer, or a rank outside [0, WORLD_SIZE).
    """
    values = {}
    for name, default in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)):
        raw = os.environ.get(name)
        try:
            values[name] = default if raw in (None, "") else int(raw)
        except ValueError:
            raise ValueError(f"environment {name}={raw!r}: expected an integer (set by torchrun)") from None
    rank, world_size, local_rank = values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"]
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"environment RANK={rank} WORLD_SIZE={world_size}: expected 0 <= RANK < WORLD_SIZE")
    return rank, world_size, local_rank


def timeout_from(config_s: float) -> float:
    """The collective timeout in seconds: env DLRM_TIMEOUT_S when set, else `config_s`.

    Raises:
        ValueError: DLRM_TIMEOUT_S is not a positive number.
    """
    raw = os.environ.get(TIMEOUT_ENV)
    if raw in (None, ""):
        return config_s
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"environment {TIMEOUT_ENV}={raw!r}: expected a positive number of seconds")
    return value


def init_distributed(device_name: str, timeout_s: float) -> tuple[Dist, torch.device]:
    """Join the torchrun job (or do nothing in a single process); return (Dist, this rank's device).

    Args:
        device_name: train.device, "auto" | "cpu" | "cuda"; under torchrun "cuda" means cuda:LOCAL_RANK.
        timeout_s: parallel.timeout_s (DLRM_TIMEOUT_S overrides it).
    Raises:
        ValueError: bad torchrun environment, "cuda" without a GPU, or fewer GPUs on the host than
            LOCAL_RANK + 1.
    """
    rank, world_size, local_rank = world_from_env()
    device = resolve_device(device_name)
    if world_size == 1:
        return SINGLE, device
    timeout_s = timeout_from(timeout_s)
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK={local_rank} but this host has {torch.cuda.device_count()} GPU(s): "
                "start at most one process per GPU (torchrun --nproc-per-node)"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    for name, value in MULTICAST_OFF.items():
        os.environ.setdefault(name, value)
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            timeout=timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    this = Dist(rank, world_size, local_rank, timeout_s)
    start_watchdog(rank, world_size, timeout_s)
    if rank > 0:  # one log for the job: the other ranks say only what goes wrong
        logger.remove()
        logger.add(sys.stderr, level="WARNING", format="rank " + str(rank) + " | {level} | {message}")
    return this, device


def shutdown() -> None:
    """Stop the heartbeat thread and leave the process group (end of a torchrun job). A collective: every
    rank stops its heartbeats before any passes the barrier, so no rank sees another's stop (or the store
    of rank 0 going away) as a failure."""
    stop_watchdog()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
