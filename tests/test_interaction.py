"""Tests for kernels/interaction.py: the DLRM dot interaction in one kernel, forward and backward, against
the PyTorch reference (bmm, strict-lower-triangle gather, concat) in fp32 and its autograd gradients."""

from __future__ import annotations

import pytest
import torch

from dlrm.model.dlrm import InteractionArch
from kernels.gemm.layout import aligned_width
from kernels.interaction import dot_interaction, dot_interaction_ref, interaction_width
from tests.tolerances import tol

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check(b: int, f: int, d: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    dense = torch.randn(b, d, generator=g, device=device).to(dtype).requires_grad_()
    embedded = torch.randn(b, f, d, generator=g, device=device).to(dtype).requires_grad_()
    dout = torch.randn(b, interaction_width(f, d), generator=g, device=device).to(dtype)
    out = dot_interaction(dense, embedded)
    out.backward(dout)

    dense32 = dense.detach().float().requires_grad_()
    embedded32 = embedded.detach().float().requires_grad_()
    expected = dot_interaction_ref(dense32, embedded32)
    expected.backward(dout.float())

    assert out.shape == (b, d + f * (f + 1) // 2) and out.dtype == dtype
    assert out.stride() == (aligned_width(out.shape[1], dtype), 1)  # rows padded to 16 bytes for GEMMs
    rows = out.detach().as_strided((b, out.stride(0)), out.stride())  # a GEMM may read the padding: zeros
    assert torch.equal(rows[:, out.shape[1] :], torch.zeros_like(rows[:, out.shape[1] :]))
    # Dot products of D terms summed in another order than bmm's: the "gemm" tolerance (fp32).
    kind = "gemm" if dtype == torch.float32 else "fwd"
    torch.testing.assert_close(out.float(), expected.detach().to(dtype).float(), **tol(dtype, kind))
    torch.testing.assert_close(
        dense.grad.float(), dense32.grad, **tol(dtype, "gemm" if kind == "gemm" else "sum")
    )
    torch.testing.assert_close(
        embedded.grad.float(), embedded32.grad, **tol(dtype, "gemm" if kind == "gemm" else "sum")
    )


@pytest.mark.parametrize(
    ("b", "f", "d"), [(1, 1, 1), (3, 2, 4), (5, 26, 16), (2, 26, 24), (7, 13, 5), (2, 26, 128)]
)
def test_matches_reference_fp32(b, f, d):
    _check(b, f, d, torch.float32, DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b", [1, 6, 9])
def test_matches_reference_16_bit(b, dtype):
    """16-bit inputs run several samples per program: batches that leave the last program partly empty."""
    _check(b, 26, 16, dtype, DEVICE)


def test_equals_the_model_interaction_arch():
    """Same column order as InteractionArch's torch path: [dense | Z[1,0], Z[2,0], Z[2,1], ...]."""
    g = torch.Generator().manual_seed(1)
    dense, embedded = torch.randn(4, 16, generator=g), torch.randn(4, 26, 16, generator=g)
    expected = InteractionArch(16)(dense, embedded)
    torch.testing.assert_close(
        dot_interaction(dense.to(DEVICE), embedded.to(DEVICE)).cpu(), expected, **tol(torch.float32, "gemm")
    )


def test_empty_batch_and_errors():
    assert dot_interaction(torch.randn(0, 4, device=DEVICE), torch.randn(0, 3, 4, device=DEVICE)).shape == (
        0,
        10,
    )
    with pytest.raises(ValueError, match="disagree on B or D"):
        dot_interaction(torch.randn(2, 4), torch.randn(2, 3, 5))
    with pytest.raises(ValueError, match="embedded dtype torch.float64 differs from dense"):
        dot_interaction(torch.randn(2, 4), torch.randn(2, 3, 4, dtype=torch.float64))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("b", "d"), [(16384, 16), (16383, 128), (65536, 16)])
def test_dlrm_shapes_on_gpu(b, d, dtype):
    _check(b, 26, d, dtype, "cuda")
