"""Multi-hot features: fixed-size bags of ids per sparse feature, and synthetic bags made from one-hot ids.

Letters: B batch (n rows), F sparse features (26), k_f the bag size of feature f, S = sum of k_f.

Layout: a multi-hot batch's `sparse` is [B, S] int64, feature-major: feature f's bag is the k_f columns
[start_f, start_f + k_f) with start_f = k_1 + ... + k_(f-1), its first column the feature's one-hot id. With
every k_f = 1 this is exactly the one-hot [B, F] layout, so the one-hot path is the same tensors and code.

Synthetic bags (`make_bags`), the scheme of MLPerf's DLRM-DCNv2 (facebookresearch/dlrm,
torchrec_dlrm/multi_hot.py): the bag of id x of feature f is [x, e_1, ..., e_(k_f - 1)], the extra ids
drawn from a fixed seeded per-feature distribution over [0, n_f), and the same id always gets the same bag.
Where ours differs from the reference, and why:
- The reference materializes a [n_f, k_f] table per feature from `np.random` (seed 0) and indexes it by
  the id, which must already be a row index < n_f. Ours draws e_j = counter hash (splitmix64) of (seed, f,
  x, j): no table (at MLPerf's sizes the reference's tables hold ~40M x 99 ids for one feature), any raw
  64-bit id works, and the bags are the same integers on every device and in every process, so bags made
  on the fly in a loader equal those written by `python -m dlrm.data.multi_hot`.
- n_f is the feature's train cardinality + 1 from metadata.json (the uncapped table rows of modulus
  hashing); the extra ids are raw ids in [0, n_f) that the model hashes like any other id.
- "pareto": the reference takes int(np.random.pareto(a=0.25)) % n_f (a Lomax draw, most mass on small ids).
  Ours is the same law, with u discretized to 15 bits so that it is integer-exact on every device:
  e = (2^60 // m^4 - 1) % n_f with m uniform in [1, 2^15] (the inverse CDF (1 - u)^(-1/a) - 1, a = 0.25,
  1 - u = m / 2^15); P(e = 0) is about 0.16 as in the reference.
- "uniform": e = h % n_f for a 63-bit hash h (the modulo bias is below n_f / 2^63).
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from dlrm.choices import BAG_DISTRIBUTIONS
from dlrm.data.schema import NUM_SPARSE, SPARSE_COLUMNS

# MLPerf Training DLRM-DCNv2's bag sizes of C1..C26 (214 ids a sample).
MLPERF_SIZES = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)

_MASK63 = (1 << 63) - 1
# splitmix64's constants as signed int64 (torch has no uint64 arithmetic; int64 products wrap the same).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def check_sizes(sizes: Sequence[int], key: str = "multi_hot_sizes") -> tuple[int, ...]:
    """`sizes` as a tuple of F ints >= 1. Raises ValueError naming `key` otherwise."""
    sizes = tuple(sizes)
    if len(sizes) != NUM_SPARSE or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in sizes):
        raise ValueError(
            f"{key}: expected {NUM_SPARSE} integers >= 1 (bag sizes of C1..C26), got {list(sizes)}"
        )
    return sizes


def parse_sizes(text: str, key: str = "--sizes") -> tuple[int, ...]:
    """`text`, "mlperf" or 26 comma-separated ints, as bag sizes. Raises ValueError naming `key`."""
    if text == "mlperf":
        return MLPERF_SIZES
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        raise ValueError(f"{key}: expected 'mlperf' or 26 comma-separated integers, got {text!r}") from None
    return check_sizes(sizes, key)


def is_one_hot(sizes: Sequence[int] | None) -> bool:
    """True when `sizes` is None or all ones: no bags, the one-hot layout."""
    return sizes is None or all(k == 1 for k in sizes)


def bag_starts(sizes: Sequence[int]) -> list[int]:
    """First column of each feature's bag in the [B, S] layout (F ints)."""
    starts, total = [], 0
    for k in sizes:
        starts.append(total)
        total += k
    return starts


def bag_columns(sizes: Sequence[int] | None) -> list[str]:
    """The names of the S columns of the [B, S] layout: feature c's bag is c, c_1, ..., c_(k_c - 1), as
    `python -m dlrm.data.multi_hot` writes them (C1..C26 with every size 1 or None)."""
    sizes = [1] * NUM_SPARSE if sizes is None else sizes
    return [f"{c}_{j}" if j else c for c, k in zip(SPARSE_COLUMNS, sizes, strict=True) for j in range(k)]


def column_features(sizes: Sequence[int], device: torch.device | str = "cpu") -> Tensor:
    """[S] int64: the feature of each column of the [B, S] layout."""
    return torch.repeat_interleave(
        torch.arange(len(sizes), device=device), torch.tensor(sizes, device=device)
    )


def _logical_shift(x: Tensor, bits: int) -> Tensor:
    """x >> bits on the 64 bits of int64 `x` as unsigned (torch's >> is arithmetic): a new tensor."""
    return (x >> bits).bitwise_and_((1 << (64 - bits)) - 1)


def _mix(x: Tensor) -> Tensor:
    """splitmix64's finalizer on int64 bits (wrapping arithmetic), in place on `x`."""
    x.bitwise_xor_(_logical_shift(x, 30)).mul_(_MIX1)
    x.bitwise_xor_(_logical_shift(x, 27)).mul_(_MIX2)
    return x.bitwise_xor_(_logical_shift(x, 31))


def extra_ids(ids: Tensor, feature: int, count: int, num_ids: int, distribution: str, seed: int) -> Tensor:
    """The `count` drawn ids of the bags of `ids` ([n] int64 raw ids of `feature`): [n, count] int64 in
    [0, num_ids). Deterministic in (seed, feature, id, slot); computed on `ids`' device."""
    slots = torch.arange(1, count + 1, dtype=torch.int64, device=ids.device)
    key = (seed * NUM_SPARSE + feature) * 1024  # slots < 1024: bags of up to 1024 ids
    h = _mix(ids[:, None] * _GOLDEN + (key + slots) * _MIX2)
    if distribution == "uniform":
        return h.bitwise_and_(_MASK63).remainder_(num_ids)
    m = _logical_shift(h, 49).add_(1)  # uniform in [1, 2^15]
    m4 = m.square_().square_()
    return torch.floor_divide(1 << 60, m4).sub_(1).remainder_(num_ids)


def make_bags(
    sparse: Tensor, sizes: Sequence[int], num_ids: Sequence[int], distribution: str, seed: int
) -> Tensor:
    """One-hot ids [n, F] int64 -> bags [n, S] int64 in the layout above (the module docstring's scheme).
    With every size 1 `sparse` itself is returned (no copy).

    Args:
        sparse: [n, F] int64 raw ids (-1 = missing, whose bag is drawn like any id's).
        sizes: F bag sizes k_f >= 1 (at most 1024).
        num_ids: F ranges n_f >= 1 of the drawn ids.
        distribution: "uniform" or "pareto".
        seed: any int; the bags are a function of (seed, feature, id, slot).
    Raises:
        ValueError: bad sizes, ranges, distribution, or `sparse` not [n, F] int64.
    """
    sizes = check_sizes(sizes, "sizes")
    if distribution not in BAG_DISTRIBUTIONS:
        raise ValueError(f"unknown bag distribution {distribution!r}: expected one of {BAG_DISTRIBUTIONS}")
    if len(num_ids) != NUM_SPARSE or min(num_ids) < 1:
        raise ValueError(f"expected {NUM_SPARSE} id ranges >= 1, got {list(num_ids)}")
    if max(sizes) > 1024:
        raise ValueError(f"bag sizes must be at most 1024, got {max(sizes)}")
    if sparse.ndim != 2 or sparse.shape[1] != NUM_SPARSE or sparse.dtype != torch.int64:
        raise ValueError(
            f"expected one-hot ids [n, {NUM_SPARSE}] int64, got {sparse.dtype} {list(sparse.shape)}"
        )
    if is_one_hot(sizes):
        return sparse
    columns = []
    for f, k in enumerate(sizes):
        columns.append(sparse[:, f : f + 1])
        if k > 1:
            columns.append(extra_ids(sparse[:, f], f, k - 1, num_ids[f], distribution, seed))
    return torch.cat(columns, dim=1)


def id_ranges(metadata: dict, source: str = "metadata.json") -> list[int]:
    """n_f of each feature: its train cardinality + 1 from a data directory's metadata.

    Raises:
        ValueError: a feature's cardinality is missing (naming `source` and the column).
    """
    categorical = metadata.get("categorical", {})
    missing = [c for c in SPARSE_COLUMNS if "cardinality" not in categorical.get(c, {})]
    if missing:
        raise ValueError(f"{source}: no cardinality for {', '.join(missing)}: the bags' id ranges need them")
    return [int(categorical[c]["cardinality"]) + 1 for c in SPARSE_COLUMNS]


class BagMaker:
    """Bags made on the fly from one-hot batches (`data.multi_hot`): a callable [B, F] -> [B, S] int64,
    on the ids' device; `make_bags` with fixed sizes, ranges, distribution and seed."""

    def __init__(self, sizes: Sequence[int], num_ids: Sequence[int], distribution: str, seed: int) -> None:
        self.sizes, self.num_ids = check_sizes(sizes, "sizes"), list(num_ids)
        self.distribution, self.seed = distribution, seed
        make_bags(torch.zeros(0, NUM_SPARSE, dtype=torch.int64), sizes, num_ids, distribution, seed)  # checks

    def __call__(self, sparse: Tensor) -> Tensor:
        return make_bags(sparse, self.sizes, self.num_ids, self.distribution, self.seed)
