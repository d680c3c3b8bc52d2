"""Tests of dlrm.data.stats: HyperLogLog, distinct counts exact up to a limit, occurrence counts."""

from collections import Counter

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from dlrm.data.stats import DistinctCounter, ValueCounter, hll_estimate, hll_registers


def random_ids(n: int, seed: int) -> np.ndarray:
    """[n] distinct int64 ids spread over the 32-bit range, like Criteo's hashes."""
    return np.random.default_rng(seed).choice(1 << 32, size=n, replace=False).astype(np.int64)


@pytest.mark.parametrize("distinct", [1, 37, 1000, 20_000, 300_000])
def test_hll_estimate_is_within_three_standard_errors(distinct):
    ids = random_ids(distinct, seed=distinct)
    # Repeats do not change the registers.
    registers = hll_registers(np.concatenate([ids, ids[: distinct // 2]]))
    assert np.array_equal(registers, hll_registers(ids))
    assert hll_estimate(registers) == pytest.approx(distinct, rel=3 * 0.0081, abs=1)


def test_hll_registers_of_a_union_are_the_maximum():
    a, b = random_ids(5000, seed=1), random_ids(7000, seed=2)
    union = hll_registers(np.concatenate([a, b]))
    assert np.array_equal(union, np.maximum(hll_registers(a), hll_registers(b)))
    assert hll_registers(np.empty(0, np.int64)).sum() == 0


def test_distinct_counter_is_exact_up_to_the_limit_then_estimates():
    ids = random_ids(50_000, seed=3)
    counter = DistinctCounter(limit=20_000)
    for block in np.array_split(ids[:20_000], 7):  # blocks overlap: the counter dedupes across them
        counter.update(pd.unique(np.concatenate([block, ids[:10]])))
    assert counter.count() == (20_000, True)
    for block in np.array_split(ids, 11):
        counter.update(block)
    count, exact = counter.count()
    assert not exact
    assert count == pytest.approx(50_000, rel=3 * 0.0081)


@pytest.mark.parametrize("budget", [1 << 19, 300])  # all in memory; spilled in many runs
def test_value_counter_vocabulary_keeps_the_frequent_ids(tmp_path, budget):
    rng = np.random.default_rng(4)
    # Zipf-like ranks spread over the 32-bit id range, as Criteo's hashed ids are.
    spread = rng.choice(1 << 32, size=20_000, replace=False).astype(np.int64)
    blocks = [spread[np.minimum(rng.zipf(1.3, size=3000), 20_000) - 1] for _ in range(20)]
    counter = ValueCounter(tmp_path / "spill", budget=budget, ranges=16)
    for block in blocks:
        counter.update(pd.Series(block).value_counts(sort=False))
    expected = Counter(np.concatenate(blocks).tolist())
    vocab = pa.concat_tables(counter.vocabulary(min_frequency=5))
    assert vocab.column_names == ["value", "count"]
    kept = {v: c for v, c in expected.items() if c >= 5}
    assert vocab.column("value").to_pylist() == sorted(kept)
    assert vocab.column("count").to_pylist() == [kept[v] for v in sorted(kept)]
    runs = len(list((tmp_path / "spill").glob("*-values.npy")))
    assert runs == 1 if budget > 20_000 else runs > 3
    pieces = list(counter.vocabulary(min_frequency=1))
    assert sum(p.num_rows for p in pieces) == len(expected)
    assert len(pieces) == 1 if budget > 20_000 else len(pieces) == 16  # ranges merged up to the budget
