"""Tests of dlrm.data.preprocess on the shipped real Criteo rows, parsed independently in plain Python."""

import gzip
import json
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dlrm import __version__
from dlrm.data.output import load_metadata
from dlrm.data.preprocess import PreprocessError, preprocess
from dlrm.data.schema import DENSE_COLUMNS, LABEL, RAW_COLUMNS, SPARSE_COLUMNS

REPO = Path(__file__).parents[1]
SAMPLE = REPO / "data" / "day_0_head10k.tsv.gz"


def raw_lines() -> list[str]:
    return gzip.decompress(SAMPLE.read_bytes()).decode().splitlines()


def reference_rows(lines: list[str]) -> dict[str, list]:
    """Column name -> values, parsed field by field with plain Python."""
    fields = [line.split("\t") for line in lines]
    columns = {LABEL: [float(int(f[0])) for f in fields]}
    for i, name in enumerate(DENSE_COLUMNS, start=1):
        columns[name] = [float(int(f[i])) if f[i] else 0.0 for f in fields]
    for i, name in enumerate(SPARSE_COLUMNS, start=1 + len(DENSE_COLUMNS)):
        columns[name] = [int(f[i], 16) if f[i] else -1 for f in fields]
    return columns


def read_split(out: Path, split: str) -> pa.Table:
    files = load_metadata(out)["files"][split]
    return pa.concat_tables([pq.read_table(out / f) for f in files])


def write_tsv(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def corrupt(lines: list[str], line_number: int, field: int, value: str | None) -> list[str]:
    """A copy of `lines` with field `field` of 1-based line `line_number` replaced (None: removed)."""
    lines = list(lines)
    fields = lines[line_number - 1].split("\t")
    if value is None:
        del fields[field]
    else:
        fields[field] = value
    lines[line_number - 1] = "\t".join(fields)
    return lines


@pytest.fixture(scope="module")
def lines() -> list[str]:
    return raw_lines()


@pytest.fixture(scope="module")
def sample_out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pre") / "criteo_sample"
    preprocess([SAMPLE], out, eval_fraction=0.2)
    return out


def test_splits_are_the_first_80_then_10_and_10_percent(sample_out, lines):
    """--eval-fraction 0.2 is shorthand for val 0.1 + test 0.1: train, val, test in file order, each line
    in exactly one split."""
    metadata = load_metadata(sample_out)
    assert metadata["rows"] == {"train": 8000, "val": 1000, "test": 1000}
    assert metadata["layout"] == "fraction"
    assert (metadata["val_fraction"], metadata["test_fraction"]) == (0.1, 0.1)
    reference = reference_rows(lines)
    for split, rows in (("train", slice(0, 8000)), ("val", slice(8000, 9000)), ("test", slice(9000, 10000))):
        table = read_split(sample_out, split)
        for name in RAW_COLUMNS:
            assert table.column(name).to_pylist() == reference[name][rows], (split, name)
    splits = ("train", "val", "test")
    assert sum(np.sum(read_split(sample_out, s).column(LABEL).to_numpy()) for s in splits) == 265


def test_val_and_test_fractions_cut_the_tail_in_file_order(tmp_path, lines):
    """--val-fraction 0.15 --test-fraction 0.05 of 1,000 lines: train 800, val 150, test the last 50; no
    line in two splits (the rows, numbered by I1 = line number, partition 0..999 in order)."""
    fields = [line.split("\t") for line in lines[:1000]]
    numbered = ["\t".join([f[0], str(i), *f[2:]]) for i, f in enumerate(fields)]
    out = tmp_path / "out"
    metadata = preprocess(
        [write_tsv(tmp_path / "x.tsv", numbered)], out, val_fraction=0.15, test_fraction=0.05
    )
    assert metadata["rows"] == {"train": 800, "val": 150, "test": 50}
    assert (metadata["val_fraction"], metadata["test_fraction"]) == (0.15, 0.05)
    ids = {s: read_split(out, s).column("I1").to_pylist() for s in ("train", "val", "test")}
    assert ids["train"] + ids["val"] + ids["test"] == list(range(1000))
    assert ids["val"] == list(range(800, 950)) and ids["test"] == list(range(950, 1000))


def test_default_fractions_are_a_tenth_each(tmp_path, lines):
    metadata = preprocess([write_tsv(tmp_path / "x.tsv", lines[:100])], tmp_path / "out")
    assert metadata["rows"] == {"train": 80, "val": 10, "test": 10}
    assert (metadata["val_fraction"], metadata["test_fraction"]) == (0.1, 0.1)


def test_parquet_schema(sample_out):
    schema = pq.read_schema(sample_out / "train" / "part-00000.parquet")
    assert schema.names == RAW_COLUMNS
    assert schema.field(LABEL).type == pa.float32()
    assert all(schema.field(c).type == pa.float32() for c in DENSE_COLUMNS)
    assert all(schema.field(c).type == pa.int64() for c in SPARSE_COLUMNS)


def test_hex_values_are_unsigned_32_bit(tmp_path, lines):
    line = corrupt(corrupt(lines, 1, 14, "ffffffff"), 1, 15, "")[0]
    out = tmp_path / "out"
    preprocess([write_tsv(tmp_path / "x.tsv", [line, line])], out, val_fraction=0.0, test_fraction=0.0)
    table = read_split(out, "train")
    assert table.column("C1").to_pylist() == [4294967295, 4294967295]
    assert table.column("C2").to_pylist() == [-1, -1]


def test_metadata_matches_reference(sample_out, lines):
    metadata = json.loads((sample_out / "metadata.json").read_text())
    assert metadata["version"] == __version__
    assert metadata["source"] == [str(SAMPLE)]
    assert metadata["skipped_lines"] == 0
    assert metadata["files"] == {s: [f"{s}/part-00000.parquet"] for s in ("train", "val", "test")}
    train, val, test = (
        [line.split("\t") for line in lines[:8000]],
        [line.split("\t") for line in lines[8000:9000]],
        [line.split("\t") for line in lines[9000:]],
    )
    assert metadata["positive_rate"]["train"] == pytest.approx(sum(int(f[0]) for f in train) / 8000)
    assert metadata["positive_rate"]["val"] == pytest.approx(sum(int(f[0]) for f in val) / 1000)
    assert metadata["positive_rate"]["test"] == pytest.approx(sum(int(f[0]) for f in test) / 1000)
    for i, name in enumerate(SPARSE_COLUMNS, start=14):
        assert metadata["categorical"][name]["cardinality"] == len({f[i] for f in train if f[i]}), name
    for i, name in enumerate(DENSE_COLUMNS, start=1):
        values = [int(f[i]) if f[i] else 0 for f in train]
        stats = metadata["dense"][name]
        assert stats["min"] == pytest.approx(min(values)), name
        assert stats["max"] == pytest.approx(max(values), rel=1e-6), name
        assert stats["mean"] == pytest.approx(sum(values) / len(values), rel=1e-6), name


def test_shards_and_small_blocks_give_the_same_rows(tmp_path, sample_out):
    # 260-line blocks that do not divide the shards, exercising the block bookkeeping.
    out = tmp_path / "out"
    metadata = preprocess([SAMPLE], out, eval_fraction=0.2, rows_per_file=3000, block_size=260, workers=3)
    assert metadata["files"]["train"] == [f"train/part-{i:05d}.parquet" for i in range(3)]
    assert [pq.read_metadata(out / f).num_rows for f in metadata["files"]["train"]] == [3000, 3000, 2000]
    assert metadata["files"]["test"] == ["test/part-00000.parquet"]
    reference = load_metadata(sample_out)
    assert metadata["rows"] == reference["rows"]
    assert metadata["categorical"] == reference["categorical"]
    assert metadata["positive_rate"] == pytest.approx(reference["positive_rate"])
    for name in DENSE_COLUMNS:
        # Sums taken block by block differ in the last bits.
        assert metadata["dense"][name] == pytest.approx(reference["dense"][name], rel=1e-12), name
    for split in ("train", "val", "test"):
        assert read_split(out, split).equals(read_split(sample_out, split))


def test_several_inputs_split_by_position_over_all_lines(tmp_path, lines, sample_out):
    first = tmp_path / "a.tsv.gz"
    first.write_bytes(gzip.compress("".join(line + "\n" for line in lines[:9000]).encode()))
    # The second file is plain text and has no final newline.
    second = tmp_path / "b.tsv"
    second.write_text("\n".join(lines[9000:]))
    out = tmp_path / "out"
    metadata = preprocess([first, second], out)
    assert metadata["source"] == [str(first), str(second)]
    assert metadata["rows"] == {"train": 8000, "val": 1000, "test": 1000}
    for split in ("train", "val", "test"):
        assert read_split(out, split).equals(read_split(sample_out, split))


def test_existing_output_dir_needs_overwrite(tmp_path, lines):
    tsv = write_tsv(tmp_path / "x.tsv", lines[:100])
    out = tmp_path / "out"
    preprocess([tsv], out)
    with pytest.raises(PreprocessError, match="already exists"):
        preprocess([tsv], out)
    metadata = preprocess([write_tsv(tmp_path / "y.tsv", lines[:50])], out, overwrite=True)
    assert load_metadata(out)["rows"] == metadata["rows"] == {"train": 40, "val": 5, "test": 5}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "x.tsv", "y.tsv"]

    unrelated = tmp_path / "unrelated"
    unrelated.mkdir()
    (unrelated / "keep.txt").write_text("precious")
    with pytest.raises(PreprocessError, match="is not a data directory"):
        preprocess([tsv], unrelated, overwrite=True)
    assert (unrelated / "keep.txt").read_text() == "precious"


def test_bad_arguments(tmp_path, lines):
    tsv = write_tsv(tmp_path / "x.tsv", lines[:10])
    with pytest.raises(PreprocessError, match="--eval-fraction must be in"):
        preprocess([tsv], tmp_path / "out", eval_fraction=1.0)
    with pytest.raises(PreprocessError, match="--val-fraction must be in"):
        preprocess([tsv], tmp_path / "out", val_fraction=-0.1)
    with pytest.raises(PreprocessError, match="--test-fraction must be in"):
        preprocess([tsv], tmp_path / "out", test_fraction=1.0)
    with pytest.raises(PreprocessError, match=r"--val-fraction 0.5 \+ --test-fraction 0.5 must be below 1"):
        preprocess([tsv], tmp_path / "out", val_fraction=0.5, test_fraction=0.5)
    with pytest.raises(PreprocessError, match="--eval-fraction F is shorthand"):
        preprocess([tsv], tmp_path / "out", eval_fraction=0.2, test_fraction=0.1)
    with pytest.raises(PreprocessError, match="--val-fraction: only for --layout fraction"):
        preprocess([tsv], tmp_path / "out", layout="kaggle", val_fraction=0.1)
    with pytest.raises(PreprocessError, match="rows per file"):
        preprocess([tsv], tmp_path / "out", rows_per_file=0)
    with pytest.raises(PreprocessError, match="no input files"):
        preprocess([], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_load_metadata_missing(tmp_path):
    with pytest.raises(
        FileNotFoundError, match="metadata.json not found: run python -m dlrm.data.preprocess"
    ):
        load_metadata(tmp_path)


def truncated_gz(tmp_path: Path) -> tuple[Path, int]:
    """A copy of the sample cut in the middle of its gzip stream, and the first line it cannot complete."""
    cut = SAMPLE.read_bytes()[: SAMPLE.stat().st_size // 2]
    readable = zlib.decompressobj(wbits=31).decompress(cut)
    path = tmp_path / "cut.tsv.gz"
    path.write_bytes(cut)
    return path, readable.count(b"\n") + 1


def bad_input(tmp_path: Path, case: str) -> tuple[list[Path], Path, int | None, str]:
    """(inputs, file the error is in, its line number, expected words) for each kind of bad input."""
    lines = raw_lines()[:300]
    if case == "field count":
        path = write_tsv(tmp_path / "x.tsv", corrupt(lines, 17, 39, None))
        return [path], path, 17, "expected 40 tab-separated fields, got 39"
    if case == "non-hex category":
        path = write_tsv(tmp_path / "x.tsv", corrupt(lines, 5, 16, "zz12"))
        return [path], path, 5, "C3: expected 1 to 8 hex digits, got 'zz12'"
    if case == "long category":
        path = write_tsv(tmp_path / "x.tsv", corrupt(lines, 300, 39, "123456789"))
        return [path], path, 300, "C26: expected 1 to 8 hex digits"
    if case == "non-integer count":
        path = write_tsv(tmp_path / "x.tsv", corrupt(lines, 9, 4, "1.5"))
        return [path], path, 9, "I4: expected an integer, got '1.5'"
    if case == "bad label":
        path = write_tsv(tmp_path / "x.tsv", corrupt(lines, 2, 0, "2"))
        return [path], path, 2, "label: expected 0 or 1, got '2'"
    if case == "label minus":
        path = write_tsv(tmp_path / "x.tsv", corrupt(lines, 7, 0, "-"))
        return [path], path, 7, "label: expected 0 or 1, got '-'"
    if case == "second file":
        first = write_tsv(tmp_path / "a.tsv", lines[:100])
        path = write_tsv(tmp_path / "b.tsv", corrupt(lines[100:], 3, 1, "x"))
        return [first, path], path, 3, "I1: expected an integer"
    if case == "empty file":
        path = tmp_path / "empty.tsv"
        path.write_bytes(b"")
        return [path], path, 1, "file is empty"
    if case == "empty gz":
        path = tmp_path / "empty.tsv.gz"
        path.write_bytes(gzip.compress(b""))
        return [path], path, 1, "file is empty"
    if case == "truncated gz":
        path, line = truncated_gz(tmp_path)
        return [path], path, line, "truncated or corrupt gzip data"
    if case == "missing file":
        path = tmp_path / "nope.tsv.gz"
        return [path], path, None, "no such file"
    raise AssertionError(case)


BAD_INPUTS = [
    "field count",
    "non-hex category",
    "long category",
    "non-integer count",
    "bad label",
    "label minus",
    "second file",
    "empty file",
    "empty gz",
    "truncated gz",
    "missing file",
]


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_fails_with_one_line(tmp_path, case):
    inputs, path, line, words = bad_input(tmp_path, case)
    out = tmp_path / "out"
    args = [arg for p in inputs for arg in ("--input", str(p))]
    proc = subprocess.run(
        [sys.executable, "-m", "dlrm.data.preprocess", *args, "--output-dir", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    [message] = proc.stderr.splitlines()
    where = f"{path}" if line is None else f"{path} line {line}: "
    assert message.startswith(f"error: {where}"), message
    assert words in message
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in inputs if p.exists())


@pytest.mark.parametrize("bad_line", [1, 2, 259, 260, 261, 262, 263, 520, 521, 9999, 10000])
def test_error_line_is_exact_across_block_boundaries(tmp_path, lines, bad_line):
    tsv = write_tsv(tmp_path / "x.tsv", corrupt(lines, bad_line, 20, "not-hex"))
    with pytest.raises(PreprocessError, match=f"x.tsv line {bad_line}: C7:"):
        preprocess([tsv], tmp_path / "out", block_size=260)
    tsv = write_tsv(tmp_path / "y.tsv", corrupt(lines, bad_line, 20, None))
    with pytest.raises(PreprocessError, match=f"y.tsv line {bad_line}: expected 40 .* got 39"):
        preprocess([tsv], tmp_path / "out", block_size=260)


def test_first_error_in_file_order_wins(tmp_path, lines):
    # A short line after a bad cell in the same block: the bad cell, earlier in the file, is reported.
    bad = corrupt(corrupt(lines[:100], 10, 3, "-"), 20, 5, None)
    with pytest.raises(PreprocessError, match="line 10: I3"):
        preprocess([write_tsv(tmp_path / "x.tsv", bad)], tmp_path / "out")
    bad = corrupt(corrupt(lines[:100], 30, 3, "-"), 20, 5, None)
    with pytest.raises(PreprocessError, match="line 20: expected 40"):
        preprocess([write_tsv(tmp_path / "y.tsv", bad)], tmp_path / "out")


@pytest.mark.parametrize("block_size", [260, 1 << 17])
def test_skip_bad_lines(tmp_path, lines, block_size):
    bad_lines = {17: (39, None), 300: (16, "zz"), 4000: (4, "1.5"), 9500: (0, ""), 10000: (5, None)}
    corrupted = list(lines)
    for line, (field, value) in bad_lines.items():
        corrupted = corrupt(corrupted, line, field, value)
    corrupted.insert(5000, "")  # an empty line is a bad line too (it is line 5001)
    tsv = write_tsv(tmp_path / "x.tsv", corrupted)
    out = tmp_path / "out"
    metadata = preprocess([tsv], out, skip_bad_lines=True, block_size=block_size)
    assert metadata["skipped_lines"] == 6

    # The split is by line position: 10,001 lines -> lines 1..8001 train, 8002..9001 val, 9002.. test.
    good = [
        (i, line) for i, line in enumerate(corrupted, start=1) if i not in {17, 300, 4000, 5001, 9501, 10001}
    ]
    expected_rows = {
        "train": [line for i, line in good if i <= 8001],
        "val": [line for i, line in good if 8001 < i <= 9001],
        "test": [line for i, line in good if i > 9001],
    }
    assert metadata["rows"] == {split: len(rows) for split, rows in expected_rows.items()}
    assert metadata["rows"] == {"train": 7997, "val": 1000, "test": 998}
    for split, expected in expected_rows.items():
        table = read_split(out, split)
        reference = reference_rows(expected)
        for name in RAW_COLUMNS:
            assert table.column(name).to_pylist() == reference[name], (split, name)


def test_skip_bad_lines_still_fails_on_truncated_gz(tmp_path):
    path, line = truncated_gz(tmp_path)
    with pytest.raises(PreprocessError, match=f"line {line}: truncated"):
        preprocess([path], tmp_path / "out", skip_bad_lines=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.tsv.gz"]


def test_counts_past_float32_exact_range_are_kept(tmp_path):
    """Criteo's I5 reaches ~23M, past 2**24: such a count rounds to the nearest float32 instead of failing."""
    fields = ["0", *["1"] * 13, *["0a1b2c3d"] * 26]
    fields[5] = "23000001"  # I5
    path = tmp_path / "big.tsv"
    path.write_text("\t".join(fields) + "\n" + "\t".join(["1", *fields[1:]]) + "\n")
    preprocess([path], tmp_path / "out", eval_fraction=0.5)
    value = pq.read_table(tmp_path / "out" / "train").column("I5")[0].as_py()
    assert value == pytest.approx(23000001, rel=1e-7)


def test_kaggle_layout_cuts_seven_days_and_halves_the_last(tmp_path, lines):
    """FB-DLRM's Kaggle split: 10,000 lines -> days of 1429 x 4 and 1428 x 3; days 0-5 train (8572 lines),
    day 6 (1428 lines) halved into val then test."""
    out = tmp_path / "kaggle"
    metadata = preprocess([SAMPLE], out, layout="kaggle", rows_per_file=3000)
    assert metadata["layout"] == "kaggle" and metadata["val_fraction"] is metadata["test_fraction"] is None
    assert metadata["rows"] == {"train": 8572, "val": 714, "test": 714}
    reference = reference_rows(lines)
    for split, rows in (("train", slice(0, 8572)), ("val", slice(8572, 9286)), ("test", slice(9286, 10000))):
        table = read_split(out, split)
        for name in (LABEL, "I5", "C3"):
            assert table.column(name).to_pylist() == reference[name][rows], (split, name)


def test_terabyte_layout_halves_the_last_input(tmp_path, lines):
    days = [write_tsv(tmp_path / f"day_{i}", lines[i * 3000 : (i + 1) * 3000]) for i in range(3)]
    days.append(write_tsv(tmp_path / "day_3", lines[9000:9101]))  # 101 lines: val gets the odd one
    out = tmp_path / "terabyte"
    metadata = preprocess(days, out, layout="terabyte")
    assert metadata["rows"] == {"train": 9000, "val": 51, "test": 50}
    reference = reference_rows(lines)
    assert read_split(out, "test").column("C1").to_pylist() == reference["C1"][9051:9101]


def test_terabyte_layout_needs_separate_days(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "dlrm.data.preprocess", "--input", str(SAMPLE), "--output-dir",
         str(tmp_path / "out"), "--layout", "terabyte"],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: layout terabyte needs the days as separate inputs (day_0 .. day_23)"
    ]
    assert not (tmp_path / "out").exists()


def test_a_run_does_not_import_pandas(tmp_path):
    # Importing pandas would cost every run ~0.15 s, and ~0.1 s more at exit (see dlrm.data.arrow).
    code = (
        "import sys; from dlrm.data.preprocess import main; "
        "main(sys.argv[1:], standalone_mode=False); print('pandas' in sys.modules)"
    )
    args = ["--input", str(SAMPLE), "--output-dir", str(tmp_path / "out")]
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False"]


def test_preprocess_does_not_import_torch():
    """torch's import (about 1.2 s and 200 MiB) once doubled the time of a 1M-row preprocess
    (bench_preprocess: 2.6x gzip -dc's time instead of 1.3x); only --binary needs it."""
    code = (
        "import sys, dlrm.data.preprocess; print([m for m in sys.modules if m.split('.')[0] == 'torch'][:3])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stdout
