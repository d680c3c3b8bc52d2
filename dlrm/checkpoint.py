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

Writing stages at most dlrm.staging.CHUNK_BYTES of host memory at a time, whatever the tables' size:
torch.save writes the file with its tensors' bytes left as holes (`torch.serialization.skip_data`: the
pickle, the zip records and their offsets, as a plain torch.save lays them out), then each storage is
copied into its record chunk by chunk (a device storage through one host buffer of CHUNK_BYTES; a host
storage straight from its memory) and the sha256 taken in file order as the bytes go by. The result is
torch.save's own format, read by torch.load like any other.

`start_save` writes in a background thread (`PendingSave`) from a snapshot of the state on its own device,
when the device has room for one (`snapshot`), so training goes on while the file is written; otherwise it
writes at once.
"""

import hashlib
import io
import os
import pickle
import re
import shutil
import struct
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from loguru import logger

from dlrm import staging
from dlrm.atomic import disk_full, replacing
from dlrm.config import from_dict
from dlrm.parallel.checkpoint import load_full
from dlrm.staging import PendingSave, announce, snapshot

TRAILER = re.compile(rb"\nDLRM-SHA256:([0-9a-f]{64})\n")
TRAILER_BYTES = 78  # len(b"\nDLRM-SHA256:") + 64 + 1


def save_checkpoint(path: Path, links: Sequence[Path] = (), **state: Any) -> None:
    """torch.save `state` to `path` atomically, its sha256 after it (module docstring), staging at most
    CHUNK_BYTES of host memory at a time: a temporary file in the same directory, fsync'ed, renamed over
    `path`, then the directory fsync'ed, so a crash or kill at any moment leaves either the old or the new
    checkpoint under the final name, never a half-written one. Then each of `links` (e.g. best.pt) is made
    the same file (`publish_link`), no second write.

    Raises:
        dlrm.atomic.DiskFull: the disk is full or read-only.
        OSError: another failure to write (an I/O error), naming `path`.
    """
    try:
        with replacing(path) as tmp:
            write_file(tmp, state)
        fsync_directory(path.parent)
        for link in links:
            publish_link(path, link)
    except OSError as err:
        if err.filename is None and disk_full(err, path) is None:
            raise OSError(err.errno, err.strerror or str(err), str(path)) from err
        raise


def write_file(path: Path, state: dict[str, Any]) -> None:
    """Write `state` into the new file `path`: torch.save's format and the sha256 trailer, the tensors'
    bytes copied in chunks of at most CHUNK_BYTES (module docstring), fsync'ed."""
    storages = _storages_in_save_order(state)
    with torch.serialization.skip_data():
        torch.save(state, path)
    records = sorted(zip(_record_offsets(path, storages), storages, strict=True), key=lambda r: r[0])
    sha256 = hashlib.sha256()
    with open(path, "r+b") as f:
        fd, size, at = f.fileno(), os.fstat(f.fileno()).st_size, 0
        for offset, storage in records:
            sha256.update(os.pread(fd, offset - at, at))  # torch.save's headers between the records
            for start, chunk in _host_chunks(storage):
                _pwrite_all(fd, chunk, offset + start)
                sha256.update(chunk)
            at = offset + storage.nbytes()
        sha256.update(os.pread(fd, size - at, at))  # the zip's central directory
        _pwrite_all(fd, b"\nDLRM-SHA256:" + sha256.hexdigest().encode() + b"\n", size)
        os.fsync(fd)


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _storages_in_save_order(state: Any) -> list[torch.UntypedStorage]:
    """The storages of `state`'s tensors in the order torch.save numbers its records data/0, data/1, ...:
    their first appearance while pickling (each storage once, as torch.serialization's persistent_id
    does)."""
    seen: dict[int, torch.UntypedStorage] = {}

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, torch.storage.TypedStorage):
                obj = obj._untyped_storage
            elif not torch.is_storage(obj):
                return None
            seen.setdefault(obj._cdata, obj)
            return ("storage", obj._cdata)

    with torch.serialization.skip_data():
        Pickler(io.BytesIO(), protocol=2).dump(state)  # torch.save's default protocol
    return list(seen.values())


def _record_offsets(path: Path, storages: list[torch.UntypedStorage]) -> list[int]:
    """The file offset of each storage's bytes in torch.save's zip `path` (record <archive>/data/<i>)."""
    with zipfile.ZipFile(path) as archive, open(path, "rb") as f:
        names = archive.namelist()
        prefix = names[0].split("/", 1)[0]
        offsets = []
        for i, storage in enumerate(storages):
            info = archive.getinfo(f"{prefix}/data/{i}")
            if info.file_size != storage.nbytes():  # the order above is not torch.save's: a bug, not data
                raise RuntimeError(
                    f"{path}: record data/{i} holds {info.file_size} bytes, not {storage.nbytes()}"
                )
            f.seek(info.header_offset)
            name_length, extra_length = struct.unpack("<HH", f.read(30)[26:30])
            offsets.append(info.header_offset + 30 + name_length + extra_length)
    return offsets


def _host_chunks(storage: torch.UntypedStorage) -> Iterator[tuple[int, Any]]:
    """(byte offset, host buffer) of `storage`'s bytes, staging.CHUNK_BYTES at a time: views of a host
    storage's own memory; a device storage's bytes copied into one reused host buffer (pinned on CUDA), on
    a side stream."""
    chunk = staging.CHUNK_BYTES
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    total = flat.numel()
    if flat.device.type == "cpu":
        for start in range(0, total, chunk):
            yield start, flat[start : start + chunk].numpy()
        return
    size = min(chunk, total)
    buffer = torch.empty(size, dtype=torch.uint8, pin_memory=flat.device.type == "cuda")
    side = None
    if flat.device.type == "cuda":  # after the work already queued on the device (the step that wrote it)
        side = torch.cuda.Stream(flat.device)
        side.wait_stream(torch.cuda.current_stream(flat.device))
    for start in range(0, total, chunk):
        n = min(chunk, total - start)
        if side is not None:
            with torch.cuda.stream(side):
                buffer[:n].copy_(flat[start : start + n], non_blocking=True)
            side.synchronize()
        else:
            buffer[:n].copy_(flat[start : start + n])
        yield start, buffer[:n].numpy()


def publish_link(path: Path, link: Path) -> None:
    """Make `link` name the same file as `path` (a hard link: no bytes written), atomically: an earlier
    `link` is replaced whole. A copy where the file system has no hard links."""
    with replacing(link) as tmp:
        try:
            os.link(path, tmp)
        except OSError:  # a file system without hard links (or across devices): the bytes once more
            shutil.copyfile(path, tmp)
    fsync_directory(link.parent)


def start_save(path: Path, state: dict[str, Any], links: Sequence[Path] = (), background: bool = True):
    """Write `state` as `save_checkpoint(path, links, **state)`; with `background`, from a snapshot of its
    tensors in a thread, when their device has room for the snapshot (`snapshot`). Returns the
    PendingSave, or None when the checkpoint was written at once. Raises as `save_checkpoint` (written at
    once)."""
    copied = snapshot(state) if background else None
    if copied is None:
        save_checkpoint(path, links, **state)
        return None
    return PendingSave(lambda: save_checkpoint(path, links, **copied), announce(state, path, links))


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
