"""Tests for kernels/interaction.py: the DLRM dot interaction in one kernel, forward and backward, against
the PyTorch reference (bmm, strict-lower-triangle gather, concat) in fp32 and its autograd gradients."""

from __future__ import annotations

import pytest
import torch

import kernels.gemm.tuning as gemm_tuning
import kernels.interaction as interaction_mod
from dlrm.model.dlrm import InteractionArch
from kernels.gemm.layout import aligned_width
from kernels.interaction import dot_interaction, dot_interaction_ref, interaction_width
from tests.test_linear_act import _assert_norm_close, allow_tf32
from tests.tolerances import tol

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _outputs(b: int, f: int, d: int, dtype: torch.dtype, device: str, seed: int = 0):
    """(out, ddense, dembedded) of the kernel path and their fp32 reference values, for random inputs."""
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
    return (out, dense.grad, embedded.grad), (expected.detach(), dense32.grad, embedded32.grad)


def _check(b: int, f: int, d: int, dtype: torch.dtype, device: str, seed: int = 0):
    (out, ddense, dembedded), (expected, ddense32, dembedded32) = _outputs(b, f, d, dtype, device, seed)
    assert out.shape == (b, d + f * (f + 1) // 2) and out.dtype == dtype
    assert out.stride() == (aligned_width(out.shape[1], dtype), 1)  # rows padded to 16 bytes for GEMMs
    rows = out.detach().as_strided((b, out.stride(0)), out.stride())  # a GEMM may read the padding: zeros
    assert torch.equal(rows[:, out.shape[1] :], torch.zeros_like(rows[:, out.shape[1] :]))
    # Dot products of D terms summed in another order than bmm's: the "gemm" tolerance (fp32).
    kind = "gemm" if dtype == torch.float32 else "fwd"
    torch.testing.assert_close(out.float(), expected.to(dtype).float(), **tol(dtype, kind))
    torch.testing.assert_close(ddense.float(), ddense32, **tol(dtype, "gemm" if kind == "gemm" else "sum"))
    torch.testing.assert_close(
        dembedded.float(), dembedded32, **tol(dtype, "gemm" if kind == "gemm" else "sum")
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


@pytest.mark.parametrize("b", [1, 5, 9])
def test_fp32_under_allow_tf32(b):
    """fp32 under allow_tf32 runs several samples per program at D <= 32 (`_meta`): batches that leave the
    last program partly empty. The interpreter's dots are IEEE ("gemm"); a GPU's are one TF32 product, as
    eager's bmm then ("gemm_norm")."""
    with allow_tf32(True):
        if DEVICE == "cpu":
            _check(b, 26, 16, torch.float32, DEVICE)
            return
        got, want = _outputs(b, 26, 16, torch.float32, DEVICE)
    for actual, expected, name in zip(got, want, ("out", "ddense", "dembedded"), strict=True):
        _assert_norm_close(actual, expected, torch.float32, f"{name} b={b}")


def test_gpu_dot_precision_and_samples_follow_allow_tf32(monkeypatch):
    """On a GPU the dots take PyTorch's matmul precision (`input_precision`): fp32 three TF32 products
    without allow_tf32, one with it (then 4 samples per forward program up to D=32); 16-bit one product."""
    monkeypatch.setattr(interaction_mod, "INTERPRETED", False)
    monkeypatch.setattr(gemm_tuning, "INTERPRETED", False)
    meta = interaction_mod._meta
    for tf32, precision, samples in ((False, "tf32x3", 1), (True, "tf32", 4)):
        with allow_tf32(tf32):
            assert meta(26, 16, torch.float32, backward=False)["PRECISION"] == precision
            assert meta(26, 16, torch.float32, backward=True)["PRECISION"] == precision
            assert meta(26, 16, torch.float32, backward=False)["SAMPLES"] == samples
            assert meta(26, 128, torch.float32, backward=False)["SAMPLES"] == 1
            bf16 = meta(26, 16, torch.bfloat16, backward=False)
            assert (bf16["PRECISION"], bf16["SAMPLES"]) == ("tf32", 4)


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


@pytest.mark.gpu
@pytest.mark.parametrize("d", [16, 128])
def test_fp32_under_allow_tf32_at_dlrm_shapes_on_gpu(d):
    """One TF32 product per dot under allow_tf32: within "gemm_norm" of the fp32 reference, forward and
    backward (B=4095 leaves the last forward program with 3 of its 4 samples at D=16)."""
    with allow_tf32(True):
        got, want = _outputs(4095, 26, d, torch.float32, "cuda")
    for actual, expected, name in zip(got, want, ("out", "ddense", "dembedded"), strict=True):
        _assert_norm_close(actual, expected, torch.float32, f"{name} d={d}")
