"""Tests for kernels/ln_linear_gelu.py: y = gelu_tanh(layer_norm(x) @ W^T + b), forward and backward.

On CPU the Triton kernels run in the interpreter (conftest), where the GEMMs are plain fp32: compared
elementwise with the fp32 reference's autograd gradients. On a GPU (and for bf16/fp16) the values are
checked as a relative norm (tests/tolerances.py, "gemm_norm").
"""

from __future__ import annotations

import math

import pytest
import torch

import kernels.gemm.partials as partials
import kernels.launch as launch
import kernels.ln_linear_gelu as ln_mod
from kernels.ln_linear_gelu import ln_linear_gelu, ln_linear_gelu_bwd, ln_linear_gelu_fwd, ln_linear_gelu_ref
from tests.test_linear_act import _assert_norm_close
from tests.tolerances import tol

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (M, N, K): ones, primes, non-multiples of the 32-wide interpreter tiles, K past one reduction chunk.
SHAPES = [(1, 1, 1), (3, 7, 5), (67, 33, 13), (40, 5, 70)]
NAMES = ("y", "dx", "dgamma", "dbeta", "dW", "db")


def _ids(s):
    return "x".join(map(str, s))


def _inputs(m, n, k, dtype, device=DEVICE, seed=0):
    """Fresh random x [M, K] (off-centre, not unit scale), gamma, beta [K], W [N, K], b [N], dy [M, N]."""
    g = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(m, k, generator=g) + 1
    gamma = 1 + 0.3 * torch.randn(k, generator=g)
    beta = 0.3 * torch.randn(k, generator=g)
    w = torch.randn(n, k, generator=g) / math.sqrt(k)
    b = torch.randn(n, generator=g)
    dy = torch.randn(m, n, generator=g)
    return tuple(t.to(device=device, dtype=dtype) for t in (x, gamma, beta, w, b, dy))


def _check(m, n, k, has_bias, dtype, device=DEVICE, needs_dx=True, seed=0):
    x, gamma, beta, w, b, dy = _inputs(m, n, k, dtype, device, seed)
    b = b if has_bias else None
    params = [t.requires_grad_(True) for t in (gamma, beta, w, b) if t is not None]
    leaves = [x.requires_grad_(True), *params] if needs_dx else params
    y = ln_linear_gelu(x, gamma, beta, w, b)
    grads = torch.autograd.grad(y, leaves, dy)
    assert y.dtype == dtype and y.shape == (m, n)

    x32 = x.detach().float().requires_grad_(needs_dx)
    p32 = [t.detach().float().requires_grad_(True) for t in params]
    y32 = ln_linear_gelu_ref(x32, *p32[:3], p32[3] if has_bias else None)
    grads32 = torch.autograd.grad(y32, [x32, *p32] if needs_dx else p32, dy.float())
    names = [n for n in NAMES if (n != "dx" or needs_dx) and (n != "db" or has_bias)]
    for got, want, name in zip((y, *grads), (y32, *grads32), names, strict=True):
        assert got.dtype == dtype
        if dtype == torch.float32 and device == "cpu":
            torch.testing.assert_close(got, want, **tol(dtype, "gemm"), msg=lambda s, n=name: f"{n}: {s}")
        else:
            _assert_norm_close(got, want, dtype, f"{name} {(m, n, k)} {dtype}")


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_fwd_bwd_fp32(shape):
    _check(*shape, True, torch.float32)


def test_several_row_blocks_per_program(monkeypatch):
    """With few programs along M, each LayerNorm-backward program loops over several row blocks and sums them
    into the dgamma / dbeta partials."""
    monkeypatch.setattr(partials, "MAX_PARTIAL_ROWS", 1)  # 2 programs; K = 13: 64-row blocks, 4 of them
    _check(200, 9, 13, True, torch.float32)


def test_no_bias_and_no_dx():
    _check(20, 5, 7, False, torch.float32, needs_dx=False, seed=1)


def test_kernels_write_every_element(monkeypatch):
    """Every launcher buffer (y, z, statistics, dx, partials) is poisoned with NaN: the kernels fill it."""

    def nan_empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(launch, "empty", nan_empty)
    _check(37, 19, 11, True, torch.float32, seed=2)


def test_statistics_and_saved_tensors():
    """mean and rstd are LayerNorm's (biased variance, eps inside the root), fp32; a is LayerNorm's output, in
    rows padded to 16 bytes as the op's fake says; z is the pre-GELU."""
    x, gamma, beta, w, b, _ = _inputs(9, 6, 13, torch.float32)
    y, z, a, mean, rstd = ln_linear_gelu_fwd(x, gamma, beta, w, b)
    var, mu = torch.var_mean(x, dim=1, unbiased=False)
    torch.testing.assert_close(mean, mu)
    torch.testing.assert_close(rstd, torch.rsqrt(var + 1e-5))
    want_a = torch.nn.functional.layer_norm(x, (13,), gamma, beta)
    torch.testing.assert_close(a, want_a)
    assert a.stride() == (16, 1) == ln_mod._ln_linear_gelu_fake(x, gamma, beta, w, b, 1e-5)[2].stride()
    torch.testing.assert_close(z, torch.nn.functional.linear(want_a, w, b), **tol(torch.float32, "gemm"))


def test_empty_batch():
    x, gamma, beta, w, b, dy = _inputs(0, 5, 7, torch.float32)
    y, z, a, mean, rstd = ln_linear_gelu_fwd(x, gamma, beta, w, b)
    assert y.shape == (0, 5) and a.shape == (0, 7) and mean.shape == (0,)
    dx, dgamma, dbeta, dw, db = ln_linear_gelu_bwd(dy, x, gamma, w, z, a, mean, rstd, True)
    assert dx.shape == (0, 7) and not dgamma.any() and not dbeta.any() and not dw.any() and not db.any()


@pytest.mark.parametrize(
    ("shapes", "match"),
    [
        (((3, 4), (4,), (4,), (5, 6), (5,)), "K = 4"),
        (((3, 4), (3,), (4,), (5, 4), (5,)), r"ln_weight must be \(\(4,\)"),
        (((3, 4), (4,), (4,), (5, 4), (4,)), r"bias must be \(\(5,\)"),
        (((3,), (4,), (4,), (5, 4), (5,)), r"x must be \[M, K\]"),
    ],
)
def test_invalid_inputs_raise_value_error(shapes, match):
    with pytest.raises(ValueError, match=match):
        ln_linear_gelu(*(torch.randn(*s) for s in shapes))


def test_opcheck():
    """Schema, fake kernels, autograd registration and AOT dispatch of dlrm::ln_linear_gelu."""
    args = [t.requires_grad_(True) for t in _inputs(5, 6, 7, torch.float32, seed=3)[:5]]
    torch.library.opcheck(torch.ops.dlrm.ln_linear_gelu.default, (*args, 1e-5))


def test_cpu_fallback_without_triton(monkeypatch):
    """With Triton unusable the op runs its PyTorch reference, forward and backward."""
    monkeypatch.setattr(ln_mod, "use_triton", lambda x: False)
    _check(33, 9, 20, True, torch.float32, "cpu", seed=4)
    _check(33, 9, 20, False, torch.float32, "cpu", needs_dx=False, seed=4)


def test_torch_compile_fullgraph():
    """torch.compile(fullgraph=True) traces the custom ops and matches eager."""
    torch._dynamo.reset()
    *args, dy = _inputs(21, 6, 9, torch.float32, seed=5)
    leaves = [t.requires_grad_(True) for t in args]
    y = torch.compile(ln_linear_gelu, fullgraph=True)(*leaves)
    grads = torch.autograd.grad(y, leaves, dy)
    y_eager = ln_linear_gelu(*leaves)
    for got, want in zip((y, *grads), (y_eager, *torch.autograd.grad(y_eager, leaves, dy)), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fwd_bwd_half(dtype):
    """bf16/fp16 through the kernels (values cast to fp32 right after load, in the interpreter too)."""
    _check(67, 33, 13, True, dtype, seed=6)


# ----------------------------------------------------------------------------------------------- GPU

DLRM_LAYERS = [(13, 512), (512, 256), (256, 64), (64, 16), (367, 512), (479, 1024), (1024, 512)]


# (300, 129, 257) takes minutes in the interpreter: on the GPU only.
@pytest.mark.parametrize(
    "shape", [(1, 1, 1), (127, 65, 13), pytest.param((300, 129, 257), marks=pytest.mark.gpu)], ids=_ids
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half(dtype, shape):
    _check(*shape, True, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layer", DLRM_LAYERS, ids=_ids)
def test_dlrm_shapes_gpu(layer, dtype):
    k, n = layer
    _check(16384, n, k, True, dtype, needs_dx=k != 13)
