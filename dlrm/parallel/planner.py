"""The sharding planner: which tables every rank holds whole (data parallel), and which rank holds which rows
of the others (model parallel).

    plan = plan_tables(table_rows, embedding_dim=128, optimizer="adagrad", world_size=8, batch_size=65536)
    plan.replicated                # tables every rank holds whole: looked up locally, gradients all-reduced
    plan.shards_of(rank)           # [Shard(table, rank, row_start, rows), ...] held by `rank`
    plan.costs(batch_size)         # per rank and step: bytes held, lookups and their time, bytes exchanged
                                   # and all-reduced
    plan_tables(..., bag_sizes=(3, 2, 1, ...))  # bags: k_f ids a sample per table (model.multi_hot_sizes)
    plan.to_dict()                 # what sharding_plan.json holds
    plan.with_checkpoint_bytes([...])  # and the bytes each rank writes into a checkpoint (preflight)

A table's bytes are its weights (4 or 2 bytes a value: `model.table_dtype` fp32 or bf16, the model-parallel
shards; replicated tables are held in fp32 whatever the dtype) plus its optimizer state (fp32).

Sharding types, decided per table by what a step moves over the network (b: samples per rank):
- data parallel: every rank holds the table and looks up its own b samples; the table's dense gradient
  [rows, D] fp32 joins the dense all-reduce (a ring all-reduce sends and receives ~2 x rows x D x 4 bytes
  per rank). Chosen where that is less than the table's exchange, forward vectors plus backward gradients:
  ~2 x b x D x e x (W - 1) / W bytes per rank, e the exchange's bytes per value; so tables of fewer rows than
  about b e (W - 1) / (4 W): every small table at the batches a GPU runs (TorchRec and HugeCTR replicate small
  tables too). A bag of k_f ids also sends k_f - 1 ids more than a one-hot feature, ~b x (k_f - 1) x 8 x
  (W - 1) / W bytes per rank sent (and as many received), which replication saves too: the bound grows by
  b (k_f - 1) (W - 1) / (W D) rows. (The one id of a one-hot feature, 8 bytes against the vectors' 2 D e, is
  left out of the bound.) `data_parallel_rows` sets the row bound instead (0: none).
- table-wise: one rank holds the whole table; each rank sends it its samples' ids and gets their vectors.
- row-wise: tables above `row_wise_bytes` (bytes of weights + optimizer state; default the model-parallel
  total over W, an even share per rank) split by rows into k = min(W, ceil(bytes / threshold)) shards of
  near-equal rows on k different ranks (which the balancing below may resize). Every shard looks up the
  whole global batch's ids of its table and gives zeros for rows it does not hold: a table split k ways costs
  k lookups per id and k vectors per sample.
Shards are placed greedily, largest first, each on the rank with the smallest load so far among those it
fits on (ties: the lowest rank). A rank's load counts what it stores and what it looks up: its share of all
bytes plus its share of all lookup bytes. A shard's lookup bytes are the bag kernel's per sample of the global
batch, k_f (8 + D t) + D e (`lookup_bytes`: k_f ids and rows of t bytes a value read, one pooled vector
written in the exchange's dtype), which the kernel moves at `LOOKUP_BYTES_PER_S` (an H200's, measured):
`costs` reports each rank's lookup time by it, and the time of their backward with the fused update
(`ShardingPlan.update_bytes` at `UPDATE_BYTES_PER_S`), which the last step weighs. A shard fits on a
rank whose bytes stay within an even share plus the largest shard, the bound greedy-by-bytes keeps. Bytes
alone put 23 of the 26 Kaggle tables on one of 2 ranks (the other 3 are as large as all 23): that rank's
lookups take many times the other's, and the other rank waits in the exchange.
Then, with `row_wise_bytes` left to its default, the bytes are balanced: while the most bytes a rank holds
exceed the fewest by more than `BYTES_SPREAD` (10%), the rank holding the most gives rows to the one holding
the fewest, as many as bring one of the two to an even share (whole rows, at least one from a giver a row or
more above it). The rows go, by preference: into the taker's own shard of a table both hold (its shards'
row ranges move, no shard is added); as a whole shard whose move brings every rank within the spread; cut
off the shard whose table looks up the fewest bytes a sample, the new shard on the taker (every shard looks
up its table's ids for the whole global batch, so a cut costs that table's lookups once more); else, every
shard being smaller than the move, as the largest whole shard. Each cut brings the giver or the taker to the
even share, so with rows to spare at most W - 1 moves cut a shard. A table's shards stay on distinct ranks,
its rows handed out in rank order. Where the rows allow no better (tiny tables, more ranks than rows) every
rank ends within a row of an even share. On 2 ranks the five 41 GB tables of MLPerf DLRM-DCNv2 (Adagrad,
fp32) fall 3 and 2 (127 and 82 GB a rank); one cut of table 0 (3 ids a sample, the fewest of the five)
evens the bytes.
Then the lookups are balanced within the bytes' spread (`_balance_lookups`): whole shards move from the
rank whose lookups cost the most a sample to the one whose cost the least, while a move lowers the larger of
the two. On 2 ranks MLPerf DLRM-DCNv2's bytes leave tables 20 (100 ids a sample) and 9, a part of table 0
and the small tables 1 and 4 on one rank: 118 ids a sample against 76; tables 1 and 4 move (110 and 84).
Last, given a batch, the ranks' times are balanced (`_balance_time`, `balance_time`): each rank's predicted
time (`ShardingPlan.rank_us`) is its shards' lookups forward and backward with the fused update (a shard
costs its table's ids of the whole global batch, whatever its rows, plus its expected distinct rows'
weights and state, which grow with its rows) and its exchange bytes at `EXCHANGE_BYTES_PER_S`. While a swap
takes at least `TIME_GAIN` (2%) off the slower of the slowest and the fastest rank, the slowest gives x rows
of a table whose rows cost the most to update and takes x rows of one whose rows cost less: the bytes held
stay as they are. A swap that gives a rank a table's first rows (a cut) costs it all that table's lookups
and adds them to every rank's exchange, so it pays only where the rows' updates outweigh them; the plan
whose slowest rank is predicted fastest on the way is kept. MLPerf DLRM-DCNv2 on 4 ranks: the byte balance
leaves table 20 (6M of the ~10M distinct rows a step touches) whole on one rank, predicted 5.0 ms against
1.9 to 2.2 ms; swaps spread it over three ranks, the slowest at 3.7 ms. On 2 ranks no swap saves 2%: the cut
of table 20 that evens the lookups adds all its ids (their sort: `update_bytes`) and their exchange on the
other rank.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

STATE_BYTES_PER_VALUE = {"sgd": 0, "adagrad": 4, "rowwise_adagrad": 0}
STATE_BYTES_PER_ROW = {"sgd": 0, "adagrad": 0, "rowwise_adagrad": 4}  # row-wise Adagrad: one fp32 a row
TABLE_BYTES = {"fp32": 4, "bf16": 2}  # bytes per weight of each model.table_dtype
ID_BYTES = 8  # int64 row ids
# The most bytes a rank may hold over the fewest before the planner splits more tables by rows.
BYTES_SPREAD = 1.1
# The bag kernel's forward on an H200 moves this many bytes a second (lookup_bytes' model): 7,729 MB in
# 2,364.4 us at MLPerf DLRM-DCNv2, 65,536 samples x 214 ids of 128 fp32 values, 26 bf16 pooled vectors a
# sample (scripts/results/breakdown.csv:42, "embedding fwd"; 77% of the copy bandwidth measured beside it).
# One-hot lookups run nearer the copy bandwidth (scripts/results/sparse.csv:43: 94%, D = 128): by this rate
# their predicted times come out about a fifth high.
LOOKUP_BYTES_PER_S = 7729.05e6 / 2364.4e-6
# The bag kernel's backward with its fused update on an H200 (update_bytes' model): a lookup of a shard's
# table costs SORT_BYTES whether or not its row is inside the shard (the sort by row, the gradient row of each
# sorted position, the segments' scan and starts), and the update moves its other bytes at
# UPDATE_BYTES_PER_S. Both fitted (least squares of relative errors) on the 6 ranks of the 2-rank placements
# of scripts/results/rank_lookups.csv (MLPerf DLRM-DCNv2, bf16 tables, Adagrad, uniform ids; fwd+bwd less
# fwd), each within 5% of them. Ranks of fewer lookups on 4 and 8 ranks run up to about a quarter slower than
# predicted: fixed costs per launch, which the model leaves out.
UPDATE_BYTES_PER_S = 3.426e12
SORT_BYTES = 252
# The all_to_alls of a step on 2 H200s move this many bytes a second (costs' exchange_bytes, sent plus
# received): rank 1's 257.7 MB in 848.8 us, MLPerf DLRM-DCNv2 at b = 32,768, bf16 vectors
# (scripts/results/profile_dlrm_dcnv2_triton_graphs_32768_config_adagrad_bf16_bf16tables_rank1of2.txt, the
# rank that waited least, under that commit's plan).
EXCHANGE_BYTES_PER_S = 257.7e6 / 848.8e-6
# The least share of its predicted time a swap of rows must take off the slower rank (_balance_time).
TIME_GAIN = 0.02


@dataclass(frozen=True)
class Shard:
    """Rows [row_start, row_start + rows) of table `table`, held by rank `rank`."""

    table: int
    rank: int
    row_start: int
    rows: int


@dataclass(frozen=True)
class RankCost:
    """What one rank holds and moves in one training step (predicted from the plan, b samples per rank).

    bytes_held: weights (its shards in the table dtype, the replicated tables fp32) + optimizer state of its
        shards and of the replicated tables.
    lookups: embedding rows it reads per step (forward; backward updates as many).
    lookup_us: its lookups' predicted forward time, microseconds (`lookup_bytes` / `LOOKUP_BYTES_PER_S`).
    update_us: its lookups' predicted backward with the fused update, microseconds (`update_bytes` /
        `UPDATE_BYTES_PER_S`; the replicated tables' dense gradients left out, the same on every rank).
    exchange_bytes: bytes it sends plus receives in the step's all_to_alls (ids, vectors, gradients).
    all_reduce_bytes: bytes it sends plus receives for the replicated tables' gradients (ring all-reduce).
    """

    bytes_held: int
    lookups: int
    lookup_us: float
    update_us: float
    exchange_bytes: int
    all_reduce_bytes: int


@dataclass(frozen=True)
class ShardingPlan:
    """Every table's place. `table_rows`: rows of each (full) table; `replicated`: tables every rank holds
    whole (data parallel); `shards`: the other tables' shards, ordered by rank, then table, their weights
    `table_bytes_per_value` bytes a value (4: fp32, 2: bf16; the replicated tables: fp32)."""

    world_size: int
    embedding_dim: int
    optimizer: str
    table_rows: tuple[int, ...]
    shards: tuple[Shard, ...]
    replicated: tuple[int, ...] = ()
    exchange_bytes_per_value: int = 4
    bag_sizes: tuple[int, ...] | None = None  # ids a sample per table (None: one each)
    # Bytes of the tensors each rank writes into a checkpoint (dlrm.run.checkpoints.preflight); None: unknown.
    checkpoint_bytes_per_rank: tuple[int, ...] | None = None
    table_bytes_per_value: int = 4

    def bag_size(self, table: int) -> int:
        """k_f, the ids a sample looks up in table `table` (1 without bags)."""
        return 1 if self.bag_sizes is None else self.bag_sizes[table]

    def shards_of(self, rank: int) -> list[Shard]:
        """The shards `rank` holds, ordered by table (a table appears at most once per rank)."""
        return [s for s in self.shards if s.rank == rank]

    def shard_bytes(self, shard: Shard) -> int:
        return shard.rows * row_bytes(self.embedding_dim, self.optimizer, self.table_bytes_per_value)

    def bytes_per_rank(self) -> list[int]:
        """Bytes of weights + optimizer state each rank holds (its shards in the table dtype, the
        replicated tables in fp32)."""
        replicated = sum(self.table_rows[f] for f in self.replicated) * row_bytes(
            self.embedding_dim, self.optimizer
        )
        loads = [replicated] * self.world_size
        for s in self.shards:
            loads[s.rank] += self.shard_bytes(s)
        return loads

    def costs(self, batch_size: int) -> list[RankCost]:
        """Each rank's predicted cost of one step with `batch_size` samples per rank (RankCost); a table's
        lookups and ids count k_f per sample (its bag), its vectors one per sample, its lookup time
        `lookup_bytes` per sample (replicated tables: fp32 rows and vectors)."""
        w, d, e, b = self.world_size, self.embedding_dim, self.exchange_bytes_per_value, batch_size
        remote = (w - 1) / w  # the share of a rank's exchange that crosses to other ranks
        replicated_rows = sum(self.table_rows[f] for f in self.replicated)
        all_reduce = round(2 * 2 * replicated_rows * d * 4 * remote)  # ring: sends and receives 2 x remote
        sent_ids = sum(self.bag_size(s.table) for s in self.shards) * b  # each rank: its b bags per shard
        sent_vectors = len(self.shards) * b  # vectors each rank receives back: one per sample and shard
        replicated_ids = sum(self.bag_size(f) for f in self.replicated) * b
        replicated_bytes = sum(lookup_bytes(self.bag_size(f), d, 4, 4) for f in self.replicated) * b
        costs = []
        for rank, held in enumerate(self.bytes_per_rank()):
            mine = self.shards_of(rank)
            received_ids = sum(self.bag_size(s.table) for s in mine) * w * b  # the global batch's bags
            lookups = received_ids + replicated_ids
            read = replicated_bytes + w * b * sum(
                lookup_bytes(self.bag_size(s.table), d, self.table_bytes_per_value, e) for s in mine
            )
            ids = (sent_ids + received_ids) * ID_BYTES * remote
            # forward vectors, backward gradients
            vectors = 2 * (sent_vectors + len(mine) * w * b) * d * e * remote
            lookup_us = round(read / LOOKUP_BYTES_PER_S * 1e6, 1)
            updated = sum(self.update_bytes(s, w * b) for s in mine)
            update_us = round(updated / UPDATE_BYTES_PER_S * 1e6, 1)
            costs.append(RankCost(held, lookups, lookup_us, update_us, round(ids + vectors), all_reduce))
        return costs

    def touched_share(self, table: int, global_batch: int) -> float:
        """The share of `table`'s R rows that the u = k_f B uniform ids of a step of `global_batch` samples
        touch on average, 1 - (1 - 1/R)^u (ids that repeat rows, as click logs' do, touch fewer)."""
        rows, ids = self.table_rows[table], self.bag_size(table) * global_batch
        return -math.expm1(ids * math.log1p(-1 / rows)) if rows > 1 else 1.0

    def update_bytes(self, shard: Shard, global_batch: int) -> int:
        """Bytes the bag kernel's backward moves for `shard` in a step of `global_batch` samples: per
        lookup of its table's ids (k_f a sample, all of them: a row shard looks up the ids outside it
        too) the sort by row (SORT_BYTES); per lookup inside the shard (its share of the table's rows, for
        uniform ids) the pooled gradient's row (D values of the exchange's e bytes: the update never reads
        the gradients of a row shard's padding row, `dlrm.parallel.sharded_bags`); per distinct row it
        touches (its rows times `touched_share`: an upper bound for ids that repeat rows), its weights (D
        values of t bytes) and optimizer state read and written once."""
        d = self.embedding_dim
        lookups = self.bag_size(shard.table) * global_batch
        inside = lookups * shard.rows / self.table_rows[shard.table]
        distinct = shard.rows * self.touched_share(shard.table, global_batch)
        per_row = row_bytes(d, self.optimizer, self.table_bytes_per_value)
        gradients = inside * d * self.exchange_bytes_per_value
        return round(lookups * SORT_BYTES + gradients + 2 * distinct * per_row)

    def lookups_us(self, table: int, global_batch: int) -> float:
        """Predicted microseconds of a shard of `table` that its rows do not change, in a step of
        `global_batch` samples: the forward over all its table's ids (`lookup_bytes`) and, in the backward,
        their sort (`update_bytes`)."""
        d, k, e = self.embedding_dim, self.bag_size(table), self.exchange_bytes_per_value
        forward = lookup_bytes(k, d, self.table_bytes_per_value, e) / LOOKUP_BYTES_PER_S
        return global_batch * (forward + k * SORT_BYTES / UPDATE_BYTES_PER_S) * 1e6

    def update_us_per_row(self, table: int, global_batch: int) -> float:
        """Predicted microseconds each row of a shard of `table` adds to its update in a step of
        `global_batch` samples (`update_bytes`): its share of the lookups' gradient rows and of the
        distinct rows' weights and state."""
        d, e, rows = self.embedding_dim, self.exchange_bytes_per_value, self.table_rows[table]
        per_row = row_bytes(d, self.optimizer, self.table_bytes_per_value)
        gradients = self.bag_size(table) * global_batch / rows * d * e
        return (gradients + 2 * self.touched_share(table, global_batch) * per_row) / UPDATE_BYTES_PER_S * 1e6

    def shard_us(self, shard: Shard, global_batch: int) -> float:
        """Predicted microseconds of `shard`'s lookups in a step of `global_batch` samples, forward and
        backward with the fused update (`lookups_us` + its rows x `update_us_per_row`)."""
        per_row = self.update_us_per_row(shard.table, global_batch)
        return self.lookups_us(shard.table, global_batch) + shard.rows * per_row

    def rank_us(self, batch_size: int) -> list[float]:
        """Each rank's predicted microseconds of a step's sharded lookups, `batch_size` samples per rank:
        its shards' `shard_us` and its exchange (`costs`' bytes at EXCHANGE_BYTES_PER_S); the replicated
        tables, the same on every rank, left out."""
        global_batch = self.world_size * batch_size
        times = [c.exchange_bytes / EXCHANGE_BYTES_PER_S * 1e6 for c in self.costs(batch_size)]
        for s in self.shards:
            times[s.rank] += self.shard_us(s, global_batch)
        return times

    def with_checkpoint_bytes(self, per_rank: list[int]) -> ShardingPlan:
        """This plan with the bytes each rank writes into a checkpoint (its tables' pieces and their
        optimizer state; rank 0 also the dense part and the replicated tables), for sharding_plan.json."""
        return replace(self, checkpoint_bytes_per_rank=tuple(per_rank))

    def to_dict(self, batch_size: int | None = None) -> dict:
        out = {
            "world_size": self.world_size,
            "embedding_dim": self.embedding_dim,
            "optimizer": self.optimizer,
            "table_bytes_per_value": self.table_bytes_per_value,
            "table_rows": list(self.table_rows),
            "bag_sizes": None if self.bag_sizes is None else list(self.bag_sizes),
            "replicated": list(self.replicated),
            "bytes_per_rank": self.bytes_per_rank(),
            "shards": [asdict(s) for s in self.shards],
        }
        if self.checkpoint_bytes_per_rank is not None:
            out["checkpoint_bytes_per_rank"] = list(self.checkpoint_bytes_per_rank)
            out["checkpoint_bytes"] = sum(self.checkpoint_bytes_per_rank)
        if batch_size is not None:
            out["predicted_per_step"] = {
                "batch_per_rank": batch_size,
                "ranks": [asdict(c) for c in self.costs(batch_size)],
            }
        return out

    def describe(self, batch_size: int | None = None) -> str:
        """One line per rank: its bytes, its tables (t<f> whole, t<f>[a:b] a row range) and, given the batch
        per rank, its predicted lookups and MB exchanged per step; first the replicated tables."""
        costs = self.costs(batch_size) if batch_size else None
        lines = [
            f"replicated (data parallel) on every rank: {' '.join(f't{f}' for f in self.replicated) or '-'}"
        ]
        for rank, load in enumerate(self.bytes_per_rank()):
            parts = [
                f"t{s.table}"
                if s.rows == self.table_rows[s.table]
                else f"t{s.table}[{s.row_start}:{s.row_start + s.rows}]"
                for s in self.shards_of(rank)
            ]
            line = f"rank {rank}: {load / 2**20:,.1f} MiB, {len(parts)} shards: {' '.join(parts) or '-'}"
            if costs:
                c = costs[rank]
                line += (
                    f"; per step {c.lookups:,} lookups ({c.lookup_us / 1e3:,.2f} ms forward, "
                    f"{c.update_us / 1e3:,.2f} ms update), "
                    f"{c.exchange_bytes / 1e6:,.1f} MB exchanged, "
                    f"{c.all_reduce_bytes / 1e6:,.1f} MB all-reduced"
                )
            lines.append(line)
        return "\n".join(lines)


def row_bytes(embedding_dim: int, optimizer: str, table_bytes_per_value: int = 4) -> int:
    """Bytes per table row: the weights (`table_bytes_per_value` each: 4 fp32, 2 bf16) plus the optimizer
    state (Adagrad: one fp32 value per weight; row-wise Adagrad: one fp32 value per row)."""
    state = embedding_dim * STATE_BYTES_PER_VALUE[optimizer] + STATE_BYTES_PER_ROW[optimizer]
    return embedding_dim * table_bytes_per_value + state


def lookup_bytes(
    bag_size: int, embedding_dim: int, table_bytes_per_value: int, out_bytes_per_value: int
) -> int:
    """Bytes the bag kernel moves to pool one sample's bag of k = `bag_size` ids in one shard: k ids read
    (8 bytes each), k rows of D values read (t = `table_bytes_per_value` bytes each) and one pooled vector of
    D values written (o = `out_bytes_per_value`): k (8 + D t) + D o, the forward's bytes model of
    scripts/breakdown_step.py ("embedding fwd"). One-hot: k = 1."""
    d = embedding_dim
    return bag_size * (ID_BYTES + d * table_bytes_per_value) + d * out_bytes_per_value


def data_parallel_bound(
    batch_size: int, world_size: int, exchange_bytes_per_value: int, embedding_dim: int, bag_size: int = 1
) -> int:
    """The most rows a table may have to be replicated: where its all-reduce (~2 x rows x D x 4 bytes per
    rank) costs no more than its exchange (~2 x b x D x e x (W - 1) / W, plus ~b x (k_f - 1) x 8 x (W - 1) / W
    for a bag of k_f = `bag_size` ids; module docstring)."""
    b, w = batch_size, world_size
    vectors = b * exchange_bytes_per_value * (w - 1) // (4 * w)
    return vectors + b * (bag_size - 1) * (w - 1) // (w * embedding_dim)


def plan_tables(
    table_rows: list[int],
    embedding_dim: int,
    optimizer: str,
    world_size: int,
    row_wise: bool = True,
    row_wise_bytes: int | None = None,
    batch_size: int = 0,
    data_parallel_rows: int | None = None,
    exchange_bytes_per_value: int = 4,
    bag_sizes: tuple[int, ...] | None = None,
    table_bytes_per_value: int = 4,
    balance_time: bool = True,
) -> ShardingPlan:
    """Place F tables on `world_size` ranks (module docstring).

    Args:
        table_rows: rows of each table (F ints, each >= 1).
        embedding_dim: D.
        optimizer: "sgd", "adagrad" or "rowwise_adagrad" (its state counts in a table's bytes).
        world_size: W ranks.
        row_wise: allow splitting tables by rows; False places every table whole.
        row_wise_bytes: tables above this many bytes are split, no others; None: those above the
            model-parallel bytes / W, and more rows where the ranks' bytes differ by more than BYTES_SPREAD.
        batch_size: b, samples per rank per step: the cost model's (0: replicate nothing by default).
        data_parallel_rows: replicate tables of at most this many rows; None: the cost model's bound
            (`data_parallel_bound`); 0: none. Never all tables: the largest stays model parallel; none
            with "rowwise_adagrad", which the dense optimizers do not implement.
        exchange_bytes_per_value: e, 4 (fp32) or 2 (bf16) exchanged bytes per vector value (also the
            pooled vectors' bytes in the lookups' cost).
        bag_sizes: k_f ids a sample per table (`model.multi_hot_sizes`; None or all ones: one-hot, the same
            plan as without); they weigh the lookups that balance the ranks (`lookup_bytes`) and raise the
            cost model's data-parallel bound of a table by its extra ids.
        table_bytes_per_value: bytes of a model-parallel weight (`TABLE_BYTES`: 4 fp32, 2 bf16), in the
            bytes that split tables by rows and balance the ranks.
        balance_time: end with the ranks' predicted times balanced (`_balance_time`; it needs a
            batch_size); False stops after the bytes' and the forward lookups' balance.
    Raises:
        ValueError: world_size < 1, an unknown optimizer, bag sizes not one per table, or (row_wise off)
            more ranks than model-parallel tables.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if optimizer not in STATE_BYTES_PER_VALUE:
        raise ValueError(f"unknown optimizer {optimizer!r}: expected one of {tuple(STATE_BYTES_PER_VALUE)}")
    if bag_sizes is not None and len(bag_sizes) != len(table_rows):
        raise ValueError(f"bag_sizes: {len(bag_sizes)} sizes for {len(table_rows)} tables")
    if bag_sizes is not None and all(k == 1 for k in bag_sizes):
        bag_sizes = None
    sizes = [1] * len(table_rows) if bag_sizes is None else list(bag_sizes)
    bounds = [data_parallel_rows] * len(table_rows)
    if optimizer == "rowwise_adagrad":  # one accumulator per row: the dense optimizers keep one per value
        bounds = [0] * len(table_rows)
    elif data_parallel_rows is None:
        bounds = [
            data_parallel_bound(batch_size, world_size, exchange_bytes_per_value, embedding_dim, k)
            if world_size > 1
            else 0
            for k in sizes
        ]
    replicated = [f for f, rows in enumerate(table_rows) if rows <= bounds[f]]
    if len(replicated) == len(table_rows):  # keep the largest sharded: the exchange needs a table
        replicated.remove(max(range(len(table_rows)), key=lambda f: (table_rows[f], -f)))
    sharded = [f for f in range(len(table_rows)) if f not in replicated]
    if not row_wise and world_size > len(sharded):
        raise ValueError(
            f"parallel.row_wise: {world_size} ranks but {len(sharded)} model-parallel tables: with row-wise "
            "sharding off every rank must hold a whole table; set parallel.row_wise true, lower "
            "parallel.data_parallel_rows or use fewer ranks"
        )
    per_row = row_bytes(embedding_dim, optimizer, table_bytes_per_value)
    total = sum(table_rows[f] for f in sharded) * per_row
    threshold = row_wise_bytes if row_wise_bytes is not None else math.ceil(total / world_size)
    pieces: list[tuple[int, list[int]]] = []  # (table, rows of each of its shards)
    for table in sharded:
        rows, k = table_rows[table], 1
        if row_wise and world_size > 1 and rows * per_row > threshold:
            k = min(world_size, rows, math.ceil(rows * per_row / threshold))
        pieces.append((table, [rows // k + (i < rows % k) for i in range(k)]))
    # Each shard's lookups: the bag kernel's bytes a sample of the global batch (lookup_bytes).
    cost = [lookup_bytes(k, embedding_dim, table_bytes_per_value, exchange_bytes_per_value) for k in sizes]
    all_lookups = sum(len(split) * cost[table] for table, split in pieces)  # per sample, all shards
    cap = total / world_size + max(split[0] for _, split in pieces) * per_row  # bytes a rank may hold
    stored = [0] * world_size
    loads = [0.0] * world_size  # share of the bytes + share of the lookups
    shards = []
    # Largest shard first; the shards of one table on distinct ranks.
    for table, split in sorted(pieces, key=lambda p: (-p[1][0], p[0])):
        fits = [r for r in range(world_size) if stored[r] + split[0] * per_row <= cap]
        if len(fits) < len(split):  # not k ranks with room: the k emptiest
            fits = sorted(range(world_size), key=lambda r: (stored[r], r))[: len(split)]
        ranks = sorted(fits, key=lambda r: (loads[r], r))[: len(split)]
        for rank, rows in zip(ranks, split, strict=True):
            shards.append(Shard(table, rank, 0, rows))  # row_start: _row_ranges
            stored[rank] += rows * per_row
            loads[rank] += rows * per_row / max(total, 1) + cost[table] / all_lookups
    plan = ShardingPlan(
        world_size, embedding_dim, optimizer, tuple(table_rows), (), tuple(replicated),
        exchange_bytes_per_value, None if bag_sizes is None else tuple(bag_sizes),
        table_bytes_per_value=table_bytes_per_value,
    )  # fmt: skip
    if row_wise and row_wise_bytes is None:
        replicated_bytes = sum(table_rows[f] for f in replicated) * row_bytes(embedding_dim, optimizer)
        shards = _balance_bytes(shards, world_size, per_row, replicated_bytes, cost)
        shards = _balance_lookups(shards, world_size, per_row, replicated_bytes, cost)
        if balance_time and batch_size > 0 and world_size > 1:
            shards = _balance_time(replace(plan, shards=tuple(shards)), batch_size)
    return replace(plan, shards=tuple(_row_ranges(shards)))


def _balance_bytes(
    shards: list[Shard], world_size: int, per_row: int, replicated_bytes: int, cost: list[int]
) -> list[Shard]:
    """`shards` with rows moved from the rank holding the most bytes to the one holding the fewest
    (`_next_move`) until every rank holds within BYTES_SPREAD of every other, or within a row of an even
    share (module docstring).

    Args:
        shards: the placed shards (their row_start is left to `_row_ranges`).
        world_size: W.
        per_row: bytes of a model-parallel row (weights + optimizer state).
        replicated_bytes: bytes of the replicated tables, which every rank holds.
        cost: bytes each table's shard moves to look up one sample (`lookup_bytes`): a cut repeats them.
    """
    shards = list(shards)
    held = _bytes_held(shards, world_size, per_row, replicated_bytes)
    while not _within_spread(held):
        move = _next_move(shards, held, per_row, cost)
        if move is None:  # every rank within a row of an even share: the rows allow no better
            break
        i, taker, rows = move
        s = shards[i]
        held = _moved(held, s.rank, taker, rows * per_row)
        same = [j for j, t in enumerate(shards) if t.rank == taker and t.table == s.table]
        if same:  # the taker's shard of the table grows: no shard more
            shards[same[0]] = replace(shards[same[0]], rows=shards[same[0]].rows + rows)
        else:
            shards.append(Shard(s.table, taker, 0, rows))
        shards[i] = replace(s, rows=s.rows - rows)
        shards = [t for t in shards if t.rows > 0]
    return shards


def _balance_lookups(
    shards: list[Shard], world_size: int, per_row: int, replicated_bytes: int, cost: list[int]
) -> list[Shard]:
    """`shards` with whole shards moved from the rank whose lookups cost the most a sample to the one whose
    cost the least, while a move lowers the larger of the two costs and leaves the ranks' bytes within
    BYTES_SPREAD (or no further apart than before it); each time the move that brings the two nearest
    each other. A shard moves only to a rank without a shard of its table. Each move lowers the sum of the
    squared costs, so the moves end.

    Args: as `_balance_bytes`'s; `cost[f]`: bytes table f's shard moves to look up one sample.
    """
    shards = list(shards)
    while True:
        held = _bytes_held(shards, world_size, per_row, replicated_bytes)
        load = [0] * world_size
        for s in shards:
            load[s.rank] += cost[s.table]
        giver = max(range(world_size), key=lambda r: (load[r], -r))
        taker = min(range(world_size), key=lambda r: (load[r], r))
        gap, theirs = load[giver] - load[taker], {s.table for s in shards if s.rank == taker}
        moves = [
            i
            for i, s in enumerate(shards)
            if s.rank == giver
            and s.table not in theirs
            and cost[s.table] < gap
            and _keeps_bytes(held, _moved(held, giver, taker, s.rows * per_row))
        ]
        if not moves:
            return shards
        i = min(moves, key=lambda i: (abs(gap - 2 * cost[shards[i].table]), i))
        shards[i] = replace(shards[i], rank=taker)


def _balance_time(plan: ShardingPlan, batch_size: int) -> list[Shard]:
    """`plan`'s shards with rows swapped between the rank predicted slowest (`ShardingPlan.rank_us`, b =
    `batch_size`: its lookups forward and backward with the fused update, and its exchange) and the one
    predicted fastest, while a swap takes at least TIME_GAIN of the slower one's time off the larger of
    the two (module docstring); of the plans on the way, the one whose slowest rank is fastest. A swap gives
    x rows of a table A from the slow rank to the fast one and x rows of a table C back: the bytes each rank
    holds stay as they are (every model-parallel row holds the same bytes). Of the swaps `_swaps` offers,
    the one that leaves the two nearest the lower time is made. A cut adds its table's ids to every rank's
    exchange, so another rank as slow as the slowest (two shards of one table) may get slower by a swap
    that the next one undoes: the walk keeps the best plan it met. At most 4 W swaps."""
    kept, kept_time = plan, max(plan.rank_us(batch_size))
    for _ in range(4 * plan.world_size):
        times = plan.rank_us(batch_size)
        slow = max(range(plan.world_size), key=lambda r: (times[r], -r))
        fast = min(range(plan.world_size), key=lambda r: (times[r], r))
        best, best_time = None, times[slow] * (1 - TIME_GAIN)
        for a, c, x in _swaps(plan, slow, fast, times, plan.world_size * batch_size):
            candidate = replace(plan, shards=tuple(_swapped(list(plan.shards), slow, fast, a, c, x)))
            after = candidate.rank_us(batch_size)
            if max(after[slow], after[fast]) < best_time:
                best, best_time = candidate, max(after[slow], after[fast])
        if best is None:
            break
        plan = best
        if max(plan.rank_us(batch_size)) < kept_time:
            kept, kept_time = plan, max(plan.rank_us(batch_size))
    return list(kept.shards)


def _swaps(plan: ShardingPlan, slow: int, fast: int, times: list[float], global_batch: int):
    """The swaps `_balance_time` prices: (table A of rank `slow`, table C of rank `fast`, rows x) for every
    A whose rows cost more to update than C's (`update_us_per_row`), x the rows that would even the two
    ranks' `times` by that difference, counting a table's `lookups_us` where a rank takes its first rows
    (a cut) and not where it gives its last, within the rows each holds."""
    held = {(s.rank, s.table): s.rows for s in plan.shards}
    per_row = {f: plan.update_us_per_row(f, global_batch) for _, f in held}
    lookups = {f: plan.lookups_us(f, global_batch) for _, f in held}
    for (rank_a, a), rows_a in held.items():
        for (rank_c, c), rows_c in held.items():
            gap = per_row[a] - per_row[c]
            if rank_a != slow or rank_c != fast or gap <= 0:
                continue
            cut_fast = lookups[a] * ((fast, a) not in held)
            cut_slow = lookups[c] * ((slow, c) not in held)
            x = min(
                rows_a, rows_c, max(0, round((times[slow] - times[fast] + cut_slow - cut_fast) / (2 * gap)))
            )
            if x > 0:
                yield a, c, x


def _swapped(shards: list[Shard], slow: int, fast: int, a: int, c: int, x: int) -> list[Shard]:
    """`shards` with x rows of table `a` moved from rank `slow` to rank `fast` and x rows of table `c` from
    `fast` to `slow`: into the receiver's own shard of the table, else as a new shard; a shard left with
    no rows dropped."""
    out = list(shards)
    for table, giver, taker in ((a, slow, fast), (c, fast, slow)):
        i = next(i for i, s in enumerate(out) if s.rank == giver and s.table == table)
        out[i] = replace(out[i], rows=out[i].rows - x)
        mine = [j for j, s in enumerate(out) if s.rank == taker and s.table == table]
        if mine:
            out[mine[0]] = replace(out[mine[0]], rows=out[mine[0]].rows + x)
        else:
            out.append(Shard(table, taker, 0, x))
    return [s for s in out if s.rows > 0]


def _next_move(
    shards: list[Shard], held: list[float], per_row: int, cost: list[int]
) -> tuple[int, int, int] | None:
    """The next move of `_balance_bytes`: (index in `shards` of the shard giving rows, the rank taking them,
    rows), or None where no whole row moves. The rank holding the most bytes gives to the one holding the
    fewest: rows into the taker's own shard of a table the giver holds too (the largest such shard); else a
    whole shard whose move brings every rank within the spread (the largest); else rows cut off the shard
    whose table looks up the fewest bytes a sample (a new shard looks up its table's ids for the whole
    global batch); else the largest whole shard."""
    world = len(held)
    even = sum(held) / world
    giver = max(range(world), key=lambda r: (held[r], -r))
    taker = min(range(world), key=lambda r: (held[r], r))
    excess, shortfall = held[giver] - even, even - held[taker]
    # Whole rows, the nearest count; a giver a row or more above the even share gives at least one. Either
    # way the ranks' distance from the even share shrinks, so the moves end.
    rows = max(round(min(excess, shortfall) / per_row), int(excess >= per_row))
    if rows <= 0:
        return None
    mine = [i for i, s in enumerate(shards) if s.rank == giver]  # some: the giver is above the even share
    theirs = {s.table for s in shards if s.rank == taker}
    shared = [i for i in mine if shards[i].table in theirs]
    if shared:
        i = max(shared, key=lambda i: (shards[i].rows, -i))
        return i, taker, min(rows, shards[i].rows)
    whole = [i for i in mine if shards[i].rows <= rows]
    finishing = [i for i in whole if _within_spread(_moved(held, giver, taker, shards[i].rows * per_row))]
    cuts = [i for i in mine if shards[i].rows > rows]
    if finishing:
        i = max(finishing, key=lambda i: (shards[i].rows, -i))
    elif cuts:
        return min(cuts, key=lambda i: (cost[shards[i].table], i)), taker, rows
    else:
        i = max(whole, key=lambda i: (shards[i].rows, -i))
    return i, taker, shards[i].rows


def _bytes_held(shards: list[Shard], world_size: int, per_row: int, replicated_bytes: int) -> list[int]:
    """Bytes each rank holds: the replicated tables' plus `per_row` for each row of its shards."""
    held = [replicated_bytes] * world_size
    for s in shards:
        held[s.rank] += s.rows * per_row
    return held


def _keeps_bytes(held: list[float], after: list[float]) -> bool:
    """Whether bytes per rank `after` a move are within BYTES_SPREAD, or no further apart than `held`."""
    return _within_spread(after) or max(after) - min(after) <= max(held) - min(held)


def _within_spread(held: list[float]) -> bool:
    """Whether the most bytes a rank holds are at most BYTES_SPREAD times the fewest."""
    return max(held) <= BYTES_SPREAD * min(held)


def _moved(held: list[float], giver: int, taker: int, nbytes: int) -> list[float]:
    """Bytes per rank once `nbytes` move from rank `giver` to rank `taker`."""
    return [h - nbytes * (r == giver) + nbytes * (r == taker) for r, h in enumerate(held)]


def _row_ranges(shards: list[Shard]) -> list[Shard]:
    """`shards` ordered by rank, then table, each table's rows handed out in rank order: its shard on the
    lowest rank from row 0, each next one from where the one before ends (contiguous, each row once)."""
    out, next_row = [], {}
    for s in sorted(shards, key=lambda s: (s.rank, s.table)):
        start = next_row.get(s.table, 0)
        out.append(replace(s, row_start=start))
        next_row[s.table] = start + s.rows
    return out
