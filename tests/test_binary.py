"""Tests of binary splits (dlrm.data.binary) and their loader (dlrm.data.binary_loader) on the CPU."""

import json
import threading

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from loguru import logger

from dlrm.data import binary as binary_cli
from dlrm.data.binary import binary_dir, open_binary, widen_ids, write_binary, write_binary_split
from dlrm.data.binary_loader import BinaryLoader
from dlrm.data.dataset import ParquetDataset, split_paths
from dlrm.run.setup import restore_loader
from tests.test_streaming import ROWS, flat, ids_of, write_id_files


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """A binary split of the 100 numbered rows of test_streaming's parquet files."""
    root = tmp_path_factory.mktemp("bin")
    write_binary_split(write_id_files(root / "parquet"), root / "train")
    return root / "train"


def loader(split, **kwargs) -> BinaryLoader:
    args = {"batch_size": 8, "window_rows": 24, "chunk_rows": 16, **kwargs}
    return BinaryLoader(split, **args)


def epoch_ids(binary_loader: BinaryLoader, epoch: int = 0) -> list[list[int]]:
    binary_loader.set_epoch(epoch)
    return ids_of(binary_loader)


def test_binary_split_holds_the_parquet_rows_exactly(criteo_sample, tmp_path):
    write_binary(criteo_sample, ["train"])
    parquet = ParquetDataset(split_paths(criteo_sample, "train"))
    batches = list(BinaryLoader(binary_dir(criteo_sample, "train"), batch_size=1000))
    assert torch.equal(torch.cat([b.dense for b in batches]), parquet.dense)
    assert torch.equal(torch.cat([b.sparse for b in batches]), parquet.sparse)
    assert torch.equal(torch.cat([b.label for b in batches]), parquet.label)
    assert (parquet.sparse == -1).any() and (parquet.sparse > 2**31).any()  # missing and high ids


def test_ids_widen_to_their_32_bit_values():
    raw = torch.tensor([[-1, 0, 5, 2**31 - 1, 2**31, 2**32 - 2]])
    stored = torch.from_numpy(raw.numpy().astype(np.uint32).view(np.int32))
    assert torch.equal(widen_ids(stored), raw)


def test_file_order_without_shuffle(split):
    assert flat(epoch_ids(loader(split))) == list(range(ROWS))
    assert [len(b) for b in epoch_ids(loader(split, drop_last=True))] == [8] * (ROWS // 8)


def test_shuffle_covers_every_row_once_and_is_deterministic(split):
    first = epoch_ids(loader(split, shuffle=True, seed=3))
    assert sorted(flat(first)) == list(range(ROWS))
    assert flat(first) != list(range(ROWS))
    assert epoch_ids(loader(split, shuffle=True, seed=3)) == first
    assert epoch_ids(loader(split, shuffle=True, seed=3), epoch=1) != first
    assert epoch_ids(loader(split, shuffle=True, seed=4)) != first


def test_a_window_holds_the_rows_of_its_chunks_only(split):
    """Rows mix within a window (24 rows here) only: each window's rows are whole chunks of 16 rows of
    the file (or a chunk's part at a window's edge), never rows of a later window."""
    batches = epoch_ids(loader(split, shuffle=True, seed=1, window_rows=24))
    ranges = loader(split, shuffle=True, seed=1).ranges(0)
    stream = [first + i for first, count in ranges for i in range(count)]
    for w in range(0, ROWS, 24):
        window = flat(batches)[w : w + 24]
        assert sorted(window) == sorted(stream[w : w + 24])


@pytest.mark.parametrize("world_size,drop_last", [(2, False), (3, False), (3, True)])
def test_ranks_read_disjoint_rows_and_the_same_number_of_batches(split, world_size, drop_last):
    per_rank = [
        epoch_ids(loader(split, shuffle=True, rank=r, world_size=world_size, drop_last=drop_last))
        for r in range(world_size)
    ]
    assert len({len(batches) for batches in per_rank}) == 1
    rows = [flat(batches) for batches in per_rank]
    seen = [i for r in rows for i in r]
    if drop_last:
        assert len(seen) == len(set(seen)) == (ROWS // world_size // 8) * 8 * world_size
    else:
        assert set(seen) == set(range(ROWS))
        assert len(seen) - ROWS < world_size  # the padding repeats fewer than W rows


@pytest.mark.parametrize("stop_at", [1, 3, 5, 12])
def test_resume_gives_the_batches_of_an_uninterrupted_epoch(split, stop_at):
    whole = epoch_ids(loader(split, shuffle=True, seed=7), epoch=2)
    first = loader(split, shuffle=True, seed=7)
    first.set_epoch(2)
    iterator = iter(first)
    for _ in range(stop_at):
        next(iterator)
    state = json.loads(json.dumps(first.state_dict()))  # a checkpoint holds plain values
    resumed = loader(split, shuffle=True, seed=7)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)
    assert whole[:stop_at] + ids_of(resumed) == whole


def test_a_position_of_two_ranks_goes_on_in_one_at_the_same_global_batch(split):
    """2 ranks of batch 4 stopped after 3 batches; one process of batch 8 goes on at its own global batch 3
    of the epoch, and the epoch after is the one-process epoch, whole."""
    ranks = [loader(split, shuffle=True, seed=7, batch_size=4, rank=r, world_size=2) for r in range(2)]
    for r in ranks:
        r.set_epoch(1)
        iterator = iter(r)
        for _ in range(3):
            next(iterator)
    state = json.loads(json.dumps(ranks[0].state_dict()))
    one = loader(split, shuffle=True, seed=7, batch_size=8)
    one.load_state_dict(state)
    assert one.other_ranks(state)
    one.set_epoch(1)
    assert ids_of(one) == epoch_ids(loader(split, shuffle=True, seed=7, batch_size=8), epoch=1)[3:]
    assert epoch_ids(one, epoch=2) == epoch_ids(loader(split, shuffle=True, seed=7, batch_size=8), epoch=2)
    with pytest.raises(ValueError, match="loader state: global batch 8 .world_size 2., this loader's is 4"):
        loader(split, shuffle=True, seed=7, batch_size=4).load_state_dict(state)


def test_a_resume_on_other_ranks_says_so_in_one_line(split):
    state = loader(split, batch_size=4, world_size=2).state_dict()
    lines = []
    sink = logger.add(lines.append, format="{message}")
    try:
        restore_loader(loader(split, batch_size=8), state, log=True)
        restore_loader(loader(split, batch_size=8), loader(split, batch_size=8).state_dict(), log=True)
    finally:
        logger.remove(sink)
    assert len(lines) == 1 and "loader position is of 2 ranks, this run has 1" in lines[0]


def test_resume_refuses_other_settings(split):
    state = loader(split, shuffle=True).state_dict()
    with pytest.raises(ValueError, match="window_rows is 24, this loader has 16"):
        loader(split, shuffle=True, window_rows=16).load_state_dict(state)


def test_memory_holds_two_windows_not_the_split(split):
    windows = iter(loader(split, window_rows=16))
    next(windows)
    frame = windows.gi_frame.f_locals["windows"]
    assert [len(w.label) for w in frame.host] == [16, 16]


def test_reader_threads_make_no_cuda_call(split, monkeypatch):
    """The reader threads must never call CUDA: a CUDA graph capture in the training thread would fail.
    On the CPU the readers run the same code; every torch.cuda entry point records its caller."""
    callers = []

    def record(*args, **kwargs):
        callers.append(threading.current_thread().name)

    for name in ("Stream", "Event", "current_stream", "synchronize", "stream"):
        monkeypatch.setattr(torch.cuda, name, record)
    assert sorted(flat(epoch_ids(loader(split, shuffle=True)))) == list(range(ROWS))
    assert callers == []
    assert any(t.name.startswith("dlrm-binary-read") for t in threading.enumerate()) is False


def test_truncated_or_missing_files_name_the_file(split, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in split.iterdir():
        broken.joinpath(path.name).write_bytes(path.read_bytes())
    sparse = broken / "sparse.bin"
    sparse.write_bytes(sparse.read_bytes()[:-3])
    with pytest.raises(ValueError, match=r"sparse.bin: expected 10400 bytes .* found 10397 bytes: truncated"):
        open_binary(broken)
    sparse.unlink()
    with pytest.raises(ValueError, match="sparse.bin: expected 10400 bytes .* found missing"):
        open_binary(broken)
    (broken / "format.json").write_text("{not json")
    with pytest.raises(ValueError, match="format.json: not a binary split description"):
        open_binary(broken)
    with pytest.raises(FileNotFoundError, match="python -m dlrm.data.binary --data DIR"):
        open_binary(tmp_path / "nothing")


def test_cli_writes_every_split_and_reports_bad_input(criteo_sample, tmp_path):
    result = CliRunner().invoke(binary_cli.main, ["--data", str(criteo_sample)])
    assert result.exit_code == 0, result.output
    assert open_binary(binary_dir(criteo_sample, "val")).rows == 1000
    assert open_binary(binary_dir(criteo_sample, "test")).rows == 1000
    result = CliRunner().invoke(binary_cli.main, ["--data", str(tmp_path)])
    assert result.exit_code == 2 and result.output.startswith("error: ") and "metadata" in result.output


def test_preprocess_binary_flag_writes_every_split(tmp_path):
    from dlrm.data import preprocess as preprocess_cli
    from tests.conftest import SAMPLE_TSV

    out = tmp_path / "data"
    result = CliRunner().invoke(
        preprocess_cli.main, ["--input", str(SAMPLE_TSV), "--output-dir", str(out), "--binary"]
    )
    assert result.exit_code == 0, result.output
    assert open_binary(binary_dir(out, "train")).rows == 8000
    assert open_binary(binary_dir(out, "val")).rows == open_binary(binary_dir(out, "test")).rows == 1000
