"""Files written whole or not at all: under a temporary name beside the target, renamed over it when
complete, removed when the writing fails, so neither name is ever left half-written."""

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def replacing(path: Path, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path in `path`'s directory (the same filesystem, so the rename is atomic) for the
    block to write; rename it over `path` when the block completes, remove it and re-raise when the block
    raises or is interrupted. `suffix` ends the temporary name, for writers that check it (torch.export
    and AOTInductor want ".pt2"). Creates `path`'s directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}{suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str) -> None:
    """`text` into `path`, whole or not at all (`replacing`)."""
    with replacing(path) as tmp:
        tmp.write_text(text)
