"""Tests for kernels/gemm/partials.py: the sum of per-program partials over their leading axis."""

from __future__ import annotations

import pytest
import torch

from kernels.gemm.partials import sum_partials

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("shape", [(1, 5), (3, 1), (33, 130), (70, 3, 7), (600, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_torch_sum(shape, dtype):
    part = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    out = sum_partials(part, dtype)
    assert out.shape == shape[1:] and out.dtype == dtype
    expected = part.double().sum(dim=0)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    else:  # the interpreter rounds to bf16 by truncation: within 2 ulp
        torch.testing.assert_close(out.double(), expected, rtol=2 * 2**-8, atol=1e-2)


def test_rejects_what_it_cannot_sum():
    with pytest.raises(ValueError, match="expected contiguous fp32"):
        sum_partials(torch.ones(4, 3, dtype=torch.float64), torch.float32)
    with pytest.raises(ValueError, match="expected contiguous fp32"):
        sum_partials(torch.ones(3, 4).t(), torch.float32)
