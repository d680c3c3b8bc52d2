"""Column names and dtypes of the Criteo data, raw and preprocessed.

Raw Criteo lines hold 40 tab-separated fields: `label` (0/1), the 13 integer counts `I1..I13` (may be
empty; I2 may be negative) and the 26 hashed categories `C1..C26` (8 hex digits, may be empty).
The lecture notebook's parquet layout names the same columns `labels`, `DENSE_0..12`, `SPARSE_0..25`.
"""

NUM_DENSE = 13
NUM_SPARSE = 26

LABEL = "label"
DENSE_COLUMNS = [f"I{i}" for i in range(1, NUM_DENSE + 1)]
SPARSE_COLUMNS = [f"C{i}" for i in range(1, NUM_SPARSE + 1)]
RAW_COLUMNS = [LABEL, *DENSE_COLUMNS, *SPARSE_COLUMNS]

LECTURE_LABEL = "labels"
LECTURE_DENSE_COLUMNS = [f"DENSE_{i}" for i in range(NUM_DENSE)]
LECTURE_SPARSE_COLUMNS = [f"SPARSE_{i}" for i in range(NUM_SPARSE)]

MISSING_CATEGORY = -1
