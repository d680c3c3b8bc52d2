"""Pooled embedding bags for SparseArch: multi-hot ids [B, S] (dlrm.data.bags' layout) -> [B, F, D].

Each feature f's bag of k_f ids is hashed like one-hot ids (modulus: row = (x + 1) % rows_f), looked up in
table f and pooled by `model.pooling`: "sum", or "mean" (the sum / k_f). Per SparseArch kernel:
- "torch": F.embedding_bag per table over its [B, k_f] columns (sparse gradients; a torch optimizer sums a
  row's gradients over the batch and steps it once, as for one-hot lookups).
- "triton": `kernels.embedding_bag`, one launch for every table's bags forward; its backward applies the
  configured optimizer, every touched row once with the sum of its gradients.
SparseArch holds a BagPooling only for sizes other than all ones: one-hot ids take its one-hot path.
"""

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from dlrm.choices import POOLINGS
from dlrm.data.bags import bag_starts, check_sizes
from dlrm.model.tables import lookup_dtype


class BagPooling(nn.Module):
    """The bag layout of a SparseArch's ids and how its bags are pooled.

    Args:
        sizes: F bag sizes k_f >= 1 (sum S).
        pooling: "sum" or "mean".
        table_rows: rows_f of each table (F ints), for the per-column modulus.
    Raises:
        ValueError: bad sizes or pooling.
    """

    def __init__(self, sizes: tuple[int, ...], pooling: str, table_rows: list[int]) -> None:
        super().__init__()
        self.sizes = check_sizes(sizes, "model.multi_hot_sizes")
        if pooling not in POOLINGS:
            raise ValueError(f"model.pooling: expected one of {POOLINGS}, got {pooling!r}")
        self.pooling = pooling
        self.starts = bag_starts(self.sizes)
        sizes_t = torch.tensor(self.sizes)
        # Buffers, so that they move with the module and a step copies nothing to the device.
        self.register_buffer("bag_sizes", sizes_t, persistent=False)
        self.register_buffer(
            "column_rows", torch.tensor(table_rows).repeat_interleave(sizes_t), persistent=False
        )

    @property
    def columns(self) -> int:
        """S, the ids of a sample."""
        return sum(self.sizes)

    def check_ids(self, sparse: torch.Tensor) -> None:
        if sparse.ndim != 2 or sparse.shape[1] != self.columns:
            raise ValueError(
                f"expected bags of ids [B, {self.columns}] (model.multi_hot_sizes), got {list(sparse.shape)}"
            )

    def torch_forward(self, tables: nn.ModuleList, sparse: torch.Tensor) -> torch.Tensor:
        """Kernel "torch": raw ids [B, S] -> pooled [B, F, D] in the tables' dtype."""
        rows = torch.remainder(sparse + 1, self.column_rows)
        pooled = [
            F.embedding_bag(rows[:, start : start + k], table.weight, mode=self.pooling, sparse=True)
            for table, start, k in zip(tables, self.starts, self.sizes, strict=True)
        ]
        return torch.stack(pooled, dim=1)

    def triton_forward(self, arch: nn.Module, sparse: torch.Tensor) -> torch.Tensor:
        """Kernel "triton": raw ids [B, S] -> pooled [B, F, D] by `kernels.embedding_bag` on `arch`'s
        table-batched weights, optimizer state, lr and rounding (SparseArch.configure_optimizer), in
        `dlrm.model.tables.lookup_dtype` (fp32, or under autocast the autocast dtype, rounded by the kernel
        as it stores)."""
        # Imported here, not with the module: importing triton must wait until dlrm.step has switched the
        # interpreter on for CPU runs (TRITON_INTERPRET is read once, when triton is first imported).
        from kernels.embedding_bag import embedding_bag_lookup

        if arch.optimizer is None and torch.is_grad_enabled() and not arch.frozen:
            raise ValueError(
                "SparseArch(kernel='triton') updates its tables in backward: call configure_optimizer "
                "before training (or look up under torch.no_grad())"
            )
        optimizer, eps = arch.optimizer or ("sgd", 0.0)  # lookups only: lr 0, nothing is updated
        dtype = lookup_dtype(sparse.device)
        with torch.no_grad() if arch.frozen else contextlib.nullcontext():
            return embedding_bag_lookup(
                arch.weights,
                arch.optimizer_state,
                arch.offsets,
                arch.rows,
                self.bag_sizes,
                sparse,
                "modulus",
                self.pooling,
                optimizer,
                arch.lr,
                eps,
                dtype,
                arch.rounding,
            )

    def forward(self, arch: nn.Module, sparse: torch.Tensor) -> torch.Tensor:
        """The pooled bags of SparseArch `arch` (modulus hashing) for raw ids [B, S] int64: [B, F, D]."""
        self.check_ids(sparse)
        if arch.kernel == "triton":
            return self.triton_forward(arch, sparse)
        return self.torch_forward(arch.embeddings, sparse)
