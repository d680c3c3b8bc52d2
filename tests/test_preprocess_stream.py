"""Tests of dlrm.data.preprocess at scale: bounded memory, resumption after a crash, bad lines deep in a
large gzip stream, split layouts row-exact across blocks, shards and files, statistics and vocabularies."""

import gzip
import io
import json
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tqdm import tqdm

from dlrm.data import pipeline as pipeline_module
from dlrm.data import text as text_module
from dlrm.data.output import load_metadata
from dlrm.data.preprocess import PreprocessError, preprocess
from dlrm.data.schema import LABEL, RAW_COLUMNS, SPARSE_COLUMNS
from dlrm.data.synthetic_output import write_tsv as write_synthetic_tsv
from dlrm.data.synthetic_rows import SyntheticConfig, preset_cardinalities
from dlrm.data.text import TextBlock
from tests.test_preprocess import SAMPLE, raw_lines, read_split, reference_rows

REPO = Path(__file__).parents[1]
BIG_LINES = 200_000
# Runs its arguments as a child and prints the child's peak RSS in KiB.
_PEAK_RSS = (
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


@pytest.fixture(scope="module")
def big_gz(tmp_path_factory) -> Path:
    """BIG_LINES synthetic Criteo lines (~250 bytes each), gzip."""
    path = tmp_path_factory.mktemp("big") / "day.tsv.gz"
    config = SyntheticConfig(preset_cardinalities("kaggle", 20_000), seed=7, ctr=0.2)
    write_synthetic_tsv(config, BIG_LINES, path)
    return path


def cli(inputs: list[Path], out: Path, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "dlrm.data.preprocess",
        *(a for p in inputs for a in ("--input", str(p))), "--output-dir", str(out), *args,
    ]  # fmt: skip


def assert_same_output(out: Path, reference: Path) -> None:
    """Same metadata (but the source) and the same rows in every shard."""
    actual, expected = load_metadata(out), load_metadata(reference)
    assert actual.keys() == expected.keys()
    for key in expected.keys() - {"source", "dense"}:
        assert actual[key] == expected[key], key
    for name, stats in expected["dense"].items():
        # Sums taken block by block differ in the last bits.
        assert actual["dense"][name] == pytest.approx(stats, rel=1e-12), name
    for split, files in expected["files"].items():
        for file in files:
            assert pq.read_table(out / file).equals(pq.read_table(reference / file)), (split, file)


def check_nothing_looks_complete_that_is_not(partial: Path) -> list[Path]:
    """Every shard under its final name in `partial` has a progress record with its footer's row count;
    returns those shards."""
    shards = sorted(partial.glob("*/part-*.parquet"))
    for shard in shards:
        record = json.loads(
            (partial / "_progress" / f"{shard.parent.name}-{shard.stem[5:]}.json").read_text()
        )
        assert pq.read_metadata(shard).num_rows == record["rows"] > 0, shard
    return shards


def _record_opened_inputs(monkeypatch) -> list:
    """The input paths preprocess opens from now on, in order (LineReader wrapped to record them)."""
    opened = []
    line_reader = text_module.LineReader

    def recording_line_reader(path):
        opened.append(path)
        return line_reader(path)

    monkeypatch.setattr(text_module, "LineReader", recording_line_reader)
    return opened


def test_resume_after_kill_gives_the_rows_of_an_uninterrupted_run(tmp_path, big_gz):
    args = {"rows_per_file": 10_000, "block_size": 2_000}
    reference = tmp_path / "reference"
    preprocess([big_gz], reference, **args)
    out, partial = tmp_path / "out", tmp_path / "out.partial"
    command = cli([big_gz], out, "--rows-per-file", "10000", "--block-size", "2000", "--workers", "1")
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(list(partial.glob("*/part-*.parquet"))) < 3:
        assert proc.poll() is None, "preprocess finished before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.002)
    proc.kill()
    proc.wait()
    done = check_nothing_looks_complete_that_is_not(partial)
    assert 3 <= len(done) < BIG_LINES // 10_000
    inodes = {shard.relative_to(partial): shard.stat().st_ino for shard in done}

    preprocess([big_gz], out, **args)
    assert not partial.exists()
    assert {path: (out / path).stat().st_ino for path in inodes} == inodes  # kept, not written again
    assert_same_output(out, reference)


class InjectedCrash(Exception):
    """Stands for a crash (disk full, power off) while a shard is being written."""


def test_resume_after_a_crash_inside_a_shard(tmp_path, monkeypatch):
    args = {"rows_per_file": 1500, "block_size": 400, "layout": "kaggle"}
    reference = tmp_path / "reference"
    preprocess([SAMPLE], reference, **args)

    parse_block = pipeline_module.parse_block

    def crash_at_line_5000(block, skip_bad_lines):
        if block.first_line <= 5000 < block.first_line + block.lines:
            raise InjectedCrash
        return parse_block(block, skip_bad_lines)

    out = tmp_path / "out"
    monkeypatch.setattr(pipeline_module, "parse_block", crash_at_line_5000)
    with pytest.raises(InjectedCrash):
        preprocess([SAMPLE], out, **args)
    done = check_nothing_looks_complete_that_is_not(tmp_path / "out.partial")
    assert [p.name for p in done] == [f"part-0000{i}.parquet" for i in range(3)]  # lines 1..4500

    monkeypatch.setattr(pipeline_module, "parse_block", parse_block)
    preprocess([SAMPLE], out, **args)
    assert_same_output(out, reference)


def test_resume_does_not_read_inputs_whose_shards_are_all_complete(tmp_path, monkeypatch):
    lines = raw_lines()
    days = [write_lines(tmp_path / f"day_{i}.tsv.gz", lines[i * 3000 : (i + 1) * 3000]) for i in range(4)]
    args = {"rows_per_file": 1500, "block_size": 400, "layout": "terabyte"}
    reference = tmp_path / "reference"
    preprocess(days, reference, **args)

    parse_block = pipeline_module.parse_block

    def crash_in_the_test_split(block, skip_bad_lines):
        if block.path == days[-1] and block.first_line <= 800 < block.first_line + block.lines:
            raise InjectedCrash
        return parse_block(block, skip_bad_lines)

    out = tmp_path / "out"
    monkeypatch.setattr(pipeline_module, "parse_block", crash_in_the_test_split)
    with pytest.raises(InjectedCrash):
        preprocess(days, out, **args)
    monkeypatch.undo()
    opened = _record_opened_inputs(monkeypatch)
    preprocess(days, out, **args)
    assert opened == [days[-1]]  # the train shards (days 0-2) and val were kept
    assert_same_output(out, reference)


def test_terabyte_counts_the_lines_of_the_last_day_only(tmp_path, monkeypatch):
    lines = raw_lines()
    days = [write_lines(tmp_path / f"day_{i}.tsv.gz", lines[i * 2500 : (i + 1) * 2500]) for i in range(4)]
    counted = []
    count_lines = text_module.count_lines

    def recording_count_lines(path, progress=None):
        counted.append(path)
        return count_lines(path, progress)

    monkeypatch.setattr(text_module, "count_lines", recording_count_lines)
    metadata = preprocess(days, tmp_path / "out", layout="terabyte", block_size=600, rows_per_file=2000)
    assert counted == [days[-1]]
    assert metadata["rows"] == {"train": 7500, "val": 1250, "test": 1250}
    assert (
        read_split(tmp_path / "out", "val").column("C1").to_pylist() == reference_rows(lines)["C1"][7500:8750]
    )


def test_terabyte_resume_with_later_days_not_counted_yet(tmp_path, monkeypatch):
    lines = raw_lines()
    days = [write_lines(tmp_path / f"day_{i}.tsv.gz", lines[i * 3000 : (i + 1) * 3000]) for i in range(4)]
    args = {"rows_per_file": 1500, "block_size": 200, "layout": "terabyte", "workers": 2}
    reference = tmp_path / "reference"
    preprocess(days, reference, **args)

    parse_block = pipeline_module.parse_block

    # The reader runs at most ~6 blocks ahead of the crash: it does not reach the end of day 1.
    def crash_in_day_1(block, skip_bad_lines):
        if block.path == days[1] and block.first_line <= 300 < block.first_line + block.lines:
            raise InjectedCrash
        return parse_block(block, skip_bad_lines)

    out = tmp_path / "out"
    monkeypatch.setattr(pipeline_module, "parse_block", crash_in_day_1)
    with pytest.raises(InjectedCrash):
        preprocess(days, out, **args)
    manifest = json.loads((tmp_path / "out.partial" / "manifest.json").read_text())
    assert manifest["line_counts"][:3] == [3000, None, None]
    monkeypatch.undo()
    opened = _record_opened_inputs(monkeypatch)
    preprocess(days, out, **args)
    assert opened == days[1:]  # day 0 is skipped by its known count
    assert_same_output(out, reference)


def test_a_partial_run_being_written_by_another_process_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(
        pipeline_module, "parse_block", lambda block, skip: (_ for _ in ()).throw(InjectedCrash)
    )
    with pytest.raises(InjectedCrash):
        preprocess([SAMPLE], tmp_path / "out")
    monkeypatch.undo()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)",
         str(tmp_path / "out.partial" / "lock")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(PreprocessError, match="out.partial is being written by another preprocess"):
            preprocess([SAMPLE], tmp_path / "out")
    finally:
        holder.kill()
        holder.wait()
    preprocess([SAMPLE], tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["metadata.json", "test", "train", "val"]


def test_a_partial_run_with_other_arguments_is_started_anew(tmp_path, monkeypatch):
    monkeypatch.setattr(
        pipeline_module, "parse_block", lambda block, skip: (_ for _ in ()).throw(InjectedCrash)
    )
    with pytest.raises(InjectedCrash):
        preprocess([SAMPLE], tmp_path / "out", rows_per_file=1000)
    assert (tmp_path / "out.partial").is_dir()
    monkeypatch.undo()
    metadata = preprocess([SAMPLE], tmp_path / "out", rows_per_file=3000)
    assert metadata["files"]["train"] == [f"train/part-{i:05d}.parquet" for i in range(3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def peak_rss_mib(command: list[str]) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS, *command], cwd=REPO, check=True, capture_output=True
    )
    return int(out.stdout.split()[-1]) / 1024


def test_memory_is_bounded_by_the_block_size_not_the_input(tmp_path, big_gz):
    # Eight copies of one input (gzip members concatenated): the same distinct values, so the vocabularies
    # cost the same, and only holding lines could make the larger run's peak grow.
    copies = 8
    many = tmp_path / "many.tsv.gz"
    many.write_bytes(big_gz.read_bytes() * copies)
    flags = [
        "--block-size",
        "4096",
        "--workers",
        "2",
        "--rows-per-file",
        "50000",
        "--exact-distinct-limit",
        "4096",
    ]
    one_mib = peak_rss_mib(cli([big_gz], tmp_path / "one", *flags))
    many_mib = peak_rss_mib(cli([many], tmp_path / "many", *flags))
    # Holding the extra copies would take at least their text (7 x 46 MiB); streaming, they cost allocator
    # noise (within 12 MiB on the 2-core dev machine; 24 MiB seen on CI between inputs of different sizes).
    extra_text_mib = (copies - 1) * len(gzip.decompress(big_gz.read_bytes())) / 2**20
    assert many_mib - one_mib < extra_text_mib / 4, (one_mib, many_mib, extra_text_mib)


@pytest.fixture(scope="module")
def bad_gz(tmp_path_factory, big_gz) -> tuple[Path, list[bytes]]:
    """The big input with C7 of line 123,457 made non-hex, as two gzip members (the second from line
    100,001), and its lines."""
    lines = gzip.decompress(big_gz.read_bytes()).split(b"\n")[:-1]
    fields = lines[123_456].split(b"\t")
    fields[20] = b"xyz"
    lines[123_456] = b"\t".join(fields)
    path = tmp_path_factory.mktemp("bad") / "bad.tsv.gz"
    path.write_bytes(
        gzip.compress(b"\n".join(lines[:100_000]) + b"\n", compresslevel=1)
        + gzip.compress(b"\n".join(lines[100_000:]) + b"\n", compresslevel=1)
    )
    return path, lines


def test_bad_line_deep_in_a_large_gz_stream_is_named(tmp_path, bad_gz):
    path, _ = bad_gz
    proc = subprocess.run(cli([path], tmp_path / "out"), cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"error: {path} line 123457: C7: expected 1 to 8 hex digits, got 'xyz'"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_bad_line_deep_in_a_large_gz_stream_is_skipped_and_counted(tmp_path, bad_gz):
    path, lines = bad_gz
    metadata = preprocess(
        [path], tmp_path / "out", skip_bad_lines=True, eval_fraction=0.0, rows_per_file=60_000
    )
    assert metadata["skipped_lines"] == 1
    assert metadata["rows"] == {"train": BIG_LINES - 1, "val": 0, "test": 0}
    assert [pq.read_metadata(tmp_path / "out" / f).num_rows for f in metadata["files"]["train"]] == [
        60_000, 60_000, 59_999, 20_000,
    ]  # fmt: skip
    good = lines[:123_456] + lines[123_457:]
    c1 = [int(line.split(b"\t", 15)[14], 16) for line in good]
    assert read_split(tmp_path / "out", "train").column("C1").to_pylist() == c1


def test_split_block_cuts_whole_lines_in_order():
    rng = random.Random(0)
    for _ in range(500):
        data = b"".join(b"x" * rng.randrange(30) + b"\n" for _ in range(rng.randrange(1, 80)))
        if rng.random() < 0.5:
            data += b"last line without a newline"
        lines = data.count(b"\n") + (not data.endswith(b"\n"))
        max_lines = rng.randrange(1, 100)
        pieces = text_module.split_block(TextBlock(Path("x.tsv"), 11, lines, data), max_lines)
        assert b"".join(p.data for p in pieces) == data
        assert [p.first_line for p in pieces] == [
            11 + sum(p.lines for p in pieces[:i]) for i in range(len(pieces))
        ]
        assert all(p.lines == p.data.count(b"\n") + (not p.data.endswith(b"\n")) > 0 for p in pieces)
        assert sum(p.lines for p in pieces) == lines
        assert len(pieces) <= -(-lines // max_lines)


def test_blocks_parsed_in_pieces_give_the_same_output(tmp_path, monkeypatch):
    args = {"rows_per_file": 1500, "block_size": 400, "layout": "kaggle"}
    reference = tmp_path / "reference"
    preprocess([SAMPLE], reference, **args)
    monkeypatch.setattr(pipeline_module, "PARSE_LINES", 37)
    preprocess([SAMPLE], tmp_path / "out", **args)
    assert_same_output(tmp_path / "out", reference)
    assert pq.read_metadata(tmp_path / "out" / "train" / "part-00000.parquet").row_group(0).num_rows == 400


def write_lines(path: Path, lines: list[str]) -> Path:
    data = "".join(line + "\n" for line in lines).encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


@pytest.mark.parametrize(
    "layout, cuts, expected",
    [
        ("kaggle", [0, 4100, 10_000], {"train": 8572, "val": 714, "test": 714}),
        ("terabyte", [0, 3000, 6000, 9000, 10_000], {"train": 9000, "val": 500, "test": 500}),
        ("fraction", [0, 2500, 7999, 10_000], {"train": 8000, "val": 1000, "test": 1000}),
    ],
)
def test_split_layouts_are_row_exact_across_blocks_shards_and_files(tmp_path, layout, cuts, expected):
    lines = raw_lines()
    inputs = [
        write_lines(tmp_path / f"day_{i}.tsv{'.gz' if i % 2 else ''}", lines[a:b])
        for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:], strict=True))
    ]
    out = tmp_path / "out"
    metadata = preprocess(inputs, out, layout=layout, rows_per_file=1000, block_size=97, workers=3)
    assert metadata["rows"] == expected
    reference = reference_rows(lines)
    first = 0
    for split, rows in expected.items():
        table = read_split(out, split)
        for name in RAW_COLUMNS:
            assert table.column(name).to_pylist() == reference[name][first : first + rows], (split, name)
        sizes = [pq.read_metadata(out / f).num_rows for f in metadata["files"][split]]
        assert sizes == [1000] * (rows // 1000) + ([rows % 1000] if rows % 1000 else [])
        first += rows


def test_vocabularies_and_estimated_cardinalities(tmp_path):
    out = tmp_path / "out"
    metadata = preprocess([SAMPLE], out, min_frequency=3, exact_distinct_limit=400)
    assert metadata["min_frequency"] == 3 and metadata["exact_distinct_limit"] == 400
    train = [line.split("\t") for line in raw_lines()[:8000]]
    for i, name in enumerate(SPARSE_COLUMNS, start=14):
        counts = Counter(int(f[i], 16) for f in train if f[i])
        entry = metadata["categorical"][name]
        assert entry["exact"] == (len(counts) <= 400), name
        assert entry["cardinality"] == pytest.approx(len(counts), rel=0 if entry["exact"] else 0.03), name
        kept = sorted(v for v, c in counts.items() if c >= 3)
        vocab = pq.read_table(out / entry["vocab"])
        assert entry["vocab"] == f"vocab/{name}.parquet" and entry["vocab_size"] == len(kept)
        assert vocab.schema == pa.schema([("value", pa.int64()), ("count", pa.int64())])
        assert vocab.column("value").to_pylist() == kept
        assert vocab.column("count").to_pylist() == [counts[v] for v in kept]
    assert not any(c["exact"] for c in metadata["categorical"].values() if c["cardinality"] > 450)
    assert read_split(out, "train").column(LABEL).to_pylist() == reference_rows(raw_lines()[:8000])[LABEL]


def test_new_bad_arguments(tmp_path):
    for kwargs, words in (
        ({"block_size": 0}, "block size must be at least 1"),
        ({"workers": 0}, "workers must be at least 1"),
        ({"min_frequency": 0}, "min frequency must be at least 1"),
        ({"exact_distinct_limit": -1}, "exact distinct limit must be at least 0"),
    ):
        with pytest.raises(PreprocessError, match=words):
            preprocess([SAMPLE], tmp_path / "out", **kwargs)
    assert not any(tmp_path.iterdir())


def test_progress_bar_shows_rows_per_second_and_eta(tmp_path, monkeypatch):
    shown = io.StringIO()
    monkeypatch.setattr(
        pipeline_module,
        "tqdm",
        lambda **kwargs: tqdm(**kwargs | {"file": shown, "disable": False, "mininterval": 0}),
    )
    preprocess([SAMPLE], tmp_path / "out", block_size=1000)
    last = shown.getvalue().split("\r")[-1]
    assert last.startswith("preprocess: 100%")
    assert "rows/s" in last and "<00:00" in last  # rows/s, and elapsed<remaining
