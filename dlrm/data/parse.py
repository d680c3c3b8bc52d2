"""Parse and validate one block of raw Criteo lines into preprocess's OUTPUT_SCHEMA.

A line is good when it has 40 tab-separated fields: `label` "0" or "1"; `I1..I13` empty or an integer of
at most 18 digits (leading zeros aside) with an optional "-"; `C1..C26` empty or 1 to 8 hex digits.
Output: `label` float32; `I1..I13` float32 (missing -> 0; counts past 2**24 round to the nearest float32);
`C1..C26` int64, the hex id read as an unsigned 32-bit number (missing -> -1).

Two paths, same result (tests/test_parse.py compares them on tricky fields). The fast path handles
blocks as Criteo writes them (ids of exactly 8 digits, no bytes past "f" nor below "-" but tabs and
newlines): pyarrow's CSV reader with typed columns, ids tested and decoded two hex digits at a time by
a table look-up. Any block the fast path does not accept goes through the checked path,
which validates every field and finds the first bad line with its number (or drops bad lines).
"""

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv

from dlrm.data.arrow import from_numpy
from dlrm.data.schema import DENSE_COLUMNS, LABEL, MISSING_CATEGORY, RAW_COLUMNS, SPARSE_COLUMNS
from dlrm.data.text import PreprocessError, TextBlock

OUTPUT_SCHEMA = pa.schema(
    [
        pa.field(LABEL, pa.float32()),
        *(pa.field(c, pa.float32()) for c in DENSE_COLUMNS),
        *(pa.field(c, pa.int64()) for c in SPARSE_COLUMNS),
    ]
)

# At most 18 digits after leading zeros, so every accepted count fits in int64 without an overflow check.
_INTEGER_PATTERN = "^-?0*[0-9]{1,18}$"
_INTEGER_LIMIT = 10**18  # the fast path takes the integers of absolute value below it, as the pattern does
_HEX_PATTERN = "^[0-9a-fA-F]{1,8}$"
# Byte -> hex digit value; only bytes that passed _HEX_PATTERN (or the padding "0") are looked up.
_HEX_DIGIT_VALUE = np.zeros(256, dtype=np.uint64)
for _digits, _first in ((b"0123456789", 0), (b"abcdef", 10), (b"ABCDEF", 10)):
    _HEX_DIGIT_VALUE[np.frombuffer(_digits, dtype=np.uint8)] = np.arange(_first, _first + len(_digits))
_HEX_SHIFTS = np.arange(28, -1, -4, dtype=np.uint64)  # bit position of each of the 8 hex digits
_FAST_TYPES = {
    LABEL: pa.binary(),
    **{c: pa.int64() for c in DENSE_COLUMNS},
    **{c: pa.binary() for c in SPARSE_COLUMNS},
}
_LOOSE_INTEGER_BYTES = (b"X", b" ")
_ZERO = from_numpy(np.zeros(1, dtype=np.int64))[0]  # what a missing count becomes
# Two bytes read as a little-endian uint16 (first byte low) -> the number their two hex digits write, first
# digit high; 0xFFFF when either byte is not a hex digit.
_IS_HEX_DIGIT = np.zeros(256, dtype=bool)
_IS_HEX_DIGIT[np.frombuffer(b"0123456789abcdefABCDEF", dtype=np.uint8)] = True
_FIRST, _SECOND = np.arange(1 << 16) & 0xFF, np.arange(1 << 16) >> 8
_PAIR_VALUE = np.where(
    _IS_HEX_DIGIT[_FIRST] & _IS_HEX_DIGIT[_SECOND],
    _HEX_DIGIT_VALUE[_FIRST] * 16 + _HEX_DIGIT_VALUE[_SECOND],
    0xFFFF,
).astype(np.uint16)


def parse_block(block: TextBlock, skip_bad_lines: bool) -> tuple[pa.RecordBatch, int]:
    """The good lines of `block` as rows in OUTPUT_SCHEMA, in line order, and the number of bad lines.

    Raises:
        PreprocessError: a bad line (the first in the block) unless `skip_bad_lines`, or a carriage return
            that is not part of a line end; the message names the file and line.
    """
    rows = _parse_fast(block)
    if rows is not None:
        return rows, 0
    return _parse_checked(block, skip_bad_lines)


def _read_csv(data: bytes, types: dict, on_invalid_row=None) -> pa.Table:
    return pcsv.read_csv(
        pa.py_buffer(data),
        read_options=pcsv.ReadOptions(
            # Serial parsing: the caller runs blocks in parallel, and line numbers of bad rows need it.
            column_names=RAW_COLUMNS,
            use_threads=False,
            block_size=min(max(len(data) + 1, 1 << 20), (1 << 31) - 1),
        ),
        # Empty lines are kept as rows (of empty fields) so that every line is a row or a reported error.
        parse_options=pcsv.ParseOptions(
            delimiter="\t", quote_char=False, invalid_row_handler=on_invalid_row, ignore_empty_lines=False
        ),
        convert_options=pcsv.ConvertOptions(column_types=types, null_values=[""], strings_can_be_null=False),
    )


def _parse_fast(block: TextBlock) -> pa.RecordBatch | None:
    """The block's rows, or None when the block needs the checked path (see the module docstring)."""
    # pyarrow reads integers more loosely than Criteo writes them: "0x1f", "0X1F", " 5 " (it rejects other
    # white space). So: no byte past "f", no "X", no space (a "\r" would end a row: the row count tells).
    if np.frombuffer(block.data, dtype=np.uint8).max() > ord("f") or any(
        block.data.find(byte) >= 0 for byte in _LOOSE_INTEGER_BYTES
    ):
        return None
    try:
        table = _read_csv(block.data, _FAST_TYPES).combine_chunks()
    except pa.ArrowInvalid:
        return None
    if table.num_rows != block.lines:
        return None
    label = _one_chunk(table.column(LABEL))
    taken = _fixed_width_bytes(label, 1)
    if taken is None or taken[1] is not None:  # a label of another length, or an empty one
        return None
    label_values = taken[0] - np.uint8(ord("0"))  # wraps around below "0"
    if np.any(label_values > 1):
        return None
    arrays = [from_numpy(label_values.astype(np.float32))]
    for name in DENSE_COLUMNS:
        counts = _one_chunk(table.column(name))
        low, high = pc.min_max(counts).values()
        if (low.as_py() or 0) <= -_INTEGER_LIMIT or (high.as_py() or 0) >= _INTEGER_LIMIT:
            return None
        # Not a safe cast: counts past 2**24 (Criteo's I5 reaches ~23M) round to the nearest float32.
        arrays.append(pc.cast(pc.fill_null(counts, _ZERO), pa.float32(), safe=False))
    for name in SPARSE_COLUMNS:
        ids = _hex_ids(_one_chunk(table.column(name)))
        if ids is None:
            return None
        arrays.append(from_numpy(ids))
    return pa.RecordBatch.from_arrays(arrays, schema=OUTPUT_SCHEMA)


def _one_chunk(column: pa.ChunkedArray) -> pa.Array:
    return column.chunk(0) if column.num_chunks == 1 else pa.concat_arrays(column.chunks)


def _fixed_width_bytes(values: pa.Array, width: int) -> tuple[np.ndarray, np.ndarray | None] | None:
    """The bytes of the non-empty values of a binary array, one after the other ([k * width] uint8), and
    which values are non-empty ([n] bool, None when all are); None unless every value is empty or exactly
    `width` bytes long."""
    n = len(values)
    offsets = np.frombuffer(values.buffers()[1], dtype=np.int32, count=n + 1, offset=4 * values.offset)
    lengths = np.diff(offsets)
    if not np.all((lengths == 0) | (lengths == width)):
        return None
    size = int(offsets[-1] - offsets[0])
    present = None if size == n * width else lengths != 0
    data = values.buffers()[2]
    if size == 0 or data is None:
        return np.empty(0, dtype=np.uint8), present
    return np.frombuffer(data, dtype=np.uint8, count=size, offset=int(offsets[0])), present


def _hex_ids(values: pa.Array) -> np.ndarray | None:
    """[n] int64 ids of a binary array of empty or 8-hex-digit values (empty -> MISSING_CATEGORY), or None
    when a value is of another length or not hex. Each pair of digits is one look-up in _PAIR_VALUE (a
    gather costs less than testing and decoding the bytes arithmetically in numpy)."""
    taken = _fixed_width_bytes(values, 8)
    if taken is None:
        return None
    digits, present = taken
    octets = np.take(_PAIR_VALUE, digits.view("<u2"))  # the ids' bytes, most significant first
    if len(octets) and octets.max() > 0xFF:
        return None
    ids = octets.astype(np.uint8).view(">u4").astype(np.int64)
    if present is None:
        return ids
    with_missing = np.full(len(values), MISSING_CATEGORY, dtype=np.int64)
    with_missing[present] = ids
    return with_missing


def _parse_checked(block: TextBlock, skip_bad_lines: bool) -> tuple[pa.RecordBatch, int]:
    """`parse_block` field by field, finding bad lines with their numbers."""
    field_count_errors: list[tuple[int, int]] = []  # (1-based line in the block, fields)

    def on_invalid_row(row: pcsv.InvalidRow) -> str:
        field_count_errors.append((row.number, row.actual_columns))
        return "skip"

    def where(line_in_block: int) -> str:
        return f"{block.path} line {block.first_line + line_in_block - 1}"

    try:
        raw = _read_csv(block.data, {c: pa.binary() for c in RAW_COLUMNS}, on_invalid_row).combine_chunks()
    except pa.ArrowException as e:
        raise PreprocessError(f"{where(1)}: {str(e).splitlines()[0]}") from None
    if raw.num_rows + len(field_count_errors) != block.lines:
        # pyarrow also ends a line at a lone "\r".
        line = block.data.count(b"\n", 0, block.data.find(b"\r")) + 1
        raise PreprocessError(f"{where(line)}: carriage return inside the line")
    bad_field_count = np.array([line for line, _ in field_count_errors], dtype=np.int64)
    lines = np.setdiff1d(np.arange(1, block.lines + 1), bad_field_count, assume_unique=True)
    rows, bad_cell, message = _convert(raw.to_batches()[0] if raw.num_rows else _empty_raw())
    if not skip_bad_lines and (len(bad_field_count) or bad_cell.any()):
        errors = []
        if field_count_errors:
            line, fields = field_count_errors[0]
            errors.append((line, f"expected {len(RAW_COLUMNS)} tab-separated fields, got {fields}"))
        if bad_cell.any():
            first = int(np.argmax(bad_cell))
            errors.append((int(lines[first]), message(first)))
        line, what = min(errors)
        raise PreprocessError(f"{where(line)}: {what}")
    return rows.filter(pa.array(~bad_cell)), len(bad_field_count) + int(bad_cell.sum())


def _empty_raw() -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([], schema=pa.schema([pa.field(c, pa.binary()) for c in RAW_COLUMNS]))


def _convert(raw: pa.RecordBatch):
    """Validate and convert one batch of raw byte fields to OUTPUT_SCHEMA.

    Returns:
        rows: the converted batch; values of bad cells are placeholders.
        bad: [rows] bool, rows with at least one bad cell.
        message: row index -> description of that row's first bad cell.
    """
    invalid: dict[str, np.ndarray] = {}
    arrays = []
    for name in RAW_COLUMNS:
        values = raw.column(name)
        empty = pc.equal(pc.binary_length(values), 0)
        if name == LABEL:
            ok = pc.is_in(values, value_set=pa.array([b"0", b"1"]))
            arrays.append(pc.cast(pc.equal(values, b"1"), pa.float32()))
        elif name in DENSE_COLUMNS:
            ok = pc.or_(empty, pc.match_substring_regex(values, _INTEGER_PATTERN))
            digits = pc.cast(pc.if_else(pc.and_not(ok, empty), values, b"0"), pa.string())
            arrays.append(pc.cast(pc.cast(digits, pa.int64()), pa.float32(), safe=False))
        else:
            ok = pc.or_(empty, pc.match_substring_regex(values, _HEX_PATTERN))
            ids = _parse_hex(pc.if_else(ok, values, b""))
            arrays.append(pa.array(np.where(empty.to_numpy(zero_copy_only=False), MISSING_CATEGORY, ids)))
        invalid[name] = ~ok.to_numpy(zero_copy_only=False)
    bad = np.logical_or.reduce(list(invalid.values()))

    def message(row: int) -> str:
        name = next(c for c in RAW_COLUMNS if invalid[c][row])
        value = raw.column(name)[row].as_py().decode("utf-8", "replace")
        expected = {LABEL: "0 or 1"}.get(name, "an integer" if name in DENSE_COLUMNS else "1 to 8 hex digits")
        return f"{name}: expected {expected}, got {value[:40]!r}"

    return pa.RecordBatch.from_arrays(arrays, schema=OUTPUT_SCHEMA), bad, message


def _parse_hex(values: pa.Array) -> np.ndarray:
    """[n] int64 values of hex strings of at most 8 digits ("" -> 0), as unsigned 32-bit numbers."""
    if len(values) == 0:
        return np.empty(0, dtype=np.int64)
    # Left-pad to exactly 8 digits, so the strings form one contiguous [n, 8] byte matrix.
    padded = pc.cast(pc.utf8_lpad(pc.cast(values, pa.string()), 8, "0"), pa.binary(8))
    digits = np.frombuffer(
        padded.buffers()[1], dtype=np.uint8, count=8 * len(padded), offset=8 * padded.offset
    )
    nibbles = _HEX_DIGIT_VALUE[digits.reshape(-1, 8)]
    return (nibbles << _HEX_SHIFTS).sum(axis=1).astype(np.int64)
