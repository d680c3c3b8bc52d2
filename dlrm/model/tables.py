"""Embedding table sizing: rows per table for modulus hashing, vocabularies for exact (vocab) hashing; the
tables' storage dtype (`model.table_dtype`) and the dtype their lookups return."""

import math

import torch

from dlrm.choices import TABLE_DTYPES
from dlrm.config import ModelConfig
from dlrm.data.schema import NUM_SPARSE, SPARSE_COLUMNS


def table_torch_dtype(name: str, kernel: str) -> torch.dtype:
    """The torch dtype of `model.table_dtype` `name` ("fp32" or "bf16") for sparse kernel `kernel`.

    Raises:
        ValueError: an unknown name, or "bf16" with kernel "torch" (its nn.Embedding tables take a torch
            optimizer, whose update would round every step to nearest; the fused update of kernel "triton"
            rounds stochastically).
    """
    if name not in TABLE_DTYPES:
        raise ValueError(f"unknown table dtype {name!r}: expected one of {TABLE_DTYPES}")
    if name == "bf16" and kernel != "triton":
        raise ValueError(f"bf16 tables need kernel 'triton', got {kernel!r}")
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def lookup_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype the "triton" lookups return on `device` (a device or its type), whatever the tables'
    dtype: the autocast dtype under autocast (the interaction takes it: the kernel writes it directly,
    saving a cast pass over [B, F, D] forward and one back in backward), else fp32 (bf16 rows widened
    exactly)."""
    device = torch.device(device).type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else torch.float32


def resolve_table_rows(cfg: ModelConfig, metadata: dict) -> list[int]:
    """Rows per table for modulus hashing: `cfg.table_rows`, else train cardinality + 1 from metadata.json
    (the + 1 leaves room for the missing id), each capped by `cfg.max_rows`.

    Raises:
        ValueError: metadata.json lacks the cardinality of a column.
    """
    if cfg.table_rows is not None:
        rows = list(cfg.table_rows)
    else:
        categorical = metadata.get("categorical", {})
        missing = [c for c in SPARSE_COLUMNS if "cardinality" not in categorical.get(c, {})]
        if missing:
            raise ValueError(f"metadata.json: no cardinality for {', '.join(missing)}; set model.table_rows")
        rows = [categorical[c]["cardinality"] + 1 for c in SPARSE_COLUMNS]
    return [min(r, cfg.max_rows) for r in rows]


def shared_row_shares(cfg: ModelConfig, metadata: dict) -> dict[str, float]:
    """Per sparse column, the share of its distinct train ids that modulus hashing puts on a table row with
    another id or with the missing id (row 0), which a one-hot model cannot then tell apart: {"C1": share in
    [0, 1], ...}.

    n distinct ids (metadata.json's "cardinality") in [0, X] (X its "max_id"; 2**32 - 1, raw Criteo hashes,
    where metadata older than the key lacks it) into m rows (`resolve_table_rows`): row r = (x + 1) % m
    holds the values x + 1 = r, r + m, ... of [0, X + 1] (0 the missing id), s_r of them. Taking the n ids
    as any n of the X + 1 values alike, row r holds n s_r / (X + 1) ids on average (less the missing id's
    value on row 0), and an id there has the row alone with probability C(X - s_r + 1, n - 1) / C(X, n - 1)
    (none of the other n - 1 ids among its row's s_r - 1 other values; row 0: never). So the share is
    ((s_0 - 1) + sum over r >= 1 of s_r (1 - that)) / (X + 1): exact for contiguous ids [0, n) (0 where
    they fit, n + 1 <= m), and about 1 - (1 - 1/m)^n for raw hashes.

    Raises:
        ValueError: as `resolve_table_rows`.
    """
    rows = resolve_table_rows(cfg, metadata)
    categorical = metadata.get("categorical", {})
    shares = {}
    for c, m in zip(SPARSE_COLUMNS, rows, strict=True):
        top = categorical.get(c, {}).get("max_id")
        top = 2**32 - 1 if top is None else top
        n = min(categorical.get(c, {}).get("cardinality", 0), top + 1)  # an estimated count may exceed it
        shares[c] = _shared_share(n, top, m)
    return shares


def _shared_share(n: int, top: int, m: int) -> float:
    """`shared_row_shares` of one column: n ids among the values [0, top], m rows."""
    if n == 0:
        return 0.0
    laps, rest = divmod(top + 2, m)  # rows r < rest hold laps + 1 values, the others laps
    first = laps + (rest > 0)  # row 0's values, the missing id's among them
    total = first - 1 + max(rest - 1, 0) * _shared_ids(laps + 1, n, top)
    total += (m - max(rest, 1)) * _shared_ids(laps, n, top)
    return min(total / (top + 1), 1.0)


def _shared_ids(values: int, n: int, top: int) -> float:
    """The ids on a row of `values` values (not row 0) that share it, on average, times (top + 1) / n:
    values times the chance that another of the n ids lies among the row's other values."""
    others = top - values + 1  # the values of the other rows
    if others < n - 1:  # the other ids cannot all lie elsewhere
        return values
    alone = math.lgamma(others + 1) - math.lgamma(others - n + 2)
    alone -= math.lgamma(top + 1) - math.lgamma(top - n + 2)
    return values * -math.expm1(alone)


def shared_rows_warning(cfg: ModelConfig, metadata: dict, threshold: float = 0.05) -> str | None:
    """One line naming the columns whose `shared_row_shares` is `threshold` or more (largest first), and
    what lowers it; None where none is (or with hashing other than "modulus")."""
    if cfg.hashing != "modulus":
        return None
    shares = shared_row_shares(cfg, metadata)
    high = sorted(((share, c) for c, share in shares.items() if share >= threshold), reverse=True)
    if not high:
        return None
    listed = ", ".join(f"{c} {share:.0%}" for share, c in high)
    return (
        f"modulus hashing: in {len(high)} of {len(shares)} tables {threshold:.0%} or more of the train ids "
        f"share a row with another id ({listed}), and a one-hot model cannot tell such ids apart; more rows "
        "(model.table_rows, model.max_rows), hashing 'vocab' (one id per feature), or contiguous ids that "
        "fit the rows (as MLPerf's preprocessed Criteo 1TB holds) lower it"
    )


def build_vocabularies(sparse: torch.Tensor, max_rows: int, min_frequency: int = 1) -> list[torch.Tensor]:
    """Sorted vocabularies of the train ids, one per sparse feature.

    Frequency thresholding (the `frequency_limit` of NVIDIA DeepLearningExamples' DLRM preprocessing): an
    id seen fewer than `min_frequency` times in train gets no row of its own; it shares the
    out-of-vocabulary row with unseen ids, whose one embedding is then trained on all of them, instead of
    a row trained on one or two examples.

    Args:
        sparse: [rows, F] int64 raw train ids (missing = -1 counts as an id).
        max_rows: table row cap; a feature with more distinct ids keeps its `max_rows - 1` most frequent
            ones (the last row is the out-of-vocabulary row).
        min_frequency: ids seen fewer times than this in `sparse` are left out (1: every id is kept).
    Returns:
        F sorted int64 tensors.
    """
    if sparse.ndim != 2 or sparse.shape[1] != NUM_SPARSE:
        raise ValueError(f"expected sparse ids of shape [rows, {NUM_SPARSE}], got {list(sparse.shape)}")
    vocabularies = []
    for f in range(NUM_SPARSE):
        ids, counts = torch.unique(sparse[:, f], return_counts=True)
        if min_frequency > 1:
            ids, counts = ids[counts >= min_frequency], counts[counts >= min_frequency]
        if len(ids) > max_rows - 1:
            ids = ids[torch.topk(counts, max_rows - 1).indices].sort().values
        vocabularies.append(ids)
    return vocabularies


# Every feature's vocabulary in one sorted array: id x of feature f as the key f * 2^58 + x + 1. One
# searchsorted then maps all F columns of a batch; per feature it took ~6 kernel launches each, ~160 per
# step with the first-order tables, most of a graphed step's time at batch 128.
KEY_SPAN = 2**58  # F * 2^58 < 2^63 for F <= 31; ids must lie in [-1, 2^58 - 1)


def vocabulary_index(vocabularies: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The lookup structure of F sorted vocabularies (int64 tensors of raw ids, on one device) for
    `vocabulary_rows`: {"keys": [sum of V_f] int64 sorted, "starts": [F] position of feature f's first key,
    "sizes": [F] V_f (also f's out-of-vocabulary row), "bases": [F] f * 2^58}.

    Raises:
        ValueError: an id outside [-1, 2^58 - 1), which would fall into another feature's key range.
    """
    device = vocabularies[0].device
    for f, vocab in enumerate(vocabularies):
        if len(vocab):
            lo, hi = int(vocab[0]), int(vocab[-1])  # sorted: its extremes
            if lo < -1 or hi >= KEY_SPAN - 1:
                raise ValueError(f"vocabulary {f}: ids must lie in [-1, 2^58 - 1), got {lo}..{hi}")
    sizes = torch.tensor([len(v) for v in vocabularies], dtype=torch.int64, device=device)
    bases = torch.arange(len(vocabularies), dtype=torch.int64, device=device) * KEY_SPAN
    keys = torch.cat([v + 1 + bases[f] for f, v in enumerate(vocabularies)])
    return {"keys": keys, "starts": sizes.cumsum(0) - sizes, "sizes": sizes, "bases": bases}


def vocabulary_rows(
    ids: torch.Tensor, keys: torch.Tensor, starts: torch.Tensor, sizes: torch.Tensor, bases: torch.Tensor
) -> torch.Tensor:
    """Raw ids [B, F] int64 -> rows [B, F] int64: the position of ids[:, f] in vocabulary f, or V_f (the
    out-of-vocabulary row) for an id it lacks. Arguments after `ids`: `vocabulary_index`'s tensors."""
    if keys.numel() == 0:  # every vocabulary empty (e.g. min_frequency above every count): all OOV
        return sizes.expand_as(ids)
    in_range = (ids >= -1) & (ids < KEY_SPAN - 1)  # others are absent from every vocabulary
    query = torch.where(in_range, ids + 1, KEY_SPAN - 1) + bases
    pos = torch.searchsorted(keys, query).clamp_(max=keys.numel() - 1)
    return torch.where(keys[pos] == query, pos - starts, sizes)


def register_vocabularies(module: torch.nn.Module, vocabularies: list[torch.Tensor]) -> None:
    """Give a SparseArch (or its sharded twin) its `vocab_<f>` buffers (int64, saved in checkpoints) and
    their one-array lookup (`index_vocabularies`), rebuilt after every load_state_dict."""
    for f, vocab in enumerate(vocabularies):
        module.register_buffer(f"vocab_{f}", vocab.to(torch.int64))
    index_vocabularies(module)
    module.register_load_state_dict_post_hook(_index_loaded_vocabularies)


def index_vocabularies(module: torch.nn.Module) -> None:
    """(Re)build `module`'s vocabulary lookup, non-persistent buffers `vocab_keys`, `vocab_starts`,
    `vocab_sizes`, `vocab_bases` (`vocabulary_index`), from its `vocab_<f>` buffers: after a load that wrote
    them in place (a distributed checkpoint), call it.

    A rebuilt lookup of the same shapes is written into the existing buffers: a CUDA graph captured earlier
    (the training step, the evaluation forward) reads them by address, so a new tensor would leave it
    reading freed memory. Only a lookup of other shapes (other vocabularies) gets new buffers."""
    index = vocabulary_index([getattr(module, f"vocab_{f}") for f in range(NUM_SPARSE)])
    for name, tensor in index.items():
        current = getattr(module, f"vocab_{name}", None)
        if current is not None and current.shape == tensor.shape and current.device == tensor.device:
            current.copy_(tensor)
        else:
            module.register_buffer(f"vocab_{name}", tensor, persistent=False)


def _index_loaded_vocabularies(module: torch.nn.Module, incompatible_keys) -> None:
    index_vocabularies(module)
