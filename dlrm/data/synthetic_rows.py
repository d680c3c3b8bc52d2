"""Synthetic Criteo-shaped rows with a planted click model (the generator of `python -m dlrm.data.synthetic`).

What a row holds (row r of seed s is the same whatever the block size; see "Determinism"):

- C1..C26: category rank k in [0, K) of a column of cardinality K, drawn Zipf-like, P(k) ~ (k + 1)^-1.15
  (inverse CDF of the continuous power law on [1, K + 1], floored), then mapped to the column's id by a
  per-(seed, column) bijection, so a column never holds more than K distinct ids. `ids` "hash": a keyed
  bijection of 32-bit integers (an integer hash), ids that look like Criteo's raw 8-hex-digit hashes;
  "index": the permutation k -> (a k + c) mod K of [0, K) (a coprime to K, a and c keyed), contiguous
  indices as MLPerf's preprocessed Criteo 1TB holds them, which modulus hashing into K + 1 or more rows
  keeps apart (raw hashes share rows: dlrm.model.tables.shared_row_shares). Missing (empty) at
  Criteo-like per-column rates.
- I1..I13: counts round(expm1(max(0, mu + sd * z))), z ~ N(0, 1), with per-column (mu, sd) on the log1p
  scale, capped at 2**24 (about Criteo's largest counts, and exact in float32); I2 is
  -1, -2, ... in 3% of rows. Missing (empty; 0 in parquet) at Criteo-like per-column rates.
- label ~ Bernoulli(sigmoid(logit)), the planted model:

      logit = bias + sum over c in PLANTED_COLUMNS of w_c(id_c)            (0 where id_c is missing)
                   + sum over j of v_j * (log1p(max(I_j, 0)) - mu_j)       (I_j = 0 where missing)

  w_c(id) ~ N(0, 0.5^2) is a pure function of (seed, column, id): a keyed 64-bit hash of the id turned
  into a normal by Box-Muller. v ~ N(0, 0.2^2) per dense column, drawn from the seed. The bias is solved
  per configuration (bisection on 32k calibration rows of their own random stream) so that the mean
  click probability is `ctr` (default 0.1, between Criteo Terabyte's ~3% and Kaggle's ~26%).

Multi-hot (`bag_sizes`, `--multi-hot`): each sparse feature holds a bag of k_f ids, the one-hot id above
followed by k_f - 1 ids drawn as dlrm.data.bags.make_bags draws them (`bag_distribution`, seeded by `seed`,
from [0, K_f + 1)), in the [n, S] layout of dlrm.data.bags. The planted model then reads the whole bag:
w_c(bag) = the mean of w_c over the bag's ids (the mean keeps the logit's scale, so the same bias range and
AUCs; a model pooling by sum learns it as well, up to a scale), so the planted model's AUC (the oracle)
still bounds what a model of the bags can reach.

Determinism: rows are generated in fixed chunks of _CHUNK_ROWS rows, chunk i from its own generator
SeedSequence(seed, spawn_key=(0, i)); blocks of `--block-size` rows are cut from those chunks, so the
output depends on (seed, cardinalities, ctr, ids, bags, rows) only. Memory is bounded by the block size
(plus one chunk), never by the row count.

Cardinalities: `kaggle` are the distinct counts of the Criteo Kaggle (Display Advertising Challenge)
train set; `terabyte` are the distinct counts over days 0..23 of the Criteo 1TB logs without frequency
threshold or index cap, as used by TorchRec's DLRM example (177,944,275 rows in all). FB-DLRM's MLPerf
setting (--max-ind-range=40000000) folds ids modulo 40M, which gives slightly smaller counts (39,884,406
for C1, ...); `--max-cardinality 40000000` approximates it.
"""

import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from dlrm.choices import BAG_DISTRIBUTIONS, SYNTHETIC_IDS
from dlrm.data.bags import bag_starts, check_sizes, is_one_hot, make_bags
from dlrm.data.schema import MISSING_CATEGORY, NUM_DENSE, NUM_SPARSE, SPARSE_COLUMNS

KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
TERABYTE_CARDINALITIES = (
    45833188, 36746, 17245, 7413, 20243, 3, 7114, 1441, 62, 29275261, 1572176, 345138, 10,
    2209, 11267, 128, 4, 974, 14, 48937457, 11316796, 40094537, 452104, 12606, 104, 35,
)  # fmt: skip
CARDINALITY_PRESETS = {"kaggle": KAGGLE_CARDINALITIES, "terabyte": TERABYTE_CARDINALITIES}

ZIPF_EXPONENT = 1.15
# Share of empty fields per column, close to those of the Kaggle train set.
SPARSE_MISSING_RATE = np.array(
    [0.0, 0.0, 0.034, 0.034, 0.0, 0.121, 0.0, 0.0, 0.0, 0.0, 0.0, 0.034, 0.0,
     0.0, 0.0, 0.034, 0.0, 0.0, 0.44, 0.44, 0.034, 0.763, 0.0, 0.034, 0.44, 0.44]
)  # fmt: skip
DENSE_MISSING_RATE = np.array(
    [0.454, 0.0, 0.215, 0.217, 0.026, 0.224, 0.043, 0.0005, 0.043, 0.454, 0.043, 0.765, 0.217]
)
# (mu, sd) of log1p(count) per dense column.
DENSE_LOG_MEAN = np.array([1.0, 2.5, 2.0, 1.6, 7.5, 3.0, 1.5, 2.2, 3.8, 0.3, 0.9, 0.2, 1.7])
DENSE_LOG_STD = np.array([1.0, 1.8, 1.2, 1.0, 2.2, 1.7, 1.4, 1.0, 1.4, 0.5, 0.8, 0.6, 1.0])
I2_NEGATIVE_RATE = 0.03
# Largest count: about Criteo's largest (I5 reaches ~23M), and every integer up to it is exact in float32.
MAX_COUNT = 1 << 24

# The planted model (see the module docstring).
PLANTED_COLUMNS = ("C1", "C2", "C3", "C5", "C6", "C9", "C14", "C17")
# With these, the planted model itself scores an AUC of 0.81..0.87 by seed (DLRMs on Criteo reach ~0.80).
PLANTED_SPARSE_STD = 0.5
PLANTED_DENSE_STD = 0.2
DEFAULT_CTR = 0.1

_CHUNK_ROWS = 1 << 14  # rows per random-number chunk; fixed, so the output does not depend on the block size
_CALIBRATION_ROWS = 1 << 15
PLANTED_INDEX = np.array([SPARSE_COLUMNS.index(c) for c in PLANTED_COLUMNS])
# spawn_key domains of SeedSequence(seed, spawn_key=...): one random stream per use.
_ROWS_STREAM, _CALIBRATION_STREAM, _MODEL_STREAM = 0, 1, 2


class SyntheticError(ValueError):
    """Bad arguments or an unusable output path; the message is one line."""


@dataclass(frozen=True)
class SyntheticConfig:
    """What the generated rows depend on (besides their number).

    Attributes:
        cardinalities: distinct ids per sparse column C1..C26 (26 ints >= 1).
        seed: non-negative seed of every random stream.
        ctr: mean click probability of the planted model, in (0, 1).
        bag_sizes: F bag sizes (module docstring, "Multi-hot"); None (or all ones): one id per feature.
        bag_distribution: "uniform" or "pareto", the law of the bags' drawn ids.
        ids: "hash" or "index", how a category rank becomes its id (module docstring).
    Raises:
        SyntheticError: a bad value.
    """

    cardinalities: tuple[int, ...] = KAGGLE_CARDINALITIES
    seed: int = 0
    ctr: float = DEFAULT_CTR
    bag_sizes: tuple[int, ...] | None = None
    bag_distribution: str = "pareto"
    ids: str = "hash"

    def __post_init__(self) -> None:
        object.__setattr__(self, "cardinalities", tuple(int(k) for k in self.cardinalities))
        if len(self.cardinalities) != NUM_SPARSE or min(self.cardinalities) < 1:
            raise SyntheticError(f"need {NUM_SPARSE} cardinalities >= 1, got {list(self.cardinalities)}")
        if max(self.cardinalities) > 1 << 32:
            raise SyntheticError(
                f"cardinalities must be at most 2**32 (32-bit ids), got {self.cardinalities}"
            )
        if self.seed < 0:
            raise SyntheticError(f"seed must be non-negative, got {self.seed}")
        if not 0.0 < self.ctr < 1.0:
            raise SyntheticError(f"ctr must be in (0, 1), got {self.ctr}")
        if self.bag_distribution not in BAG_DISTRIBUTIONS:
            raise SyntheticError(
                f"bag distribution must be one of {BAG_DISTRIBUTIONS}, got {self.bag_distribution!r}"
            )
        if self.ids not in SYNTHETIC_IDS:
            raise SyntheticError(f"ids must be one of {SYNTHETIC_IDS}, got {self.ids!r}")
        if self.bag_sizes is not None:
            try:
                sizes = check_sizes(self.bag_sizes, "--multi-hot")
            except ValueError as err:
                raise SyntheticError(str(err)) from None
            object.__setattr__(self, "bag_sizes", None if is_one_hot(sizes) else sizes)


def preset_cardinalities(preset: str, max_cardinality: int | None = None) -> tuple[int, ...]:
    """The 26 cardinalities of `preset` ("kaggle" or "terabyte"), each capped at `max_cardinality`."""
    if preset not in CARDINALITY_PRESETS:
        raise SyntheticError(
            f"unknown cardinalities {preset!r} (expected one of {', '.join(CARDINALITY_PRESETS)})"
        )
    if max_cardinality is not None and max_cardinality < 1:
        raise SyntheticError(f"max cardinality must be at least 1, got {max_cardinality}")
    cap = max_cardinality or 1 << 32
    return tuple(min(k, cap) for k in CARDINALITY_PRESETS[preset])


class Rows(NamedTuple):
    """A block of n synthetic rows.

    label: [n] int8, 0 or 1.
    dense: [n, 13] int64 counts; 0 where missing.
    dense_missing: [n, 13] bool.
    sparse: [n, 26] int64 ids in [0, 2**32), MISSING_CATEGORY (-1) where missing; with bags [n, S], the
        bags' layout of dlrm.data.bags.
    logit: [n] float64 logit of the planted model, which the label was drawn from (not written; it gives
        the oracle numbers, dlrm.data.oracle).
    """

    label: np.ndarray
    dense: np.ndarray
    dense_missing: np.ndarray
    sparse: np.ndarray
    logit: np.ndarray

    @property
    def num_rows(self) -> int:
        return len(self.label)

    def slice(self, start: int, stop: int) -> "Rows":
        return Rows(*(a[start:stop] for a in self))


def _concat(parts: Sequence[Rows]) -> Rows:
    if len(parts) == 1:
        return parts[0]
    return Rows(*(np.concatenate(arrays) for arrays in zip(*parts, strict=True)))


# ---------------------------------------------------------------------------------------------------------
# Generation


def _stream(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=key))


@functools.cache
def _column_keys(seed: int) -> np.ndarray:
    """[4, 26] uint32: per-column keys of the rank -> id bijection (rows 0, 1) and of the planted weights."""
    return (
        np.random.SeedSequence(seed, spawn_key=(_MODEL_STREAM,)).generate_state(4 * NUM_SPARSE).reshape(4, -1)
    )


@functools.cache
def _dense_weights(seed: int) -> np.ndarray:
    """[13] float64 weights v of the planted model's dense term."""
    return _stream(seed, _MODEL_STREAM, 1).normal(0.0, PLANTED_DENSE_STD, NUM_DENSE)


def _hashes_of_ranks(ranks: np.ndarray, keys_add: np.ndarray, keys_xor: np.ndarray) -> np.ndarray:
    """Keyed bijection of 32-bit integers (add, lowbias32 hash, xor), column-wise: [n, c] int64 ids."""
    h = ranks.astype(np.uint32) + keys_add
    h ^= h >> 16
    h *= np.uint32(0x7FEB352D)
    h ^= h >> 15
    h *= np.uint32(0x846CA68B)
    h ^= h >> 16
    h ^= keys_xor
    return h.astype(np.int64)


def ids_of_ranks(
    config: SyntheticConfig, ranks: np.ndarray, columns: Sequence[int] | None = None
) -> np.ndarray:
    """The ids [n, c] int64 of category ranks [n, c] of the 0-based sparse `columns` (default: all 26), by
    `config.ids` (module docstring): "hash", the keyed 32-bit bijection `_hashes_of_ranks`; "index", the
    permutation (a k + c) mod K of [0, K), a coprime to K and a, c drawn from the column's keys
    (`_index_permutations`; exact: a, k < 2**32, so a k < 2**64)."""
    columns = np.arange(NUM_SPARSE) if columns is None else np.asarray(columns)
    if config.ids == "hash":
        keys = _column_keys(config.seed)
        return _hashes_of_ranks(ranks, keys[0, columns], keys[1, columns])
    multipliers, offsets = _index_permutations(config.cardinalities, config.seed)
    k = np.asarray(config.cardinalities, dtype=np.uint64)[columns]
    ids = (ranks.astype(np.uint64) * multipliers[columns] + offsets[columns]) % k
    return ids.astype(np.int64)


@functools.cache
def _index_permutations(cardinalities: tuple[int, ...], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """([c] uint64 multipliers a, coprime to K, [c] uint64 offsets) of `ids_of_ranks`, from the
    keys of the hash bijection (rows 0 and 1 of `_column_keys`)."""
    keys = _column_keys(seed)
    multipliers, offsets = [], []
    for column, k in enumerate(cardinalities):
        a = int(keys[0, column]) % k or 1
        while math.gcd(a, k) != 1:
            a = a % k + 1
        multipliers.append(a)
        offsets.append(int(keys[1, column]) % k)
    return np.array(multipliers, dtype=np.uint64), np.array(offsets, dtype=np.uint64)


def planted_weights(seed: int, columns: Sequence[int] | np.ndarray, ids: np.ndarray) -> np.ndarray:
    """w_c(id) of the planted model: [n, c] float64 for [n, c] int64 `ids` of the 0-based sparse `columns`.

    A pure function of (seed, column, id) ~ N(0, PLANTED_SPARSE_STD**2); missing ids (-1) get weight 0.
    """
    keys = _column_keys(seed)[2:, np.asarray(columns)].astype(np.uint64)
    z = ids.astype(np.uint64) ^ ((keys[0] << np.uint64(32)) | keys[1])
    # splitmix64
    z += np.uint64(0x9E3779B97F4A7C15)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    u1 = ((z >> np.uint64(32)).astype(np.float64) + 0.5) * 2.0**-32  # (0, 1)
    u2 = (z & np.uint64(0xFFFFFFFF)).astype(np.float64) * 2.0**-32
    w = PLANTED_SPARSE_STD * np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
    return np.where(ids == MISSING_CATEGORY, 0.0, w)


def planted_logit(config: SyntheticConfig, dense: np.ndarray, sparse: np.ndarray) -> np.ndarray:
    """[n] float64 logit of the planted model for [n, 13] counts (0 = missing) and [n, 26] ids (with
    `config.bag_sizes`: [n, S] bags, each planted column's term the mean over its bag)."""
    return planted_bias(config) + _logit_without_bias(config, dense, sparse)


def _logit_without_bias(config: SyntheticConfig, dense: np.ndarray, sparse: np.ndarray) -> np.ndarray:
    seed, sizes = config.seed, config.bag_sizes
    if sizes is None:
        sparse_term = planted_weights(seed, PLANTED_INDEX, sparse[:, PLANTED_INDEX]).sum(axis=1)
    else:
        starts = bag_starts(sizes)
        sparse_term = sum(
            planted_weights(seed, np.full(sizes[c], c), sparse[:, starts[c] : starts[c] + sizes[c]]).mean(
                axis=1
            )
            for c in PLANTED_INDEX
        )
    dense_term = (np.log1p(np.maximum(dense, 0)) - DENSE_LOG_MEAN) @ _dense_weights(seed)
    return sparse_term + dense_term


def power_law_ranks(u: np.ndarray, cardinalities) -> np.ndarray:
    """Category ranks [n, F] int64 in [0, K_f) of column f, P(k) ~ (k + 1)^-ZIPF_EXPONENT, from uniforms
    u [n, F] in [0, 1): the inverse CDF of the continuous power law x^-s on [1, K + 1], rank = floor(x) - 1.
    Rank 0 is the most frequent (about 11% of a 10M-row column's draws)."""
    k = np.asarray(cardinalities, dtype=np.float64)
    one_minus_s = 1.0 - ZIPF_EXPONENT
    tail = 1.0 - (k + 1.0) ** one_minus_s
    x = (1.0 - u * tail) ** (1.0 / one_minus_s)
    return np.clip(x.astype(np.int64) - 1, 0, np.asarray(cardinalities, dtype=np.int64) - 1)


def _features(
    rng: np.random.Generator, n: int, config: SyntheticConfig
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dense [n, 13] int64 with 0 where missing, dense_missing [n, 13] bool, sparse [n, 26] int64 or
    with bags [n, S])."""
    cardinalities, seed = config.cardinalities, config.seed
    ranks = power_law_ranks(rng.random((n, NUM_SPARSE)), cardinalities)
    sparse = ids_of_ranks(config, ranks)
    sparse[rng.random((n, NUM_SPARSE)) < SPARSE_MISSING_RATE] = MISSING_CATEGORY

    # Dense: rounded log-normal counts; I2 sometimes negative.
    y = rng.standard_normal((n, NUM_DENSE)) * DENSE_LOG_STD + DENSE_LOG_MEAN
    dense = np.minimum(np.rint(np.expm1(np.maximum(y, 0.0))), MAX_COUNT).astype(np.int64)
    negative = rng.random(n) < I2_NEGATIVE_RATE
    dense[:, 1] = np.where(negative, -rng.geometric(0.7, n), dense[:, 1])
    dense_missing = rng.random((n, NUM_DENSE)) < DENSE_MISSING_RATE
    dense[dense_missing] = 0
    if config.bag_sizes is not None:
        ranges = [k + 1 for k in cardinalities]
        bags = make_bags(torch.from_numpy(sparse), config.bag_sizes, ranges, config.bag_distribution, seed)
        sparse = bags.numpy()
    return dense, dense_missing, sparse


@functools.cache
def planted_bias(config: SyntheticConfig) -> float:
    """The bias that makes the mean click probability `config.ctr` on calibration rows (own stream)."""
    rng = _stream(config.seed, _CALIBRATION_STREAM)
    dense, _, sparse = _features(rng, _CALIBRATION_ROWS, config)
    base = _logit_without_bias(config, dense, sparse)
    low, high = -40.0, 40.0
    for _ in range(60):
        mid = 0.5 * (low + high)
        if _sigmoid(mid + base).mean() < config.ctr:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _chunk(config: SyntheticConfig, index: int) -> Rows:
    """Rows [index * _CHUNK_ROWS, (index + 1) * _CHUNK_ROWS), from the chunk's own random stream."""
    rng = _stream(config.seed, _ROWS_STREAM, index)
    dense, dense_missing, sparse = _features(rng, _CHUNK_ROWS, config)
    logit = planted_logit(config, dense, sparse)
    label = (rng.random(_CHUNK_ROWS) < _sigmoid(logit)).astype(np.int8)
    return Rows(label, dense, dense_missing, sparse, logit)


def iter_blocks(
    config: SyntheticConfig, rows: int, block_size: int = 1 << 16, start: int = 0
) -> Iterator[Rows]:
    """Rows [start, start + rows) in blocks of `block_size` rows (the last may be smaller).

    The rows do not depend on `block_size`: each block is cut from fixed chunks of _CHUNK_ROWS rows.
    """
    if rows < 0 or start < 0 or block_size < 1:
        raise SyntheticError(f"bad row range or block size: rows={rows}, start={start}, block={block_size}")
    cached: tuple[int, Rows | None] = (-1, None)  # the chunk shared by consecutive blocks
    stop_all = start + rows
    for block_start in range(start, stop_all, block_size):
        block_stop = min(block_start + block_size, stop_all)
        parts = []
        for index in range(block_start // _CHUNK_ROWS, (block_stop - 1) // _CHUNK_ROWS + 1):
            chunk = cached[1] if cached[0] == index else _chunk(config, index)
            cached = (index, chunk)
            offset = index * _CHUNK_ROWS
            parts.append(
                chunk.slice(max(block_start, offset) - offset, min(block_stop, offset + _CHUNK_ROWS) - offset)
            )
        yield _concat(parts)


def generate_rows(config: SyntheticConfig, start: int, stop: int) -> Rows:
    """Rows [start, stop) in one block."""
    return _concat(list(iter_blocks(config, stop - start, max(stop - start, 1), start)) or [_empty_rows()])


def _empty_rows() -> Rows:
    return Rows(
        np.empty(0, np.int8),
        np.empty((0, NUM_DENSE), np.int64),
        np.empty((0, NUM_DENSE), bool),
        np.empty((0, NUM_SPARSE), np.int64),
        np.empty(0, np.float64),
    )
