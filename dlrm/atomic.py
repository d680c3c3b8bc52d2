"""Files written whole or not at all: under a temporary name beside the target, renamed over it when
complete, removed when the writing fails, so neither name is ever left half-written.

A write that fails for want of space (ENOSPC, EDQUOT) or on a read-only file system (EROFS), however the
writer wrapped the OSError (torch.save raises a RuntimeError after it), becomes `DiskFull`: one line
naming the file and the space left, which the CLIs print with exit status 2 (dlrm.errors)."""

import errno
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


class DiskFull(OSError):
    """Writing `filename` failed: no space left, quota exceeded or read-only file system; the message
    says how much space is free there."""


@contextmanager
def replacing(path: Path, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path in `path`'s directory (the same filesystem, so the rename is atomic) for the
    block to write; rename it over `path` when the block completes, remove it and re-raise when the block
    raises or is interrupted. `suffix` ends the temporary name, for writers that check it (torch.export
    and AOTInductor want ".pt2"). Creates `path`'s directory (removed again, where empty, when the block
    raises).

    Raises:
        DiskFull: the block (or the rename) failed for want of space or on a read-only file system.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}{suffix}")
    created = [p for p in path.parents if not p.exists()]  # innermost first
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield tmp
        os.replace(tmp, path)
    except BaseException as err:
        with suppress(OSError):  # (no temporary, or no directory for it)
            tmp.unlink(missing_ok=True)
        for directory in created:  # nothing left of the write: the directories made for it go too
            with suppress(OSError):  # (not made, or no longer empty)
                directory.rmdir()
        full = disk_full(err, path)
        if full is not None:
            raise full from None
        raise


def check_output_file(path: Path, option: str, inputs: Sequence[Path] = ()) -> None:
    """Check, before any work, that `replacing(path)` can write the file a command's `option` names and
    takes nothing but an earlier file of that name: `path` is not a directory, nor under a file, nor one
    of the command's `inputs` (nor an existing file inside an input directory).

    Raises:
        ValueError: one line naming `option`, `path` and what to give instead.
    """
    resolved = path.resolve()
    if path.is_dir():
        raise ValueError(f"{option} {path}: is a directory; give the path of a file to write")
    blocking = next((p for p in resolved.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ValueError(f"{option} {path}: {blocking} is not a directory; give the path of a file to write")
    for given in inputs:
        source = Path(given).resolve()
        if resolved == source or (path.exists() and source in resolved.parents):
            what = "is" if resolved == source else "is a file of"
            raise ValueError(f"{option} {path} {what} the input {given}; give another path")


def process_alive(pid: int) -> bool:
    """Whether a process `pid` exists (this one included): whether a temporary named for it may still be
    being written."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, owned by another user
        return True
    return True


def write_text(path: Path, text: str) -> None:
    """`text` into `path`, whole or not at all (`replacing`). Raises DiskFull as `replacing`."""
    with replacing(path) as tmp:
        tmp.write_text(text)


def disk_full(err: BaseException, path: Path | None) -> DiskFull | None:
    """A DiskFull naming `path` (None: the OSError's own file) when `err`, or an exception it was raised
    from or during, is an OSError ENOSPC / EDQUOT / EROFS; None otherwise."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, DiskFull):
            return err
        if isinstance(err, OSError) and err.errno in FULL_ERRNOS:
            path = path or Path(err.filename or ".")
            return DiskFull(
                err.errno, f"{err.strerror or os.strerror(err.errno)} ({free_space(path)})", str(path)
            )
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
    return None


def free_space(path: Path) -> str:
    """ "<n> MiB free" on the file system that holds `path` (its nearest existing directory)."""
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
        return "free space unknown"
    return f"{free / 2**20:,.1f} MiB free on {existing if existing.is_dir() else existing.parent}"
