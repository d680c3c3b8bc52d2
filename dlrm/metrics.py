"""Evaluation metrics for CTR models: AUC, logloss and normalized entropy (NE).

logloss = mean BCE(sigmoid(logit), label), computed from the logits in the numerically stable form.
NE = logloss / H(p), H(p) = -(p log p + (1 - p) log(1 - p)) with p the split's positive rate
(He et al. 2014, "Practical Lessons from Predicting Clicks on Ads at Facebook").
"""

import functools
import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torchmetrics.classification import BinaryAUROC
from torchmetrics.functional.classification import binary_auroc

from dlrm.data.dataset import Batch


def auc_scores(logits: torch.Tensor) -> torch.Tensor:
    """[n] float64 scores in (0, 1) in the order of `logits` [n], for torchmetrics' AUROC (which applies a
    sigmoid to scores outside [0, 1]). AUC needs only the ranks, and sigmoid(logit) in fp32 rounds every
    logit above ~16.6 to 1.0, tying them; 1/2 + atan(x)/pi in float64 stays strictly increasing for every
    finite fp32 logit the model produces (its slope 1/(pi x^2) is above float64's spacing up to |x| ~ 1e7)."""
    return 0.5 + torch.atan(logits.double()) / torch.pi


def auc(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Exact AUC of logits [n] (any float dtype) against labels [n] (0/1, any dtype): torchmetrics' AUROC
    on `auc_scores(logits)`, ties counted half, as `evaluate` computes it. Holds all n scores (float64)."""
    return binary_auroc(auc_scores(logits), labels.long()).item()


def normalized_entropy(logloss: float, positive_rate: float) -> float:
    """NE = logloss / H(p), H(p) the entropy of a Bernoulli(p) (p = the split's positive rate).

    Raises:
        ValueError: p is 0 or 1 (or outside [0, 1]): H(p) is 0, NE undefined.
    """
    p = positive_rate
    if not 0.0 < p < 1.0:
        raise ValueError(f"positive rate {p}: NE is undefined unless it is strictly between 0 and 1")
    return logloss / -(p * math.log(p) + (1 - p) * math.log(1 - p))


def forward_logits(
    model: torch.nn.Module, precision: str, dense: torch.Tensor, sparse: torch.Tensor
) -> torch.Tensor:
    """The model's logits [B] in fp32 for dense [B, 13] and sparse [B, F], under bf16 autocast for precision
    "bf16" (as the training step runs the forward)."""
    with torch.autocast(dense.device.type, torch.bfloat16, precision == "bf16"):
        return model(dense, sparse).float()


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: Iterable[Batch],
    device: torch.device,
    precision: str = "fp32",
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, float]:
    """Run `model` over `batches` and return {"auc", "logloss", "ne", "samples"}.

    The forward runs as in training: under bf16 autocast for precision "bf16" (`forward_logits`), or as
    `forward(dense, sparse)` when given (dlrm.graphs.GraphedForward: the same forward as graph replays).
    A last batch smaller than the first is padded to the first's size (the padding's logits are dropped),
    so evaluation runs the kernels the first batch compiled and tuned instead of JIT-compiling and
    autotuning a new shape, and the graph of the first batch's size.
    AUC is computed on `auc_scores(logits)`, which keep the logits' order (see there).
    Raises:
        ValueError: no samples, or only one class in the labels (AUC undefined).
    """
    was_training = model.training
    model.eval()
    # Without its argument checks: they sync the host with the GPU at every batch (torch.unique of the
    # labels), so the host could not launch the next batch while the GPU runs this one. The labels were
    # checked to be 0 or 1 when decoded (dlrm.data.dataset.decode_table); the scores lie in (0, 1).
    auroc = BinaryAUROC(validate_args=False).to(device)
    forward = forward or functools.partial(forward_logits, model, precision)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    positives = torch.zeros((), dtype=torch.float64, device=device)
    samples, size = 0, None
    for batch in batches:
        batch = batch.to(device, non_blocking=True)
        rows = batch.label.numel()
        size = size or rows
        dense, sparse = batch.dense, batch.sparse
        if rows < size:
            dense, sparse = (torch.cat([t, t[:1].expand(size - rows, -1)]) for t in (dense, sparse))
        logits = forward(dense, sparse)[:rows]
        loss_sum += F.binary_cross_entropy_with_logits(logits, batch.label, reduction="sum").double()
        positives += batch.label.sum().double()
        auroc.update(auc_scores(logits), batch.label.long())
        samples += rows
    model.train(was_training)
    if samples == 0:
        raise ValueError("evaluation split is empty")
    p = positives.item() / samples
    if p in (0.0, 1.0):
        raise ValueError(f"evaluation labels are all {int(p)}: AUC is undefined")
    logloss = loss_sum.item() / samples
    ne = normalized_entropy(logloss, p)
    return {"auc": auroc.compute().item(), "logloss": logloss, "ne": ne, "samples": samples}
