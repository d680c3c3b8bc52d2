"""The sharded SparseArch: embedding tables model parallel over W ranks, exchanged by all_to_all.

Letters: W ranks, b = B / W samples per rank (the global batch B split evenly), F tables, D dim,
S = the plan's shard count (a table split row-wise over k ranks counts k times), n = this rank's shards.
The plan's replicated tables (data parallel) skip steps 2-4: every rank holds them whole and looks up its
own b samples (`replicated_weights`, dense gradients that dlrm.parallel.dense all-reduces with the MLPs').

Forward on each rank, for its b samples' raw ids [b, F] int64:
1. hash: rows [b, F] = the table row of each id in the FULL table, as one process does (modulus
   (x + 1) % rows_f, or the vocabulary); every rank holds the F row counts (and vocabularies).
2. ids all_to_all: to each rank q the columns of the tables q holds a shard of, [n_q, b] per q (fixed
   split sizes b * n_q). Rank q receives [W, n_q, b]: the rows of the whole global batch for its shards,
   in global-batch order (rank r's samples are rows r*b .. (r+1)*b - 1).
3. lookup on the local shards (kernel "triton": our table-batched kernel with the optimizer fused into
   backward; kernel "torch": one table-batched weight with a sparse gradient for a torch optimizer).
   A row shard [start, start + rows) looks up row - start where 0 <= row - start < rows and gives zeros
   (and, through the zero gradient, no update) elsewhere: exactly one shard of a table gives a row's vector.
4. pooled all_to_all back: [W*b, n, D] as it is (rank r's rows are a contiguous block) -> from each rank
   q a [b, n_q, D] block (split sizes b * n_q * D), put in table order in embedded [b, F, D] with the
   replicated tables' local columns (ToTableOrder: one kernel pass, kernels.table_order, that also casts
   to the lookup's dtype; a table split by rows is the sum of its shards' columns, one non-zero term per
   element, so exact).
The vectors cross in `exchange_dtype` (the lookup's dtype by default; "bf16" halves the bytes of an fp32
run, forward vectors and backward gradients, at bf16's rounding of each vector).
Backward reverses 4 (the gradients put back in block order and scaled by 1/W in the same pass: each rank's
loss is a mean over its b samples, so the summed gradient of W ranks is W times the one-process mean over
B; then their all_to_all) and 3 applies the
optimizer. Every size depends on b and the plan only: the step can be captured as one CUDA graph.
Profiler ranges (inside "embedding"): all_to_all_ids, lookup, all_to_all_vectors; all_to_all_backward.
With bags (`model.multi_hot_sizes`), steps 1-3 carry each table's bag columns and pool them on the shards
(dlrm.parallel.sharded_bags); step 4 and backward are the same.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.profiler import record_function

from dlrm.data.bags import is_one_hot
from dlrm.model import DLRM
from dlrm.model.sparse import SparseArch, init_tables
from dlrm.model.tables import (
    build_vocabularies,
    lookup_dtype,
    register_vocabularies,
    resolve_table_rows,
    table_torch_dtype,
)
from dlrm.parallel.dense import broadcast_from_rank0
from dlrm.parallel.planner import TABLE_BYTES, ShardingPlan, plan_tables
from dlrm.parallel.sharded_bags import ShardedBags

# The sparse kernels whose tables shard ("torch_fused", the plain-PyTorch fused update of one process's
# tables, does not: --use-torch-compile's whole-step graph runs on one rank, dlrm.step.resolve_cuda_graphs).
SHARDED_KERNELS = ("torch", "triton")


class AllToAll(torch.autograd.Function):
    """all_to_all_single of a flat tensor with fixed split sizes; backward sends the gradient back the
    other way (the splits swapped)."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int]) -> Tensor:
        ctx.out_splits, ctx.in_splits = out_splits, in_splits
        return exchange(x, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad: Tensor):
        with record_function("all_to_all_backward"):
            return exchange(grad, ctx.in_splits, ctx.out_splits), None, None


class ToTableOrder(torch.autograd.Function):
    """The vectors received from the ranks (`back`, flat: from each rank q a [b, n_q, D] block, rank after
    rank) and the replicated tables' local ones (`local` [b, n_r, D]) -> embedded [b, F, D] `out_dtype`,
    by `order` (kernels.table_order.ColumnOrder: one pass, a table split by rows the sum of its shards'
    columns). Backward: each block's gradient, the exchanged ones times `grad_scale`, in `back`'s and
    `local`'s dtypes (one pass)."""

    @staticmethod
    def forward(ctx, back: Tensor, local: Tensor, b: int, d: int, order, out_dtype, grad_scale: float):
        ctx.meta = (b, d, order, grad_scale, back.dtype, local.dtype)
        return order.gather(back, local, b, d, out_dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        b, d, order, grad_scale, back_dtype, local_dtype = ctx.meta
        grad_back, grad_local = order.scatter(grad, b, d, grad_scale, back_dtype, local_dtype)
        return grad_back, grad_local, None, None, None, None, None


class ReplicatedLookup(torch.autograd.Function):
    """The replicated tables' lookup: weights [R_r, D] fp32 (table-batched, table j from row offsets[j] of
    rows[j]), rows [b, n_r] int64 within each table -> vectors [b, n_r, D] fp32; backward gives the dense
    gradient [R_r, D] fp32, each row's summed gradient. On a GPU both are the embedding kernels: the lookup,
    and the SGD update with lr -1 into zeros, each row's lookups summed in sorted order where `in_order`
    (ShardedSparseArch.replicated_in_order says where), else by atomic adds, which sum in whatever order a
    GPU's threads come, so the gradient's last bits, then a whole many-GPU run, differ from run to run of
    one seed. torch's embedding is several times slower there at the batches a GPU runs: its forward
    gathers D-value rows one thread block each."""

    @staticmethod
    def forward(
        ctx, weights: Tensor, offsets: Tensor, table_rows: Tensor, rows: Tensor, in_order: bool
    ) -> Tensor:
        from kernels.embedding import embedding_lookup_fwd  # dlrm.model.sparse says why here
        from kernels.launch import use_triton

        if use_triton(weights):
            out, index = embedding_lookup_fwd(weights, offsets, table_rows, rows, "index")
        else:
            index = rows + offsets
            out = F.embedding(index, weights)
        ctx.save_for_backward(index)
        ctx.shape, ctx.in_order = weights.shape, in_order
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        from kernels.embedding_update import embedding_update, optimizer_state

        (index,) = ctx.saved_tensors
        grad_weights = grad.new_zeros(ctx.shape, dtype=torch.float32)
        minus_one = torch.full((), -1.0, device=grad.device)
        embedding_update(
            grad_weights, optimizer_state(grad_weights, "sgd"), index, grad, "sgd", minus_one, 0.0,
            in_order=ctx.in_order,
        )  # fmt: skip
        return grad_weights, None, None, None, None


def exchange(x: Tensor, out_splits: list[int], in_splits: list[int]) -> Tensor:
    """torch.distributed.all_to_all_single on the default group: send in_splits[q] elements of the 1-D x
    (in rank order) to rank q, receive out_splits[q] from rank q; returns the [sum(out_splits)] tensor."""
    out = x.new_empty(sum(out_splits))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
    return out


class ShardedSparseArch(nn.Module):
    """This rank's shards of the F embedding tables, and the exchange that serves every rank's samples.

    Same interface as dlrm.model.dlrm.SparseArch (forward [b, F] raw ids, or bags [b, S], -> [b, F, D];
    `kernel`, `table_rows`, `configure_optimizer`, `optimizer_state`), but holds only the rows the plan gives
    `rank`: `weights` [rows of the local shards, D] in `table_dtype` (fp32 or bf16, kernel "triton": its
    fused updates round stochastically, SparseArch), shard i from row `offsets[i]`, and every rank
    `replicated_weights` [rows of the replicated tables, D] fp32 whatever `table_dtype` (None without any;
    dense gradients, for
    the dense optimizer after the all-reduce: `replicated_parameters`), created on `device` (never whole on
    the host), each shard or table holding its rows of the weights a one-process SparseArch of the same
    seed starts from (dlrm.model.sparse.init_tables: drawn on the host block by block and copied over), so
    a run starts from the same tables on any number of ranks.

    Args:
        plan: the sharding plan (dlrm.parallel.planner); W = plan.world_size.
        rank: this process's rank.
        embedding_dim: D.
        hashing: "modulus", "vocab" (vocabularies: F sorted int64 tensors, held by every rank) or "index"
            (rows given: the first-order tables of a vocab model, looked up with the embeddings' rows).
        kernel: "torch" or "triton".
        device: where the shards live.
        seed: the tables' initialization seed (the run's train.seed).
        exchange_dtype: "auto" (the lookup's dtype), "fp32" or "bf16": the vectors' dtype on the wire.
        multi_hot_sizes: F bag sizes (None or all ones: one id per feature); with bags, forward takes ids
            [b, S] (dlrm.data.bags) and pools each bag by `pooling` ("sum" or "mean"), modulus hashing
            only. A rank holding a row shard then has one more row at the end of `weights`, the padding
            row that ids outside its shards look up (dlrm.parallel.sharded_bags).
        table_dtype: "fp32" or "bf16" (kernel "triton" only), the dtype of `weights`.
    Raises:
        ValueError: unknown kernel, a plan of other tables than `vocabularies` give, bags with another
            hashing than "modulus", bad bag sizes or pooling.
    """

    def __init__(
        self,
        plan: ShardingPlan,
        rank: int,
        embedding_dim: int,
        hashing: str = "modulus",
        vocabularies: list[Tensor] | None = None,
        kernel: str = "torch",
        device: torch.device | str = "cpu",
        seed: int = 0,
        exchange_dtype: str = "auto",
        multi_hot_sizes: tuple[int, ...] | None = None,
        pooling: str = "sum",
        table_dtype: str = "fp32",
    ):
        super().__init__()
        if kernel not in SHARDED_KERNELS:
            raise ValueError(f"sparse kernel {kernel!r} on many ranks: expected one of {SHARDED_KERNELS}")
        dtype = table_torch_dtype(table_dtype, kernel)
        one_hot = is_one_hot(multi_hot_sizes)
        if not one_hot and hashing != "modulus":
            raise ValueError(f"bags (model.multi_hot_sizes) need hashing 'modulus', got {hashing!r}")
        device = torch.device(device)
        self.plan, self.rank, self.world_size = plan, rank, plan.world_size
        self.kernel, self.hashing = kernel, hashing
        self.table_rows = list(plan.table_rows)
        if hashing == "vocab":
            if vocabularies is None or [len(v) + 1 for v in vocabularies] != self.table_rows:
                raise ValueError("hashing 'vocab': the vocabularies do not give the plan's table rows")
            register_vocabularies(self, [vocab.to(device) for vocab in vocabularies])
        self.register_buffer("rows", torch.tensor(self.table_rows, device=device), persistent=False)
        self.exchange_dtype = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16}[exchange_dtype]
        self.local_shards = plan.shards_of(rank)
        shard_rows = [s.rows for s in self.local_shards]
        # Only row shards need the range mask; whole tables hold every row.
        self.partial = any(s.rows != self.table_rows[s.table] for s in self.local_shards)
        padding_row = sum(shard_rows) if self.partial and not one_hot else None
        held = sum(shard_rows) + (padding_row is not None)
        self.weights = nn.Parameter(torch.empty(held, embedding_dim, device=device, dtype=dtype))
        if padding_row is not None:
            self.weights.data[padding_row].zero_()
        self.replicated = list(plan.replicated)
        replicated_rows = [self.table_rows[f] for f in self.replicated]
        replicated = (
            torch.empty(sum(replicated_rows), embedding_dim, device=device) if self.replicated else None
        )
        self.register_parameter(
            "replicated_weights", None if replicated is None else nn.Parameter(replicated)
        )
        pieces = [
            (s.table, s.row_start, t)
            for s, t in zip(
                self.local_shards, self.weights.data[: sum(shard_rows)].split(shard_rows), strict=True
            )
        ]
        if replicated is not None:
            pieces += [
                (f, 0, t) for f, t in zip(self.replicated, replicated.split(replicated_rows), strict=True)
            ]
        init_tables(
            [(values, table, self.table_rows[table], row_start) for table, row_start, values in pieces], seed
        )
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
        self.register_buffer("replicated_tables", as_tensor(self.replicated), persistent=False)
        self.register_buffer(
            "replicated_offsets", as_tensor([0, *replicated_rows[:-1]]).cumsum(0), persistent=False
        )
        self.register_buffer("replicated_rows", as_tensor(replicated_rows), persistent=False)
        self.register_buffer("offsets", as_tensor([0, *shard_rows[:-1]]).cumsum(0), persistent=False)
        self.register_buffer("shard_rows", as_tensor(shard_rows), persistent=False)
        self.register_buffer(
            "row_start", as_tensor([s.row_start for s in self.local_shards]), persistent=False
        )
        # The tables of each rank's shards (its block of the exchange), rank after rank: the ids' send order
        # and, coming back, the table of each pooled column.
        self.blocks = [[s.table for s in plan.shards_of(q)] for q in range(self.world_size)]
        self.shards_per_rank = [len(tables) for tables in self.blocks]
        send_tables = [t for tables in self.blocks for t in tables]
        # Table f is column j of rank q's block for each (q, j) in columns[f] (the replicated tables: of the
        # local block W).
        self.columns: list[list[tuple[int, int]]] = [[] for _ in self.table_rows]
        for q, tables in enumerate([*self.blocks, self.replicated]):
            for j, t in enumerate(tables):
                self.columns[t].append((q, j))
        self.register_buffer("send_tables", as_tensor(send_tables), persistent=False)
        self.bags = None
        if not one_hot:
            self.bags = ShardedBags(
                multi_hot_sizes, pooling, self.table_rows, self.blocks, self.local_shards, self.replicated,
                padding_row, device,
            )  # fmt: skip
        self.register_buffer("optimizer_state", torch.zeros(0, device=device), persistent=False)
        self.register_buffer("lr", torch.zeros((), device=device), persistent=False)
        self.optimizer: tuple[str, float] | None = None  # (optimizer, eps)
        self.rounding: Tensor | None = None  # bf16 shards: (seed, count), set by configure_optimizer
        self._order = None

    def configure_optimizer(
        self, optimizer: str, lr: float | Tensor, eps: float = 1e-10, rounding: Tensor | None = None
    ) -> None:
        """For kernel "triton": the update its backward applies, and bf16 shards' stochastic rounding
        (see SparseArch.configure_optimizer).

        Raises:
            ValueError: kernel "torch", or an unknown optimizer.
        """
        SparseArch.configure_optimizer(self, optimizer, lr, eps, rounding)

    def hash_ids(self, sparse: Tensor) -> Tensor:
        """Raw ids [b, F] int64 -> rows [b, F] int64 of the full tables (as SparseArch.hash_ids)."""
        return SparseArch.hash_ids(self, sparse)

    def replicated_parameters(self) -> list[nn.Parameter]:
        """The replicated tables' weights (dense gradients): for the dense optimizer and all-reduce."""
        return [] if self.replicated_weights is None else [self.replicated_weights]

    def forward(self, sparse: Tensor) -> Tensor:
        """sparse: [b, F] int64 raw ids of this rank's samples (with bags: [b, S], each bag pooled) ->
        embedded [b, F, D] (the lookup's dtype: fp32 whatever the tables' dtype, or bf16 from the "triton"
        kernel under bf16 autocast). Every rank must call it with the same b: it exchanges with all of
        them."""
        b, world, n = sparse.shape[0], self.world_size, len(self.local_shards)
        bags = self.bags
        # The id columns each rank is sent (its shards' tables; with bags, their bag columns).
        if bags is None:
            rows, send_columns, per_rank = self.hash_ids(sparse), self.send_tables, self.shards_per_rank
        else:
            rows, send_columns, per_rank = bags.hash_ids(sparse), bags.send_columns, bags.columns_per_rank
        send = rows.index_select(1, send_columns).t().contiguous()  # per rank q, [L_q, b] (one-hot: n_q)
        mine = per_rank[self.rank]
        with record_function("all_to_all_ids"):
            ids = exchange(send.view(-1), [mine * b] * world, [k * b for k in per_rank])
        ids = ids.view(world, mine, b).transpose(1, 2).reshape(world * b, mine)  # global batch x columns
        with record_function("lookup"):
            # [W*b, n, D]: rank r's samples are rows r*b .. (r+1)*b - 1
            pooled = self._lookup(ids) if bags is None else bags.lookup(self, ids)
        b_dtype, d = pooled.dtype, pooled.shape[2]
        wire = pooled if self.exchange_dtype is None else pooled.to(self.exchange_dtype)
        with record_function("all_to_all_vectors"):
            back = AllToAll.apply(
                wire.reshape(-1), [b * k * d for k in self.shards_per_rank], [b * n * d] * world
            )  # from each rank q, [b, n_q, D]
        local = self._lookup_replicated(rows) if bags is None else bags.lookup_replicated(self, rows)
        return ToTableOrder.apply(back, local, b, d, self._column_order(rows.device), b_dtype, 1.0 / world)

    def lookup_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype of this rank's lookups: kernel "triton" `dlrm.model.tables.lookup_dtype` (fp32, or
        the autocast dtype), kernel "torch" its fp32 tables'. Every rank's agrees: the exchange sends it."""
        return lookup_dtype(device) if self.kernel == "triton" else self.weights.dtype

    def _column_order(self, device: torch.device):
        """The kernels' placement of the tables in the exchange's blocks, on `device` (made once)."""
        from kernels.table_order import ColumnOrder  # dlrm.model.sparse says why here

        if self._order is None or self._order.counts.device != device:
            widths = [*self.shards_per_rank, len(self.replicated)]
            self._order = ColumnOrder(widths, self.columns, device)
        return self._order

    def _lookup_replicated(self, rows: Tensor) -> Tensor:
        """Rows [b, F] of the full tables -> the replicated tables' vectors [b, n_r, D] fp32 (dense
        gradient); [b, 0, D] without replicated tables."""
        if self.replicated_weights is None:
            return self.weights.new_zeros(rows.shape[0], 0, self.weights.shape[1], dtype=torch.float32)
        local = rows.index_select(1, self.replicated_tables)
        return ReplicatedLookup.apply(
            self.replicated_weights, self.replicated_offsets, self.replicated_rows, local,
            self.replicated_in_order(),
        )  # fmt: skip

    def replicated_in_order(self) -> bool:
        """Whether the replicated tables' dense gradient sums each row's lookups in sorted order, as the
        shards' own update does for every optimizer and table dtype but SGD on fp32 tables (atomic adds:
        kernels.embedding_update.sums_by_atomics). So a run whose updates are the same bits on every run
        (Adagrad, bf16 tables) stays so, and an SGD run on fp32 tables, whose shards already sum as the
        GPU's threads come, skips the sort and the segment sums of its replicated tables' lookups (most of
        them share a few rows)."""
        from kernels.embedding_update import sums_by_atomics  # dlrm.model.sparse says why here

        return self.optimizer is None or not sums_by_atomics(self.optimizer[0], self.weights.dtype)

    def _lookup(self, ids: Tensor) -> Tensor:
        """Table rows [N, n] (N = W*b) -> vectors [N, n, D]; zeros where a row lies outside its shard."""
        local = ids - self.row_start
        valid = None
        if self.partial:
            valid = (local >= 0) & (local < self.shard_rows)
            local = torch.where(valid, local, 0)
        d = self.weights.shape[1]
        if local.shape[1] == 0:  # a rank without shards still takes part in the exchange, both ways
            empty = self.weights.new_zeros(local.shape[0], 0, d, dtype=self.lookup_dtype(ids.device))
            return empty.requires_grad_(torch.is_grad_enabled())
        if self.kernel == "triton":
            from kernels.embedding import embedding_lookup  # dlrm.model.sparse says why here

            if self.optimizer is None and torch.is_grad_enabled():
                raise ValueError(
                    "ShardedSparseArch(kernel='triton'): call configure_optimizer before training"
                )
            optimizer, eps = self.optimizer or ("sgd", 0.0)
            pooled = embedding_lookup(
                self.weights, self.optimizer_state, self.offsets, self.shard_rows, local, "index",
                optimizer, self.lr, eps, self.lookup_dtype(ids.device), self.rounding,
            )  # fmt: skip
        else:
            pooled = F.embedding(local + self.offsets, self.weights, sparse=True)
        return pooled if valid is None else pooled * valid.unsqueeze(2).to(pooled.dtype)


def build_sharded_model(
    cfg, metadata: dict, train_sparse: Tensor, rank: int, world_size: int, device: torch.device
):
    """(DLRM with this rank's shards of the tables and the whole dense part, its ShardingPlan) for a run
    config `cfg` (RunConfig) on `world_size` ranks. The tables are created on `device`, each shard holding
    its rows of one process's tables for train.seed; the dense part is built like one process's (the same
    modules from the same global torch generator, which the tables leave untouched: one process's weights,
    after the same torch.manual_seed) and then made equal to rank 0's.

    Raises:
        ValueError: as dlrm.model.build_model and dlrm.parallel.planner.plan_tables.
    """
    m = cfg.model
    vocabularies = (
        build_vocabularies(train_sparse, m.max_rows, m.min_frequency) if m.hashing == "vocab" else None
    )
    table_rows = [len(v) + 1 for v in vocabularies] if vocabularies else resolve_table_rows(m, metadata)
    par = cfg.parallel
    plan = plan_tables(
        table_rows,
        m.embedding_dim,
        cfg.train.optimizer,
        world_size,
        par.row_wise,
        par.row_wise_bytes,
        batch_size=cfg.data.batch_size // world_size,
        data_parallel_rows=par.data_parallel_rows,
        exchange_bytes_per_value=exchange_bytes(cfg),
        bag_sizes=m.multi_hot_sizes,
        table_bytes_per_value=TABLE_BYTES[m.table_dtype],
    )
    sparse = ShardedSparseArch(
        plan, rank, m.embedding_dim, m.hashing, vocabularies, cfg.sparse_kernel, device, cfg.train.seed,
        par.exchange_dtype, m.multi_hot_sizes, m.pooling, m.table_dtype,
    )  # fmt: skip
    first_order = None
    if m.first_order:  # D = 1 tables on the same plan; vocab models pass them the embeddings' rows
        hashing = "modulus" if m.hashing == "modulus" else "index"
        first_order = ShardedSparseArch(
            plan, rank, 1, hashing, None, cfg.sparse_kernel, device, cfg.train.seed, par.exchange_dtype
        )
    model = DLRM(
        m,
        mlp_kernel=cfg.mlp_kernel,
        sparse_kernel=cfg.sparse_kernel,
        sparse_arch=sparse,
        first_order_tables=first_order,
        overlap_sparse=par.overlap,
    ).to(device)
    for module in (model.dense_arch, model.interaction_arch, model.over_arch):
        broadcast_from_rank0(module)
    return model, plan


def exchange_bytes(cfg) -> int:
    """Bytes per vector value on the wire for run config `cfg`: 2 for bf16 ("bf16", or "auto" where the
    lookup writes bf16: the "triton" kernel under bf16 precision), else 4."""
    e = cfg.parallel.exchange_dtype
    bf16 = e == "bf16" or (e == "auto" and cfg.train.precision == "bf16" and cfg.sparse_kernel == "triton")
    return 2 if bf16 else 4
