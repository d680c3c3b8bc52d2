"""Tests of dlrm.data.parse: the fast path accepts a block only when it gives what the checked path gives."""

import random
from pathlib import Path

from dlrm.data.parse import _parse_checked, _parse_fast
from dlrm.data.schema import DENSE_COLUMNS
from dlrm.data.text import TextBlock
from tests.test_preprocess import raw_lines

# Field values around what each path accepts: looser integer syntaxes pyarrow reads, lengths, cases, bytes.
TRICKY = {
    "label": [b"0", b"1", b"", b"-", b"/", b"2", b"00", b"01", b" 1", b"1 ", b"+1", b"x", b"\xff"],
    "dense": [
        b"", b"0", b"-1", b"5", b"-0", b"007", b"1.5", b"1e3", b"0x1f", b"0X1F", b" 5", b"5 ", b"+5", b"--1",
        b"-", b"a", b"nan", b"NULL", b"99999999999999999", b"999999999999999999", b"1000000000000000000",
        b"-999999999999999999", b"-1000000000000000000", b"0000000000000000000005", b"\xd9\xa3", b"\x0b5",
        b"5\x0c", b"\x005", b"!5", b"#5", b"5,", b"(5)",
    ],
    "sparse": [
        b"", b"0a1b2c3d", b"ABCDEF12", b"abcdef12", b"AbCdEf12", b"ffffffff", b"00000000", b"1", b"1234567",
        b"123456789", b"0x1234ab", b"g1234567", b"G1234567", b"-1234567", b" 1234567", b"1234567 ",
        b"+1234567", b"@1234567", b"`1234567", b"12:45678", b"\xc3\xa9123456", b"\xff1234567",
    ],
}  # fmt: skip


def kind(field: int) -> str:
    return "label" if field == 0 else "dense" if field <= len(DENSE_COLUMNS) else "sparse"


def test_fast_and_checked_paths_agree_on_tricky_fields():
    rng = random.Random(0)
    lines = [line.encode().split(b"\t") for line in raw_lines()[:40]]
    taken = rejected = 0
    for _ in range(250):
        fields = [list(f) for f in lines]
        for _ in range(rng.choice([0, 1, 1, 2])):
            field = rng.randrange(40)
            fields[rng.randrange(len(fields))][field] = rng.choice(TRICKY[kind(field)])
        data = b"".join(b"\t".join(f) + b"\n" for f in fields)
        block = TextBlock(Path("x.tsv"), 1, len(fields), data)
        fast = _parse_fast(block)
        rows, bad_lines = _parse_checked(block, skip_bad_lines=True)
        if fast is None:
            rejected += 1
        else:
            taken += 1
            assert bad_lines == 0, data
            assert fast.equals(rows)
    assert taken > 30 and rejected > 30  # both paths were exercised
