"""A device out-of-memory error turned into the one line a user can act on (batch, table bytes, free GPU
memory, what to change)."""

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
        state = 2 if cfg.train.optimizer == "adagrad" else 1  # Adagrad keeps one accumulator per weight
        table_bytes = rows * cfg.model.embedding_dim * 4 * state
        size = f"{table_bytes / 2**30:.2f} GiB" if table_bytes >= 2**30 else f"{table_bytes / 2**20:.1f} MiB"
        parts.append(
            f"embedding tables {size} ({rows:,} rows x D={cfg.model.embedding_dim}"
            f"{', with Adagrad state' if state == 2 else ''})"
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
