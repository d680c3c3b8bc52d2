"""What every benchmark script records: the run's provenance and its rows appended to a CSV."""

import csv
import importlib.metadata
import os
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import torch


def provenance(device: str) -> dict[str, str]:
    """date (UTC), device name, torch/triton versions and git sha (GIT_SHA overrides, for copies
    without .git such as the GPU machine's)."""
    sha = os.environ.get("GIT_SHA")
    if not sha:
        try:
            sha = subprocess.check_output(
                ["git", "rev-parse", "--short", "HEAD"], text=True, stderr=subprocess.DEVNULL
            ).strip()
        except (OSError, subprocess.CalledProcessError):
            sha = "unknown"
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device,
        "torch": torch.__version__,
        # Not `import triton`: on a CPU, TRITON_INTERPRET must be set before triton is first imported.
        "triton": importlib.metadata.version("triton"),
        "git_sha": sha,
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
