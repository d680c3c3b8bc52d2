"""Hashed logistic regression (`model.arch` "logistic"): the baseline floor a DLRM must beat, on the same
preprocessed splits, table sizes and hashing, trained by the same loop on every backend.

    logit[b] = bias + sum_j dense[b, j] w_dense[j] + sum_f w_f[row_f(sparse[b, f])]
    p[b] = sigmoid(logit[b]),   trained on the mean BCE-with-logits

It is logistic regression on the one-hot encoding of each sparse feature's hashed row (the "hashing trick",
Weinberger et al. 2009, with one hash space per feature) next to the dense features: the same model as
scikit-learn's LogisticRegression without a penalty on those features, fit by SGD / Adagrad instead of a
second-order solver. Shapes (glossary of dlrm/model/dlrm.py): dense [B, N_dense] fp32, sparse [B, F] int64
raw ids, logit [B] fp32. The terms are dlrm.model.first_order.FirstOrder.
"""

import torch
from torch import nn
from torch.profiler import record_function

from dlrm.model.dlrm import bce_loss, embedding_parameters, log_odds
from dlrm.model.first_order import FirstOrder
from dlrm.model.sparse import SparseArch


class LogisticRegression(nn.Module):
    """dense [B, N_dense] fp32 and raw sparse ids [B, F] int64 -> logit [B] fp32; the interface of
    dlrm.model.dlrm.DLRM that the training loop, checkpoints, prediction and export use.

    Args:
        table_rows: rows_f per table (F ints), resolved from config/metadata and capped.
        hashing: "modulus" or "vocab" (SparseArch).
        vocabularies: F sorted id tensors for "vocab".
        sparse_kernel: "torch" (sparse gradients, a torch optimizer), "torch_fused" (plain PyTorch, the
            optimizer in the lookup's backward) or "triton" (our embedding kernel with the optimizer fused
            into its backward, and our loss kernel).
    Raises:
        ValueError: as SparseArch.
    """

    def __init__(
        self,
        table_rows: list[int] | None = None,
        hashing: str = "modulus",
        vocabularies: list[torch.Tensor] | None = None,
        sparse_kernel: str = "torch",
    ):
        super().__init__()
        self.first_order = FirstOrder(table_rows, hashing, vocabularies, sparse_kernel, bias=True)

    @property
    def sparse_arch(self) -> SparseArch:
        """The first-order tables: what a DLRM's `sparse_arch` is to the loop (table layout, optimizer)."""
        return self.first_order.tables

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        with record_function("first_order"):
            return self.first_order(dense, sparse)

    def start_at_base_rate(self, positive_rate: float) -> None:
        """Make the fresh model predict `positive_rate` (a click rate in (0, 1)) for every row: the bias at
        its log-odds (every weight is zero at the start), the intercept a fit converges to first. Raises
        ValueError as dlrm.model.dlrm.log_odds."""
        with torch.no_grad():
            self.first_order.dense.bias.fill_(log_odds(positive_rate))

    def dense_modules(self) -> list[nn.Module]:
        """The dense layer, which `--use-torch-compile` compiles (the lookups stay eager, as DLRM's)."""
        return [self.first_order.dense]

    def table_archs(self) -> list[nn.Module]:
        return [self.first_order.tables]

    def dense_parameters(self) -> list[nn.Parameter]:
        """The dense weights and the bias: dense gradients."""
        return list(self.first_order.dense.parameters())

    def embedding_parameters(self) -> list[nn.Parameter]:
        """The first-order tables for a torch optimizer (sparse gradients); none for kernel "triton"."""
        return embedding_parameters(self.table_archs())

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean BCE-with-logits of logits [B] against labels [B] (dlrm.model.dlrm.bce_loss)."""
        return bce_loss(logits, labels, self.sparse_arch.kernel)
