"""Tests of the streaming loader (dlrm.data.streaming) on small multi-file, multi-row-group parquet splits."""

import math
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dlrm.data.dataset import BatchLoader, ParquetDataset, open_split, split_paths
from dlrm.data.schema import DENSE_COLUMNS, LABEL, SPARSE_COLUMNS
from dlrm.data.streaming import StreamingLoader

# (rows, row group size) per file: 100 rows in 4 + 4 + 3 = 11 row groups of unequal sizes.
FILES = ((37, 10), (50, 13), (13, 5))
ROWS = sum(rows for rows, _ in FILES)


def write_id_files(directory: Path, files=FILES) -> list[Path]:
    """Parquet files whose rows are numbered across files in C1 (and I1 = C1 % 50, label = C1 % 2),
    so a batch says which rows it holds."""
    directory.mkdir(parents=True, exist_ok=True)
    paths, first = [], 0
    for i, (rows, row_group) in enumerate(files):
        ids = np.arange(first, first + rows)
        columns = {LABEL: ids % 2, **{c: (ids % 50 if c == "I1" else np.ones(rows)) for c in DENSE_COLUMNS}}
        columns.update({c: ids if c == "C1" else np.full(rows, i, np.int64) for c in SPARSE_COLUMNS})
        paths.append(directory / f"part-{i:05d}.parquet")
        pq.write_table(pa.table(columns), paths[-1], row_group_size=row_group)
        first += rows
    return paths


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[Path]:
    return write_id_files(tmp_path_factory.mktemp("ids"))


def ids_of(batches) -> list[list[int]]:
    """Row ids of each batch; checks on the way that every row is whole."""
    out = []
    for batch in batches:
        ids = batch.sparse[:, 0]
        assert torch.equal(batch.label, (ids % 2).float())
        assert torch.equal(batch.dense[:, 0], torch.log1p((ids % 50).float()))
        out.append(ids.tolist())
    return out


def epoch_ids(loader: StreamingLoader, epoch: int = 0) -> list[list[int]]:
    loader.set_epoch(epoch)
    return ids_of(loader)


def flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def test_without_shuffle_it_gives_the_batches_of_the_memory_loader(files):
    stream = list(StreamingLoader(files, batch_size=16))
    memory = list(BatchLoader(ParquetDataset(files), batch_size=16))
    assert len(stream) == len(memory) == math.ceil(ROWS / 16)
    for ours, theirs in zip(stream, memory, strict=True):
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(ours, theirs, strict=True))


def test_len_and_drop_last(files):
    loader = StreamingLoader(files, batch_size=16, shuffle=True, shuffle_buffer=20)
    assert len(loader) == 7 and [len(b) for b in epoch_ids(loader)] == [16] * 6 + [4]
    loader = StreamingLoader(files, batch_size=16, shuffle=True, shuffle_buffer=20, drop_last=True)
    assert len(loader) == 6 and [len(b) for b in epoch_ids(loader)] == [16] * 6
    assert list(StreamingLoader(files, batch_size=101, drop_last=True)) == []


@pytest.mark.parametrize("shuffle_buffer", [0, 7, 30, 1000])
def test_shuffle_is_a_deterministic_permutation_per_seed_and_epoch(files, shuffle_buffer):
    def make(seed):
        return StreamingLoader(files, batch_size=16, shuffle=True, seed=seed, shuffle_buffer=shuffle_buffer)

    loader = make(3)
    epoch0 = epoch_ids(loader, 0)
    assert sorted(flat(epoch0)) == list(range(ROWS))
    assert flat(epoch0) != list(range(ROWS))
    assert epoch_ids(make(3), 0) == epoch0
    assert epoch_ids(loader, 0) == epoch0  # iterating again repeats the epoch
    epoch1 = epoch_ids(loader, 1)
    assert sorted(flat(epoch1)) == list(range(ROWS)) and epoch1 != epoch0
    assert epoch_ids(make(4), 0) != epoch0


def test_row_groups_are_shuffled_and_rows_within_them(files):
    # Without a buffer, each row group's rows come out together: the units are visible in the order.
    order = flat(epoch_ids(StreamingLoader(files, batch_size=ROWS, shuffle=True, seed=1)))
    bounds = [0, 10, 20, 30, 37, 50, 63, 76, 87, 92, 97, 100]
    units = [next(u for u in range(11) if bounds[u] <= i < bounds[u + 1]) for i in order]
    runs = [units[0]] + [b for a, b in zip(units, units[1:], strict=False) if a != b]
    assert sorted(runs) == list(range(11))  # contiguous per unit
    assert runs != list(range(11))  # unit order shuffled
    first_unit = order[: bounds[runs[0] + 1] - bounds[runs[0]]]
    assert first_unit != sorted(first_unit)  # rows shuffled within the unit


@pytest.mark.parametrize("shuffle_buffer", [5, 20])
def test_shuffle_buffer_bounds_how_early_a_row_comes_out(files, shuffle_buffer):
    """A row leaves the buffer no earlier than `shuffle_buffer` + (its unit's size) rows before its place in
    the buffer-free stream (same seed, so the same unit order and within-unit order)."""
    stream = flat(epoch_ids(StreamingLoader(files, batch_size=8, shuffle=True, seed=2)))
    mixed = flat(
        epoch_ids(StreamingLoader(files, batch_size=8, shuffle=True, seed=2, shuffle_buffer=shuffle_buffer))
    )
    assert sorted(mixed) == list(range(ROWS)) and mixed != stream
    place = {row: i for i, row in enumerate(stream)}
    largest_unit = 13
    earliest = min(out - place[row] for out, row in enumerate(mixed))
    assert earliest >= -(shuffle_buffer + largest_unit - 1)
    # The buffer does mix: some row comes out well before its place.
    assert earliest < -shuffle_buffer // 2


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_read_disjoint_rows_in_equal_batch_counts(files, world_size, drop_last):
    def rank_ids(rank):
        loader = StreamingLoader(
            files,
            batch_size=8,
            shuffle=True,
            seed=5,
            shuffle_buffer=12,
            drop_last=drop_last,
            rank=rank,
            world_size=world_size,
        )
        batches = epoch_ids(loader, 1)
        assert len(batches) == len(loader)
        return batches

    per_rank = [rank_ids(r) for r in range(world_size)]
    assert len({len(b) for b in per_rank}) == 1  # same number of batches on every rank
    rows = [flat(b) for b in per_rank]
    if drop_last:
        # Each rank's share, N // W rows, loses its last partial batch.
        per_rank = ROWS // world_size // 8 * 8
        assert {len(r) for r in rows} == {per_rank}
        seen = flat(rows)
        assert len(seen) == len(set(seen)) == world_size * per_rank
    else:
        # Every row exactly once, plus fewer than world_size rows padded by repeating the first ones.
        assert {len(r) for r in rows} == {math.ceil(ROWS / world_size)}
        seen = flat(rows)
        assert set(seen) == set(range(ROWS))
        assert len(seen) - ROWS == world_size * math.ceil(ROWS / world_size) - ROWS < world_size
        for a in range(world_size):
            for b in range(a + 1, world_size):
                assert len(set(rows[a]) & set(rows[b])) <= len(seen) - ROWS


def test_ranks_without_padding_see_every_row_exactly_once(tmp_path):
    paths = write_id_files(tmp_path, ((48, 7), (12, 12)))
    loaders = [
        StreamingLoader(paths, 8, shuffle=True, shuffle_buffer=9, rank=r, world_size=4) for r in range(4)
    ]
    seen = [flat(epoch_ids(loader)) for loader in loaders]
    assert sorted(flat(seen)) == list(range(60))
    assert [len(s) for s in seen] == [15] * 4


@pytest.mark.parametrize(
    ("shuffle", "shuffle_buffer", "world_size", "drop_last"),
    [
        (True, 20, 1, False),
        (True, 0, 1, True),
        (True, 35, 3, False),
        (False, 0, 2, False),
        (True, 1000, 1, False),
    ],
)
def test_resume_mid_epoch_gives_the_remaining_batches(files, shuffle, shuffle_buffer, world_size, drop_last):
    def make():
        return StreamingLoader(
            files,
            batch_size=6,
            shuffle=shuffle,
            seed=9,
            shuffle_buffer=shuffle_buffer,
            drop_last=drop_last,
            world_size=world_size,
            rank=world_size - 1,
        )

    full = make()
    full.set_epoch(2)
    expected = ids_of(full)
    for stop in (1, 4, len(expected) - 1, len(expected)):
        first = make()
        first.set_epoch(2)
        batches = iter(first)
        head = ids_of(next(batches) for _ in range(stop))
        state = first.state_dict()
        assert state["epoch"] == 2 and state["batches"] == stop
        resumed = make()
        resumed.load_state_dict(state)
        resumed.set_epoch(2)  # the training loop sets the epoch again; the position stays
        assert head + ids_of(resumed) == expected
        assert resumed.state_dict()["batches"] == len(expected)
        # The next epoch starts from its beginning.
        resumed.set_epoch(3)
        assert len(ids_of(resumed)) == len(expected)


def test_resume_with_prefetch_reads_back_the_buffer_in_the_thread(files):
    def make():
        return StreamingLoader(files, batch_size=6, shuffle=True, seed=2, shuffle_buffer=25, prefetch=3)

    expected = ids_of(make())
    first = make()
    batches = iter(first)
    head = ids_of(next(batches) for _ in range(5))
    state = first.state_dict()
    batches.close()
    resumed = make()
    resumed.load_state_dict(state)
    assert head + ids_of(resumed) == expected


def test_resume_refuses_a_state_of_other_settings(files):
    state = StreamingLoader(files, batch_size=6, shuffle=True, shuffle_buffer=4).state_dict()
    with pytest.raises(ValueError, match="loader state: batch_size is 6, this loader has 7"):
        StreamingLoader(files, batch_size=7, shuffle=True, shuffle_buffer=4).load_state_dict(state)
    with pytest.raises(ValueError, match="loader state: world_size is 1, this loader has 2"):
        StreamingLoader(files, 6, shuffle=True, shuffle_buffer=4, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"batches must be in \[0, 17\], got 18"):
        StreamingLoader(files, 6, shuffle=True, shuffle_buffer=4).load_state_dict({**state, "batches": 18})


@pytest.mark.parametrize("depth", [1, 3])
def test_threaded_prefetch_gives_the_same_batches(files, depth):
    def make(prefetch):
        return StreamingLoader(
            files, batch_size=7, shuffle=True, seed=1, shuffle_buffer=15, prefetch=prefetch
        )

    plain = list(make(0))
    threaded = list(make(depth))
    assert len(threaded) == len(plain) == 15
    for a, b in zip(threaded, plain, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_prefetch_position_counts_consumed_batches_only(files):
    loader = StreamingLoader(files, batch_size=7, shuffle=True, shuffle_buffer=15, prefetch=4)
    batches = iter(loader)
    next(batches), next(batches)
    assert loader.state_dict()["batches"] == 2  # the thread has read ahead; the position has not
    batches.close()


def test_errors_in_the_prefetch_thread_reach_the_consumer(tmp_path):
    paths = write_id_files(tmp_path, ((20, 10), (20, 10)))
    loader = StreamingLoader(paths, batch_size=5, prefetch=2)
    # Break the second file after the loader read its footer: the thread fails when it reaches it.
    pq.write_table(pa.table({"x": [1]}), paths[1])
    batches = iter(loader)
    assert len(next(batches).label) == 5
    with pytest.raises(ValueError, match="part-00001.parquet: missing columns label, I1, "):
        list(batches)


def test_the_consumer_gets_the_worker_exception_itself(files, monkeypatch):
    loader = StreamingLoader(files, batch_size=5, prefetch=2)
    decode = loader._decode_unit
    failure = RuntimeError("disk on fire")

    def fail_on_third_unit(unit):
        if unit == 2:
            raise failure
        return decode(unit)

    monkeypatch.setattr(loader, "_decode_unit", fail_on_third_unit)
    batches = iter(loader)
    assert len(ids_of([next(batches) for _ in range(4)])) == 4  # units 0 and 1: 20 rows
    with pytest.raises(RuntimeError, match="^disk on fire$") as raised:
        next(batches)
    assert raised.value is failure


def test_abandoned_iterators_stop_their_threads(files):
    loader = StreamingLoader(files, batch_size=5, prefetch=1)
    for _ in range(3):
        batches = iter(loader)
        next(batches)
        assert any(t.name.startswith("dlrm-read") for t in threading.enumerate())
        del batches
    assert not [t.name for t in threading.enumerate() if t.name.startswith("dlrm-")]


def test_real_rows_through_the_streaming_loader(criteo_sample):
    memory = open_split(criteo_sample, "train")
    loader = StreamingLoader(
        split_paths(criteo_sample, "train"), batch_size=512, shuffle=True, shuffle_buffer=3000
    )
    batches = list(loader)
    assert sum(len(b.label) for b in batches) == memory.num_rows == 8000

    # Same rows as the memory loader, in another order: compare sorted row fingerprints.
    def fingerprint(sparse, label):
        return sorted(map(tuple, torch.cat([sparse, label[:, None].long()], 1).tolist()))

    assert fingerprint(
        torch.cat([b.sparse for b in batches]), torch.cat([b.label for b in batches])
    ) == fingerprint(memory.sparse, memory.label)


def test_bad_arguments_name_the_argument(files, tmp_path):
    for kwargs, message in (
        ({"batch_size": 0}, "batch_size must be at least 1, got 0"),
        ({"batch_size": 4, "shuffle_buffer": -1}, "shuffle_buffer must be at least 0"),
        ({"batch_size": 4, "world_size": 0}, "world_size must be at least 1"),
        ({"batch_size": 4, "rank": 2, "world_size": 2}, r"rank must be in \[0, world_size=2\), got 2"),
        ({"batch_size": 4, "prefetch": -1}, "prefetch must be at least 0"),
    ):
        with pytest.raises(ValueError, match=message):
            StreamingLoader(files, **kwargs)
    with pytest.raises(FileNotFoundError, match="no \\*.parquet files"):
        StreamingLoader(tmp_path, batch_size=4)


@pytest.mark.gpu
def test_cuda_batches_match_cpu_batches(files):
    for prefetch in (0, 3):
        cuda = list(
            StreamingLoader(files, 8, shuffle=True, shuffle_buffer=9, device="cuda", prefetch=prefetch)
        )
        cpu = list(StreamingLoader(files, 8, shuffle=True, shuffle_buffer=9))
        for on_gpu, on_cpu in zip(cuda, cpu, strict=True):
            assert all(t.is_cuda for t in on_gpu)
            assert all(torch.equal(a.cpu(), b) for a, b in zip(on_gpu, on_cpu, strict=True))


def test_a_file_gone_since_opening_names_file_and_row_group(tmp_path):
    paths = write_id_files(tmp_path, ((20, 10), (20, 10)))
    loader = StreamingLoader(paths, batch_size=5)
    paths[1].unlink()
    with pytest.raises(ValueError, match=r"part-00001.parquet: row group 0: "):
        list(loader)
