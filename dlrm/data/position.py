"""What the loaders that read their files themselves (streaming, binary) share: each rank's part of an
epoch's stream of rows, and the epoch position that checkpoints save and resumption restores.

Letters: N rows of the split, W world size, n rows per rank.
"""

import bisect
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np


class Piece(NamedTuple):
    """Rows [start, stop) of unit `unit` (a row group, a chunk), counted in the unit's own row order."""

    unit: int
    start: int
    stop: int


def rank_pieces(order: Sequence[int], sizes: Sequence[int], rank: int, rows_per_rank: int) -> list[Piece]:
    """Rank `rank`'s rows of the stream formed by the units `order` put end to end (unit u has sizes[u]
    rows): stream rows [rank * n, (rank + 1) * n), n = `rows_per_rank`. Past the stream's end the rows
    wrap around to its start (the padding of the last ranks, as torch's DistributedSampler pads)."""
    starts = np.cumsum([0] + [sizes[u] for u in order]).tolist()
    total = starts[-1]
    pieces = []
    position, end = rank * rows_per_rank, (rank + 1) * rows_per_rank
    while position < end:
        row = position % total
        i = bisect.bisect_right(starts, row) - 1
        take = min(starts[i + 1] - row, end - position)
        pieces.append(Piece(order[i], row - starts[i], row - starts[i] + take))
        position += take
    return pieces


class EpochPosition:
    """Epoch, batches handed out and where the next iteration starts, for a loader of `num_rows` rows read
    by `world_size` ranks in batches of `batch_size`. Subclasses set those attributes (and `drop_last`)
    and list in STATE_KEYS the settings a resume must match; those of them in RANK_KEYS may differ where
    the global batch (batch_size x world_size) is the same: a resume on another number of ranks.

    The state is (epoch, batches consumed): `state_dict` / `load_state_dict`. An iteration calls
    `_begin()` for the batch it starts at and `_consumed += 1` before handing each batch out.
    """

    STATE_KEYS: tuple[str, ...] = ()
    RANK_KEYS: tuple[str, ...] = ()
    num_rows: int
    batch_size: int
    drop_last: bool
    world_size: int

    def _reset_position(self) -> None:
        self.epoch = 0
        self._consumed = 0  # batches of this epoch handed out
        self._resume_at = 0  # batch the next iteration starts at

    @property
    def rows_per_rank(self) -> int:
        """Rows each rank reads per epoch (n): N // W under drop_last, else ceil(N / W)."""
        if self.drop_last:
            return self.num_rows // self.world_size
        return math.ceil(self.num_rows / self.world_size)

    def __len__(self) -> int:
        """Batches per epoch, the same on every rank."""
        if self.drop_last:
            return self.rows_per_rank // self.batch_size
        return math.ceil(self.rows_per_rank / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Select the order of `epoch`. Setting the epoch of a state just loaded keeps its position."""
        if epoch != self.epoch:
            self.epoch, self._consumed, self._resume_at = epoch, 0, 0

    def state_dict(self) -> dict[str, Any]:
        """The position after the batches handed out so far: {"epoch", "batches", and the settings that
        must match on resumption}; plain ints and bools, for a checkpoint."""
        return {
            "epoch": self.epoch,
            "batches": self._consumed,
            **{key: getattr(self, key) for key in self.STATE_KEYS},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (of `state_dict`): the next iteration yields the batches that followed it.

        A state of another number of ranks (RANK_KEYS differ, the global batch the same) goes on at the same
        global batch of the same epoch, in this number of ranks' order: the rest of that epoch is not the
        rows the saved run would have read (`other_ranks` tells the caller so); later epochs are whole.

        Raises:
            ValueError: a setting in `state` differs from this loader's (the message names it), so the
                batches would not be those of the saved run; or the batch count is out of range.
        """
        if self.other_ranks(state):
            saved = state.get("batch_size", 0) * state.get("world_size", 0)
            if saved != self.batch_size * self.world_size:
                raise ValueError(
                    f"loader state: global batch {saved} (world_size {state.get('world_size')!r}), this "
                    f"loader's is {self.batch_size * self.world_size}"
                )
        for key in self.STATE_KEYS:
            if key in self.RANK_KEYS and self.other_ranks(state):
                continue
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"loader state: {key} is {state.get(key)!r}, this loader has {getattr(self, key)!r}"
                )
        if not 0 <= state["batches"] <= len(self):
            raise ValueError(f"loader state: batches must be in [0, {len(self)}], got {state['batches']}")
        self.epoch, self._consumed, self._resume_at = state["epoch"], state["batches"], state["batches"]

    def other_ranks(self, state: dict[str, Any]) -> bool:
        """Whether `state` (of `state_dict`) is of another number of ranks that this loader can go on from
        (its RANK_KEYS allow it)."""
        return "world_size" in self.RANK_KEYS and state.get("world_size") != self.world_size

    def _begin(self) -> int:
        """Start an iteration: the batch it starts at (0, or where a loaded state stopped)."""
        start, self._resume_at = self._resume_at, 0
        self._consumed = start
        return start
