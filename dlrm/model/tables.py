"""Embedding table sizing: rows per table for modulus hashing, vocabularies for exact (vocab) hashing."""

import torch

from dlrm.config import ModelConfig
from dlrm.data.schema import NUM_SPARSE, SPARSE_COLUMNS


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
