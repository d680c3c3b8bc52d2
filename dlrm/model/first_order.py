"""First-order ("wide") terms of a click logit: one weight per embedding-table row and a linear layer over
the dense features. They are what logistic regression has and DLRM lacks: the linear term of a
factorization machine (Rendle 2010, w_0 + sum_i w_i x_i with the sparse features one-hot), the "wide"
part of Wide & Deep (Cheng et al. 2016) without its cross-product features.

    wide[b] = bias + sum_j dense[b, j] w_dense[j] + sum_f w_f[row_f(sparse[b, f])]

Shapes (glossary of dlrm/model/dlrm.py): dense [B, N_dense] fp32 (the loaders' log(1 + max(count, 0)),
what the DLRM's bottom MLP reads), sparse [B, F] int64 (raw ids, or rows for hashing "index"), wide [B]
fp32. The F weight vectors w_f [rows_f] are a SparseArch of D = 1: the same hashing and table sizes as
the DLRM's tables, and the same kernels (kernel "torch": nn.Embedding with sparse gradients for a torch
optimizer; "triton": our table-batched lookup, whose backward applies SGD / Adagrad to the touched rows).
"""

import torch
import torch.nn.functional as F
from torch import nn

from dlrm.data.schema import NUM_DENSE
from dlrm.model.sparse import SparseArch


class DenseTerm(nn.Module):
    """dense [B, N_dense] -> dense @ weight^T + bias, [B]: nn.Linear(N_dense, 1) squeezed, a module of ours
    so that `--use-torch-compile` compiles it (torch.compile skips torch.nn's own modules compiled in place).

    Parameters: weight [1, N_dense], bias [1] (or none), both zero at the start.
    """

    def __init__(self, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, NUM_DENSE))
        self.bias = nn.Parameter(torch.zeros(1)) if bias else None

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        return F.linear(dense, self.weight, self.bias).squeeze(1)


class FirstOrder(nn.Module):
    """wide[B] = bias + dense @ w_dense + sum over f of w_f[row_f]: a SparseArch of D = 1 (`tables`) and a
    DenseTerm (`dense`), both initialized to zero.

    Computed in fp32 whatever the autocast: 27 terms of a logit, which bf16 (8 bits of mantissa) would
    round as they are summed, for no speed gain at one column.

    Args:
        table_rows: rows_f per table (F ints); ignored for "vocab" (len(vocabulary) + 1).
        hashing: "modulus", "vocab" or "index" (SparseArch).
        vocabularies: for "vocab", F sorted int64 tensors of known ids.
        kernel: "torch" or "triton" (SparseArch).
        bias: whether `dense` has a bias (the DLRM's logit layer has one already).
        tables: the D = 1 tables to use instead of a new SparseArch (many ranks: this rank's shards,
            dlrm.parallel.sharded); zeroed like it.
    Raises:
        ValueError: as SparseArch.
    """

    def __init__(
        self,
        table_rows: list[int] | None,
        hashing: str = "modulus",
        vocabularies: list[torch.Tensor] | None = None,
        kernel: str = "torch",
        bias: bool = True,
        tables: nn.Module | None = None,
    ):
        super().__init__()
        # Seed 0: any, the tables are zeroed below (and the global torch generator is left as it was).
        self.tables = (
            tables if tables is not None else SparseArch(1, table_rows, hashing, vocabularies, kernel, seed=0)
        )
        self.dense = DenseTerm(bias)
        # Zero: logistic regression's usual start (p = 0.5; the loss is convex, so no symmetry to break), and
        # a DLRM with first-order terms starts as the plain DLRM.
        for p in self.tables.parameters():
            nn.init.zeros_(p)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """dense [B, N_dense] fp32, sparse [B, F] int64 -> wide [B] fp32."""
        with torch.autocast(dense.device.type, enabled=False):
            return self.dense(dense.float()) + self.tables(sparse).sum(dim=(1, 2))
