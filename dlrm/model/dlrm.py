"""The DLRM model (Naumov et al. 2019, "Deep Learning Recommendation Model for Personalization and
Recommendation Systems"; layout of TorchRec's DLRM: DenseArch, SparseArch, InteractionArch, OverArch).

Glossary letters, used across the project:
    B        batch size (samples)
    F        sparse (categorical) features, 26 for Criteo
    D        embedding dim, also the bottom MLP's output width
    N_dense  dense features, 13 for Criteo
    M, N, K  GEMM sizes: [M, K] @ [K, N]

Forward: dense[B, N_dense] -> DenseArch -> [B, D]; sparse[B, F] raw ids -> hashing -> SparseArch -> [B, F, D];
InteractionArch -> [B, D + F(F+1)/2] ("dot") or [B, (F+1) D] ("cat"); OverArch -> logit[B].
The model returns logits; the sigmoid is applied once, in evaluation/prediction.
"""

import torch
from torch import nn
from torch.profiler import record_function

from dlrm.config import ModelConfig
from dlrm.data.schema import NUM_DENSE, NUM_SPARSE
from dlrm.model.mlp import MLP


class DenseArch(nn.Module):
    """Bottom MLP over the dense features, ReLU after every layer: [B, N_dense] f32 -> [B, D]."""

    def __init__(self, widths: tuple[int, ...], mlp_kernel: str = "torch"):
        super().__init__()
        self.mlp = MLP(NUM_DENSE, widths, "relu", "relu", mlp_kernel)

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        return self.mlp(dense)


class SparseArch(nn.Module):
    """F embedding tables of D columns, looked up from raw Criteo ids.

    Hashing (ids are the raw 32-bit category values, -1 for missing):
    - "modulus": row = (x + 1) % rows_f (FB-DLRM's convention; missing lands in row 0).
    - "vocab": row = position of x in the sorted train values of feature f (the `vocabularies`, missing
      included as a value); ids not in the vocabulary share the last row, the out-of-vocabulary row.
      rows_f = len(vocabulary_f) + 1.

    Tables are nn.Embedding with sparse gradients, so optimizers touch only the looked-up rows.

    Args:
        embedding_dim: D.
        table_rows: rows_f per table (F ints). Ignored for "vocab", which takes len(vocabulary) + 1.
        hashing: "modulus" or "vocab".
        vocabularies: for "vocab", F sorted int64 tensors of known ids.
    Raises:
        ValueError: wrong number of tables or vocabularies, unknown hashing.
    """

    def __init__(
        self,
        embedding_dim: int,
        table_rows: list[int] | None = None,
        hashing: str = "modulus",
        vocabularies: list[torch.Tensor] | None = None,
    ):
        super().__init__()
        if hashing == "vocab":
            if vocabularies is None or len(vocabularies) != NUM_SPARSE:
                raise ValueError(f"hashing 'vocab' needs {NUM_SPARSE} vocabularies")
            table_rows = [len(v) + 1 for v in vocabularies]
            for f, vocab in enumerate(vocabularies):
                self.register_buffer(f"vocab_{f}", vocab.to(torch.int64))
        elif hashing != "modulus":
            raise ValueError(f"unknown hashing {hashing!r}: expected 'modulus' or 'vocab'")
        if table_rows is None or len(table_rows) != NUM_SPARSE:
            raise ValueError(f"expected {NUM_SPARSE} table sizes, got {table_rows!r}")
        self.hashing = hashing
        self.table_rows = list(table_rows)
        # A buffer, so hashing does not copy the sizes to the device every step.
        self.register_buffer("rows", torch.tensor(self.table_rows), persistent=False)
        self.embeddings = nn.ModuleList(nn.Embedding(rows, embedding_dim, sparse=True) for rows in table_rows)
        for table in self.embeddings:
            bound = (1.0 / table.num_embeddings) ** 0.5  # FB-DLRM: U(-sqrt(1/rows), sqrt(1/rows))
            nn.init.uniform_(table.weight, -bound, bound)

    def hash_ids(self, sparse: torch.Tensor) -> torch.Tensor:
        """Raw ids [B, F] int64 -> row indices [B, F] int64, one column per table."""
        if self.hashing == "modulus":
            return torch.remainder(sparse + 1, self.rows)
        columns = []
        for f in range(NUM_SPARSE):
            vocab = getattr(self, f"vocab_{f}")
            ids = sparse[:, f].contiguous()
            pos = torch.searchsorted(vocab, ids).clamp_(max=len(vocab) - 1)
            columns.append(torch.where(vocab[pos] == ids, pos, len(vocab)))
        return torch.stack(columns, dim=1)

    def forward(self, sparse: torch.Tensor) -> torch.Tensor:
        """sparse: [B, F] int64 raw ids -> embeddings [B, F, D]."""
        rows = self.hash_ids(sparse)
        return torch.stack([table(rows[:, f]) for f, table in enumerate(self.embeddings)], dim=1)


class InteractionArch(nn.Module):
    """Feature interaction over the dense output [B, D] and the embeddings [B, F, D].

    "dot" (FB-DLRM's `interact_features`, self-interaction off): stack the F + 1 vectors as T [B, F+1, D],
    take Z = T @ T^T and keep the strict lower triangle Z[:, i, j], i > j, in row-major order
    (F(F+1)/2 = 351 products for F = 26); output [dense | products], [B, D + 351] (367 for D = 16).
    "cat": [dense | embeddings flattened], [B, (F + 1) D].
    """

    def __init__(self, embedding_dim: int, interaction: str = "dot", num_sparse: int = NUM_SPARSE):
        super().__init__()
        if interaction not in ("dot", "cat"):
            raise ValueError(f"unknown interaction {interaction!r}: expected 'dot' or 'cat'")
        self.interaction = interaction
        n = num_sparse + 1
        li, lj = torch.tril_indices(n, n, offset=-1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)
        if interaction == "dot":
            self.out_features = embedding_dim + n * (n - 1) // 2
        else:
            self.out_features = n * embedding_dim

    def forward(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        if self.interaction == "cat":
            return torch.cat([dense, embedded.flatten(1)], dim=1)
        t = torch.cat([dense.unsqueeze(1), embedded], dim=1)
        z = torch.bmm(t, t.transpose(1, 2))
        return torch.cat([dense, z[:, self.li, self.lj]], dim=1)


class OverArch(nn.Module):
    """Top MLP, ReLU between layers and none after the last: [B, interaction width] -> logit [B]."""

    def __init__(self, in_features: int, widths: tuple[int, ...], mlp_kernel: str = "torch"):
        super().__init__()
        self.mlp = MLP(in_features, widths, "relu", "identity", mlp_kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x).squeeze(1)


class DLRM(nn.Module):
    """The full model: dense [B, N_dense] f32 and raw sparse ids [B, F] i64 -> logit [B] f32.

    Args:
        cfg: the model section of the run config.
        table_rows: rows per table (F ints), already resolved from config/metadata and capped.
        vocabularies: F sorted id tensors when cfg.hashing == "vocab".
        mlp_kernel: how MLP layers run: "torch", "bias_act" or "linear_act" (dlrm.model.mlp).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        table_rows: list[int] | None = None,
        vocabularies: list[torch.Tensor] | None = None,
        mlp_kernel: str = "torch",
    ):
        super().__init__()
        self.dense_arch = DenseArch(cfg.bottom_mlp, mlp_kernel)
        self.sparse_arch = SparseArch(cfg.embedding_dim, table_rows, cfg.hashing, vocabularies)
        self.interaction_arch = InteractionArch(cfg.embedding_dim, cfg.interaction)
        self.over_arch = OverArch(self.interaction_arch.out_features, cfg.top_mlp, mlp_kernel)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        with record_function("embedding"):
            embedded = self.sparse_arch(sparse)
        with record_function("bottom_mlp"):
            dense_out = self.dense_arch(dense)
        with record_function("interaction"):
            features = self.interaction_arch(dense_out, embedded)
        with record_function("top_mlp"):
            return self.over_arch(features)

    def dense_parameters(self) -> list[nn.Parameter]:
        """Parameters of the MLPs (dense gradients)."""
        return [*self.dense_arch.parameters(), *self.over_arch.parameters()]

    def embedding_parameters(self) -> list[nn.Parameter]:
        """Embedding tables (sparse gradients)."""
        return list(self.sparse_arch.parameters())
