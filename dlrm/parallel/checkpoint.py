"""Sharded checkpoints of a many-rank run with torch.distributed.checkpoint (DCP), in the tables' logical
layout, so that a checkpoint written by N ranks loads on M ranks (any plan) and in one process.

A checkpoint is a directory (e.g. runs/<run>/checkpoints/last/): DCP's files (`__<rank>_<i>.distcp`, one
per piece of at most dlrm.staging.CHUNK_BYTES, plus .metadata) and meta.json (config, table_rows, step, best
evaluation, early-stopping count, loader position, world size and plan of the writer, and "sha256": the
hash of each of DCP's files, checked before a load), written by rank 0. The DCP keys, flat:

    model/<name>        every entry of the one-process model's state_dict, by the same names: the
                        dense part (replicated: DCP writes it once) and the tables
                        `sparse_arch.embeddings.<f>.weight` [rows_f, D] in the tables' dtype
                        (`model.table_dtype`: fp32, or bf16, 2 bytes a value), each a ShardedTensor
                        whose shards are the plan's row ranges, written by the ranks that hold them
                        in pieces of at most CHUNK_BYTES of rows, each its own file, so a rank stages
                        one piece at a time (a replicated table: a plain tensor, written once like the
                        dense part); with
                        model.first_order, `first_order.tables.embeddings.<f>.weight` [rows_f, 1] the same
                        way (sharded on the same plan)
    optim/<name>        Adagrad's accumulator ("sum") of each parameter, same names and layout (tables
                        sharded, for both sparse kernels; fp32); row-wise Adagrad's one value a row,
                        [rows_f] fp32, sharded by the same row ranges; nothing for SGD
    optim/table_rounding_count  the bf16 tables' stochastic-rounding count ([1] int64, the same on every
                        rank: written once; dlrm.optim.RunOptimizer)

Each rank hashes its files as it writes them (`_HashingFileSystem`); rank 0 gathers the hashes into
meta.json. `save_sharded` can write in the background: from a snapshot of the state on each rank's device
(when every rank has room for it), in a thread whose collectives go through a gloo group of their own.

Loading on M ranks builds the same keys as ShardedTensors of the new plan, views of the new shards, and
DCP reads each shard's rows from whichever files hold them (resharding). One process (`load_full`, used by
`--resume` and `python -m dlrm.evaluate`) reads every key whole into a one-process checkpoint dict.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import math
import os
import shutil
import warnings
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

from dlrm import staging
from dlrm.atomic import DiskFull, disk_full
from dlrm.config import from_dict
from dlrm.model.tables import index_vocabularies
from dlrm.optim import ROUNDING_COUNT_KEY
from dlrm.parallel.faults import is_communication_error
from dlrm.parallel.group import Dist
from dlrm.parallel.planner import ShardingPlan
from dlrm.staging import PendingSave, announce, has_room

META = "meta.json"

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # ShardedTensor is deprecated in favour of DTensor, which cannot
    # express a table held whole by one rank of the mesh; TorchRec's checkpoints use it the same way.
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties


def table_key(f: int, prefix: str = "sparse_arch.") -> str:
    """The one-process state_dict name of table f of the table set under `prefix`."""
    return f"{prefix}embeddings.{f}.weight"


# (state_dict prefix, one-process checkpoint key of the fused optimizer state) of each table set: the
# embeddings, and a DLRM's first-order tables.
EMBEDDINGS = ("sparse_arch.", "embedding_optimizer_state")
FIRST_ORDER = ("first_order.tables.", "first_order_optimizer_state")


def _table_sets(model) -> list[tuple[str, Any, str]]:
    """(state_dict prefix, sharded tables, one-process checkpoint key of their fused optimizer state) of
    each table set of `model`: the embeddings, and a DLRM's first-order tables if it has them."""
    sets = [(EMBEDDINGS[0], model.sparse_arch, EMBEDDINGS[1])]
    if getattr(model, "first_order", None) is not None:
        sets.append((FIRST_ORDER[0], model.first_order.tables, FIRST_ORDER[1]))
    return sets


def _is_dense(name: str, prefixes: list[str]) -> bool:
    """Whether state_dict entry `name` is not a table (the vocabularies count as dense: every rank
    holds them whole)."""
    return not any(name.startswith(p) and not name.startswith(f"{p}vocab_") for p in prefixes)


def _sharded(
    plan: ShardingPlan,
    rank: int,
    f: int,
    local: Tensor | None,
    tail: tuple[int, ...],
    dtype: torch.dtype,
    chunk_bytes: int | None = None,
) -> ShardedTensor:
    """Table f's [rows_f, *tail] `dtype` tensor (every rank's the same, holding rows of f or not; tail (D,)
    for the weights and Adagrad's state, () for row-wise Adagrad's) as a ShardedTensor over the plan's
    shards; `local`: this rank's rows. With `chunk_bytes` each shard is cut into pieces of at most that many
    bytes of rows (every rank cuts every shard the same way), which DCP writes one by one: the same logical
    tensor."""
    device = "cpu" if local is None else str(local.device)
    row_bytes = math.prod(tail) * torch.empty((), dtype=dtype).element_size()
    step = None if chunk_bytes is None else max(1, chunk_bytes // row_bytes)
    pieces = [  # (shard, first row within it, rows)
        (s, start, min(step or s.rows, s.rows - start))
        for s in plan.shards
        if s.table == f
        for start in range(0, s.rows, step or s.rows)
    ]
    zeros = [0] * len(tail)  # every piece holds whole rows
    metas = [
        ShardMetadata([s.row_start + start, *zeros], [rows, *tail], f"rank:{s.rank}/{device}")
        for s, start, rows in pieces
    ]
    global_md = ShardedTensorMetadata(
        metas, torch.Size([plan.table_rows[f], *tail]), TensorProperties(dtype=dtype)
    )
    mine = [
        Shard(local.narrow(0, start, rows), m)
        for (s, start, rows), m in zip(pieces, metas, strict=True)
        if s.rank == rank
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ShardedTensor._init_from_local_shards_and_global_metadata(mine, global_md)


def _table_views(tensor: Tensor, arch) -> dict[int, Tensor]:
    """Rows of each local shard of `tensor` ([local rows, ...], laid out as arch.weights), by table (the
    padding row that a rank with bags and row shards holds last is no table's)."""
    rows = [s.rows for s in arch.local_shards]
    views = tensor.narrow(0, 0, sum(rows)).split(rows)
    return {s.table: view for s, view in zip(arch.local_shards, views, strict=True)}


def _embedding_state(arch, optimizer: torch.optim.Optimizer) -> Tensor | None:
    """The Adagrad accumulators of the sharded tables `arch` (either kernel), laid out as `arch.weights`:
    [local rows, D], row-wise Adagrad's [local rows]; None for SGD."""
    if arch.kernel == "triton":  # by the optimizer, not the state's size: a rank may hold no rows
        return None if arch.optimizer is None or arch.optimizer[0] == "sgd" else arch.optimizer_state
    return optimizer.state.get(arch.weights, {}).get("sum")


def _state_dict(
    model, optimizer: torch.optim.Optimizer, dist_: Dist, chunk_bytes: int | None = None
) -> dict[str, Any]:
    """The flat DCP state of this rank (module docstring): views of the live tensors, so loading fills
    them in place; `chunk_bytes`: the sharded tables cut into pieces of at most that size (`_sharded`)."""
    sets = _table_sets(model)
    state: dict[str, Any] = {}
    for name, value in model.state_dict(keep_vars=False).items():
        if _is_dense(name, [prefix for prefix, _, _ in sets]):
            state[f"model/{name}"] = value
    names = {p: n for n, p in model.named_parameters()}
    for p in model.dense_parameters():
        if "sum" in optimizer.state.get(p, {}):
            state[f"optim/{names[p]}"] = optimizer.state[p]["sum"]
    for prefix, arch, _ in sets:
        plan, weights = arch.plan, arch.weights.detach()
        tables = _table_views(weights, arch)
        sums = _embedding_state(arch, optimizer)
        sum_views = _table_views(sums, arch) if sums is not None else {}
        for f in range(len(plan.table_rows)):
            if f in plan.replicated:
                continue
            key = table_key(f, prefix)
            state[f"model/{key}"] = _sharded(
                plan, dist_.rank, f, tables.get(f), weights.shape[1:], weights.dtype, chunk_bytes
            )
            if sums is not None:
                state[f"optim/{key}"] = _sharded(
                    plan, dist_.rank, f, sum_views.get(f), sums.shape[1:], torch.float32, chunk_bytes
                )
        for key, view in _replicated_views(arch, optimizer, prefix).items():
            state[key] = view  # whole on every rank, like the dense part: DCP writes it once
    count = _rounding_count(optimizer)
    if count is not None:  # the same on every rank, like the dense part: DCP writes it once
        state[f"optim/{ROUNDING_COUNT_KEY}"] = count
    return state


def _rounding_count(optimizer) -> Tensor | None:
    """The live [1] int64 stochastic-rounding count of a dlrm.optim.RunOptimizer (None for another
    optimizer)."""
    rounding = getattr(optimizer, "table_rounding", None)
    return None if rounding is None else rounding[1:]


def _replicated_views(arch, optimizer: torch.optim.Optimizer, prefix: str) -> dict[str, Tensor]:
    """{DCP key: view} of the replicated tables of `arch` (weights, and Adagrad's sums if any), by the
    one-process table names."""
    if arch.replicated_weights is None:
        return {}
    rows = [arch.table_rows[f] for f in arch.replicated]
    views = {}
    sums = optimizer.state.get(arch.replicated_weights, {}).get("sum")
    for kind, tensor in (("model", arch.replicated_weights.detach()), ("optim", sums)):
        if tensor is not None:
            for f, view in zip(arch.replicated, tensor.split(rows), strict=True):
                views[f"{kind}/{table_key(f, prefix)}"] = view
    return views


class CheckpointError(OSError):
    """A checkpoint cannot be written: its writing failed on a rank (a full disk, quota or read-only file
    system, an I/O error), or the disk has no room for the checkpoints train.checkpoint_policy keeps
    (found before the first step). Raised on every rank at once, naming the checkpoint (directory); the
    earlier checkpoint is unchanged."""


class CheckpointDiskFull(CheckpointError, DiskFull):
    """The disk filled (or a quota, or it is read-only) while a sharded checkpoint was written, on any
    rank: raised on every rank at once, naming the checkpoint directory; the earlier one is unchanged."""


_save_group = None  # the gloo group of background saves (created by every rank at its first one)


def save_sharded(
    path: Path,
    model,
    optimizer: torch.optim.Optimizer,
    dist_: Dist,
    meta: dict,
    links: Sequence[Path] = (),
    background: bool = False,
) -> PendingSave | None:
    """Write the checkpoint directory `path` from every rank (a collective: all ranks call it), each rank's
    tables in pieces of at most CHUNK_BYTES (one file each: a rank stages one piece on the host at a time);
    then each of `links` (e.g. checkpoints/best) becomes a directory of hard links to its files.

    Written under a temporary name and renamed into place by rank 0 once complete, so a crash never
    leaves a partial checkpoint under the final name. The directory must be on a filesystem every rank
    sees (shared across hosts). With `background`, when every rank's device has room for a copy of its
    state, the copy is written by a thread (the returned PendingSave: its `wait()` raises what the writing
    raised, on every rank alike); else the checkpoint is written now and None returned.

    Raises:
        CheckpointError (CheckpointDiskFull for a full disk): on every rank, when a rank's write failed (DCP
            gathers each rank's failure and raises it on all) or rank 0's meta.json or rename did; the
            temporary directory is removed.
    """
    state = _state_dict(model, optimizer, dist_, chunk_bytes=staging.CHUNK_BYTES)
    plan = model.sparse_arch.plan
    if background and _all_ranks(_state_fits(state)):
        global _save_group
        if _save_group is None:  # its own collectives, beside the training's on the default group
            timeout = timedelta(seconds=max(dist_.timeout_s, 1800.0))
            _save_group = dist.new_group(backend="gloo", timeout=timeout)
        copied, group = _snapshot(state), _save_group
        devices = {t.device for t in _local_tensors(copied) if t.device.type == "cuda"}

        def write() -> None:
            # The thread's own CUDA device and stream (both are per thread): the copies to the host run
            # beside the training's kernels, and DCP's waits are on them.
            with contextlib.ExitStack() as on:
                for device in devices:
                    on.enter_context(torch.cuda.device(device))
                    on.enter_context(torch.cuda.stream(torch.cuda.Stream(device)))
                _save(path, copied, plan, dist_, meta, links, group)

        return PendingSave(write, announce(meta, path, links))
    _save(path, state, plan, dist_, meta, links, None)
    return None


def _save(path: Path, state: dict, plan: ShardingPlan, dist_: Dist, meta: dict, links, group) -> None:
    """`save_sharded`'s writing of `state` on every rank, its collectives on `group` (None: the default)."""
    tmp = path.with_name(f".{path.name}.tmp")
    if dist_.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier(group=group)
    failure = None
    try:
        writer = dcp.FileSystemWriter(tmp, single_file_per_rank=False)
        writer.fs = _HashingFileSystem()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=writer, process_group=group)
        hashes = [None] * dist_.world_size if dist_.is_main else None
        dist.gather_object(writer.fs.sha256, hashes, dst=0, group=group)
        if dist_.is_main:
            _publish(tmp, path, plan, dist_, meta, {k: v for h in hashes for k, v in h.items()})
            for link in links:
                _link_directory(path, link)
    except (Exception, CheckpointException) as err:  # (CheckpointException is a BaseException)
        if dist_.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        failure = _write_failure(err, path)
        if failure is None:
            raise
    # Rank 0's outcome to every rank (its own steps after DCP's can fail alone), in place of a barrier.
    outcome = [None if failure is None else (type(failure).__name__, failure.errno, failure.strerror)]
    dist.broadcast_object_list(outcome, group=group)
    if outcome[0] is not None:
        kind, code, reason = outcome[0]
        raise (CheckpointDiskFull if kind == "CheckpointDiskFull" else CheckpointError)(
            code, reason, str(path)
        )


def _publish(tmp: Path, path: Path, plan: ShardingPlan, dist_: Dist, meta: dict, hashes: dict) -> None:
    """Rank 0, once DCP wrote `tmp`: its meta.json (with each file's sha256: `hashes`, taken by the ranks
    as they wrote; any other file read here), then `tmp` renamed to `path` (an earlier `path` moved aside
    first and removed last)."""
    sha256 = {f.name: hashes.get(f.name) or file_sha256(f) for f in sorted(tmp.iterdir()) if f.is_file()}
    meta = {**meta, "world_size": dist_.world_size, "plan": plan.to_dict(), "sha256": sha256}
    (tmp / META).write_text(json.dumps(meta, indent=2))
    old = path.with_name(f".{path.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def _link_directory(path: Path, link: Path) -> None:
    """Rank 0: make checkpoint directory `link` hold the files of `path` (hard links: no bytes written;
    copies where the file system has none), built as .<link>.tmp and renamed into place (an earlier
    `link` moved aside first and removed last)."""
    tmp, old = link.with_name(f".{link.name}.tmp"), link.with_name(f".{link.name}.old")
    for stale in (tmp, old):
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()
    for f in path.iterdir():
        try:
            os.link(f, tmp / f.name)
        except OSError:  # a file system without hard links: the bytes once more
            shutil.copyfile(f, tmp / f.name)
    if link.exists():
        os.replace(link, old)
    os.replace(tmp, link)
    shutil.rmtree(old, ignore_errors=True)


def _write_failure(err: BaseException, path: Path) -> CheckpointError | None:
    """The CheckpointError naming `path` of a failed write (CheckpointDiskFull for a full disk: the first
    rank's failure that is one, with the space left), also out of DCP's CheckpointException; None when no
    rank's failure is an OSError (a bug, re-raised)."""
    errors = [exc for exc, _ in err.failures.values()] if isinstance(err, CheckpointException) else [err]
    full = next(filter(None, (disk_full(exc, path) for exc in errors)), None)
    if full is not None:
        return CheckpointDiskFull(full.errno, full.strerror, str(path))
    for exc in errors:
        while exc is not None and not isinstance(exc, OSError):
            exc = exc.__cause__ or exc.__context__
        if exc is not None:
            return CheckpointError(exc.errno or errno.EIO, exc.strerror or str(exc), str(path))
    return None


class _HashingFileSystem(FileSystem):
    """DCP's file system, each file's sha256 taken as it is written (`sha256`: {file name: hex}), so no
    file is read back to hash it. The temporary .metadata.tmp (renamed to .metadata) is left out."""

    def __init__(self):
        super().__init__()
        self.sha256: dict[str, str] = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode: str) -> Iterator[io.IOBase]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashing = _HashingStream(stream)
            yield hashing
        if not Path(path).name.endswith(".tmp"):
            self.sha256[Path(path).name] = hashing.sha256.hexdigest()


class _HashingStream:
    """A binary stream that hashes what is written through it."""

    def __init__(self, stream):
        self.stream, self.sha256 = stream, hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        return self.stream.write(data)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def _local_tensors(state: dict) -> Iterator[Tensor]:
    """This rank's tensors of a DCP state: its local shards, and the plain (replicated) tensors."""
    for value in state.values():
        if isinstance(value, ShardedTensor):
            yield from (shard.tensor for shard in value.local_shards())
        elif isinstance(value, Tensor):
            yield value


def _state_fits(state: dict) -> bool:
    """Whether each device of this rank's state has room for a copy of it (dlrm.checkpoint.has_room)."""
    sizes: dict[torch.device, int] = {}
    for t in _local_tensors(state):
        sizes[t.device] = sizes.get(t.device, 0) + t.numel() * t.element_size()
    return all(has_room(device, nbytes) for device, nbytes in sizes.items())


def _all_ranks(flag: bool) -> bool:
    """Whether `flag` holds on every rank (a collective)."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return bool(tensor.item())


def _snapshot(state: dict) -> dict:
    """A copy of this rank's DCP state that training cannot change: each local piece and plain tensor
    cloned on its device, the ShardedTensors rebuilt around the clones with the same metadata."""
    copied: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, ShardedTensor):
            shards = [Shard(s.tensor.clone(), s.metadata) for s in value.local_shards()]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                copied[key] = ShardedTensor._init_from_local_shards_and_global_metadata(
                    shards, value.metadata()
                )
        else:
            copied[key] = value.clone() if isinstance(value, Tensor) else value
    devices = {t.device for t in _local_tensors(copied) if t.device.type == "cuda"}
    for device in devices:  # the copies are complete before the writing thread reads them
        torch.cuda.current_stream(device).synchronize()
    return copied


def checkpoint_bytes(model, optimizer: torch.optim.Optimizer, dist_: Dist) -> int:
    """Bytes of tensors this rank writes into a sharded checkpoint: its pieces of the sharded tables and
    their optimizer state, and on rank 0 the dense part and the replicated tables (written once)."""
    state = _state_dict(model, optimizer, dist_)
    total = 0
    for value in state.values():
        if isinstance(value, ShardedTensor):
            total += sum(s.tensor.numel() * s.tensor.element_size() for s in value.local_shards())
        elif isinstance(value, Tensor) and dist_.is_main:
            total += value.numel() * value.element_size()
    return total


def read_meta(path: Path) -> dict:
    """meta.json of checkpoint directory `path`.

    Raises:
        ValueError: `path` is not a sharded checkpoint directory.
    """
    if not (path / META).is_file() or not (path / ".metadata").is_file():
        raise ValueError(f"{path}: not a sharded DLRM checkpoint (no {META} or .metadata)")
    try:
        meta = json.loads((path / META).read_text())
        meta["config"] = from_dict(meta["config"]).to_dict()  # JSON lists back to the config's tuples
    except (ValueError, KeyError, TypeError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"{path / META}: not the meta.json of a sharded DLRM checkpoint: {reason}") from None
    return meta


def file_sha256(path: Path) -> str:
    """The sha256 of file `path`'s bytes, hex."""
    sha256 = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            sha256.update(chunk)
    return sha256.hexdigest()


def verify_files(path: Path, meta: dict, part: tuple[int, int] = (0, 1)) -> None:
    """Check DCP's files of checkpoint directory `path` against meta.json's "sha256" (none there: a
    checkpoint written before they carried one, not checked). Reads every file whole; `part` (k, n): only
    files k, k + n, k + 2n, ... of them, one rank's share of a check that n ranks split.

    Raises:
        ValueError: a file is missing or its bytes changed since it was written, naming it.
    """
    k, n = part
    for name, expected in list(meta.get("sha256", {}).items())[k::n]:
        file = path / name
        if not file.is_file():
            raise ValueError(f"{file}: missing from the sharded checkpoint {path}")
        if file_sha256(file) != expected:
            raise ValueError(
                f"{file}: checksum mismatch: the file changed after it was written (a bad disk, copy or "
                "edit); the checkpoint's weights cannot be trusted: use another checkpoint or retrain"
            )


def load_sharded(path: Path, model, optimizer: torch.optim.Optimizer, dist_: Dist) -> dict:
    """Load checkpoint directory `path` (written by any number of ranks) into this rank's model and
    optimizer, resharding the tables to this run's plan; returns meta.json. A collective.

    Raises:
        ValueError: on every rank at once, with the same message (the lowest rank's that found one): not a
            sharded checkpoint, a file of it changed since it was written (`verify_files`, the files split
            over the ranks), a model of other table sizes, or a file DCP cannot read.
    """
    meta = _on_every_rank(lambda: _checked_meta(path, model, dist_))
    state = _state_dict(model, optimizer, dist_)
    written = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    if f"optim/{ROUNDING_COUNT_KEY}" not in written:  # a checkpoint of a version without it: count 0
        state.pop(f"optim/{ROUNDING_COUNT_KEY}", None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, checkpoint_id=path)
    except CheckpointException as err:  # (a BaseException) gathered from every rank, raised on all
        rank, (exc, _) = min(err.failures.items(), key=lambda item: item[0])
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        if is_communication_error(err):  # a peer gone: dlrm.parallel.fail names it
            raise RuntimeError(f"rank {rank}: {type(exc).__name__}: {first}") from None
        raise ValueError(f"{path}: not a readable sharded checkpoint: rank {rank}: {first}") from None
    # Plain tensors load in place; copy anyway where DCP handed back a new tensor.
    live = {f"model/{name}": value for name, value in model.state_dict().items()}
    for prefix, arch, _ in _table_sets(model):
        live.update(_replicated_views(arch, optimizer, prefix))
    if _rounding_count(optimizer) is not None:
        live[f"optim/{ROUNDING_COUNT_KEY}"] = _rounding_count(optimizer)
    for key, value in state.items():
        if key in live and live[key].data_ptr() != value.data_ptr():
            live[key].copy_(value)
    if model.sparse_arch.hashing == "vocab":  # vocab_<f> written in place: their lookup follows
        index_vocabularies(model.sparse_arch)
    set_steps(optimizer, meta["step"])
    return meta


def _checked_meta(path: Path, model, dist_: Dist) -> dict:
    """meta.json of checkpoint `path`, its files checked (this rank's share) and its table sizes those of
    `model`. Raises ValueError as `load_sharded`."""
    meta = read_meta(path)
    verify_files(path, meta, (dist_.rank, dist_.world_size))
    if meta["table_rows"] != model.sparse_arch.table_rows:
        raise ValueError(
            f"{path}: tables of {meta['table_rows']} rows, this model has {model.sparse_arch.table_rows}"
        )
    return meta


def _on_every_rank(check: Callable[[], dict]) -> dict:
    """`check()` on every rank (a collective): its result, or, when it raised ValueError on any rank, that
    ValueError on every rank (the lowest rank's message), so that the job ends with one line."""
    try:
        result, problem = check(), None
    except ValueError as err:
        result, problem = None, str(err)
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p is not None), None)
    if first is not None:
        raise ValueError(first)
    return result


def set_steps(optimizer: torch.optim.Optimizer, step: int) -> None:
    """Set torch Adagrad's per-parameter step counters (not saved: they equal the run's step)."""
    for state in optimizer.state.values():
        if "step" in state and isinstance(state["step"], Tensor):
            state["step"].fill_(step)


def load_full(path: Path) -> dict[str, Any]:
    """Read checkpoint directory `path` whole in this process (no process group): a dict like a
    one-process checkpoint (dlrm.checkpoint): "model" (one-process state_dict names; the tables in the
    dtype they were written in), "optimizer" None, "optimizer_by_name" ({parameter name: Adagrad sum}),
    "embedding_optimizer_state" (the tables' sums concatenated, as the one-process "triton" kernel keeps
    them: [rows, D], row-wise Adagrad's [rows]; None for SGD), the same of the first-order tables as
    "first_order_optimizer_state" when there are some, the stochastic rounding's count as
    "table_rounding_count" where written, and meta.json's fields.

    Raises:
        ValueError: not a sharded checkpoint, or a file of it changed since it was written (`verify_files`).
    """
    meta = read_meta(path)
    verify_files(path, meta)
    reader = dcp.FileSystemReader(path)
    state: dict[str, Any] = {}
    for key, md in reader.read_metadata().state_dict_metadata.items():
        if hasattr(md, "size"):
            state[key] = torch.empty(md.size, dtype=md.properties.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=reader, no_dist=True)
    model = {k.removeprefix("model/"): v for k, v in state.items() if k.startswith("model/")}
    sums = {k.removeprefix("optim/"): v for k, v in state.items() if k.startswith("optim/")}
    fused = {ROUNDING_COUNT_KEY: sums.pop(ROUNDING_COUNT_KEY, None)}
    for prefix, key in (EMBEDDINGS, FIRST_ORDER):
        tables = [table_key(f, prefix) for f in range(len(meta["table_rows"]))]
        if all(k in model for k in tables):  # the first-order tables: only where the model has them
            fused[key] = torch.cat([sums[k] for k in tables]) if all(k in sums for k in tables) else None
    return {**meta, "model": model, "optimizer": None, "optimizer_by_name": sums, **fused}


def load_optimizer_by_name(
    model, optimizer: torch.optim.Optimizer, sums: dict[str, Tensor], step: int
) -> None:
    """One process: set Adagrad's accumulators from {parameter name: sum} (load_full's
    "optimizer_by_name") and its step counters to `step`."""
    for name, p in model.named_parameters():
        if name in sums and "sum" in optimizer.state.get(p, {}):
            optimizer.state[p]["sum"].copy_(sums[name])
    set_steps(optimizer, step)


def load_full_into_sharded(checkpoint: dict[str, Any], model, optimizer: torch.optim.Optimizer) -> None:
    """Load a one-process checkpoint dict (dlrm.checkpoint.load_checkpoint of a .pt, or load_full) into
    this rank's sharded model: the dense part whole, each local shard its rows of the full tables.

    Raises:
        ValueError: tables of other sizes.
    """
    if list(checkpoint["table_rows"]) != model.sparse_arch.table_rows:
        raise ValueError(
            f"checkpoint tables of {checkpoint['table_rows']} rows, this model has "
            f"{model.sparse_arch.table_rows}"
        )
    full = checkpoint["model"]
    sets = _table_sets(model)
    model.load_state_dict(
        {k: v for k, v in full.items() if _is_dense(k, [prefix for prefix, _, _ in sets])}, strict=False
    )
    sums = _optimizer_sums(checkpoint, model)
    with torch.no_grad():
        for prefix, arch, _ in sets:
            local_sums = _embedding_state(arch, optimizer)
            pairs = [(arch.weights, full)]  # (local rows, the full tables they come from)
            if local_sums is not None and sums:
                pairs.append((local_sums, sums))
            for tensor, source in pairs:
                views = _table_views(tensor, arch)
                for shard in arch.local_shards:
                    rows = slice(shard.row_start, shard.row_start + shard.rows)
                    views[shard.table].copy_(source[table_key(shard.table, prefix)][rows])
            for key, view in _replicated_views(arch, optimizer, prefix).items():
                kind, name = key.split("/", 1)
                source = full if kind == "model" else sums
                if name in source:
                    view.copy_(source[name])
    names = dict(model.named_parameters())
    for name in model_dense_names(model):
        if name in sums and "sum" in optimizer.state.get(names[name], {}):
            optimizer.state[names[name]]["sum"].copy_(sums[name])
    count = _rounding_count(optimizer)
    if count is not None and checkpoint.get(ROUNDING_COUNT_KEY) is not None:
        count.copy_(checkpoint[ROUNDING_COUNT_KEY].reshape(1))
    set_steps(optimizer, checkpoint["step"])


def model_dense_names(model) -> list[str]:
    ids = {id(p) for p in model.dense_parameters()}
    return [n for n, p in model.named_parameters() if id(p) in ids]


def _optimizer_sums(checkpoint: dict[str, Any], model) -> dict[str, Tensor]:
    """{parameter name: Adagrad sum} of a one-process checkpoint dict (a .pt or load_full's)."""
    if checkpoint.get("optimizer_by_name") is not None:
        return checkpoint["optimizer_by_name"]
    sums: dict[str, Tensor] = {}
    optimizer_state = checkpoint.get("optimizer") or {}
    if optimizer_state.get("state"):
        # A .pt of one process: torch's optimizer state_dict numbers parameters in group order, dense
        # parameters first (dlrm.optim.RunOptimizer), then the "torch" kernel's tables, table set after
        # table set.
        tables = range(len(checkpoint["table_rows"]))
        order = [*model_dense_names(model)]
        order += [table_key(f, prefix) for prefix, _, _ in _table_sets(model) for f in tables]
        for index, value in optimizer_state["state"].items():
            if "sum" in value and index < len(order):
                sums[order[index]] = value["sum"]
    for prefix, _, key in _table_sets(model):
        state = checkpoint.get(key)
        if state is not None and state.numel():
            for f, part in enumerate(state.split(list(checkpoint["table_rows"]))):
                sums[table_key(f, prefix)] = part
    return sums
