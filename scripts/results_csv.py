"""What every benchmark script records: the run's provenance and its rows appended to a CSV.

A row names the commit it measured (`commit`): "+dirty" marks rows of source files that no commit holds. A
device copy has no .git: run `python scripts/results_csv.py` here and put its GIT_SHA=... SOURCE_HASH=...
in front of the benchmark there, which then checks the copy's files against that commit's hash."""

import csv
import hashlib
import importlib.metadata
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
# The files whose content a results row measures: the code, the scripts and the configs.
SOURCE_GLOBS = ("dlrm/**/*.py", "kernels/**/*.py", "kernels/**/*.cu", "scripts/*.py", "configs/*.json")
SOURCE_FILES = ("pyproject.toml",)


def source_files(root: Path = REPO) -> list[Path]:
    """The files of SOURCE_GLOBS and SOURCE_FILES under `root`, sorted (no git needed: a device copy has
    none)."""
    found = {p for pattern in SOURCE_GLOBS for p in root.glob(pattern) if "__pycache__" not in p.parts}
    found |= {root / name for name in SOURCE_FILES if (root / name).is_file()}
    return sorted(found)


def source_hash(root: Path = REPO) -> str:
    """sha256 (16 hex digits) of the source files' relative paths and contents under `root`."""
    digest = hashlib.sha256()
    for path in source_files(root):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _git(*args: str) -> str | None:
    try:
        return subprocess.check_output(["git", *args], text=True, stderr=subprocess.DEVNULL, cwd=REPO).strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def commit(root: Path = REPO) -> str:
    """The commit the source files are: git's short HEAD, with "+dirty" when the source files differ from
    it (changed or untracked). Without git (a device copy), the environment's GIT_SHA, trusted only when
    SOURCE_HASH, the `source_hash` computed beside that commit, equals the files' own: else "+dirty"
    (another hash) or "+unverified" (none given); "unknown" without either."""
    given = os.environ.get("GIT_SHA")
    head = None if given else _git("rev-parse", "--short", "HEAD")
    if head is not None:
        changed = _git("status", "--porcelain", "--", *SOURCE_GLOBS, *SOURCE_FILES)
        return head + ("+dirty" if changed else "")
    if not given:
        return "unknown"
    expected = os.environ.get("SOURCE_HASH")
    if expected is None:
        return given + "+unverified"
    return given if expected == source_hash(root) else given + "+dirty"


def provenance(device: str) -> dict[str, str]:
    """date (UTC), device name, torch/triton versions and the commit of the source files (`commit`)."""
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device,
        "torch": torch.__version__,
        # Not `import triton`: on a CPU, TRITON_INTERPRET must be set before triton is first imported.
        "triton": importlib.metadata.version("triton"),
        "git_sha": commit(),
    }


def append_rows(path: Path, rows: list[dict]) -> None:
    """Append `rows` to the CSV at `path` in the order of its header (written from the rows' keys, in order
    of appearance, when the file is new). Raises ValueError when the rows' columns differ from the file's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        with path.open(newline="") as f:
            fields = next(csv.reader(f))
    else:
        fields = list(dict.fromkeys(key for row in rows for key in row))
    extra = {key for row in rows for key in row} - set(fields)
    if extra:
        raise ValueError(f"{path}: columns {sorted(extra)} are not in its header; start a new results file")
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        if f.tell() == 0:
            writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    # `python scripts/results_csv.py`: the environment a device copy needs, GIT_SHA=... SOURCE_HASH=...,
    # refused (exit 1) when the source files differ from HEAD.
    sha = commit()
    if sha.endswith("+dirty") or sha == "unknown":
        sys.exit(f"the source files are not a commit ({sha}): commit them first")
    print(f"GIT_SHA={sha} SOURCE_HASH={source_hash()}")
