"""Tests of the evaluation metrics (dlrm.metrics)."""

import torch

from dlrm.data.dataset import Batch
from dlrm.metrics import evaluate


class FirstDense(torch.nn.Module):
    """A 'model' whose logit is the first dense feature, so a test chooses the logits."""

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return dense[:, 0]


def pairwise_auc(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """P(logit of a positive > logit of a negative) + half the ties, by counting every pair."""
    pos, neg = logits[labels == 1].double(), logits[labels == 0].double()
    diff = pos[:, None] - neg[None, :]
    return ((diff > 0).double().mean() + 0.5 * (diff == 0).double().mean()).item()


def test_auc_ranks_logits_that_saturate_a_float32_sigmoid():
    """Logits of 17..60 are all 1.0 after an fp32 sigmoid; AUC must still order them."""
    generator = torch.Generator().manual_seed(0)
    high = 17 + 43 * torch.rand(300, generator=generator)
    logits = torch.cat([high, torch.randn(300, generator=generator)])
    labels = (torch.rand(600, generator=generator) < 0.4).float()
    batches = []
    for start in range(0, 600, 128):
        part = logits[start : start + 128]
        dense = part[:, None].expand(-1, 13).contiguous()
        ids = torch.zeros(len(part), 26, dtype=torch.int64)
        batches.append(Batch(dense, ids, labels[start : start + 128]))
    result = evaluate(FirstDense(), batches, torch.device("cpu"))
    expected = pairwise_auc(logits, labels)
    assert torch.sigmoid(logits[:300]).eq(1.0).all()  # the fp32 sigmoid ties them all ...
    assert abs(pairwise_auc(torch.sigmoid(logits), labels) - expected) > 1e-2  # ... which moves the AUC
    assert abs(result["auc"] - expected) < 1e-6  # torchmetrics returns a float32
    assert result["samples"] == 600
