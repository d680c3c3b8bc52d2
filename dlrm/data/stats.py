"""Statistics of a split, gathered block by block in one streaming pass.

- `BlockStats` (`block_stats`): what one block of rows contributes, computed where the block is parsed (in
  a worker thread): row and positive counts, dense min/max/sum, per sparse column the distinct ids of the
  block and, when vocabularies are wanted, each id's number of occurrences.
- `SplitStats`: the running merge of a split's blocks: dense statistics, and per sparse column its largest
  id, a `DistinctCounter` (exact set of ids up to a limit, then a HyperLogLog estimate) and optionally a
  `ValueCounter` (exact occurrences per id, for frequency-thresholded vocabularies).

Ids are int64 (the 32-bit Criteo hashes read as unsigned numbers); MISSING_CATEGORY (-1) is never counted.
"""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from dlrm.data.arrow import to_numpy
from dlrm.data.schema import DENSE_COLUMNS, LABEL, MISSING_CATEGORY, SPARSE_COLUMNS

if TYPE_CHECKING:
    import pandas as pd

# HyperLogLog with 2**14 one-byte registers: 16 KiB per column, relative standard error 1.04 / 2**7 = 0.8%.
HLL_PRECISION = 14
# Distinct counts are exact up to this many ids per column (8 bytes each while exact), estimated past it.
DEFAULT_EXACT_DISTINCT_LIMIT = 1 << 20

_U64 = np.uint64


def _pandas():
    """pandas, imported on first use: only the occurrence counts (vocabularies) need it, and importing it
    would cost every preprocess run ~0.15 s, and ~0.1 s more at exit."""
    import pandas

    return pandas


def sorted_unique(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([k] the distinct values of [n] int64 `values`, ascending; [k] int64 occurrences of each). numpy's
    vectorized sort is faster than hashing (pandas.unique) on blocks of Criteo ids, and needs no pandas."""
    ordered = np.sort(values)
    first = np.empty(len(ordered), dtype=bool)
    first[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    return ordered[starts], np.diff(starts, append=len(ordered))


def hash64(values: np.ndarray) -> np.ndarray:
    """[n] uint64 well-mixed hashes of [n] int64 `values` (the splitmix64 finalizer, wrapping arithmetic)."""
    h = values.astype(np.uint64)
    h ^= h >> _U64(30)
    h *= _U64(0xBF58476D1CE4E5B9)
    h ^= h >> _U64(27)
    h *= _U64(0x94D049BB133111EB)
    h ^= h >> _U64(31)
    return h


def hll_registers(values: np.ndarray, precision: int = HLL_PRECISION) -> np.ndarray:
    """[2**precision] uint8 HyperLogLog registers of [n] int64 `values`: register j holds the largest rank
    (1 + leading zeros of the hash bits after the first `precision`) of the values hashed into bucket j."""
    registers = np.zeros(1 << precision, dtype=np.uint8)
    if len(values):
        h = hash64(values)
        rest_bits = 64 - precision
        bucket = (h >> _U64(rest_bits)).astype(np.intp)
        rest = (h & _U64((1 << rest_bits) - 1)).astype(np.float64)  # exact: fewer than 53 bits
        bit_length = np.frexp(rest)[1]  # 0 for rest == 0
        np.maximum.at(registers, bucket, (rest_bits + 1 - bit_length).astype(np.uint8))
    return registers


def hll_estimate(registers: np.ndarray) -> int:
    """Distinct values estimated from HyperLogLog registers (Flajolet et al. 2007, with linear counting
    while the estimate is small; 64-bit hashes need no large-range correction)."""
    m = len(registers)
    alpha = 0.7213 / (1 + 1.079 / m)
    estimate = alpha * m * m / float(np.sum(np.ldexp(1.0, -registers.astype(np.int64))))
    zeros = int(np.count_nonzero(registers == 0))
    if estimate <= 2.5 * m and zeros:
        estimate = m * np.log(m / zeros)
    return round(estimate)


class DistinctCounter:
    """Distinct ids of one column: an exact set while it holds at most `limit` ids, then a HyperLogLog.

    Per-block distinct ids are merged only once they outgrow the merged set (or the limit), which keeps the
    merging cost near-linear; memory stays within about twice `limit` ids (8 bytes each) and one block's,
    plus 16 KiB of registers.
    """

    def __init__(self, limit: int = DEFAULT_EXACT_DISTINCT_LIMIT) -> None:
        self.limit = limit
        self._merged = np.empty(0, dtype=np.int64)
        self._pending: list[np.ndarray] = []
        self._pending_size = 0
        self._registers: np.ndarray | None = None  # set once past the limit

    @property
    def exact(self) -> bool:
        return self._registers is None

    def update(self, distinct: np.ndarray) -> None:
        """Add a block's distinct ids ([k] int64, no duplicates, no missing)."""
        if not self.exact:
            self._registers = np.maximum(self._registers, hll_registers(distinct))
            return
        self._pending.append(distinct)
        self._pending_size += len(distinct)
        if self._pending_size > max(len(self._merged), min(self.limit, 1 << 16)):
            self._merge()

    def count(self) -> tuple[int, bool]:
        """(distinct ids, whether that count is exact)."""
        if self.exact:
            self._merge()  # may find the limit passed
        if self.exact:
            return len(self._merged), True
        return hll_estimate(self._registers), False

    def _merge(self) -> None:
        self._merged = sorted_unique(np.concatenate([self._merged, *self._pending]))[0]
        self._pending, self._pending_size = [], 0
        if len(self._merged) > self.limit:
            self._registers = hll_registers(self._merged)
            self._merged = np.empty(0, dtype=np.int64)


class ValueCounter:
    """Exact occurrences of every id of one column, for frequency-thresholded vocabularies, in bounded
    memory: an external aggregation.

    Block counts are merged in memory up to `budget` distinct ids (~16 bytes each, twice that while
    merging), then spilled into `spill_dir` as a run sorted by id with the offsets of `ranges` equal id
    ranges. The vocabulary merges the runs one id range at a time (ids are 32-bit hashes, so the ranges
    hold similar shares), which bounds memory by a range's entries over all runs, not by the column's ids.
    """

    def __init__(self, spill_dir: Path, budget: int = 1 << 18, ranges: int = 256) -> None:
        self.spill_dir, self.budget, self.ranges = spill_dir, budget, ranges
        self._range_bits = 32 - (ranges.bit_length() - 1)  # ranges is a power of 2
        pd = _pandas()
        self._merged = pd.Series(np.empty(0, np.int64), index=pd.Index(np.empty(0, np.int64)))
        self._pending: list[pd.Series] = []
        self._pending_size = 0
        self._runs = 0

    def update(self, counts: "pd.Series") -> None:
        """Add a block's counts: a Series of int64 occurrences indexed by distinct ids in [0, 2**32)."""
        self._pending.append(counts)
        self._pending_size += len(counts)
        if self._pending_size > max(len(self._merged), min(self.budget, 1 << 16)):
            self._merge()
            if len(self._merged) > self.budget:
                self._spill()

    def vocabulary(self, min_frequency: int) -> Iterator[pa.Table]:
        """Ids seen at least `min_frequency` times, ascending, in pieces: columns `value` int64, `count`
        int64."""
        self._merge()
        self._spill()
        runs = [
            [np.load(self.spill_dir / f"{run:06d}-{part}.npy", mmap_mode="r") for part in _RUN_PARTS]
            for run in range(self._runs)
        ]
        # Consecutive ranges are merged together while they hold at most `budget` entries over all runs.
        before = sum(np.asarray(offsets) for _, _, offsets in runs)  # [ranges + 1] entries before each range
        first = 0
        while first < self.ranges:
            last = int(np.searchsorted(before, before[first] + self.budget, side="right")) - 1
            last = min(max(last, first + 1), self.ranges)
            values = np.concatenate([v[o[first] : o[last]] for v, _, o in runs])
            counts = np.concatenate([c[o[first] : o[last]] for _, c, o in runs])
            total = _pandas().Series(counts, index=values).groupby(level=0).sum()
            kept = total[total >= min_frequency]
            if len(kept):
                yield pa.table(
                    {
                        "value": pa.array(kept.index.to_numpy(np.int64)),
                        "count": pa.array(kept.to_numpy(np.int64)),
                    }
                )
            first = last

    def _merge(self) -> None:
        merged = _pandas().concat([self._merged, *self._pending])
        self._merged = merged.groupby(level=0, sort=False).sum()
        self._pending, self._pending_size = [], 0

    def _spill(self) -> None:
        merged = self._merged.sort_index()
        values = merged.index.to_numpy(np.int64)
        starts = np.arange(self.ranges + 1, dtype=np.int64) << self._range_bits
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        for part, array in zip(
            _RUN_PARTS, (values, merged.to_numpy(np.int64), np.searchsorted(values, starts)), strict=True
        ):
            np.save(self.spill_dir / f"{self._runs:06d}-{part}.npy", array)
        self._runs += 1
        self._merged = self._merged.iloc[:0]


_RUN_PARTS = ("values", "counts", "offsets")  # the files of one spilled run


@dataclass
class BlockStats:
    """What one block of rows contributes to its split's statistics (see `block_stats`)."""

    rows: int
    positives: float
    dense_min: np.ndarray  # [13] float64, +inf for an empty block
    dense_max: np.ndarray  # [13] float64, -inf for an empty block
    dense_sum: np.ndarray  # [13] float64
    distinct: list[np.ndarray] | None  # per sparse column, [k] int64 distinct non-missing ids
    counts: "list[pd.Series] | None"  # per sparse column, occurrences indexed by id (with vocabularies)


def block_stats(rows: pa.RecordBatch | pa.Table, features: bool, value_counts: bool) -> BlockStats:
    """Statistics of `rows` (in preprocess's OUTPUT_SCHEMA); dense and sparse ones only when `features`,
    occurrences per id only when `value_counts` as well."""
    n = rows.num_rows
    positives = float(np.sum(to_numpy(rows.column(LABEL), np.float32), dtype=np.float64))
    empty = np.zeros(len(DENSE_COLUMNS))
    if not features or n == 0:
        return BlockStats(n, positives, empty + np.inf, empty - np.inf, empty, None, None)
    # Column by column: numpy's reductions over the rows of a stacked [n, 13] matrix cost 5x more.
    dense = [to_numpy(rows.column(c), np.float32) for c in DENSE_COLUMNS]
    distinct, counts = [], [] if value_counts else None
    for c in SPARSE_COLUMNS:
        unique, occurrences = sorted_unique(to_numpy(rows.column(c), np.int64))
        if len(unique) and unique[0] == MISSING_CATEGORY:  # the lowest id: leave it out, with its count
            unique, occurrences = unique[1:], occurrences[1:]
        distinct.append(unique)
        if counts is not None:
            counts.append(_pandas().Series(occurrences, index=unique))
    return BlockStats(
        n,
        positives,
        np.array([values.min() for values in dense], dtype=np.float64),
        np.array([values.max() for values in dense], dtype=np.float64),
        np.array([values.sum(dtype=np.float64) for values in dense]),
        distinct,
        counts,
    )


class SplitStats:
    """The running statistics of one split, merged from `BlockStats` in file order."""

    def __init__(self, features: bool, exact_distinct_limit: int, value_counts_dir: Path | None) -> None:
        """`value_counts_dir`: where to spill the occurrences per id (None: no vocabularies)."""
        self.features, self.value_counts = features, value_counts_dir is not None
        self.exact_distinct_limit = exact_distinct_limit
        self.rows = 0
        self.positives = 0.0
        self._min = np.full(len(DENSE_COLUMNS), np.inf)
        self._max = np.full(len(DENSE_COLUMNS), -np.inf)
        self._sum = np.zeros(len(DENSE_COLUMNS))
        self._distinct = [DistinctCounter(exact_distinct_limit) for _ in SPARSE_COLUMNS]
        self._max_id = [MISSING_CATEGORY] * len(SPARSE_COLUMNS)
        self._counts = (
            [ValueCounter(value_counts_dir / c) for c in SPARSE_COLUMNS] if self.value_counts else []
        )

    def add(self, stats: BlockStats) -> None:
        self.rows += stats.rows
        self.positives += stats.positives
        if not self.features or stats.distinct is None:
            return
        self._min = np.minimum(self._min, stats.dense_min)
        self._max = np.maximum(self._max, stats.dense_max)
        self._sum += stats.dense_sum
        for counter, distinct in zip(self._distinct, stats.distinct, strict=True):
            counter.update(distinct)
        self._max_id = [
            max(m, int(distinct[-1])) if len(distinct) else m
            for m, distinct in zip(self._max_id, stats.distinct, strict=True)
        ]
        for counter, counts in zip(self._counts, stats.counts or [], strict=False):
            counter.update(counts)

    def positive_rate(self) -> float | None:
        return self.positives / self.rows if self.rows else None

    def cardinalities(self) -> dict:
        """{"C1": {"cardinality": distinct non-missing ids, "exact": bool, "max_id": the largest id, None
        without any}, ...}. "max_id" tells contiguous indices, which modulus hashing can keep apart, from
        raw hashes (dlrm.model.tables.shared_row_shares)."""
        result = {}
        for c, counter, max_id in zip(SPARSE_COLUMNS, self._distinct, self._max_id, strict=True):
            count, exact = counter.count()
            result[c] = {"cardinality": count, "exact": exact, "max_id": None if max_id < 0 else max_id}
        return result

    def dense_stats(self) -> dict:
        """{"I1": {"min", "max", "mean"}, ...} (missing counted as 0); NaN for an empty split."""
        mean = self._sum / self.rows if self.rows else np.full(len(DENSE_COLUMNS), np.nan)
        return {
            c: {"min": float(self._min[i]), "max": float(self._max[i]), "mean": float(mean[i])}
            for i, c in enumerate(DENSE_COLUMNS)
        }

    def vocabularies(self, min_frequency: int) -> dict[str, Iterator[pa.Table]]:
        """Per sparse column, the ids seen at least `min_frequency` times (see ValueCounter.vocabulary)."""
        return {
            c: counter.vocabulary(min_frequency)
            for c, counter in zip(SPARSE_COLUMNS, self._counts, strict=True)
        }
