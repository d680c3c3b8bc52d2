"""Checkpoints: model and optimizer state, step, resolved config and table layout, written atomically.

With `--use-triton` the embedding tables are updated inside their kernel's backward, not by the torch
optimizer, so their optimizer state (Adagrad's accumulators; empty for SGD) is saved apart, as
`embedding_optimizer_state`; None otherwise.

With `data.loader` "streaming" a checkpoint also holds `loader`: the train loader's position
(`StreamingLoader.state_dict()`: epoch, batches consumed, and the settings a resume must match); other
loaders store None (their order is a function of the seed and epoch, so the step alone places them).
`best` and `evals_since_best` keep early stopping's state. `python -m dlrm.train --resume PATH` restores
all of it and goes on from `step`.
"""

import os
from pathlib import Path
from typing import Any

import torch


def save_checkpoint(path: Path, **state: Any) -> None:
    """torch.save `state` to `path` via a temporary file renamed into place, so a crash never leaves a
    half-written checkpoint under the final name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint written by `save_checkpoint` onto the CPU; or a sharded checkpoint directory of a
    many-rank run, read whole (dlrm.parallel.checkpoint.load_full: its optimizer state comes as
    "optimizer_by_name", "optimizer" is None).

    Raises:
        ValueError: the file is missing or is not a DLRM checkpoint.
    """
    if path.is_dir():
        from dlrm.parallel.checkpoint import load_full

        return load_full(path)
    if not path.is_file():
        raise ValueError(f"{path}: checkpoint not found")
    state = torch.load(path, map_location="cpu", weights_only=True)
    missing = [k for k in ("model", "config", "table_rows") if k not in state]
    if missing:
        raise ValueError(f"{path}: not a DLRM checkpoint (missing {', '.join(missing)})")
    return state
