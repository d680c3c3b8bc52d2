"""Tests for kernels/loss.py: BCE-with-logits forward + gradient in one kernel, and the evaluation
accumulator, against torch.nn.functional.binary_cross_entropy_with_logits in fp32."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kernels.loss import bce_with_logits

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(b: int, scale: float = 4.0, seed: int = 0, device: str = DEVICE):
    g = torch.Generator(device=device).manual_seed(seed)
    logits = scale * torch.randn(b, generator=g, device=device)
    labels = (torch.rand(b, generator=g, device=device) < 0.3).float()
    return logits, labels


@pytest.mark.parametrize("b", [1, 7, 1024, 3001, 5000])  # 5000: several programs, a sum of partials
@pytest.mark.parametrize("scale", [1.0, 60.0])  # 60: exp(|x|) would overflow fp32 in a naive form
def test_loss_and_gradient_match_torch(b, scale):
    logits, labels = _inputs(b, scale)
    x = logits.clone().requires_grad_()
    loss = bce_with_logits(x, labels)
    loss.backward()
    x_ref = logits.clone().requires_grad_()
    expected = F.binary_cross_entropy_with_logits(x_ref, labels)
    expected.backward()
    assert loss.shape == () and loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-8)


def test_gradient_scales_with_the_incoming_gradient():
    logits, labels = _inputs(50)
    x = logits.clone().requires_grad_()
    (3.0 * bce_with_logits(x, labels)).backward()
    expected = 3.0 * (torch.sigmoid(logits) - labels) / 50
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-8)


def test_empty_batch_is_nan_and_errors():
    assert math.isnan(bce_with_logits(torch.zeros(0, device=DEVICE), torch.zeros(0, device=DEVICE)).item())
    with pytest.raises(ValueError, match=r"must both be \[B\]"):
        bce_with_logits(torch.zeros(3), torch.zeros(4))


@pytest.mark.parametrize("b", [128, 65536])
def test_bf16_logits(b):
    """bf16 logits (the kernel casts them to fp32 right after the load, in the interpreter too)."""
    logits, labels = _inputs(b)
    x = logits.to(torch.bfloat16).requires_grad_()
    loss = bce_with_logits(x, labels)
    loss.backward()
    x_ref = x.detach().float().requires_grad_()
    expected = F.binary_cross_entropy_with_logits(x_ref, labels)
    expected.backward()
    torch.testing.assert_close(
        loss, expected, rtol=1e-5, atol=1e-6
    )  # computed in fp32 from the same bf16 values
    torch.testing.assert_close(x.grad.float(), x_ref.grad, rtol=1.6e-2, atol=1e-7)  # one bf16 rounding


@pytest.mark.gpu
def test_the_loss_is_the_same_bits_on_every_run_gpu():
    """Past one program's batch the partial sums of 64 programs meet in a fixed order, not in the order
    the programs finish (which atomic adds would take): the loss of the same batch never changes."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(65_536, generator=g) * 3).cuda()
    labels = (torch.rand(65_536, generator=g) < 0.25).float().cuda()
    losses = torch.stack([bce_with_logits(logits, labels) for _ in range(50)])
    assert (losses == losses[0]).all()
    torch.testing.assert_close(losses[0], F.binary_cross_entropy_with_logits(logits, labels))
