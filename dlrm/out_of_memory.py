"""Out of memory as the one line a user can act on (batch, table bytes, free memory, what to change): a
device out-of-memory error turned into it, and tables too large for the host or the GPU refused before they
are built."""

from pathlib import Path

import torch

from dlrm.config import RunConfig
from dlrm.data.dataset import load_metadata
from dlrm.errors import OutOfMemory
from dlrm.model.tables import resolve_table_rows


def out_of_memory(cfg: RunConfig, err: torch.OutOfMemoryError, when: str) -> OutOfMemory:
    """OutOfMemory with what matters: batch size, embedding table bytes, free device memory, what to do."""
    parts = [f"batch {cfg.data.batch_size}"]
    try:
        rows = sum(resolve_table_rows(cfg.model, load_metadata(Path(cfg.data.path))))
        dim, weights, state = table_bytes(cfg, rows)
        held = weights + state
        size = f"{held / 2**30:.2f} GiB" if held >= 2**30 else f"{held / 2**20:.1f} MiB"
        parts.append(
            f"embedding tables {size} ({rows:,} rows x D={dim}{', with Adagrad state' if state else ''})"
        )
    except (ValueError, OSError):
        pass
    if torch.cuda.is_available():
        try:
            free, total = torch.cuda.mem_get_info()
            parts.append(f"{free / 2**30:.2f} of {total / 2**30:.2f} GiB GPU memory free")
        except RuntimeError:
            pass
    # "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of ...": the first two.
    first = str(err).strip().splitlines()[0] if str(err).strip() else "out of memory"
    first = ". ".join(first.split(". ")[:2])
    return OutOfMemory(
        f"out of memory {when} ({first}): {', '.join(parts)}; lower data.batch_size or model.max_rows, "
        "use --precision bf16, or spread the tables over more GPUs"
    )


def table_bytes(cfg: RunConfig, rows: int) -> tuple[int, int, int]:
    """(D, fp32 weight bytes, optimizer state bytes) of `rows` table rows: D is 1 for `logistic` (a weight per
    row); Adagrad keeps one accumulator per weight, row-wise Adagrad one per row, SGD none."""
    dim = 1 if cfg.model.arch == "logistic" else cfg.model.embedding_dim
    weights = rows * dim * 4
    state = {"sgd": 0, "adagrad": weights, "rowwise_adagrad": rows * 4}[cfg.train.optimizer]
    return dim, weights, state


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux): what can be allocated without swapping; None elsewhere."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_tables_fit(cfg: RunConfig, table_rows: list[int], device: torch.device) -> None:
    """Refuse tables that cannot be built: their fp32 weights are initialized in host memory, then moved to
    `device` (with the optimizer's state there). Past the host's available memory the allocation succeeds
    lazily and the kernel's OOM killer ends the process while the weights are initialized, with no message;
    past a GPU's free memory the move fails.

    Raises:
        OutOfMemory: more bytes than the host has available, or (CUDA) than the device has free.
    """
    rows = sum(table_rows)
    dim, weights, state = table_bytes(cfg, rows)
    what = f"embedding tables of {rows:,} rows x D={dim} ({_gib(weights)} in fp32)"
    fix = "lower model.max_rows or model.embedding_dim, or spread the tables over more GPUs (torchrun)"
    available = host_available_bytes()
    if available is not None and weights > available:
        raise OutOfMemory(f"out of memory during set-up: {what}, built in host memory, which has "
                          f"{_gib(available)} available; {fix}")  # fmt: skip
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if weights + state > free:
            with_state = f" plus {_gib(state)} of Adagrad state" if state else ""
            raise OutOfMemory(f"out of memory during set-up: {what}{with_state}, on a GPU with {_gib(free)} "
                              f"of {_gib(total)} free; {fix}")  # fmt: skip
