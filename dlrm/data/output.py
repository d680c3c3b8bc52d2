"""What preprocess writes, and how a run that stops leaves nothing that looks complete.

    DIR/train/part-00000.parquet ...   shards of OUTPUT_SCHEMA rows (see `SplitWriter`)
    DIR/vocab/C1.parquet ...           with --min-frequency: VOCAB_SCHEMA rows (see `write_vocabularies`)
    DIR/metadata.json                  see `build_metadata`; read back by `load_metadata`

A run writes into `DIR.partial/` (see `PartialDir`): its manifest names the run's arguments and inputs (and
the line counts once known), its lock file keeps a second process out, and `_progress/` holds a record per
completed shard, which is how a resumed run recognizes the shards it may keep. Every file is written under a
`.tmp` name and renamed once complete; `move_into_place` renames DIR.partial to DIR at the very end.

Every tool that writes a data directory (preprocess, synthetic, multi_hot) checks DIR first with
`check_output_dir`: a missing or empty directory is written; one that holds a data directory and nothing
else is replaced only with --overwrite; anything else (a directory of other files, one that is or holds an
input, or holds the working directory) is refused with one line, and nothing is deleted.
"""

import fcntl
import json
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

import pyarrow as pa
import pyarrow.parquet as pq
from loguru import logger

from dlrm import __version__, atomic
from dlrm.choices import SPLITS
from dlrm.data.parse import OUTPUT_SCHEMA
from dlrm.data.stats import DEFAULT_EXACT_DISTINCT_LIMIT, BlockStats, SplitStats, block_stats
from dlrm.data.text import PreprocessError

__all__ = [
    "METADATA_FILE",
    "VOCAB_SCHEMA",
    "PartialDir",
    "SplitWriter",
    "build_metadata",
    "check_output_dir",
    "load_metadata",
    "move_into_place",
    "temporary_dir",
    "write_vocabularies",
]

METADATA_FILE = "metadata.json"
VOCAB_SCHEMA = pa.schema([("value", pa.int64()), ("count", pa.int64())])
VOCAB_DIR = "vocab"
MANIFEST_FILE = "manifest.json"
LOCK_FILE = (
    "lock"  # flock'ed by the process writing DIR.partial (the manifest itself is replaced as it grows)
)
PROGRESS_DIR = "_progress"  # per completed shard: its line range and row count (removed at the end)
COUNTS_DIR = "_counts"  # with --min-frequency: occurrences per id spilled to disk (removed at the end)


def load_metadata(data_dir: Path | str) -> dict:
    """The metadata.json written by `preprocess` into `data_dir`.

    Raises:
        FileNotFoundError: `data_dir` holds no metadata.json (the message names the directory it looked in,
            and says to preprocess a raw Criteo file given instead of a directory).
    """
    data_dir = Path(data_dir)
    path = data_dir / METADATA_FILE
    if data_dir.is_file():
        raise FileNotFoundError(
            f"{data_dir}: a raw file, not a preprocessed data directory: preprocess it with python -m "
            f"dlrm.data.preprocess --input {data_dir} --output-dir DIR, then give DIR"
        )
    if not path.is_file():
        where = "" if data_dir.is_absolute() else f" (looked in {data_dir.absolute()})"
        raise FileNotFoundError(f"{path} not found{where}: run python -m dlrm.data.preprocess first")
    return json.loads(path.read_text())


class PartialDir:
    """DIR.partial, the work directory of a run writing DIR; a context manager that locks it for this
    process. Entered, it is resumed when its manifest has the same `identity` (arguments and input
    fingerprints), else made anew (an earlier run's with other arguments is removed).

    Raises (from entering):
        PreprocessError: DIR.partial exists but is not a preprocess work directory, or another process
            is writing it.
    """

    def __init__(self, output_dir: Path, identity: dict) -> None:
        self.path = output_dir.with_name(f"{output_dir.name}.partial")
        self.identity = identity
        self._lock: IO | None = None

    @property
    def progress_dir(self) -> Path:
        """Where the shard writers leave a record per completed shard."""
        return self.path / PROGRESS_DIR

    @property
    def counts_dir(self) -> Path:
        """Where the occurrences per id are spilled with --min-frequency."""
        return self.path / COUNTS_DIR

    def __enter__(self) -> "PartialDir":
        manifest = self.path / MANIFEST_FILE
        if self.path.exists() and not manifest.is_file():
            raise PreprocessError(
                f"{self.path} exists and is not a preprocess work directory (no {MANIFEST_FILE})"
            )
        if self.path.exists():
            self._lock_partial()
            if json.loads(manifest.read_text())["identity"] == self.identity:
                logger.info("resuming the preprocess in {}", self.path)
                return self
            logger.warning("{} was written with other arguments or inputs: starting anew", self.path)
            shutil.rmtree(self.path)
            self._lock.close()
        fresh = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        shutil.rmtree(fresh, ignore_errors=True)  # left by a killed run whose pid was reused
        fresh.mkdir(parents=True)
        (fresh / MANIFEST_FILE).write_text(json.dumps({"identity": self.identity}, indent=2) + "\n")
        os.replace(fresh, self.path)
        self._lock_partial()
        return self

    def _lock_partial(self) -> None:
        self._lock = (self.path / LOCK_FILE).open("a")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise PreprocessError(f"{self.path} is being written by another preprocess") from None

    def __exit__(self, *exc) -> None:
        if self._lock is not None:
            self._lock.close()

    def line_counts(self) -> list[int | None] | None:
        """The inputs' line counts that the manifest holds (None for those not known), or None if none."""
        return json.loads((self.path / MANIFEST_FILE).read_text()).get("line_counts")

    def save_line_counts(self, counts: list[int | None]) -> None:
        """Keep the inputs' line counts known so far (None for the others) in the manifest."""
        path = self.path / MANIFEST_FILE
        atomic.write_text(path, json.dumps(json.loads(path.read_text()) | {"line_counts": counts}) + "\n")

    def finish(self, metadata: dict) -> None:
        """Write `metadata` to metadata.json and remove the run's bookkeeping: what is left is DIR."""
        (self.path / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
        shutil.rmtree(self.progress_dir, ignore_errors=True)
        shutil.rmtree(self.counts_dir, ignore_errors=True)
        (self.path / MANIFEST_FILE).unlink()
        (self.path / LOCK_FILE).unlink()


# In DIR while `move_into_place` replaces an earlier output entry by entry: what makes an incomplete DIR
# (no metadata.json yet) recognizable as a data directory.
INCOMPLETE_MARK = ".dlrm-incomplete"
# A directory temporary of a tool writing DIR (.DIR.tmp-<pid>, .DIR.partial.tmp-<pid>), or one of
# dlrm.atomic's (.<name>.tmp-<pid>...) at any depth of a data directory.
_TEMPORARY = re.compile(r"\.[^/]+\.tmp-(\d+)(\.[^/]*)?")


def temporary_dir(output_dir: Path) -> Path:
    """The directory a tool writes before `move_into_place` renames it to `output_dir` (resolved): a hidden
    sibling named for this process, which `check_output_dir` removes once the process is gone."""
    return output_dir.with_name(f".{output_dir.name}.tmp-{os.getpid()}")


def check_output_dir(
    output_dir: Path | str,
    overwrite: bool,
    inputs: Sequence[Path | str] = (),
    option: str = "--output-dir",
    error: type[ValueError] = ValueError,
) -> Path:
    """Check the directory a data tool is about to write, before it reads or writes anything; return it
    resolved (so `.` and other relative paths have a name and a parent).

    Accepted: a missing directory, an empty one, or, with `overwrite`, one holding a data directory
    (metadata.json, or the mark of an interrupted `move_into_place`) and only what the data tools write
    there. Then the temporaries that a killed run of a tool left beside it (.DIR.tmp-<pid>,
    .DIR.partial.tmp-<pid> of a process that is gone) are removed.

    Raises:
        error: one line naming `option` and the path, and what to do: the path is or holds one of
            `inputs`, holds the working directory, is not a directory, holds other files, or holds an earlier
            output and not `overwrite`.
    """
    path = Path(output_dir).resolve()
    name = _describe(option, Path(output_dir), path)
    if path == path.parent:
        raise error(f"{name}: the root directory; give a directory to write")
    for given in inputs:
        source = Path(given).resolve()
        if path == source or path in source.parents:
            what = "is" if path == source else "holds"
            raise error(f"{name} {what} the input {given}; give another directory (never the input's)")
    if path in Path.cwd().resolve().parents:
        raise error(f"{name} holds the working directory; give another directory")
    refusal = _refusal(path, name)
    if refusal is not None:
        raise error(refusal)
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise error(f"{name} already exists and holds a data directory: pass --overwrite to replace it")
    remove_stale_temporaries(path)
    return path


def _describe(option: str, given: Path, resolved: Path) -> str:
    return f"{option} {given}" + ("" if str(given) == str(resolved) else f" ({resolved})")


def _refusal(path: Path, name: str) -> str | None:
    """Why a tool may not replace `path` (one line), or None: missing, empty, or a data directory holding
    only what the data tools write."""
    if not path.exists() and not path.is_symlink():
        return None
    if not path.is_dir():
        return f"{name} exists and is not a directory; give a directory to write"
    if not any(path.iterdir()):
        return None
    if not ((path / METADATA_FILE).is_file() or (path / INCOMPLETE_MARK).is_file()):
        held = _shown(sorted(p.name for p in path.iterdir()))
        return (
            f"{name} is not empty and is not a data directory (no {METADATA_FILE}; it holds {held}): "
            "refusing to write over it; give a new or empty directory"
        )
    foreign = foreign_entries(path)
    if foreign:
        return (
            f"{name} holds files that the data tools do not write ({_shown(foreign)}): refusing to replace "
            "it; move them or give another directory"
        )
    return None


def _shown(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def foreign_entries(data_dir: Path) -> list[str]:
    """The paths under `data_dir` (relative, sorted; a directory's with a trailing /) that no data tool
    writes: anything but metadata.json, the shards it lists or `<split>/part-N.parquet`, `vocab/C*.parquet`,
    `binary/<split>/` column files and format.json, and temporaries. Symbolic links are never followed."""
    listed: set[str] = set()
    try:
        files = json.loads((data_dir / METADATA_FILE).read_text()).get("files", {})
        listed = {name for names in files.values() for name in names if isinstance(name, str)}
    except (OSError, ValueError, AttributeError, TypeError):
        pass  # no metadata.json, or not one of ours: only the patterns below
    splits = "|".join(re.escape(s) for s in sorted({*SPLITS, "eval", *(n.split("/")[0] for n in listed)}))
    own_file = re.compile(
        rf"{METADATA_FILE}|{INCOMPLETE_MARK}|({splits})/part-\d+\.parquet|{VOCAB_DIR}/C\d+\.parquet"
        rf"|binary/({splits})/(label\.bin|dense\.bin|sparse\.bin|format\.json)"
    )
    own_dir = re.compile(rf"({splits}|{VOCAB_DIR}|binary|binary/({splits}))")
    foreign = []
    for root, dirs, files in os.walk(data_dir):
        here = Path(root).relative_to(data_dir)
        for d in list(dirs):
            relative = (here / d).as_posix()
            if _TEMPORARY.fullmatch(d):
                dirs.remove(d)  # a temporary's contents are its own
            elif (Path(root) / d).is_symlink() or not own_dir.fullmatch(relative):
                foreign.append(f"{relative}/" if not (Path(root) / d).is_symlink() else relative)
                dirs.remove(d)
        for f in files:
            relative = (here / f).as_posix()
            if not (relative in listed or own_file.fullmatch(relative) or _TEMPORARY.fullmatch(f)):
                foreign.append(relative)
    return sorted(foreign)


def remove_stale_temporaries(output_dir: Path) -> None:
    """Remove the temporaries that a tool killed while writing `output_dir` (resolved) left beside it:
    .DIR.tmp-<pid> and .DIR.partial.tmp-<pid> whose process is gone (they can be as large as DIR)."""
    pattern = re.compile(rf"\.{re.escape(output_dir.name)}(\.partial)?\.tmp-(\d+)")
    try:
        siblings = list(output_dir.parent.iterdir())
    except OSError:  # no parent yet: nothing left there
        return
    for path in siblings:
        match = pattern.fullmatch(path.name)
        if match is not None and not atomic.process_alive(int(match.group(2))):
            logger.info("removing {}, left by a run that was stopped while writing it", path)
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)


def move_into_place(tmp_dir: Path, output_dir: Path) -> None:
    """Make the finished `tmp_dir` `output_dir` (resolved, checked by `check_output_dir`): a rename when
    `output_dir` is missing. An existing one (empty, or an earlier output with --overwrite) stays, so that
    it may be the working directory: checked again (it may have changed since), marked incomplete, emptied
    (metadata.json first), filled from `tmp_dir` (metadata.json last) and unmarked; an interruption leaves
    it marked, which a later --overwrite replaces.

    Raises:
        ValueError: `output_dir` came to hold other files since it was checked (nothing is deleted).
    """
    if not output_dir.exists() and not output_dir.is_symlink():
        os.replace(tmp_dir, output_dir)
        return
    refusal = _refusal(output_dir, str(output_dir))
    if refusal is not None:
        raise ValueError(refusal)
    mark = output_dir / INCOMPLETE_MARK
    mark.write_text(json.dumps({"replacing_with": str(tmp_dir)}) + "\n")
    (output_dir / METADATA_FILE).unlink(missing_ok=True)
    for entry in output_dir.iterdir():
        if entry.name != INCOMPLETE_MARK:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    for entry in sorted(tmp_dir.iterdir(), key=lambda e: e.name == METADATA_FILE):
        os.replace(entry, output_dir / entry.name)
    tmp_dir.rmdir()
    mark.unlink()


class SplitWriter:
    """Writes one split as parquet shards and merges its statistics (see `SplitStats`).

    Each shard is written as `<split>/part-NNNNN.parquet.tmp` and renamed once closed and its footer's row
    count checked. With `rows_per_file` a shard is closed after that many rows; with None only by
    `end_shard`. With `progress_dir`, a completed shard also leaves `<split>-NNNNN.json` there (its first
    line, lines and rows), which is how a resumed run recognizes it.
    """

    def __init__(
        self,
        root: Path,
        split: str,
        rows_per_file: int | None,
        collect_feature_stats: bool,
        exact_distinct_limit: int = DEFAULT_EXACT_DISTINCT_LIMIT,
        value_counts_dir: Path | None = None,
        progress_dir: Path | None = None,
        schema: pa.Schema = OUTPUT_SCHEMA,
    ) -> None:
        self.root, self.split, self.rows_per_file = root, split, rows_per_file
        self.schema = schema  # of the rows written: OUTPUT_SCHEMA, with bag columns for multi-hot rows
        self.progress_dir = progress_dir
        self.files: list[str] = []
        self.stats = SplitStats(
            collect_feature_stats, exact_distinct_limit, value_counts_dir if collect_feature_stats else None
        )
        self.bad_lines = 0
        self._writer: pq.ParquetWriter | None = None
        self._rows_in_file = 0

    @property
    def rows(self) -> int:
        return self.stats.rows

    @property
    def positives(self) -> float:
        return self.stats.positives

    def shard_path(self, index: int) -> str:
        """Path of shard `index`, relative to the root."""
        return f"{self.split}/part-{index:05d}.parquet"

    def completed_shard(self, index: int) -> dict | None:
        """The progress record of shard `index` ({"first_line", "lines", "rows", "bad_lines"}, as given to
        `end_shard`) if an earlier run completed it (the record and the shard exist), else None."""
        progress = self._progress_path(index)
        if not (progress.is_file() and (self.root / self.shard_path(index)).is_file()):
            return None
        return json.loads(progress.read_text())

    def write(self, rows: pa.RecordBatch | pa.Table, stats: BlockStats | None = None) -> None:
        """Append `rows` (OUTPUT_SCHEMA) to the open shard as one row group, opening a shard first if none
        is; `stats` are the rows' block_stats when the caller has them."""
        if rows.num_rows == 0:
            return
        self._open()
        take = rows.num_rows if self.rows_per_file is None else self.rows_per_file - self._rows_in_file
        if take < rows.num_rows:  # only with rows_per_file, which then computes the statistics here
            self.write(rows.slice(0, take))
            self.write(rows.slice(take))
            return
        self.stats.add(stats or block_stats(rows, self.stats.features, self.stats.value_counts))
        self._writer.write(rows)
        self._rows_in_file += rows.num_rows
        if self._rows_in_file == self.rows_per_file:
            self.end_shard()

    def end_shard(self, first_line: int = 0, lines: int = 0, bad_lines: int = 0) -> None:
        """Close the open shard (an empty one if none is open and `lines` > 0); for the progress file,
        it covered `lines` input lines from 0-based line `first_line` over all inputs, `bad_lines` bad.

        Raises:
            OSError: the shard's footer does not count the rows written (it is left under its .tmp name).
        """
        if lines:
            self._open()
        if self._writer is None:
            return
        self._writer.close()
        self._writer = None
        relative = self.files[-1]
        tmp = self.root / f"{relative}.tmp"
        footer_rows = pq.read_metadata(tmp).num_rows
        if footer_rows != self._rows_in_file:
            raise OSError(f"{tmp}: footer says {footer_rows} rows, {self._rows_in_file} were written")
        if self.progress_dir is not None:
            record = {"first_line": first_line, "lines": lines, "rows": footer_rows, "bad_lines": bad_lines}
            atomic.write_text(self._progress_path(len(self.files) - 1), json.dumps(record) + "\n")
        os.replace(tmp, self.root / relative)
        self._rows_in_file = 0

    def add_completed_shard(self, stats: list[BlockStats], bad_lines: int) -> None:
        """Count a shard that an earlier run completed (the next index) with its rows' statistics."""
        self.files.append(self.shard_path(len(self.files)))
        for s in stats:
            self.stats.add(s)
        self.bad_lines += bad_lines

    def close(self) -> None:
        self.end_shard()

    def _progress_path(self, index: int) -> Path:
        return self.progress_dir / f"{self.split}-{index:05d}.json"

    def _open(self) -> None:
        if self._writer is None:
            relative = self.shard_path(len(self.files))
            (self.root / self.split).mkdir(exist_ok=True)
            self._writer = pq.ParquetWriter(self.root / f"{relative}.tmp", self.schema)
            self.files.append(relative)
            self._rows_in_file = 0

    def positive_rate(self) -> float | None:
        return self.stats.positive_rate()

    def cardinalities(self) -> dict:
        return self.stats.cardinalities()

    def dense_stats(self) -> dict:
        return self.stats.dense_stats()


def build_metadata(writers: dict[str, SplitWriter], source: list[str], skipped_lines: int) -> dict:
    """The metadata.json contents for closed split writers; "train" carries the feature statistics."""
    train = writers["train"]
    return {
        "version": __version__,
        "source": source,
        "rows": {name: w.rows for name, w in writers.items()},
        "files": {name: w.files for name, w in writers.items()},
        "positive_rate": {name: w.positive_rate() for name, w in writers.items()},
        "categorical": train.cardinalities(),
        "dense": train.dense_stats(),
        "skipped_lines": skipped_lines,
        "exact_distinct_limit": train.stats.exact_distinct_limit,
    }


def write_vocabularies(root: Path, vocabularies: dict[str, Iterator[pa.Table]]) -> dict[str, dict]:
    """Write each column's vocabulary, given piece by piece (VOCAB_SCHEMA tables), to
    `root/vocab/<column>.parquet`; returns per column {"vocab": its path relative to `root`, "vocab_size":
    its rows}, the keys metadata.json adds to the column's entry."""
    (root / VOCAB_DIR).mkdir(exist_ok=True)
    written = {}
    for column, pieces in vocabularies.items():
        relative = f"{VOCAB_DIR}/{column}.parquet"
        size = 0
        with pq.ParquetWriter(root / f"{relative}.tmp", VOCAB_SCHEMA) as writer:
            for piece in pieces:
                writer.write_table(piece)
                size += piece.num_rows
        os.replace(root / f"{relative}.tmp", root / relative)
        written[column] = {"vocab": relative, "vocab_size": size}
    return written
