"""Evaluation over W ranks: each rank scores a contiguous part of the eval split, and the metrics are
computed over all of it, exactly as one process computes them (dlrm.metrics.evaluate).

The sharded tables answer every rank's lookups through all_to_all, so every rank must run the same number
of batches of the same size: rank r takes rows [r*n, (r+1)*n) of the split, n = ceil(N / W), padded with
masked rows (the split's first row) to n; batches of ceil(eval_batch_size / W) rows. The logits and labels
of all ranks are gathered (all_gather, n per rank), the padding dropped, and AUC (exact,
torchmetrics' binary_auroc on all N scores), logloss and NE computed from them on every rank, so every
rank gets the same numbers (and the same early-stopping decision).
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchmetrics.functional.classification import binary_auroc

from dlrm.data.dataset import ParquetDataset
from dlrm.parallel.group import Dist


class ShardedEvalSplit:
    """The eval split as rank `dist.rank` scores it: rows, padding mask and batch size (module docstring).

    Args:
        dataset: the whole eval split (every rank reads it).
        eval_batch_size: the global eval batch (data.eval_batch_size); each rank's batches hold
            ceil(eval_batch_size / W) rows.
        dist: this rank.
    """

    def __init__(self, dataset: ParquetDataset, eval_batch_size: int, dist: Dist):
        self.dataset, self.dist = dataset, dist
        total, world = dataset.num_rows, dist.world_size
        self.rows_per_rank = math.ceil(total / world)
        rows = torch.arange(dist.rank * self.rows_per_rank, (dist.rank + 1) * self.rows_per_rank)
        self.valid = rows < total
        self.rows = torch.where(self.valid, rows, 0)
        self.batch_size = math.ceil(eval_batch_size / world)

    @property
    def num_rows(self) -> int:
        return self.dataset.num_rows


@torch.no_grad()
def evaluate_sharded(
    model: torch.nn.Module, split: ShardedEvalSplit, device: torch.device
) -> dict[str, float]:
    """{"auc", "logloss", "ne", "samples"} of `model` over the whole eval split, on every rank.

    Every rank must call it (collectives). Raises ValueError as dlrm.metrics.evaluate: an empty split, or
    labels of one class only.
    """
    was_training = model.training
    model.eval()
    logits, labels = [], []
    for start in range(0, split.rows_per_rank, split.batch_size):
        batch = split.dataset.batch(split.rows[start : start + split.batch_size]).to(
            device, non_blocking=True
        )
        logits.append(model(batch.dense, batch.sparse).float())
        labels.append(batch.label)
    model.train(was_training)
    local = torch.stack([torch.cat(logits), torch.cat(labels), split.valid.to(device, torch.float32)])
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
    auc = binary_auroc(torch.sigmoid(logit), label.long()).item()
    return {"auc": auc, "logloss": logloss, "ne": logloss / entropy, "samples": samples}
