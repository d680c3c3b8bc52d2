"""Tests for kernels/lora_linear.py: y = act(x W^T + s (x A^T) B^T + b), W and b frozen, forward and backward.

On CPU the Triton kernel runs in the interpreter (conftest), with fp32 GEMMs: compared elementwise with the
fp32 reference's autograd gradients. On a GPU (and for bf16/fp16) as a relative norm ("gemm_norm").
"""

from __future__ import annotations

import math

import pytest
import torch

import kernels.launch as launch
import kernels.lora_linear as lora_mod
from kernels.activations import ACTIVATIONS
from kernels.linear_act import linear_act
from kernels.lora_linear import lora_linear, lora_linear_fwd, lora_linear_ref, lora_merge
from tests.test_linear_act import _assert_norm_close
from tests.tolerances import tol

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (M, N, K, r): ones, primes, non-multiples of the 32-wide interpreter tiles (K = 70: whole chunks and a
# tail), K = 64 (EVEN_K: no tail), a rank past 16 (BLOCK_R 32).
SHAPES = [(1, 1, 1, 1), (3, 7, 5, 2), (67, 33, 13, 4), (40, 5, 70, 17), (37, 9, 64, 3)]
SCALE = 0.5


def _ids(s):
    return "x".join(map(str, s))


def _inputs(m, n, k, r, dtype, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / math.sqrt(k)
    b = torch.randn(n, generator=g)
    a = torch.randn(r, k, generator=g) / math.sqrt(k)
    b_lora = torch.randn(n, r, generator=g)  # not zeros (LoRA's init), so every gradient path is exercised
    dy = torch.randn(m, n, generator=g)
    return tuple(t.to(device=device, dtype=dtype) for t in (x, w, b, a, b_lora, dy))


def _check(m, n, k, r, activation, dtype, device=DEVICE, needs_dx=True, has_bias=True, seed=0):
    x, w, b, a, b_lora, dy = _inputs(m, n, k, r, dtype, device, seed)
    b = b if has_bias else None
    leaves = [x.requires_grad_(True)] if needs_dx else []
    leaves += [a.requires_grad_(True), b_lora.requires_grad_(True)]
    y = lora_linear(x, w, b, a, b_lora, SCALE, activation)
    grads = torch.autograd.grad(y, leaves, dy)
    assert y.dtype == dtype and y.shape == (m, n)
    leaves32 = [t.detach().float().requires_grad_(True) for t in leaves]
    x32 = leaves32[0] if needs_dx else x.float()
    b32 = None if b is None else b.float()
    y32 = lora_linear_ref(x32, w.float(), b32, *leaves32[-2:], SCALE, activation, u_dtype=dtype)
    grads32 = torch.autograd.grad(y32, leaves32, dy.float())
    names = (["y", "dx"] if needs_dx else ["y"]) + ["dA", "dB"]
    for got, want, name in zip((y, *grads), (y32, *grads32), names, strict=True):
        if dtype == torch.float32 and device == "cpu":
            torch.testing.assert_close(got, want, **tol(dtype, "gemm"), msg=lambda s, n=name: f"{n}: {s}")
        else:
            _assert_norm_close(got, want, dtype, f"{name} {activation} {(m, n, k, r)} {dtype}")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_fwd_bwd_fp32(shape, activation):
    _check(*shape, activation, torch.float32)


def test_no_bias_and_no_dx():
    _check(20, 6, 9, 3, "gelu_tanh", torch.float32, needs_dx=False, has_bias=False, seed=1)


def test_frozen_weight_and_bias_get_no_gradient():
    x, w, b, a, b_lora, _ = _inputs(5, 4, 3, 2, torch.float32)
    for t in (w, b, a, b_lora):
        t.requires_grad_(True)
    lora_linear(x, w, b, a, b_lora, SCALE, "relu").sum().backward()
    assert w.grad is None and b.grad is None and a.grad is not None and b_lora.grad is not None


@pytest.mark.parametrize("activation", ["relu", "silu"])
def test_merged_weight_gives_the_same_output(activation):
    """lora_merge folds the adapters into W: a plain linear_act with it gives the adapted layer's output."""
    x, w, b, a, b_lora, _ = _inputs(37, 19, 23, 5, torch.float32, seed=2)
    merged = linear_act(x, lora_merge(w, a, b_lora, SCALE), b, activation)
    torch.testing.assert_close(
        merged, lora_linear(x, w, b, a, b_lora, SCALE, activation), **tol(torch.float32, "gemm")
    )


def test_kernels_write_every_element(monkeypatch):
    def nan_empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(launch, "empty", nan_empty)
    _check(37, 19, 11, 3, "gelu_tanh", torch.float32, seed=3)
    x, w, b, a, b_lora, _ = _inputs(37, 40, 11, 3, torch.float32, seed=3)
    _, _, u = lora_linear_fwd(x, w, b, a, b_lora, SCALE, "relu")  # two column tiles; u from the first
    torch.testing.assert_close(u, x @ a.t(), **tol(torch.float32, "gemm"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fwd_bwd_half(dtype):
    _check(67, 33, 13, 4, "gelu_tanh", dtype, seed=4)


@pytest.mark.parametrize(
    ("shapes", "match"),
    [
        (((3, 4), (5, 4), (5,), (2, 4), (5, 3)), r"lora_b \[N, r\]"),
        (((3, 4), (5, 4), (5,), (200, 4), (5, 200)), "rank r must be in 1..128"),
        (((3, 4), (5, 4), (4,), (2, 4), (5, 2)), r"bias must be \[N\] = \[5\]"),
    ],
)
def test_invalid_inputs_raise_value_error(shapes, match):
    x, w, b, a, b_lora = (torch.randn(*s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        lora_linear(x, w, b, a, b_lora)


@pytest.mark.parametrize("k", [13, 16])
def test_dx_comes_in_rows_of_16_bytes(k):
    """dx lies in rows padded to 16 bytes (the layout cuBLAS writes fast), as the op's fake says."""
    x, w, b, a, b_lora, dy = _inputs(9, 5, k, 2, torch.float32, seed=4)
    x.requires_grad_()
    (dx,) = torch.autograd.grad(lora_linear(x, w, b, a, b_lora, SCALE, "relu"), [x], dy)
    assert dx.stride() == (16, 1)
    fake = lora_mod._lora_linear_backward_fake(dy, x, w, a, b_lora, None, x[:, :2], SCALE, "relu", True)[0]
    assert fake.stride() == dx.stride()


def test_opcheck():
    x, w, b, a, b_lora, _ = _inputs(5, 6, 7, 2, torch.float32, seed=5)
    args = (x.requires_grad_(), w, b, a.requires_grad_(), b_lora.requires_grad_(), SCALE, "silu")
    torch.library.opcheck(torch.ops.dlrm.lora_linear.default, args)


def test_cpu_fallback_without_triton(monkeypatch):
    monkeypatch.setattr(lora_mod, "use_triton", lambda x: False)
    for activation in ("identity", "sigmoid", "gelu_tanh"):
        _check(33, 9, 20, 3, activation, torch.float32, "cpu", seed=6)


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    x, w, b, a, b_lora, dy = _inputs(21, 6, 9, 2, torch.float32, seed=7)
    leaves = [x.requires_grad_(), a.requires_grad_(), b_lora.requires_grad_()]
    fn = torch.compile(lambda x, a, bl: lora_linear(x, w, b, a, bl, SCALE, "relu"), fullgraph=True)
    y = fn(*leaves)
    y_eager = lora_linear(x, w, b, a, b_lora, SCALE, "relu")
    torch.testing.assert_close(y, y_eager, rtol=1e-5, atol=1e-5)
    for got, want in zip(
        torch.autograd.grad(y, leaves, dy), torch.autograd.grad(y_eager, leaves, dy), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layer", [(13, 512), (512, 256), (367, 512), (1024, 1024)], ids=_ids)
@pytest.mark.parametrize("rank", [4, 16, 64])
def test_dlrm_shapes_gpu(layer, rank, dtype):
    k, n = layer
    _check(16384, n, k, rank, "relu", dtype, needs_dx=k != 13)
