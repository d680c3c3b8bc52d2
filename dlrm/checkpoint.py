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

The file ends in a content hash: torch.save's bytes, then `\nDLRM-SHA256:<64 hex digits>\n`, the sha256 of
those bytes (`TRAILER`; torch.load reads past it, as zip readers do). `load_checkpoint` checks it, so a
checkpoint changed on disk or in a copy is refused with one line instead of loading other weights.
"""

import hashlib
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from loguru import logger

from dlrm.atomic import replacing
from dlrm.config import from_dict
from dlrm.parallel.checkpoint import load_full

TRAILER = re.compile(rb"\nDLRM-SHA256:([0-9a-f]{64})\n")
TRAILER_BYTES = 78  # len(b"\nDLRM-SHA256:") + 64 + 1


class _HashingWriter:
    """A binary file for torch.save that hashes what goes through it."""

    def __init__(self, f):
        self.f, self.sha256 = f, hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def save_checkpoint(path: Path, **state: Any) -> None:
    """torch.save `state` to `path` atomically, its sha256 after it (module docstring): a temporary file in
    the same directory, fsync'ed, renamed over `path`, then the directory fsync'ed, so a crash or kill at
    any moment leaves either the old or the new checkpoint under the final name, never a half-written one.
    Raises dlrm.atomic.DiskFull when the disk is full or read-only."""
    with replacing(path) as tmp, open(tmp, "wb") as f:
        hashing = _HashingWriter(f)
        torch.save(state, hashing)
        f.write(b"\nDLRM-SHA256:" + hashing.sha256.hexdigest().encode() + b"\n")
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
            (truncated, empty, a directory, another kind of file), changed since it was written (its
            sha256), or not a DLRM checkpoint; one line naming the file.
    """
    if path.is_dir() and (path / ".metadata").is_file():
        return load_full(path)
    if not path.exists():
        sharded = path.with_suffix("")
        if path.suffix == ".pt" and (sharded / ".metadata").is_file():
            raise ValueError(
                f"{path}: checkpoint not found; {sharded} is the sharded checkpoint of this torchrun run: "
                f"--resume {sharded}"
            )
        others = sorted(p.name for p in path.parent.glob("*.pt")) if path.parent.is_dir() else []
        hint = f" ({path.parent} has {', '.join(others)})" if others else ""
        raise ValueError(f"{path}: checkpoint not found{hint}")
    if path.is_dir():
        raise ValueError(
            f"{path}: is a directory, expected a checkpoint file (checkpoints/last.pt) or the directory of a "
            "sharded checkpoint of a torchrun job (checkpoints/last)"
        )
    try:
        verified = verify_checksum(path)
        state = torch.load(path, map_location="cpu", weights_only=True)
    except PermissionError as err:
        raise ValueError(f"{path}: {err.strerror}") from None
    except ChecksumMismatch as err:
        raise ValueError(str(err)) from None
    except Exception as err:  # noqa: BLE001 - torch.load raises many kinds for a bad file; all mean the same
        reason = "empty file" if path.stat().st_size == 0 else _first_line(err)
        raise ValueError(
            f"{path}: not a readable checkpoint (truncated, or not written by dlrm.train): {reason}"
        ) from None
    if not verified:
        logger.warning("{}: carries no checksum (written by an older version): not verified", path)
    missing = [k for k in ("model", "config", "table_rows") if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(f"{path}: not a DLRM checkpoint (missing {', '.join(missing)})")
    # Config keys added since the checkpoint was written (e.g. model.mlp_block) take their defaults, which
    # are what such a run had: a resume compares configs key by key.
    state["config"] = from_dict(state["config"]).to_dict()
    return state


class ChecksumMismatch(Exception):
    """The file's bytes are not those whose sha256 it carries."""


def verify_checksum(path: Path) -> bool:
    """Check the sha256 trailer of checkpoint file `path` (module docstring); False when it has none (a
    checkpoint written before checkpoints carried one, or one cut short, which torch.load then refuses).

    Raises:
        ChecksumMismatch: the bytes differ from those written, naming the file.
    """
    size = path.stat().st_size
    if size <= TRAILER_BYTES:
        return False
    with open(path, "rb") as f:
        f.seek(size - TRAILER_BYTES)
        trailer = TRAILER.fullmatch(f.read())
        if trailer is None:
            return False
        f.seek(0)
        sha256, left = hashlib.sha256(), size - TRAILER_BYTES
        while left:
            chunk = f.read(min(left, 1 << 24))
            sha256.update(chunk)
            left -= len(chunk)
    if sha256.hexdigest() != trailer.group(1).decode():
        raise ChecksumMismatch(
            f"{path}: checksum mismatch: the file changed after it was written (a bad disk, copy or edit); "
            "its weights cannot be trusted: use another checkpoint (best.pt, step-<N>.pt) or retrain"
        )
    return True


def _first_line(err: BaseException) -> str:
    if isinstance(err, pickle.UnpicklingError):  # torch.load's long weights_only advice does not apply
        return "not a torch.save file"
    text = str(err).strip()
    if not text:
        return type(err).__name__
    first = text.splitlines()[0]
    if len(first) > 120:  # cut at a word, and say so
        first = first[:120].rsplit(" ", 1)[0] + " ..."
    return f"{type(err).__name__}: {first}"
