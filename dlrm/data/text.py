"""Raw Criteo text, plain or gzip, read as a stream of whole lines: blocks for parsing, and line counts.

A line ends at "\\n"; a last line without one counts too. Errors are `PreprocessError`s naming the file and
the 1-based number of the first line that cannot be read in full.
"""

import functools
import gzip
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np

_GZIP_MAGIC = b"\x1f\x8b"
_READ_SIZE = 1 << 20  # decompressed bytes per read


class PreprocessError(ValueError):
    """Bad input or arguments; the message is one line naming the file and line where there is one."""


class TextBlock(NamedTuple):
    """Consecutive whole lines of one input file."""

    path: Path
    first_line: int  # 1-based line number in `path` of the block's first line
    lines: int  # lines in `data` (a last line without "\n" counts)
    data: bytes


def is_gzip(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(len(_GZIP_MAGIC)) == _GZIP_MAGIC


class LineReader:
    """Reads one file (plain or gzip) in blocks of whole lines; a context manager.

    Raises (from `read` and `skip`):
        PreprocessError: the file cannot be opened or read, or its gzip stream is truncated or corrupt.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.next_line = 1  # 1-based number of the next line to hand out
        try:
            self._raw = path.open("rb")
        except OSError as e:
            raise PreprocessError(f"{path}: cannot open ({e.strerror})") from None
        self._text: BinaryIO = gzip.GzipFile(fileobj=self._raw) if is_gzip(path) else self._raw
        self._buffer = b""  # read but not yet handed out; holds no complete line at the end of the file
        self._eof = False

    def __enter__(self) -> "LineReader":
        return self

    def __exit__(self, *exc) -> None:
        self._raw.close()

    @property
    def compressed_position(self) -> int:
        """Bytes of the file read so far."""
        return self._raw.tell()

    def read(self, max_lines: int) -> TextBlock | None:
        """The next at most `max_lines` lines, or None at the end of the file."""
        parts, lines = self._take(max_lines, keep=True)
        if not lines:
            return None
        block = TextBlock(self.path, self.next_line, lines, b"".join(parts))
        self.next_line += lines
        return block

    def skip(self, lines: int) -> int:
        """Skip at most `lines` lines; returns how many were skipped (fewer at the end of the file)."""
        _, skipped = self._take(lines, keep=False)
        self.next_line += skipped
        return skipped

    def _take(self, max_lines: int, keep: bool) -> tuple[list[bytes], int]:
        parts: list[bytes] = []
        lines = 0
        while lines < max_lines:
            if not self._buffer and not self._fill():
                break
            newlines = self._buffer.count(b"\n")
            wanted = max_lines - lines
            if newlines >= wanted:
                cut = _position_of_newline(self._buffer, wanted) + 1
                chunk, self._buffer = self._buffer[:cut], self._buffer[cut:]
                lines += wanted
            elif newlines == 0 and self._eof:
                chunk, self._buffer = self._buffer, b""  # the last line, without "\n"
                lines += 1
            else:
                # Hand out the complete lines; a partial last line waits for the rest of it.
                cut = self._buffer.rfind(b"\n") + 1
                if cut == 0:
                    self._fill()
                    continue
                chunk, self._buffer = self._buffer[:cut], self._buffer[cut:]
                lines += newlines
            if keep:
                parts.append(chunk)
        return parts, lines

    def _fill(self) -> bool:
        """Append the next decompressed bytes to the buffer; False at the end of the file."""
        if self._eof:
            return False
        try:
            # read1 returns what was decompressed before a truncation; the next call raises.
            chunk = self._text.read1(_READ_SIZE)
        except (EOFError, OSError, zlib.error) as e:
            line = self.next_line + self._buffer.count(b"\n")
            raise PreprocessError(f"{self.path} line {line}: truncated or corrupt gzip data ({e})") from None
        if not chunk:
            self._eof = True
            return bool(self._buffer)
        self._buffer += chunk
        return True


def _position_of_newline(data: bytes, k: int) -> int:
    """Index of the `k`-th (1-based) "\\n" in `data`, which holds at least `k`."""
    if k <= 64:
        position = -1
        for _ in range(k):
            position = data.index(b"\n", position + 1)
        return position
    return int(np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)[k - 1])


def count_lines(path: Path, progress: Callable[[int], None] | None = None) -> int:
    """Lines in `path` (plain or gzip text); `progress(newlines)` is told the newlines counted so far.

    Raises:
        PreprocessError: the file cannot be read, is empty, or its gzip stream is truncated or corrupt.
    """
    newlines, last_byte = 0, b"\n"
    try:
        raw = path.open("rb")
    except OSError as e:
        raise PreprocessError(f"{path}: cannot open ({e.strerror})") from None
    with raw:
        text = gzip.GzipFile(fileobj=raw) if is_gzip(path) else raw
        try:
            while chunk := text.read1(_READ_SIZE):
                newlines += chunk.count(b"\n")
                last_byte = chunk[-1:]
                if progress is not None:
                    progress(newlines)
        except (EOFError, OSError, zlib.error) as e:
            raise PreprocessError(
                f"{path} line {newlines + 1}: truncated or corrupt gzip data ({e})"
            ) from None
    lines = newlines + (last_byte != b"\n")
    if lines == 0:
        raise PreprocessError(f"{path} line 1: file is empty")
    return lines


class LineCounter:
    """Counts the lines of the inputs, in order, on a background thread.

    While it runs, `partial()` gives the counts so far: those of the files done, then the lines counted
    so far in the current file, then zeros; every count only grows.
    """

    def __init__(self, inputs: list[Path]) -> None:
        self._inputs = inputs
        self._counts = [0] * len(inputs)
        self._error: PreprocessError | None = None
        self._thread = threading.Thread(target=self._run, name="preprocess-line-counter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for i, path in enumerate(self._inputs):
                self._counts[i] = count_lines(path, functools.partial(self._counts.__setitem__, i))
        except PreprocessError as e:
            self._error = e

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def partial(self) -> list[int]:
        """Lower bounds of the line counts (exact once `done`)."""
        return list(self._counts)

    def result(self) -> list[int]:
        """The line counts of all inputs, waiting for them.

        Raises:
            PreprocessError: an input is empty, unreadable, truncated or corrupt.
        """
        self._thread.join()
        if self._error is not None:
            raise self._error
        return list(self._counts)


class InputStream:
    """The lines of several input files one after the other, read in blocks that never span two files;
    a context manager.

    Raises (from `read` and `skip`):
        PreprocessError: an input is unreadable, empty, truncated or corrupt.
    """

    def __init__(self, inputs: list[Path]) -> None:
        self._inputs = inputs
        self._index = 0  # the file being read
        self._reader: LineReader | None = None
        self._bytes_before = 0  # sizes of the files read completely

    def __enter__(self) -> "InputStream":
        return self

    def __exit__(self, *exc) -> None:
        if self._reader is not None:
            self._reader.__exit__()

    @property
    def compressed_position(self) -> int:
        """Bytes of the input files read so far."""
        return self._bytes_before + (self._reader.compressed_position if self._reader else 0)

    def read(self, max_lines: int) -> TextBlock | None:
        """The next at most `max_lines` lines of the current file, or None after the last file."""
        while (reader := self._current()) is not None:
            if (block := reader.read(max_lines)) is not None:
                return block
            self._next_file()
        return None

    def skip(self, lines: int) -> int:
        """Skip `lines` lines across files; returns how many were skipped (fewer after the last file)."""
        skipped = 0
        while skipped < lines and (reader := self._current()) is not None:
            skipped += reader.skip(lines - skipped)
            if skipped < lines:
                self._next_file()
        return skipped

    def _current(self) -> LineReader | None:
        if self._reader is None and self._index < len(self._inputs):
            self._reader = LineReader(self._inputs[self._index])
        return self._reader

    def _next_file(self) -> None:
        reader = self._reader
        if reader.next_line == 1:
            raise PreprocessError(f"{reader.path} line 1: file is empty")
        reader.__exit__()
        self._bytes_before += reader.path.stat().st_size
        self._reader, self._index = None, self._index + 1
