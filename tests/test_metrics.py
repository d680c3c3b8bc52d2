"""Tests of the evaluation metrics (dlrm.metrics)."""

import numpy as np
import pytest
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


def test_logloss_ne_and_auc_equal_scikit_learns_on_random_and_extreme_logits():
    """dlrm.metrics.evaluate (batches of 128, a partial last one) against scikit-learn, an independent
    implementation: log_loss of the probabilities, NE as that over log_loss of the constant positive rate
    (the entropy H(p)), roc_auc_score. A fifth of the logits are beyond +-17, where an fp32 sigmoid rounds to
    0 or 1 (a loss computed from it would be infinite for a wrong label); they stay within +-35, where the
    float64 probabilities scikit-learn takes keep every digit (it clips them to float64's eps, 2.2e-16, the
    probability of a logit of -36)."""
    from sklearn.metrics import log_loss, roc_auc_score

    generator = torch.Generator().manual_seed(1)
    logits = torch.cat(
        [3 * torch.randn(400, generator=generator), 17 + 18 * torch.rand(100, generator=generator)]
    )
    logits[torch.rand(500, generator=generator) < 0.5] *= -1  # extreme logits of both signs
    labels = (torch.rand(500, generator=generator) < torch.sigmoid(logits / 4)).float()
    labels[-50:] = 1 - labels[-50:]  # some extreme logits on the wrong side: losses of 17 to 35
    batches = []
    for start in range(0, 500, 128):
        part = logits[start : start + 128]
        ids = torch.zeros(len(part), 26, dtype=torch.int64)
        batches.append(Batch(part[:, None].expand(-1, 13).contiguous(), ids, labels[start : start + 128]))
    result = evaluate(FirstDense(), batches, torch.device("cpu"))

    x, y = logits.double().numpy(), labels.long().numpy()
    probabilities = np.stack([1 / (1 + np.exp(x)), 1 / (1 + np.exp(-x))], axis=1)  # [P(0), P(1)], float64
    assert probabilities.min() > np.finfo(np.float64).eps  # scikit-learn clips nothing
    logloss = log_loss(y, probabilities)
    entropy = log_loss(y, np.full(len(y), y.mean()))
    # The loss of each row is computed in fp32 (a few ulp, 2**-24 each, relative), summed in float64: the
    # mean keeps ~1e-7 of relative error; 1e-6 leaves room and is far below any real error (the mean is ~3.4:
    # one row's loss of 17..35 dropped or miscounted moves it by more than 8e-3 relative).
    assert result["logloss"] == pytest.approx(logloss, rel=1e-6)
    assert result["ne"] == pytest.approx(logloss / entropy, rel=1e-6)
    # torchmetrics returns a float32 AUC: within 1e-6 of the exact one.
    assert result["auc"] == pytest.approx(roc_auc_score(y, x), abs=1e-6)
    assert result["samples"] == 500
