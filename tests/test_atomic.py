"""dlrm.atomic: a file is replaced whole or not at all."""

import pytest

from dlrm import atomic


def test_a_completed_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "metrics.json"
    atomic.write_text(path, "old")
    atomic.write_text(path, "new")
    assert path.read_text() == "new"
    assert [p.name for p in path.parent.iterdir()] == ["metrics.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path):
    path = tmp_path / "model.pt2"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="disk full"), atomic.replacing(path, suffix=".pt2") as tmp:
        assert tmp.parent == tmp_path and tmp.name.endswith(".pt2") and tmp != path
        tmp.write_text("half")
        raise RuntimeError("disk full")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt2"]
