"""The best any model can do on synthetic data: the planted model's own AUC, logloss and NE on each split
(`"oracle"` in the metadata.json of dlrm.data.synthetic), accumulated block by block as the rows are written.

Each synthetic label is drawn from Bernoulli(sigmoid(logit)) with `logit` the planted model's, so scoring
the rows with that very logit is the best any model can do on them, up to sampling noise. The numbers use
the definitions of dlrm.metrics, so they compare directly with the eval numbers of a training run:

- logloss: mean BCE-with-logits (torch's F.binary_cross_entropy_with_logits, as dlrm.metrics.evaluate) of
  the float64 planted logits, summed per block in float64 and over blocks with math.fsum: exact up to
  float64 rounding (relative error ~1e-15 per block sum).
- NE: dlrm.metrics.normalized_entropy(logloss, the split's positive rate).
- AUC: memory-bounded, from a histogram of the logits per label: BINS = 2**20 equal bins over
  [LOW, HIGH) = [-40, 40) (width ~7.6e-5; logits outside fall into the end bins, the planted ones never
  come near), counted with one np.bincount per block. That costs 16 MiB per split whatever its row count
  (keeping float32 logits and labels instead would cost 225 MB at Kaggle's 45M rows and 21 GB at the
  Terabyte's 4.2 billion). Pairs in different bins are ordered exactly; a pair sharing a bin counts half,
  as a tie does in dlrm.metrics.auc, so the exact AUC lies within
      auc_error_bound = sum_b pos_b * neg_b / (2 * P * N)      (P, N: positives, negatives)
  of the one reported. The bound is computed from the same counts and written next to it; for the planted
  model it is ~4e-6 (identical logits, true ties, included), far below the sampling noise of a split's
  AUC (~1e-3 at 1M rows).
"""

import math
from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F

from dlrm.metrics import normalized_entropy

BINS = 1 << 20
LOW, HIGH = -40.0, 40.0
_WIDTH = (HIGH - LOW) / BINS


def histogram_auc(positives: np.ndarray, negatives: np.ndarray) -> tuple[float, float]:
    """(AUC, error bound) of scores given as per-bin counts, bins in increasing score order.

    Args:
        positives, negatives: [bins] int64 counts of positive / negative rows per bin.
    Returns:
        The AUC with pairs inside one bin counted half, and the most the exact AUC (ties half) can differ
        from it: sum_b pos_b * neg_b / (2 P N).
    Raises:
        ValueError: no positives or no negatives (AUC undefined).
    """
    p, n = float(positives.sum()), float(negatives.sum())
    if p == 0 or n == 0:
        raise ValueError(f"AUC is undefined with {p:.0f} positives and {n:.0f} negatives")
    pos, neg = positives.astype(np.float64), negatives.astype(np.float64)
    negatives_below = np.cumsum(neg) - neg  # negatives in lower bins, exact in float64 up to 2**53
    same_bin = float(pos @ neg)
    wins = float(pos @ negatives_below) + 0.5 * same_bin
    return wins / (p * n), 0.5 * same_bin / (p * n)


class OracleMetrics:
    """AUC, logloss and NE of streamed (logit, label) rows of one split, in bounded memory (see the module
    docstring for the cost and the AUC's error bound)."""

    def __init__(self) -> None:
        self.counts = np.zeros(2 * BINS, dtype=np.int64)  # [negatives per bin | positives per bin]
        self.loss_sums: list[float] = []
        self.rows = 0

    def update(self, logits: np.ndarray, labels: np.ndarray) -> None:
        """Add rows: logits [n] float64 (the planted model's), labels [n] 0/1 of any numeric dtype."""
        if len(logits) == 0:
            return
        logits = np.asarray(logits, dtype=np.float64)
        positive = np.asarray(labels) != 0
        bins = np.clip(np.floor((logits - LOW) / _WIDTH), 0, BINS - 1).astype(np.int64)
        self.counts += np.bincount(bins + BINS * positive, minlength=2 * BINS)
        loss = F.binary_cross_entropy_with_logits(
            torch.from_numpy(logits), torch.from_numpy(positive.astype(np.float64)), reduction="sum"
        )
        self.loss_sums.append(loss.item())
        self.rows += len(logits)

    def result(self) -> dict:
        """{"auc", "auc_error_bound", "logloss", "ne", "rows"}; None where undefined (logloss of no rows,
        AUC and NE of rows of one class)."""
        if self.rows == 0:
            return {"auc": None, "auc_error_bound": None, "logloss": None, "ne": None, "rows": 0}
        logloss = math.fsum(self.loss_sums) / self.rows
        negatives, positives = self.counts[:BINS], self.counts[BINS:]
        positive_rate = int(positives.sum()) / self.rows
        if positive_rate in (0.0, 1.0):
            auc = bound = ne = None
        else:
            auc, bound = histogram_auc(positives, negatives)
            ne = normalized_entropy(logloss, positive_rate)
        return {"auc": auc, "auc_error_bound": bound, "logloss": logloss, "ne": ne, "rows": self.rows}


class SplitOracle:
    """OracleMetrics per split, fed from blocks of consecutive rows that may straddle splits.

    Args:
        splits: split name -> [start, stop) row range of the generated rows (ranges need not cover all
            rows nor be disjoint).
    Raises:
        ValueError: a range with start < 0 or stop < start.
    """

    def __init__(self, splits: Mapping[str, tuple[int, int]]) -> None:
        for name, (start, stop) in splits.items():
            if start < 0 or stop < start:
                raise ValueError(f"split {name!r}: bad row range [{start}, {stop})")
        self.splits = dict(splits)
        self.metrics = {name: OracleMetrics() for name in splits}

    def update(self, start: int, logits: np.ndarray, labels: np.ndarray) -> None:
        """Add the block of rows [start, start + n): logits [n] float64, labels [n] 0/1."""
        for name, (first, stop) in self.splits.items():
            lo, hi = max(first - start, 0), min(stop - start, len(logits))
            if lo < hi:
                self.metrics[name].update(logits[lo:hi], labels[lo:hi])

    def result(self) -> dict[str, dict]:
        """Split name -> OracleMetrics.result()."""
        return {name: m.result() for name, m in self.metrics.items()}


def describe(oracle: Mapping[str, dict]) -> str:
    """One line for a log: `train AUC 0.8123 logloss 0.2712 NE 0.8321, eval ...` (n/a where undefined)."""

    def number(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.4f}"

    return ", ".join(
        f"{name} AUC {number(m['auc'])} logloss {number(m['logloss'])} NE {number(m['ne'])}"
        for name, m in oracle.items()
    )
