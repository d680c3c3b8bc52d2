"""The DLRM model and its construction from a run config."""

import torch

from dlrm.config import ModelConfig
from dlrm.model.dlrm import DLRM
from dlrm.model.tables import build_vocabularies, resolve_table_rows


def build_model(
    cfg: ModelConfig,
    metadata: dict,
    train_sparse: torch.Tensor,
    mlp_kernel: str = "torch",
    sparse_kernel: str = "torch",
) -> DLRM:
    """A freshly initialized DLRM sized from the config and the training data.

    Args:
        cfg: model section of the run config.
        metadata: preprocess metadata.json (cardinalities for modulus hashing without `table_rows`).
        train_sparse: [rows, F] int64 raw train ids (vocabularies for vocab hashing).
        mlp_kernel: how MLP layers run: "torch", "bias_act" or "linear_act" (dlrm.model.mlp).
        sparse_kernel: how embeddings, interaction and loss run: "torch" or "triton" (dlrm.model.dlrm.DLRM).
    """
    kernels = {"mlp_kernel": mlp_kernel, "sparse_kernel": sparse_kernel}
    if cfg.hashing == "vocab":
        return DLRM(cfg, vocabularies=build_vocabularies(train_sparse, cfg.max_rows), **kernels)
    return DLRM(cfg, table_rows=resolve_table_rows(cfg, metadata), **kernels)


def model_from_checkpoint(
    cfg: ModelConfig, table_rows: list[int], state: dict, mlp_kernel: str = "torch"
) -> DLRM:
    """Rebuild a DLRM with the table layout stored in a checkpoint and load its weights."""
    if cfg.hashing == "vocab":
        placeholders = [torch.empty(rows - 1, dtype=torch.int64) for rows in table_rows]
        model = DLRM(cfg, vocabularies=placeholders, mlp_kernel=mlp_kernel)
    else:
        model = DLRM(cfg, table_rows=table_rows, mlp_kernel=mlp_kernel)
    model.load_state_dict(state)
    return model


__all__ = ["DLRM", "build_model", "model_from_checkpoint"]
