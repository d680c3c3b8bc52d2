"""Evaluation metrics for CTR models: AUC, logloss and normalized entropy (NE).

logloss = mean BCE(sigmoid(logit), label), computed from the logits in the numerically stable form.
NE = logloss / H(p), H(p) = -(p log p + (1 - p) log(1 - p)) with p the split's positive rate
(He et al. 2014, "Practical Lessons from Predicting Clicks on Ads at Facebook").
"""

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torchmetrics.classification import BinaryAUROC

from dlrm.data.dataset import Batch


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[Batch], device: torch.device) -> dict[str, float]:
    """Run `model` over `batches` and return {"auc", "logloss", "ne", "samples"}.

    The sigmoid is applied here, once, to turn logits into click probabilities for AUC.
    Raises:
        ValueError: no samples, or only one class in the labels (AUC undefined).
    """
    was_training = model.training
    model.eval()
    auroc = BinaryAUROC().to(device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    positives = torch.zeros((), dtype=torch.float64, device=device)
    samples = 0
    for batch in batches:
        batch = batch.to(device, non_blocking=True)
        logits = model(batch.dense, batch.sparse).float()
        loss_sum += F.binary_cross_entropy_with_logits(logits, batch.label, reduction="sum").double()
        positives += batch.label.sum().double()
        auroc.update(torch.sigmoid(logits), batch.label.long())
        samples += batch.label.numel()
    model.train(was_training)
    if samples == 0:
        raise ValueError("evaluation split is empty")
    p = positives.item() / samples
    if p in (0.0, 1.0):
        raise ValueError(f"evaluation labels are all {int(p)}: AUC is undefined")
    logloss = loss_sum.item() / samples
    entropy = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    return {"auc": auroc.compute().item(), "logloss": logloss, "ne": logloss / entropy, "samples": samples}
