"""Evaluation over W ranks: each rank scores a contiguous part of the eval split, and the metrics are
computed over all of it, exactly as one process computes them (dlrm.metrics.evaluate).

The sharded tables answer every rank's lookups through all_to_all, so every rank must run the same number
of batches of the same size: rank r takes rows [r*n, (r+1)*n) of the split, n >= ceil(N / W), padded with
masked rows (the split's first row) to a whole number of batches of one size: as few batches as
ceil(eval_batch_size / W) rows a batch allow, each as full as that count allows (fewer padding rows than
batches). Each
rank keeps its rows on its device after the first evaluation, so later ones read no host memory, and every
batch has one size, so the forward given (a graph replay in training, dlrm.graphs.GraphedForward) runs
without host work between batches. The logits and labels of all ranks are gathered (all_gather, n per
rank), the padding dropped, and AUC (exact, torchmetrics' binary_auroc on all N scores), logloss and NE
computed from them on every rank, so every rank gets the same numbers (and the same early-stopping
decision).
"""

import functools
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchmetrics.functional.classification import binary_auroc

from dlrm.data.dataset import Batch, ParquetDataset
from dlrm.metrics import auc_scores, forward_logits
from dlrm.parallel.group import Dist


class ShardedEvalSplit:
    """The eval split as rank `dist.rank` scores it: rows, padding mask and batch size (module docstring).

    Args:
        dataset: the whole eval split (every rank reads it).
        eval_batch_size: the global eval batch (data.eval_batch_size); each rank's batches hold at most
            ceil(eval_batch_size / W) rows.
        dist: this rank.
        bags: makes the rows' bags from their one-hot ids on the device (data.multi_hot,
            dlrm.data.bags.BagMaker); None: the ids as read.
    """

    def __init__(
        self,
        dataset: ParquetDataset,
        eval_batch_size: int,
        dist: Dist,
        bags: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        self.dataset, self.dist, self.bags = dataset, dist, bags
        total, world = dataset.num_rows, dist.world_size
        # Batches of the cap padded to a whole batch would score up to a batch of padding a rank (262,144
        # rows for the 200,000 of a 400,000-row split on 2 ranks, 65,536 rows a batch).
        share = math.ceil(total / world)
        batches = math.ceil(share / math.ceil(eval_batch_size / world))
        self.batch_size = math.ceil(share / batches)
        self.rows_per_rank = batches * self.batch_size
        rows = torch.arange(dist.rank * self.rows_per_rank, (dist.rank + 1) * self.rows_per_rank)
        self.valid = rows < total
        self.rows = torch.where(self.valid, rows, 0)
        self._on_device: tuple[Batch, torch.Tensor] | None = None

    def on_device(self, device: torch.device) -> tuple[Batch, torch.Tensor]:
        """(this rank's rows [rows_per_rank, ...], their validity mask [rows_per_rank] float32) on `device`,
        read from the host once."""
        if self._on_device is None or self._on_device[1].device != device:
            batch = self.dataset.batch(self.rows).to(device)
            if self.bags is not None:
                batch = batch._replace(sparse=self.bags(batch.sparse))
            self._on_device = batch, self.valid.to(device, torch.float32)
        return self._on_device

    @property
    def num_rows(self) -> int:
        return self.dataset.num_rows


@torch.no_grad()
def evaluate_sharded(
    model: torch.nn.Module,
    split: ShardedEvalSplit,
    device: torch.device,
    precision: str = "fp32",
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, float]:
    """{"auc", "logloss", "ne", "samples"} of `model` over the whole eval split, on every rank.

    The forward runs as in training (dlrm.metrics.evaluate): at `precision`, or as `forward(dense, sparse)`
    when given. Every rank must call it (collectives). Raises ValueError as dlrm.metrics.evaluate: an empty
    split, or labels of one class only.
    """
    was_training = model.training
    model.eval()
    forward = forward or functools.partial(forward_logits, model, precision)
    rows, valid = split.on_device(device)
    logits = torch.empty(split.rows_per_rank, dtype=torch.float32, device=device)
    for start in range(0, split.rows_per_rank, split.batch_size):
        part = slice(start, start + split.batch_size)
        logits[part] = forward(rows.dense[part], rows.sparse[part])
    model.train(was_training)
    local = torch.stack([logits, rows.label, valid])
    gathered = [torch.empty_like(local) for _ in range(split.dist.world_size)]
    dist.all_gather(gathered, local)
    logit, label, valid = torch.cat(gathered, dim=1)
    logit, label = logit[valid.bool()], label[valid.bool()]
    samples = label.numel()
    if samples == 0:
        raise ValueError("evaluation split is empty")
    p = label.double().mean().item()
    if p in (0.0, 1.0):
        raise ValueError(f"evaluation labels are all {int(p)}: AUC is undefined")
    logloss = (
        F.binary_cross_entropy_with_logits(logit.double(), label.double(), reduction="sum").item() / samples
    )
    entropy = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    auc = binary_auroc(auc_scores(logit), label.long()).item()
    return {"auc": auc, "logloss": logloss, "ne": logloss / entropy, "samples": samples}
