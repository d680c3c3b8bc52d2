"""The model (`model.arch`: DLRM, or hashed logistic regression) and its construction from a run config."""

import torch

from dlrm.config import ModelConfig
from dlrm.model.dlrm import DLRM
from dlrm.model.logistic import LogisticRegression
from dlrm.model.tables import build_vocabularies, resolve_table_rows

# What the training loop, checkpoints, prediction and export take: forward(dense, sparse) -> logit [B],
# loss, dense_parameters, embedding_parameters, table_archs, dense_modules, sparse_arch.
Model = DLRM | LogisticRegression


def make_model(
    cfg: ModelConfig,
    table_rows: list[int] | None = None,
    vocabularies: list[torch.Tensor] | None = None,
    mlp_kernel: str = "torch",
    sparse_kernel: str = "torch",
    seed: int | None = None,
) -> Model:
    """`cfg.arch`'s model: DLRM, or LogisticRegression (which has no MLPs: `mlp_kernel` unused; its tables
    start at zero: `seed` unused). `seed`: the tables' initialization seed (DLRM's)."""
    if cfg.arch == "logistic":
        return LogisticRegression(table_rows, cfg.hashing, vocabularies, sparse_kernel)
    return DLRM(cfg, table_rows, vocabularies, mlp_kernel, sparse_kernel, seed=seed)


def build_model(
    cfg: ModelConfig,
    metadata: dict,
    train_sparse: torch.Tensor,
    mlp_kernel: str = "torch",
    sparse_kernel: str = "torch",
    seed: int | None = None,
) -> Model:
    """A freshly initialized model (`cfg.arch`) sized from the config and the training data (a LoRA
    fine-tuning run starts from its base checkpoint's model instead: `model_from_checkpoint`). Its tables
    are the seed's alone (dlrm.model.sparse.init_tables); its MLPs draw from the global torch generator.

    Args:
        cfg: model section of the run config.
        metadata: preprocess metadata.json (cardinalities for modulus hashing without `table_rows`).
        train_sparse: [rows, F] int64 raw train ids (vocabularies for vocab hashing).
        mlp_kernel: how MLP layers run: "torch", "bias_act" or "linear_act" (dlrm.model.mlp).
        sparse_kernel: how embeddings, interaction and loss run: "torch" or "triton" (dlrm.model.dlrm.DLRM).
        seed: the tables' initialization seed (the run's train.seed; None: drawn from the global generator).
    """
    kernels = {"mlp_kernel": mlp_kernel, "sparse_kernel": sparse_kernel, "seed": seed}
    if cfg.hashing == "vocab":
        vocabularies = build_vocabularies(train_sparse, cfg.max_rows, cfg.min_frequency)
        return make_model(cfg, vocabularies=vocabularies, **kernels)
    return make_model(cfg, table_rows=resolve_table_rows(cfg, metadata), **kernels)


def model_from_checkpoint(
    cfg: ModelConfig,
    table_rows: list[int],
    state: dict,
    mlp_kernel: str = "torch",
    sparse_kernel: str = "torch",
    adapters_missing: bool = False,
) -> Model:
    """Rebuild a model (`cfg.arch`) with the table layout stored in a checkpoint and load its weights. With
    `adapters_missing` the state may lack the LoRA adapters (`lora_a`, `lora_b`: a base model's checkpoint),
    which keep their initialization.

    Raises:
        ValueError: the state does not fit the model (the message names the keys).
    """
    kernels = {"mlp_kernel": mlp_kernel, "sparse_kernel": sparse_kernel}
    if cfg.hashing == "vocab":
        placeholders = [torch.zeros(rows - 1, dtype=torch.int64) for rows in table_rows]  # loaded below
        model = make_model(cfg, vocabularies=placeholders, **kernels)
    else:
        model = make_model(cfg, table_rows=table_rows, **kernels)
    if not adapters_missing:
        model.load_state_dict(state)
        return model
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as err:
        raise ValueError(f"the base checkpoint does not fit model config: {err}") from None
    missing = [k for k in missing if ".lora_" not in k]
    if missing or unexpected:
        raise ValueError(
            f"the base checkpoint does not fit the model: missing {missing}, unexpected {unexpected}"
        )
    return model


__all__ = ["DLRM", "LogisticRegression", "Model", "build_model", "make_model", "model_from_checkpoint"]
