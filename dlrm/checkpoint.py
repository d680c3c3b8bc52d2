"""Checkpoints: model and optimizer state, step, resolved config and table layout, written atomically.

With `--use-triton` the embedding tables are updated inside their kernel's backward, not by the torch
optimizer, so their optimizer state (Adagrad's accumulators; empty for SGD) is saved apart, as
`embedding_optimizer_state`; None otherwise. A DLRM with `model.first_order` keeps its first-order tables'
state beside it the same way, as `first_order_optimizer_state`.

With `data.loader` "streaming" or "binary" a checkpoint also holds `loader`: the train loader's position
(the `state_dict()` of StreamingLoader or BinaryLoader: epoch, batches consumed, and the settings a resume
must match); other loaders store None (their order is a function of the seed and epoch, so the step alone
places them). `best` and `evals_since_best` keep early stopping's state. `python -m dlrm.train --resume
PATH` restores all of it and goes on from `step`.
"""

import os
import pickle
from pathlib import Path
from typing import Any

import torch

from dlrm.atomic import replacing


def save_checkpoint(path: Path, **state: Any) -> None:
    """torch.save `state` to `path` atomically: a temporary file in the same directory, fsync'ed, renamed
    over `path`, then the directory fsync'ed, so a crash or kill at any moment leaves either the old or the
    new checkpoint under the final name, never a half-written one."""
    with replacing(path) as tmp, open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_directory(path.parent)


def fsync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable (a no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint written by `save_checkpoint` onto the CPU; or a sharded checkpoint directory of a
    many-rank run, read whole (dlrm.parallel.checkpoint.load_full: its optimizer state comes as
    "optimizer_by_name", "optimizer" is None).

    Raises:
        ValueError: the file is missing (naming the other checkpoints of its directory, if any), unreadable
            (truncated, empty, a directory, another kind of file), or not a DLRM checkpoint; one line naming
            the file.
    """
    if path.is_dir() and (path / ".metadata").is_file():
        from dlrm.parallel.checkpoint import load_full

        return load_full(path)
    if not path.exists():
        others = sorted(p.name for p in path.parent.glob("*.pt")) if path.parent.is_dir() else []
        hint = f" ({path.parent} has {', '.join(others)})" if others else ""
        raise ValueError(f"{path}: checkpoint not found{hint}")
    if path.is_dir():
        raise ValueError(
            f"{path}: is a directory, expected a checkpoint file (checkpoints/last.pt) or the directory of a "
            "sharded checkpoint of a torchrun job (checkpoints/last)"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except PermissionError as err:
        raise ValueError(f"{path}: {err.strerror}") from None
    except Exception as err:  # noqa: BLE001 - torch.load raises many kinds for a bad file; all mean the same
        reason = "empty file" if path.stat().st_size == 0 else _first_line(err)
        raise ValueError(
            f"{path}: not a readable checkpoint (truncated, or not written by dlrm.train): {reason}"
        ) from None
    missing = [k for k in ("model", "config", "table_rows") if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(f"{path}: not a DLRM checkpoint (missing {', '.join(missing)})")
    # Config keys added since the checkpoint was written (e.g. model.mlp_block) take their defaults, which
    # are what such a run had: a resume compares configs key by key.
    from dlrm.config import from_dict

    state["config"] = from_dict(state["config"]).to_dict()
    return state


def _first_line(err: BaseException) -> str:
    if isinstance(err, pickle.UnpicklingError):  # torch.load's long weights_only advice does not apply
        return "not a torch.save file"
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:120]}" if text else type(err).__name__
