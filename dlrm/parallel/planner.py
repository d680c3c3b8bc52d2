"""The sharding planner: which rank holds which rows of which embedding table.

    plan = plan_tables(table_rows, embedding_dim=128, optimizer="adagrad", world_size=8)
    plan.shards_of(rank)          # [Shard(table, rank, row_start, rows), ...] held by `rank`
    plan.to_dict()                # what sharding_plan.json holds

A table costs rows x D x 4 bytes of fp32 weights plus its optimizer state (Adagrad: as much again; SGD:
none). Tables larger than the row-wise threshold (`row_wise_bytes`, default the total over W: an even share
per rank) are split by rows into k = min(W, ceil(bytes / threshold)) shards of near-equal rows (row-wise);
the others stay whole (table-wise). Shards are placed greedily, largest first, each on the rank with the
smallest load so far among those it fits on (ties: the lowest rank); the k shards of one table go to k
different ranks. A rank's load counts what it stores and what it looks up: its share of all bytes plus
its share of all shards (every shard looks up the whole global batch's ids of its table, so lookups go
with shard counts). A shard fits on a rank whose bytes stay within an even share plus the largest shard,
the bound greedy-by-bytes keeps, so memory is never worse than that. Bytes alone put 23 of the 26 Kaggle
tables on one of 2 ranks (the other 3 are as large as all 23): that rank's lookups take many times the
other's, and the other rank waits in the exchange.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

STATE_BYTES_PER_VALUE = {"sgd": 0, "adagrad": 4, "rowwise_adagrad": 0}


@dataclass(frozen=True)
class Shard:
    """Rows [row_start, row_start + rows) of table `table`, held by rank `rank`."""

    table: int
    rank: int
    row_start: int
    rows: int


@dataclass(frozen=True)
class ShardingPlan:
    """Every table's shards. `table_rows`: rows of each (full) table; `shards` ordered by rank, then table."""

    world_size: int
    embedding_dim: int
    optimizer: str
    table_rows: tuple[int, ...]
    shards: tuple[Shard, ...]

    def shards_of(self, rank: int) -> list[Shard]:
        """The shards `rank` holds, ordered by table (a table appears at most once per rank)."""
        return [s for s in self.shards if s.rank == rank]

    def shard_bytes(self, shard: Shard) -> int:
        return shard.rows * row_bytes(self.embedding_dim, self.optimizer)

    def bytes_per_rank(self) -> list[int]:
        """Bytes of weights + optimizer state each rank holds."""
        loads = [0] * self.world_size
        for s in self.shards:
            loads[s.rank] += self.shard_bytes(s)
        return loads

    def to_dict(self) -> dict:
        return {
            "world_size": self.world_size,
            "embedding_dim": self.embedding_dim,
            "optimizer": self.optimizer,
            "table_rows": list(self.table_rows),
            "bytes_per_rank": self.bytes_per_rank(),
            "shards": [asdict(s) for s in self.shards],
        }

    def describe(self) -> str:
        """One line per rank: its bytes and its tables (t<f> whole, t<f>[a:b] a row range)."""
        lines = []
        for rank, load in enumerate(self.bytes_per_rank()):
            parts = [
                f"t{s.table}"
                if s.rows == self.table_rows[s.table]
                else f"t{s.table}[{s.row_start}:{s.row_start + s.rows}]"
                for s in self.shards_of(rank)
            ]
            lines.append(
                f"rank {rank}: {load / 2**20:,.1f} MiB, {len(parts)} shards: {' '.join(parts) or '-'}"
            )
        return "\n".join(lines)


def row_bytes(embedding_dim: int, optimizer: str) -> int:
    """Bytes per table row: fp32 weights plus the optimizer state (Adagrad: one fp32 value per weight)."""
    return embedding_dim * (4 + STATE_BYTES_PER_VALUE[optimizer])


def plan_tables(
    table_rows: list[int],
    embedding_dim: int,
    optimizer: str,
    world_size: int,
    row_wise: bool = True,
    row_wise_bytes: int | None = None,
) -> ShardingPlan:
    """Place F tables on `world_size` ranks (module docstring).

    Args:
        table_rows: rows of each table (F ints, each >= 1).
        embedding_dim: D.
        optimizer: "sgd", "adagrad" or "rowwise_adagrad" (its state counts in a table's bytes).
        world_size: W ranks.
        row_wise: allow splitting tables by rows; False places every table whole.
        row_wise_bytes: tables above this many bytes are split; None: total bytes / W.
    Raises:
        ValueError: world_size < 1, an unknown optimizer, or (row_wise off) more ranks than tables.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if optimizer not in STATE_BYTES_PER_VALUE:
        raise ValueError(f"unknown optimizer {optimizer!r}: expected one of {tuple(STATE_BYTES_PER_VALUE)}")
    if not row_wise and world_size > len(table_rows):
        raise ValueError(
            f"parallel.row_wise: {world_size} ranks but {len(table_rows)} tables: with row-wise sharding off "
            "every rank must hold a whole table; set parallel.row_wise true or use fewer ranks"
        )
    per_row = row_bytes(embedding_dim, optimizer)
    total = sum(table_rows) * per_row
    threshold = row_wise_bytes if row_wise_bytes is not None else math.ceil(total / world_size)
    pieces: list[tuple[int, list[int]]] = []  # (table, rows of each of its shards)
    for table, rows in enumerate(table_rows):
        k = 1
        if row_wise and world_size > 1 and rows * per_row > threshold:
            k = min(world_size, rows, math.ceil(rows * per_row / threshold))
        pieces.append((table, [rows // k + (i < rows % k) for i in range(k)]))
    count = sum(len(split) for _, split in pieces)
    cap = total / world_size + max(split[0] for _, split in pieces) * per_row  # bytes a rank may hold
    stored = [0] * world_size
    loads = [0.0] * world_size  # share of the bytes + share of the shards
    shards = []
    # Largest shard first; the shards of one table on distinct ranks.
    for table, split in sorted(pieces, key=lambda p: (-p[1][0], p[0])):
        fits = [r for r in range(world_size) if stored[r] + split[0] * per_row <= cap]
        if len(fits) < len(split):  # not k ranks with room: the k emptiest
            fits = sorted(range(world_size), key=lambda r: (stored[r], r))[: len(split)]
        ranks = sorted(fits, key=lambda r: (loads[r], r))[: len(split)]
        start = 0
        for rank, rows in zip(sorted(ranks), split, strict=True):
            shards.append(Shard(table, rank, start, rows))
            stored[rank] += rows * per_row
            loads[rank] += rows * per_row / max(total, 1) + 1 / count
            start += rows
    shards.sort(key=lambda s: (s.rank, s.table))
    return ShardingPlan(world_size, embedding_dim, optimizer, tuple(table_rows), tuple(shards))
