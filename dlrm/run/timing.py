"""Where a run's wall time goes, per process (each rank its own): `TimeSpent` charges every moment from the
start of `dlrm.run.loop.train` to one part at a time, so the parts add up to the wall time.

Parts (PARTS, in this order):
- setup: `dlrm.run.setup.set_up` and the loop's start (data, model, run directory, checkpoint preflight).
- data: blocked in the train loader's next batch.
- step: host time of the steps: the lr, the step call, the loss copy and the loop's bookkeeping. On a GPU
  the step only launches work, and this grows when the launch queue is full (the device is behind); on
  the CPU it is the step's compute.
- first_steps: the steps timed apart from throughput (the first, the first of each new batch size, and the
  CUDA graph's warm-up and capture steps): compilation, kernel JIT and tuning, graph capture, launch and
  the wait for the device.
- device_wait: waiting for the device at the loop's host syncs: reading the interval's losses (log lines,
  evaluations, checkpoints) and finishing the steps before a step timed apart.
- collectives: the loop's collectives outside the step (many ranks: agreeing on a stop signal or a timed
  checkpoint at log lines, the mean loss over the ranks); each waits for the slowest rank. 0 on one process.
- eval: the val evaluations and the test evaluation at the end.
- checkpoint: writing last.pt / best.pt (a background save: its snapshot), waiting for a previous background
  save, the weights' finiteness check before a save, loading best.pt's weights for the test evaluation.
- log: log lines, TensorBoard scalars, the progress bar, the profiler starting and stopping its tracer and
  writing its window's trace.
- other: the rest (set-up of each epoch's loader iterator, the end of the run).

The loop switches parts where it already does the work: two perf_counter readings a step, no host sync,
no device work. The sums are this process's, as wall_s and samples_per_s in metrics.json: a resumed run
counts its own time, and checkpoints do not hold them.
"""

import time
from collections.abc import Iterator
from contextlib import contextmanager

PARTS = (
    "setup",
    "data",
    "step",
    "first_steps",
    "device_wait",
    "collectives",
    "eval",
    "checkpoint",
    "log",
    "other",
)
LABELS = {"step": "step launch", "first_steps": "first steps", "device_wait": "device wait"}


class TimeSpent:
    """Seconds per part (PARTS) of this process since `start` (a time.perf_counter() reading; default now),
    charged to the part it is in (`switch`, `part`), starting in `first`."""

    def __init__(self, start: float | None = None, first: str = "setup"):
        now = time.perf_counter() if start is None else start
        self.start = self.since = now
        self.current = first
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.logged = {part: 0.0 for part in ("wall", *PARTS)}  # `totals` at the last `shares`

    def switch(self, part: str) -> str:
        """From now on charge `part`; returns the part charged until now."""
        now = time.perf_counter()
        self.seconds[self.current] += now - self.since
        previous, self.current, self.since = self.current, part, now
        return previous

    @contextmanager
    def part(self, part: str) -> Iterator[None]:
        """Charge `part` inside the block, then the part charged before it (nested blocks: each moment to
        the innermost)."""
        previous = self.switch(part)
        try:
            yield
        finally:
            self.switch(previous)

    def move(self, seconds: float, part: str) -> None:
        """Charge `seconds` already spent in the current part to `part` instead."""
        self.seconds[self.current] -= seconds
        self.seconds[part] += seconds

    def totals(self) -> dict[str, float]:
        """{"wall": seconds since the start, part: its seconds, ...}: the parts add up to "wall"."""
        now = time.perf_counter()
        seconds = dict(self.seconds)
        seconds[self.current] += now - self.since
        return {"wall": now - self.start, **seconds}

    def breakdown(self) -> dict[str, float]:
        """metrics.json's form of `totals`: {"wall_s", "<part>_s", ...}, none negative, "other_s" the wall
        time the other parts leave (rounding kept out of it)."""
        totals = self.totals()
        named = {part: max(0.0, totals[part]) for part in PARTS if part != "other"}
        other = max(0.0, totals["wall"] - sum(named.values()))
        return {"wall_s": totals["wall"], **{f"{part}_s": s for part, s in named.items()}, "other_s": other}

    def shares(self) -> dict[str, float]:
        """Each part's % of the wall time since the last call (the first: since the start)."""
        totals = self.totals()
        spent = {part: totals[part] - self.logged[part] for part in totals}
        self.logged = totals
        wall = spent.pop("wall")
        return {part: 100 * s / wall if wall > 0 else 0.0 for part, s in spent.items()}


def describe(per_rank: list[dict[str, float]]) -> str:
    """The one log line of the breakdowns (`TimeSpent.breakdown`, in rank order): each part's seconds and %
    of the wall time on rank 0 and, for many ranks, the range over the ranks; parts under 5 ms on every rank
    left out (e.g. collectives on one process). E.g. "time: wall 20.5 s | setup 2.10 s (10%) | data 3.10 s
    (15%) | ..."."""
    main = per_rank[0]
    many = len(per_rank) > 1
    head = "time (rank 0; min-max over the ranks)" if many else "time"
    fields = [f"wall {main['wall_s']:.1f} s" + (f" ({_spread(per_rank, 'wall_s')})" if many else "")]
    for part in PARTS:
        key = f"{part}_s"
        if not any(rank[key] >= 0.005 for rank in per_rank):
            continue
        share = 100 * main[key] / main["wall_s"] if main["wall_s"] > 0 else 0.0
        spread = f"; {_spread(per_rank, key)}" if many else ""
        fields.append(f"{LABELS.get(part, part)} {main[key]:.2f} s ({share:.0f}%{spread})")
    return f"{head}: " + " | ".join(fields)


def _spread(per_rank: list[dict[str, float]], key: str) -> str:
    values = [rank[key] for rank in per_rank]
    return f"{min(values):.2f}-{max(values):.2f} s"
