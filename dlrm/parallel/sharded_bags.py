"""Bags on the sharded tables (dlrm.parallel.sharded): the ids exchange carries each shard's bag columns, each
rank pools its shards' bags, and the pooled vectors [b, F, D] come back through the same vector exchange as
one-hot lookups.

Letters of dlrm.parallel.sharded (W, b, F, D, n, n_r), and k_f the bag size of table f, S = sum of k_f (the
[b, S] ids of dlrm.data.bags, feature-major), L = sum of k_f over this rank's n shards.

- hash: rows [b, S] = (x + 1) % rows_f of each id (bags take modulus hashing only, as in one process).
- ids all_to_all: to each rank q the bag columns of the tables q holds a shard of, [L_q, b] (fixed split
  sizes b * L_q); rank q receives [W*b, L_q], the global batch's bags of its shards (shard after shard).
- lookup: the bags of the local shards pooled as one process pools them ("sum", or "mean" = sum / k_f), kernel
  "triton" by `kernels.embedding_bag` (its backward applies the optimizer, every touched row once with its
  summed gradient), kernel "torch" by one F.embedding_bag over the table-batched weights (sparse gradient).
  A row shard pools the ids it holds: an id outside it looks up the shard arch's padding row, the last row
  of `weights`, zeroed before every lookup, so it adds nothing to the pool and no update reaches a table
  row through it. Kernel "triton" drops the padding row's lookups from its update (`drop_last_row`: their
  gradients never read, the row never stepped); kernel "torch"'s sparse gradient steps the padding row,
  whose update the next zeroing overwrites. The shards of a table
  split by rows each give their partial pool, and ToTableOrder sums them: the bag's pool (its "mean" too,
  each part divided by the whole k_f).
- the replicated tables pool their own b samples' bags (`ReplicatedBagLookup`, dense gradient).
Every size depends on b, the bag sizes and the plan only: the step stays one CUDA graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlrm.choices import POOLINGS
from dlrm.data.bags import bag_starts, check_sizes
from dlrm.parallel.planner import Shard


class ReplicatedBagLookup(torch.autograd.Function):
    """The replicated tables' pooled bags: weights [R_r, D] fp32 (table j from row offsets[j] of rows[j]),
    rows [b, L_r] int64 within each table (table j's bag in bag_sizes[j] consecutive columns) -> pooled
    [b, n_r, D] fp32; backward gives the dense gradient [R_r, D] fp32, each row's summed gradient. Triton
    where it runs (`kernels.launch.use_triton`): the bag kernel's forward, and its SGD update with lr -1 into
    zeros, each row's lookups summed in sorted order where `in_order` (the same bits on every run, as
    `dlrm.parallel.sharded.ReplicatedLookup` says), else by atomic adds; elsewhere their PyTorch
    references."""

    @staticmethod
    def forward(ctx, weights: Tensor, offsets: Tensor, table_rows: Tensor, bag_sizes: Tensor, rows: Tensor,
                pooling: str, in_order: bool) -> Tensor:  # fmt: skip
        # Imported here: dlrm.model.sparse says why.
        from kernels.embedding_bag import embedding_bag_fwd, embedding_bag_lookup_ref
        from kernels.launch import use_triton

        lookup = embedding_bag_fwd if use_triton(weights) else embedding_bag_lookup_ref
        out, index = lookup(weights, offsets, table_rows, bag_sizes, rows, "index", pooling)
        ctx.save_for_backward(index, bag_sizes)
        ctx.shape, ctx.pooling, ctx.in_order = weights.shape, pooling, in_order
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        from kernels.embedding_bag import embedding_bag_update
        from kernels.embedding_update import optimizer_state

        index, bag_sizes = ctx.saved_tensors
        grad_weights = grad.new_zeros(ctx.shape, dtype=torch.float32)
        minus_one = torch.full((), -1.0, device=grad.device)
        state = optimizer_state(grad_weights, "sgd")
        embedding_bag_update(
            grad_weights, state, index, grad, bag_sizes, ctx.pooling, "sgd", minus_one, 0.0,
            in_order=ctx.in_order,
        )  # fmt: skip
        return grad_weights, None, None, None, None, None, None


class ShardedBags(nn.Module):
    """The bag layout of a ShardedSparseArch's exchange and the pooled lookups of its bags (module
    docstring). Buffers only (no state): a checkpoint's keys are the same with and without bags.

    Args:
        sizes: F bag sizes k_f >= 1 (`model.multi_hot_sizes`).
        pooling: "sum" or "mean".
        table_rows: rows_f of each full table.
        blocks: the tables of each rank's shards, rank after rank (ShardedSparseArch.blocks).
        local_shards: this rank's shards, in its `weights` order.
        replicated: the replicated tables, in `replicated_weights` order.
        padding_row: the row of the arch's `weights` that ids outside a row shard look up (None: no row
            shards here).
        device: where the buffers live.
    Raises:
        ValueError: bad sizes or pooling.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        pooling: str,
        table_rows: list[int],
        blocks: list[list[int]],
        local_shards: list[Shard],
        replicated: list[int],
        padding_row: int | None,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.sizes = check_sizes(sizes, "model.multi_hot_sizes")
        if pooling not in POOLINGS:
            raise ValueError(f"model.pooling: expected one of {POOLINGS}, got {pooling!r}")
        self.pooling, self.padding_row = pooling, padding_row
        starts = bag_starts(self.sizes)

        def columns(tables: list[int]) -> list[int]:
            return [starts[f] + j for f in tables for j in range(self.sizes[f])]

        # L_q of every rank q: its share of the ids exchange is b * L_q ids.
        self.columns_per_rank = [len(columns(tables)) for tables in blocks]
        local_tables = [s.table for s in local_shards]
        local_sizes = [self.sizes[f] for f in local_tables]
        shard_rows = [s.rows for s in local_shards]
        offsets = [sum(shard_rows[:j]) for j in range(len(shard_rows))]

        def per_column(values: list[int]) -> list[int]:  # a shard's value on each of its k_f columns
            return [v for v, k in zip(values, local_sizes, strict=True) for _ in range(k)]

        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
        buffers = {
            "column_rows": [table_rows[f] for f, k in enumerate(self.sizes) for _ in range(k)],
            "send_columns": [c for tables in blocks for c in columns(tables)],
            "local_sizes": local_sizes,
            "local_starts": bag_starts(local_sizes),  # first column of each local shard's bag
            "column_start": per_column([s.row_start for s in local_shards]),  # each column's shard's rows
            "column_rows_held": per_column(shard_rows),
            "column_offsets": per_column(offsets),
            "replicated_columns": columns(replicated),
            "replicated_sizes": [self.sizes[f] for f in replicated],
        }
        for name, values in buffers.items():
            self.register_buffer(name, as_tensor(values), persistent=False)
        if padding_row is not None:  # the padding row, as a row of each column's shard (kernel "index")
            self.register_buffer("padding", padding_row - self.column_offsets, persistent=False)

    def hash_ids(self, sparse: Tensor) -> Tensor:
        """Raw ids [b, S] int64 -> rows [b, S] int64 of the full tables (modulus, as one process)."""
        if sparse.ndim != 2 or sparse.shape[1] != self.column_rows.shape[0]:
            raise ValueError(
                f"expected bags of ids [b, {self.column_rows.shape[0]}] (model.multi_hot_sizes), got "
                f"{list(sparse.shape)}"
            )
        return torch.remainder(sparse + 1, self.column_rows)

    def lookup(self, arch: nn.Module, ids: Tensor) -> Tensor:
        """Full-table rows [N, L] of the local shards' bags (N = W*b) -> pooled [N, n, D] in the lookup's
        dtype, the ids outside a row shard adding nothing (module docstring)."""
        n, d = self.local_sizes.shape[0], arch.weights.shape[1]
        if n == 0:  # a rank without shards still takes part in the exchange, both ways
            empty = arch.weights.new_zeros(ids.shape[0], 0, d, dtype=arch.lookup_dtype(ids.device))
            return empty.requires_grad_(torch.is_grad_enabled())
        local = ids - self.column_start
        if self.padding_row is not None:
            valid = (local >= 0) & (local < self.column_rows_held)
            local = torch.where(valid, local, self.padding)
            with torch.no_grad():  # the padding row adds zeros (kernel "torch" steps it: undone here)
                arch.weights[self.padding_row].zero_()
        if arch.kernel == "triton":
            return self._triton_lookup(arch, local)
        flat = (local + self.column_offsets).reshape(-1)
        samples = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1) * ids.shape[1]
        bag_offsets = (samples + self.local_starts).reshape(-1)  # [N * n]: sample after sample
        pooled = F.embedding_bag(flat, arch.weights, bag_offsets, mode=self.pooling, sparse=True)
        return pooled.view(ids.shape[0], n, d)

    def _triton_lookup(self, arch: nn.Module, local: Tensor) -> Tensor:
        from kernels.embedding_bag import embedding_bag_lookup  # dlrm.model.sparse says why here

        if arch.optimizer is None and torch.is_grad_enabled():
            raise ValueError("ShardedSparseArch(kernel='triton'): call configure_optimizer before training")
        optimizer, eps = arch.optimizer or ("sgd", 0.0)
        return embedding_bag_lookup(
            arch.weights, arch.optimizer_state, arch.offsets, arch.shard_rows, self.local_sizes, local,
            "index", self.pooling, optimizer, arch.lr, eps, arch.lookup_dtype(local.device), arch.rounding,
            self.padding_row is not None,
        )  # fmt: skip

    def lookup_replicated(self, arch: nn.Module, rows: Tensor) -> Tensor:
        """Rows [b, S] of the full tables -> the replicated tables' pooled bags [b, n_r, D] fp32 (dense
        gradient); [b, 0, D] without replicated tables."""
        if arch.replicated_weights is None:
            return arch.weights.new_zeros(rows.shape[0], 0, arch.weights.shape[1], dtype=torch.float32)
        local = rows.index_select(1, self.replicated_columns)
        return ReplicatedBagLookup.apply(
            arch.replicated_weights, arch.replicated_offsets, arch.replicated_rows, self.replicated_sizes,
            local, self.pooling, arch.replicated_in_order(),
        )  # fmt: skip
