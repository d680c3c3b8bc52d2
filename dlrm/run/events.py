"""The run's TensorBoard writer: torch's SummaryWriter (add_scalar, add_text, purge_step as ever), whose
event file takes each event as one whole record, written in the calling thread.

A write that fails cuts the file back to its last whole record (or removes a file that had none), so
`tensorboard --logdir` reads every event before it, and raises with the event file's name: for want of
space, a quota or a read-only file system, dlrm.atomic's DiskFull (the CLIs' one line with the space
left, exit 2). tensorboard's own EventFileWriter writes from a thread of its own: there a full disk prints
that thread's traceback, leaves a partial record, and reaches the loop later as an OSError without a file.
"""

import itertools
import os
import socket
import time
from contextlib import suppress
from pathlib import Path

from tensorboard.compat.proto.event_pb2 import Event, SessionLog, SourceMetadata
from tensorboard.summary.writer.record_writer import RecordWriter
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.writer import FileWriter

from dlrm.atomic import disk_full

_SERIAL = itertools.count()  # the file name's last field, as tensorboard's: two writers of one process


class EventWriter(SummaryWriter):
    """SummaryWriter(log_dir, purge_step=...) writing through `EventFile`. Its add_* and flush raise
    DiskFull (an OSError naming the event file) when the disk is full, quota exceeded or read-only, and
    an OSError naming the file for any other failed write."""

    def _get_file_writer(self) -> FileWriter:
        # SummaryWriter makes its file writer here, at construction and again after close; this is its
        # code with our FileWriter.
        if self.all_writers is None or self.file_writer is None:
            self.file_writer = _FileWriter(self.log_dir, self.filename_suffix)
            self.all_writers = {self.log_dir: self.file_writer}
            if self.purge_step is not None:  # TensorBoard drops the earlier events from this step on
                self.file_writer.add_event(Event(step=self.purge_step, file_version="brain.Event:2"))
                start = SessionLog(status=SessionLog.START)
                self.file_writer.add_event(Event(step=self.purge_step, session_log=start))
                self.purge_step = None
        return self.file_writer


class _FileWriter(FileWriter):
    """torch's FileWriter (events and summaries stamped with step and wall time) on an `EventFile`."""

    def __init__(self, log_dir: str, filename_suffix: str = ""):
        # FileWriter.__init__ would only open tensorboard's threaded writer in place of this one.
        self.event_writer = EventFile(log_dir, filename_suffix)


class EventFile:
    """One event file in `log_dir`, named as tensorboard names them (events.out.tfevents.<unix time>.<host>
    .<pid>.<n><suffix>), opened with its file_version event; each `add_event` appends one whole TFRecord
    or, failing, leaves the file as it was and raises (DiskFull or an OSError naming the file), as every
    later call does."""

    def __init__(self, log_dir: str, filename_suffix: str = ""):
        self.log_dir = log_dir
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
        self.path = Path(log_dir) / f"{name}.{next(_SERIAL)}{filename_suffix}"
        self.size = 0  # bytes of whole records in the file
        self.failed: OSError | None = None
        self.fd: int | None = None
        self.fd = self._do(self._open)
        self.records = RecordWriter(self)  # frames each event and hands it to `write` in one call
        metadata = SourceMetadata(writer="tensorboard.summary.writer.event_file_writer")
        self.add_event(Event(wall_time=time.time(), file_version="brain.Event:2", source_metadata=metadata))

    def get_logdir(self) -> str:
        return self.log_dir

    def add_event(self, event: Event) -> None:
        """Append `event` as one record. Raises DiskFull / OSError (see the class)."""
        self.records.write(event.SerializeToString())

    def write(self, record: bytes) -> None:
        """Append `record` whole: os.write may write part of it (the disk fills), so it is called again
        for the rest; on failure the file is cut back to `size`."""
        self._do(self._append, record)
        self.size += len(record)

    def flush(self) -> None:
        """Nothing to do: each record is in the file (the OS's cache) once `add_event` returns."""
        if self.failed is not None:
            raise self.failed

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _open(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o644)

    def _append(self, record: bytes) -> None:
        view = memoryview(record)
        while view:
            view = view[os.write(self.fd, view) :]

    def _do(self, action, *args):
        """`action(*args)`; an OSError from it becomes DiskFull or an OSError naming the file, kept for
        every later call, with the file cut back to its whole records (removed when it has none)."""
        if self.failed is not None:
            raise self.failed
        try:
            return action(*args)
        except OSError as err:
            with suppress(OSError):  # (not opened, or gone)
                if self.size:
                    os.ftruncate(self.fd, self.size)
                else:
                    self.path.unlink(missing_ok=True)
            self.close()
            self.failed = disk_full(err, self.path) or OSError(err.errno, err.strerror, str(self.path))
            raise self.failed from None
