"""Tests for kernels/linear_act.py (and the GEMM pieces it uses in kernels/gemm/): fused y = act(x @ W^T + b),
forward and backward.

On CPU (no CUDA) conftest sets TRITON_INTERPRET=1, so the tests run the Triton kernels in the interpreter,
where the GEMMs are plain fp32 and compare elementwise with the fp32 reference's autograd gradients. On a
GPU machine the same tests run on DEVICE = "cuda", where fp32 GEMMs run on TF32 tensor cores (one product, or
three: 3xTF32): there (and for bf16/fp16 anywhere) values are checked as a relative norm, and the backward
against PyTorch's own activation backward applied to the tensor the forward saved (so relu's kink, where
TF32 rounding can flip the sign of z, does not count as an error of the backward kernels). bf16/fp16 run
in the interpreter too; DLRM-shape tests are GPU-only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

import kernels.gemm.dw as dw_mod
import kernels.gemm.grads as grads_mod
import kernels.gemm.layout as layout
import kernels.gemm.partials as partials
import kernels.gemm.tuning as gemm_tuning
import kernels.launch as launch
import kernels.linear_act as linear_act_mod
from kernels.linear_act import (
    ACTIVATIONS,
    launch_bwd,
    linear_act,
    linear_act_bwd,
    linear_act_fwd,
    linear_act_ref,
    linear_act_stack,
)
from tests.tolerances import tol

# Where the Triton kernels run: the GPU when there is one, else the CPU interpreter (see conftest).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (M, N, K): ones, primes, and non-multiples of every block size (32 in the interpreter, 64..256 on the GPU).
SHAPES = [(1, 1, 1), (3, 7, 5), (127, 65, 13), (130, 33, 257)]


def _ids(s):
    return "x".join(map(str, s))


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    """Fresh random x [M, K], W [N, K], b [N], dy [M, N] (never zeros), from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / math.sqrt(k)  # nn.Linear-like scale: |z| ~ 1
    b = torch.randn(n, generator=g)
    dy = torch.randn(m, n, generator=g)
    return tuple(t.to(device=device, dtype=dtype) for t in (x, w, b, dy))


def _grads_from_saved(dy, x, w, saved, activation: str, has_bias: bool):
    """fp32 (dx, dW, db) from PyTorch's own activation backward at the forward's saved y or z."""
    dy = dy.float()
    s = None if saved is None else saved.float()
    dz = {
        "identity": lambda: dy,
        "relu": lambda: torch.ops.aten.threshold_backward(dy, s, 0.0),
        "sigmoid": lambda: torch.ops.aten.sigmoid_backward(dy, s),
        "gelu_tanh": lambda: torch.ops.aten.gelu_backward(dy, s, approximate="tanh"),
        "silu": lambda: torch.ops.aten.silu_backward(dy, s),
    }[activation]()
    return dz @ w.float(), dz.t() @ x.float(), dz.sum(0) if has_bias else None


def _assert_norm_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str, rtol: float | None = None
):
    """||actual - expected|| <= rtol ||expected|| + atol sqrt(numel), with tol(dtype, "gemm_norm") unless
    `rtol` is given."""
    t = tol(dtype, "gemm_norm") | ({} if rtol is None else {"rtol": rtol})
    err = (actual.float() - expected.float()).norm().item()
    ref = expected.float().norm().item()
    bound = t["rtol"] * ref + t["atol"] * math.sqrt(max(expected.numel(), 1))
    assert err <= bound, f"{what}: ||out - ref|| = {err:.3e} > {bound:.3e} (||ref|| = {ref:.3e})"


@contextmanager
def allow_tf32(value: bool) -> Iterator[None]:
    """torch.backends.cuda.matmul.allow_tf32 set to `value` for the block, the previous value restored after
    (monkeypatch cannot undo it: the flag is no attribute of the object, which forwards it to torch._C)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = value
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def _check_fwd_bwd(m, n, k, activation, has_bias, dtype, device, seed=0):
    """linear_act forward and autograd backward against the fp32 reference (see the module docstring)."""
    x, w, b, dy = _inputs(m, n, k, dtype, device, seed)
    b = b if has_bias else None
    leaves = [t.requires_grad_(True) for t in (x, w, b) if t is not None]
    y = linear_act(x, w, b, activation)
    grads = torch.autograd.grad(y, leaves, dy)

    assert y.dtype == dtype and y.shape == (m, n)
    for got, leaf in zip(grads, leaves, strict=True):
        assert got.dtype == dtype and got.shape == leaf.shape

    leaves32 = [t.detach().float().requires_grad_(True) for t in leaves]
    x32, w32 = leaves32[:2]
    y32 = linear_act_ref(x32, w32, leaves32[2] if has_bias else None, activation)
    names = ("y", "dx", "dW", "db")
    if dtype == torch.float32 and device == "cpu":  # interpreter: a plain fp32 GEMM, compare elementwise
        grads32 = torch.autograd.grad(y32, leaves32, dy.float())
        for got, want, name in zip((y, *grads), (y32, *grads32), names, strict=False):
            torch.testing.assert_close(got, want, **tol(dtype, "gemm"), msg=lambda s, n=name: f"{n}: {s}")
    else:  # tensor cores: relative norm; backward from the saved tensor (see the module docstring)
        _, saved = linear_act_fwd(x.detach(), w.detach(), None if b is None else b.detach(), activation)
        want = _grads_from_saved(dy, x.detach(), w.detach(), saved, activation, has_bias)
        for got, ref, name in zip((y, *grads), (y32, *want), names, strict=False):
            _assert_norm_close(got, ref, dtype, f"{name} {activation} {(m, n, k)} {dtype}")


# ----------------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_fwd_bwd_fp32(shape, activation, has_bias):
    _check_fwd_bwd(*shape, activation, has_bias, torch.float32, DEVICE)


def _check_backward_method(m, n, k, activation, has_bias, dtype, device, method, needs_dx=True):
    """linear_act_bwd(method=...) against PyTorch's activation backward at the forward's saved tensor."""
    x, w, b, dy = _inputs(m, n, k, dtype, device, seed=m + n)
    _, saved = linear_act_fwd(x, w, b if has_bias else None, activation)
    got = linear_act_bwd(dy, x, w, saved, activation, has_bias, needs_dx, method=method)
    want = list(_grads_from_saved(dy, x, w, saved, activation, has_bias))
    if not needs_dx:
        want[0] = None
    for g, r, name in zip(got, want, ("dx", "dw", "db"), strict=True):
        if r is None:
            assert g is None
        elif device == "cpu":
            torch.testing.assert_close(g.float(), r, **tol(dtype, "gemm"), msg=lambda s, n=name: f"{n}: {s}")
        else:
            _assert_norm_close(g, r, dtype, f"{name} {method} {activation} {(m, n, k)} {dtype}")


# (method, needs_dx): the Triton backward computes dW and db only.
METHODS = [("cublas", True), ("cublas", False), ("triton", False)]


@pytest.mark.parametrize(("method", "needs_dx"), METHODS, ids=["cublas-dx", "cublas", "triton"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(1, 1, 1), (70, 1, 19), (67, 33, 13), (130, 129, 17)], ids=_ids)
def test_backward_methods(shape, activation, method, needs_dx):
    """Both backward implementations (Triton dW GEMM with dz fused; Triton dz + cuBLAS GEMMs) agree with
    PyTorch; "auto" picks one of them per shape where dx is not needed."""
    _check_backward_method(*shape, activation, True, torch.float32, DEVICE, method, needs_dx)


@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("activation", linear_act_mod.CUBLAS_ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_cublas_forward_trains_like_the_reference(monkeypatch, shape, activation, has_bias):
    """The cuBLAS forward (what a small batch may take on the GPU, ``fastest_fwd``), run here on the CPU
    through the autograd op: the same outputs and gradients as the reference, from the y it saves."""
    monkeypatch.setattr(linear_act_mod, "fastest_fwd", lambda *args: "cublas")
    _check_fwd_bwd(*shape, activation, has_bias, torch.float32, DEVICE)


def test_cublas_forward_reads_a_row_padded_input_in_place():
    """x as a view of a row-padded buffer (the interaction's output, NaN in the padding): the cuBLAS
    forward gives the contiguous x's results."""
    x, w, b, _ = _inputs(67, 33, 13, torch.float32, DEVICE, seed=9)
    padded = torch.full((67, 16), float("nan"), device=DEVICE)
    padded[:, :13] = x
    y, saved = linear_act_mod.cublas_fwd(padded[:, :13], w, b, "relu")
    assert saved is y and not y.isnan().any()
    torch.testing.assert_close(y, linear_act_mod.cublas_fwd(x, w, b, "relu")[0], rtol=0, atol=0)


def test_forward_choice_outside_the_gpu_and_cublas_epilogues():
    """Our kernel wherever nothing is timed: the interpreter (the CPU tests run it), and activations with
    no cuBLAS epilogue, which never reach the timing."""
    x, w, b, _ = _inputs(8, 4, 4, torch.float32, DEVICE)
    for activation in ACTIVATIONS:
        choice = linear_act_mod.fastest_fwd(x, w, b, activation)
        if DEVICE == "cpu" or activation not in linear_act_mod.CUBLAS_ACTIVATIONS:
            assert choice == "triton", activation
        else:
            assert choice in ("triton", "cublas")


def test_triton_backward_has_no_dx():
    x, w, b, dy = _inputs(3, 4, 5, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="'triton' computes dW and db only: it needs needs_dx=False"):
        linear_act_bwd(dy, x, w, dy, "relu", True, needs_dx=True, method="triton")


def test_auto_backward_with_dx_is_cublas(monkeypatch):
    """With dx needed, "auto" runs the cuBLAS backward without timing or trying the Triton one."""
    x, w, b, dy = _inputs(67, 33, 13, torch.float32, DEVICE, seed=6)
    _, saved = linear_act_fwd(x, w, b, "silu")
    want = linear_act_bwd(dy, x, w, saved, "silu", True, method="cublas")

    def fail(*args, **kwargs):
        raise AssertionError("not the cuBLAS backward")

    monkeypatch.setattr(linear_act_mod, "fastest_dw", fail)
    monkeypatch.setattr(linear_act_mod, "act_dw", fail)
    got = linear_act_bwd(dy, x, w, saved, "silu", True)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


def test_cublas_backward_with_several_row_blocks_per_program(monkeypatch):
    """With few programs along M, each dz program loops over several row blocks and sums them into db."""
    monkeypatch.setattr(partials, "MAX_PARTIAL_ROWS", 1)  # 4 programs along M (N = 33: one column tile)
    _check_backward_method(400, 33, 13, "relu", True, torch.float32, DEVICE, "cublas")


@pytest.mark.parametrize(("method", "needs_dx"), [("triton", False), ("cublas", True)])
def test_row_padded_input_and_dx(monkeypatch, method, needs_dx):
    """x as a view of a row-padded buffer (the interaction's output) is read in place, not copied, and
    gives the results of a contiguous x (the NaN padding reaches no result); dx comes back with rows
    padded to 16 bytes."""
    x, w, b, dy = _inputs(67, 33, 13, torch.float32, DEVICE, seed=9)
    padded = torch.full((67, 16), float("nan"), device=DEVICE)
    padded[:, :13] = x
    x_view = padded[:, :13]
    contiguous = torch.Tensor.contiguous

    def no_copy_of_x(t, *args, **kwargs):
        if t.untyped_storage().data_ptr() == padded.untyped_storage().data_ptr() and not t.is_contiguous():
            raise AssertionError("the row-padded input was copied")
        return contiguous(t, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "contiguous", no_copy_of_x)
    y, saved = linear_act_fwd(x_view, w, b, "relu")
    got = linear_act_bwd(dy, x_view, w, saved, "relu", True, needs_dx, method=method)
    monkeypatch.undo()
    y_ref, saved_ref = linear_act_fwd(x, w, b, "relu")
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    want = linear_act_bwd(dy, x, w, saved_ref, "relu", True, needs_dx, method=method)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=0)
    if needs_dx:
        assert got[0].stride() == (16, 1)
    else:
        assert got[0] is None


def _saved_inputs(x, w, b):
    """The tensors autograd saves for linear_act(x, w, b), and the gradients of a sum of its output."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = linear_act(x, w, b, "relu")
    return saved, torch.autograd.grad(y.sum(), (x, w, b))


def test_unaligned_input_is_padded_once():
    """An x whose rows are not 16 bytes apart (K=13 fp32) is copied once into rows of 16, which autograd
    saves (the backward's dW reads it); an x already in padded rows is saved itself; both give the same
    gradients."""
    x, w, b, _ = _inputs(67, 33, 13, torch.float32, DEVICE, seed=4)
    x.requires_grad_()
    w.requires_grad_()
    b.requires_grad_()
    saved, grads = _saved_inputs(x, w, b)
    copies = [t for t in saved if t.shape == x.shape]
    assert len(copies) == 1 and copies[0].stride() == (16, 1)
    torch.testing.assert_close(copies[0], x, rtol=0, atol=0)

    padded = torch.full((67, 16), float("nan"), device=DEVICE)
    padded[:, :13] = x.detach()
    x_view = padded[:, :13].requires_grad_()
    saved_view, grads_view = _saved_inputs(x_view, w, b)
    assert any(t.data_ptr() == x_view.data_ptr() and t.stride() == (16, 1) for t in saved_view)
    for g, r in zip(grads_view, grads, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


def test_aligned_weight():
    """A weight whose K is not a multiple of 16 bytes comes back as its values in rows of 16 bytes (zeros past
    K in the storage); an aligned contiguous one as itself."""
    w = torch.randn(5, 13)
    aligned = layout.aligned_weight(w)
    assert aligned.shape == (5, 13) and aligned.stride() == (16, 1)
    torch.testing.assert_close(aligned, w, rtol=0, atol=0)
    assert not aligned.as_strided((5, 16), (16, 1))[:, 13:].any()
    w16 = torch.randn(4, 16, dtype=torch.bfloat16)
    assert layout.aligned_weight(w16) is w16
    assert layout.aligned_weight(torch.randn(13, 5, dtype=torch.bfloat16).t()).stride() == (16, 1)


def test_tma_descriptor():
    """A tensor whose rows and base lie 16 bytes apart is described in place (a row-padded view too); one
    whose rows do not (K = 13 fp32) or whose base does not (a view one element in) through a copy of its
    values in rows of 16 bytes; the shape is the tensor's, whatever its row stride."""
    x = torch.randn(7, 16)
    d = layout.tma_descriptor(x)
    assert d.base is x and d.shape == [7, 16] and d.strides == [16, 1]
    padded = layout.aligned_copy(torch.randn(7, 13))
    d = layout.tma_descriptor(padded)
    assert d.base is padded and d.shape == [7, 13] and d.strides == [16, 1]
    for t in (torch.randn(7, 13), torch.randn(7, 16)[:, 1:], torch.randn(13, 7).t()):
        d = layout.tma_descriptor(t)
        assert d.base is not t and d.base.data_ptr() % 16 == 0 and d.shape == list(t.shape)
        assert d.strides == [layout.aligned_width(t.shape[1], t.dtype), 1]
        torch.testing.assert_close(d.base, t, rtol=0, atol=0)


@pytest.mark.parametrize("layout_name", ["transposed", "direct"])
def test_fp32_dx_layouts_agree(monkeypatch, layout_name):
    """fp32 dx over a copy of W^T or over W as it is (whichever a shape times faster on the GPU): dz @ W
    either way, through the cuBLAS backward of the autograd op."""
    monkeypatch.setattr(grads_mod, "_fp32_dx_layout", lambda dz, w: layout_name)
    _check_backward_method(67, 33, 16, "relu", True, torch.float32, DEVICE, "cublas")
    x, w, b, dy = _inputs(67, 33, 16, torch.float32, DEVICE, seed=12)
    torch.testing.assert_close(
        grads_mod._aligned_fp32_dx(dy, w, layout_name), dy @ w, **tol(torch.float32, "gemm")
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("k", [13, 16])
def test_gemm_grads(k, dtype):
    """dx = dz @ W and dW = dz^T @ x, from x in place or in rows padded to 16 bytes (NaN padding, never
    read into the results); dx in rows of 16 bytes, dW contiguous."""
    g = torch.Generator().manual_seed(k)
    dz, x, w = (torch.randn(*shape, generator=g).to(dtype) for shape in ((37, 9), (37, k), (9, k)))
    kp = layout.aligned_width(k, dtype)
    padded = torch.full((37, kp), float("nan"), dtype=dtype)
    padded[:, :k] = x
    # fp32: a reduction in another order; bf16: the fp32 value rounded once (tests/tolerances.py)
    tolerance = tol(dtype, "gemm" if dtype == torch.float32 else "fwd")
    for x_in in (x, padded[:, :k]):
        dx, dw = grads_mod.gemm_grads(dz, x_in, w, needs_dx=True)
        assert dx.stride() == (kp, 1) and dw.is_contiguous()
        torch.testing.assert_close(dx, (dz.float() @ w.float()).to(dtype), **tolerance)
        torch.testing.assert_close(dw, (dz.float().t() @ x.float()).to(dtype), **tolerance)
    assert grads_mod.gemm_grads(dz, x, w, needs_dx=False)[0] is None


def test_unknown_backward_method():
    x, w, b, dy = _inputs(3, 4, 5, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="unknown backward method 'x'"):
        linear_act_bwd(dy, x, w, dy, "relu", True, method="x")


@pytest.mark.parametrize("activation", ["relu", "silu"])
def test_input_without_grad_skips_dx(monkeypatch, activation):
    """A first layer's input needs no gradient: dx is not computed, dW and db still match the reference."""
    calls = []

    def recording_bwd(*args):
        grads = launch_bwd(*args)
        calls.append((args[6], grads[0]))  # (needs_dx, dx)
        return grads

    monkeypatch.setattr(linear_act_mod, "launch_bwd", recording_bwd)
    x, w, b, dy = _inputs(67, 33, 13, torch.float32, DEVICE, seed=5)
    w.requires_grad_(True)
    b.requires_grad_(True)
    dw, db = torch.autograd.grad(linear_act(x, w, b, activation), (w, b), dy)
    w32, b32 = w.detach().requires_grad_(True), b.detach().requires_grad_(True)
    dw32, db32 = torch.autograd.grad(linear_act_ref(x, w32, b32, activation), (w32, b32), dy)
    kind = "gemm" if DEVICE == "cpu" else "gemm_norm"
    torch.testing.assert_close(dw, dw32, **tol(torch.float32, kind))
    torch.testing.assert_close(db, db32, **tol(torch.float32, kind))
    assert calls == [(False, None)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("activation", ["relu", "gelu_tanh"])
def test_fwd_bwd_half(activation, dtype):
    """bf16/fp16 through the kernels (in the interpreter the dot operands are cast to fp32 first)."""
    _check_fwd_bwd(127, 65, 13, activation, True, dtype, DEVICE, seed=1)


@pytest.mark.parametrize("activation", ["identity", "silu"])
def test_dw_split_m(monkeypatch, activation):
    """The Triton dW/db reduced over several M splits (the last one ragged), summed by the launcher."""
    monkeypatch.setattr(dw_mod, "_dw_rows_per_split", lambda m, n, k: 40)  # 130 = 40+40+40+10 rows
    _check_backward_method(130, 33, 70, activation, True, torch.float32, DEVICE, "triton", needs_dx=False)


@pytest.mark.parametrize("activation", ["relu", "gelu_tanh"])
def test_kernels_write_every_element(monkeypatch, activation):
    """Every launcher buffer (y, z, dz, dW/db partials) is poisoned with NaN: the kernels must fill it."""

    def nan_empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(launch, "empty", nan_empty)
    monkeypatch.setattr(dw_mod, "_dw_rows_per_split", lambda m, n, k: 64)  # 3 splits of 130 rows
    _check_fwd_bwd(130, 33, 70, activation, True, torch.float32, DEVICE, seed=3)
    _check_backward_method(130, 33, 70, activation, True, torch.float32, DEVICE, "triton", needs_dx=False)


def test_saved_tensors():
    """Forward saves nothing for identity, y itself for relu/sigmoid, z = x @ W^T + b for gelu_tanh/silu."""
    x, w, b, _ = _inputs(37, 19, 24, torch.float32, DEVICE, seed=4)
    z_ref = F.linear(x, w, b)
    for activation in ACTIVATIONS:
        y, saved = linear_act_fwd(x, w, b, activation)
        if activation == "identity":
            assert saved is None
        elif activation in ("relu", "sigmoid"):
            assert saved is y
        else:
            assert saved.shape == y.shape and saved.data_ptr() != y.data_ptr()
            _assert_norm_close(saved, z_ref, torch.float32, f"z {activation}")


def test_noncontiguous_inputs():
    """Transposed x and W and an expanded (stride-0) upstream gradient, as from y.sum().backward()."""
    g = torch.Generator().manual_seed(5)
    xt = torch.randn(24, 37, generator=g).to(DEVICE).t().requires_grad_(True)  # [37, 24], column-major
    wt = (torch.randn(24, 19, generator=g) / 5).to(DEVICE).t().requires_grad_(True)  # [19, 24]
    b = torch.randn(19, generator=g).to(DEVICE).requires_grad_(True)
    linear_act(xt, wt, b, "silu").sum().backward()
    x32, w32, b32 = (t.detach().clone().requires_grad_(True) for t in (xt, wt, b))
    linear_act_ref(x32, w32, b32, "silu").sum().backward()
    kind = "gemm" if DEVICE == "cpu" else "gemm_norm"
    for got, want in ((xt.grad, x32.grad), (wt.grad, w32.grad), (b.grad, b32.grad)):
        if kind == "gemm":
            torch.testing.assert_close(got, want, **tol(torch.float32, kind))
        else:
            _assert_norm_close(got, want, torch.float32, "grad")


def test_empty_batch():
    """M == 0: empty y and dx; dW and db are zeros."""
    x = torch.randn(0, 9, device=DEVICE, requires_grad=True)
    g = torch.Generator().manual_seed(6)
    w = torch.randn(5, 9, generator=g).to(DEVICE).requires_grad_(True)
    b = torch.randn(5, generator=g).to(DEVICE).requires_grad_(True)
    y = linear_act(x, w, b, "gelu_tanh")
    assert y.shape == (0, 5) and y.dtype == torch.float32
    y.sum().backward()
    assert x.grad.shape == (0, 9)
    torch.testing.assert_close(w.grad, torch.zeros(5, 9, device=DEVICE))
    torch.testing.assert_close(b.grad, torch.zeros(5, device=DEVICE))

    y, saved = linear_act_fwd(x.detach(), w.detach(), None, "relu")
    dx, dw, db = linear_act_bwd(
        torch.empty(0, 5, device=DEVICE), x.detach(), w.detach(), saved, "relu", False
    )
    assert dx.shape == (0, 9) and db is None
    torch.testing.assert_close(dw, torch.zeros(5, 9, device=DEVICE))


_X = torch.ones(4, 6)
_W = torch.ones(3, 6)
_B = torch.ones(3)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((torch.ones(6), _W, _B, "relu"), r"x must be 2-D.*\(6,\)"),
        ((torch.ones(2, 4, 6), _W, _B, "relu"), r"x must be 2-D.*\(2, 4, 6\)"),
        ((_X, torch.ones(6), _B, "relu"), r"weight must be 2-D.*\(6,\)"),
        ((_X, torch.ones(3, 5), _B, "relu"), r"K = 6.*\(4, 6\).*\(3, 5\)"),
        ((torch.ones(4, 0), torch.ones(3, 0), _B, "relu"), r"K >= 1 and N >= 1.*\(4, 0\).*\(3, 0\)"),
        ((_X, torch.ones(0, 6), torch.ones(0), "relu"), r"K >= 1 and N >= 1.*\(0, 6\)"),
        ((_X, _W, torch.ones(4), "relu"), r"\[3\].*\(4,\)"),
        ((_X, _W, torch.ones(1, 3), "relu"), r"\[3\].*\(1, 3\)"),
        ((_X, _W, _B, "swish"), r"'swish'.*identity.*relu.*sigmoid.*gelu_tanh.*silu"),
        ((_X, _W.double(), _B, "relu"), r"weight dtype torch.float64.*torch.float32"),
        ((_X, _W, _B.half(), "relu"), r"bias dtype torch.float16.*torch.float32"),
        ((_X.long(), _W.long(), _B.long(), "relu"), r"torch.int64"),
        ((_X, torch.ones(3, 6, device="meta"), _B, "relu"), r"weight is on meta.*cpu"),
        ((_X, _W, torch.ones(3, device="meta"), "relu"), r"bias is on meta.*cpu"),
    ],
    ids=[
        "x-1d", "x-3d", "w-1d", "k-mismatch", "k-zero", "n-zero", "b-short", "b-2d", "activation",
        "w-dtype", "b-dtype", "int-dtype", "w-device", "b-device",
    ],
)  # fmt: skip
def test_invalid_inputs_raise_value_error(args, match):
    x, w, b, activation = args
    with pytest.raises(ValueError, match=match):
        linear_act_fwd(*args)
    if b is _B:  # the backward takes no bias
        dy = torch.ones(x.shape[0] if x.dim() else 1, w.shape[0] if w.dim() else 1)
        with pytest.raises(ValueError, match=match):
            linear_act_bwd(dy, x, w, dy, activation, True)
    if all(t.device.type == "cpu" for t in args[:3]):  # the custom op itself dispatches on mixed devices
        with pytest.raises(ValueError, match=match):
            linear_act(*args)


def test_invalid_backward_inputs_raise_value_error():
    dy = torch.ones(4, 3)
    with pytest.raises(ValueError, match=r"dy must be \(\(4, 3\).*got \(\(4, 5\)"):
        linear_act_bwd(torch.ones(4, 5), _X, _W, dy, "relu", True)
    with pytest.raises(ValueError, match=r"dy must be .*torch.float16"):
        linear_act_bwd(dy.half(), _X, _W, dy, "relu", True)
    with pytest.raises(ValueError, match=r"saved \(the forward's y for 'sigmoid'\).*got None"):
        linear_act_bwd(dy, _X, _W, None, "sigmoid", True)
    with pytest.raises(ValueError, match=r"saved \(the forward's z for 'silu'\).*got \(\(4, 6\)"):
        linear_act_bwd(dy, _X, _W, _X, "silu", True)
    with pytest.raises(ValueError, match=r"has_bias must be a bool, got 1"):
        linear_act_bwd(dy, _X, _W, dy, "relu", 1)


@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "nobias"])
def test_opcheck(has_bias):
    """Schema, fake (meta) kernels, autograd registration and AOT dispatch of dlrm::linear_act."""
    x, w, b, _ = _inputs(5, 11, 7, torch.float32, DEVICE, seed=7)
    args = (x.requires_grad_(True), w.requires_grad_(True), b.requires_grad_(True) if has_bias else None)
    torch.library.opcheck(torch.ops.dlrm.linear_act.default, (*args, "gelu_tanh"))


def test_cpu_fallback_without_triton(monkeypatch):
    """With Triton unusable (CPU tensors, no interpreter) the ops fall back to plain PyTorch."""
    monkeypatch.setattr(linear_act_mod, "use_triton", lambda x: False)
    for activation in ACTIVATIONS:
        for has_bias in (True, False):
            _check_fwd_bwd(67, 33, 20, activation, has_bias, torch.float32, "cpu", seed=8)


@pytest.mark.gpu
def test_timing_a_choice_leaves_a_live_step_graph_replaying_right():
    """A step graph with cuBLAS GEMMs captured on ``torch.cuda.graph``'s default stream (a stream of the
    default-priority pool, as dlrm.graphs' are), then a new key timed mid-run (a timing graph captured and
    destroyed), then memory churn: the step graph still replays eager's results, and the timing was
    captured on a stream of its own (a graph destroyed on the step's stream clears the cuBLAS workspace the
    step graph still uses)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    a, b = (torch.randn(4096, 512, device="cuda", generator=g) for _ in range(2))
    step = torch.cuda.CUDAGraph()
    torch.mm(a, b.t())  # cuBLAS initialized outside the capture
    with torch.cuda.graph(step):
        out = torch.mm(a, b.t()) @ b
    captured_on = torch.cuda.graph.default_capture_stream
    timed_on = []
    graph = torch.cuda.graph

    def spy(cuda_graph, **kwargs):
        timed_on.append(kwargs.get("stream"))
        return graph(cuda_graph, **kwargs)

    x, w = torch.randn(300, 96, device="cuda"), torch.randn(200, 96, device="cuda")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "graph", spy)
        gemm_tuning.graph_time(lambda: torch.mm(x, w.t()))
    assert timed_on and all(s is not None and s != captured_on for s in timed_on)
    churn = [torch.full((1 << 20,), 7.0, device="cuda") for _ in range(64)]  # reuses what was freed
    step.replay()
    torch.testing.assert_close(out, torch.mm(a, b.t()) @ b)  # the same GEMMs: fp32's default tolerances
    del churn


def test_m_bucket_and_dw_splits():
    assert [gemm_tuning.m_bucket(m) for m in (1, 64, 65, 2048, 2049, 65536, 10**6)] == [
        64, 64, 128, 2048, 4096, 65536, 65536,
    ]  # fmt: skip
    f = dw_mod._dw_rows_per_split
    assert f(65536, 16, 64) == 1024  # one (N, K) tile: 64 splits
    assert f(65536, 1024, 1024) == 13312  # 64 tiles: 5 splits
    assert f(128, 512, 13) == 256  # small batch: one split
    for m, n, k in ((1, 1, 1), (2049, 256, 512), (16384, 1, 256), (65536, 512, 479)):
        rows = f(m, n, k)
        assert rows % 256 == 0 and (rows >= m or rows >= 1024)  # whole blocks; one split or >= 1024 rows


def test_torch_compile_fullgraph():
    """torch.compile(fullgraph=True) traces the custom ops (no graph break) and matches eager."""
    torch._dynamo.reset()

    def mlp(x, w1, b1, w2):
        return linear_act(linear_act(x, w1, b1, "relu"), w2, None, "sigmoid")

    g = torch.Generator().manual_seed(9)
    x, w1, b1, w2 = (torch.randn(*s, generator=g).to(DEVICE) for s in ((33, 13), (24, 13), (24,), (3, 24)))
    dy = torch.randn(33, 3, generator=g).to(DEVICE)
    leaves = [t.requires_grad_(True) for t in (x, w1, b1, w2)]

    t0 = time.perf_counter()
    y = torch.compile(mlp, fullgraph=True)(*leaves)
    grads = torch.autograd.grad(y, leaves, dy)
    print(f"torch.compile first call (fwd+bwd): {time.perf_counter() - t0:.1f} s")

    y_eager = mlp(*leaves)
    grads_eager = torch.autograd.grad(y_eager, leaves, dy)
    # Same kernels on both sides: only Inductor's own ops around them could differ.
    torch.testing.assert_close(y, y_eager, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, grads_eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activations_half(activation, has_bias, dtype):
    """bf16/fp16 through the kernels (values cast to fp32 right after load, in the interpreter too)."""
    for shape in SHAPES:
        _check_fwd_bwd(*shape, activation, has_bias, dtype, DEVICE)


# ----------------------------------------------------------------------------------------------- GPU

# (K, N) of every layer of the DLRM MLPs (bottom then top), deduplicated across the two configs.
KAGGLE_LAYERS = [(13, 512), (512, 256), (256, 64), (64, 16), (367, 512), (512, 256), (256, 1)]
MLPERF_LAYERS = [(13, 512), (512, 256), (256, 128), (479, 1024), (1024, 1024), (1024, 512), (512, 256)]
MLPERF_LAYERS += [(256, 1)]
DLRM_LAYERS = sorted(set(KAGGLE_LAYERS + MLPERF_LAYERS))


@pytest.mark.gpu
@pytest.mark.parametrize("forward", ["triton", "cublas"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layer", DLRM_LAYERS, ids=lambda kn: f"{kn[0]}to{kn[1]}")
@pytest.mark.parametrize("m", [128, 2048, 16384, 65536])
def test_dlrm_shapes_gpu(monkeypatch, m, layer, dtype, forward):
    """Every MLP layer at DLRM batch sizes, by each forward (whichever ``fastest_fwd`` would time faster):
    relu hidden layers, identity for the logit (N = 1)."""
    monkeypatch.setattr(linear_act_mod, "fastest_fwd", lambda *args: forward)
    k, n = layer
    _check_fwd_bwd(m, n, k, "identity" if n == 1 else "relu", True, dtype, "cuda", seed=m + n + k)


@pytest.mark.gpu
@pytest.mark.parametrize(("method", "needs_dx"), METHODS, ids=["cublas-dx", "cublas", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layer", DLRM_LAYERS, ids=lambda kn: f"{kn[0]}to{kn[1]}")
def test_dlrm_shapes_backward_methods_gpu(layer, dtype, method, needs_dx):
    k, n = layer
    act = "identity" if n == 1 else "relu"
    _check_backward_method(16384, n, k, act, True, dtype, "cuda", method, needs_dx)


@pytest.mark.gpu
@pytest.mark.parametrize("layer", DLRM_LAYERS, ids=lambda kn: f"{kn[0]}to{kn[1]}")
def test_dlrm_shapes_tf32_gpu(layer):
    """fp32 with TF32 matmuls allowed: the kernel's dots switch to TF32, still within the tf32 norm bound."""
    k, n = layer
    with allow_tf32(True):
        _check_fwd_bwd(16384, n, k, "identity" if n == 1 else "relu", True, torch.float32, "cuda", seed=n + k)


@pytest.mark.gpu
def test_forward_choice_is_timed_once_per_shape_gpu(monkeypatch):
    """The first call of a shape times both forwards; later calls in its M bucket reuse the choice."""
    monkeypatch.setattr(gemm_tuning, "_TABLES", {})
    monkeypatch.setattr(linear_act_mod, "_FORWARD_CHOICE", gemm_tuning.ChoiceTable("linear_act forward"))
    x, w, b, _ = _inputs(128, 512, 256, torch.float32, "cuda", seed=11)
    first = linear_act_mod.fastest_fwd(x, w, b, "relu")
    assert first in ("triton", "cublas") and len(linear_act_mod._FORWARD_CHOICE) == 1
    monkeypatch.setattr(gemm_tuning, "graph_time", lambda fn: pytest.fail("timed again"))
    assert linear_act_mod.fastest_fwd(x[:100], w, b, "relu") == first


@pytest.mark.gpu
def test_first_layer_path_is_timed_once_per_shape_gpu(monkeypatch):
    """An MLP's first layer over data: the first backward of its shapes times both paths (layer 1's dx GEMM
    making its dz, or its own backward after cuBLAS's dx of layer 1); later ones in the M bucket reuse it."""
    monkeypatch.setattr(gemm_tuning, "_TABLES", {})
    choices = gemm_tuning.ChoiceTable("first layer from dx with act'")
    monkeypatch.setattr(linear_act_mod, "_FIRST_CHOICE", choices)
    x, w0, b0, _ = _inputs(4096, 512, 13, torch.float32, "cuda", seed=12)
    _, w1, b1, dy = _inputs(4096, 256, 512, torch.float32, "cuda", seed=13)
    params = [p.requires_grad_() for p in (w0, b0, w1, b1)]
    linear_act_stack(x, [w0, w1], [b0, b1], ["relu", "relu"]).backward(dy)
    assert list(choices.values()) in (["fused"], ["two-pass"])
    monkeypatch.setattr(gemm_tuning, "graph_time", lambda fn: pytest.fail("timed again"))
    linear_act_stack(x[:3000], [w0, w1], [b0, b1], ["relu", "relu"]).backward(dy[:3000])
    assert len(choices) == 1 and all(p.grad is not None for p in params)


@pytest.mark.gpu
def test_fp32_dx_layout_is_timed_once_per_shape_gpu(monkeypatch):
    """The first fp32 dx of a shape times both layouts; later ones in its M bucket reuse the choice."""
    monkeypatch.setattr(gemm_tuning, "_TABLES", {})
    monkeypatch.setattr(grads_mod, "_DX_LAYOUT", gemm_tuning.ChoiceTable("fp32 dx layout"))
    _, w, _, dz = _inputs(128, 512, 256, torch.float32, "cuda", seed=13)  # W [N, K], dz [M, N]
    first = grads_mod._fp32_dx_layout(dz, w)
    assert first in ("transposed", "direct") and len(grads_mod._DX_LAYOUT) == 1
    monkeypatch.setattr(gemm_tuning, "graph_time", lambda fn: pytest.fail("timed again"))
    assert grads_mod._fp32_dx_layout(dz[:100], w) == first


def _padded_rows(m: int, k: int, generator: torch.Generator, device) -> torch.Tensor:
    """x [m, k] fp32 in rows padded to 16 bytes (``layout.new_padded``) whose padding holds NaN."""
    x = layout.new_padded(m, k, torch.empty(0, device=device))
    x.as_strided((m, layout.aligned_width(k, x.dtype)), x.stride()).fill_(float("nan"))
    x.copy_(torch.randn(m, k, generator=generator).to(device))
    return x


@pytest.mark.parametrize("k", [13, 367])
def test_unaligned_dw_layouts_give_one_dw(k):
    """dW = dz^T @ x for x of K = 13 and 367 in padded rows (NaN padding): the GEMM over the padded rows with
    dW's extra columns dropped and the GEMM on x as it is give the same dW [N, K], contiguous, also into
    `out`; `_dw_layout` takes "padded" in the interpreter and "direct" where rows are not padded."""
    g = torch.Generator().manual_seed(k)
    x = _padded_rows(96, k, g, DEVICE)
    dz = torch.randn(96, 40, generator=g).to(DEVICE)
    want = dz.double().t() @ x.double()
    for name in ("padded", "direct"):
        dw = grads_mod._weight_grad(dz, x, name)
        assert dw.shape == (40, k) and dw.is_contiguous()
        torch.testing.assert_close(dw.double(), want, rtol=1e-5, atol=1e-5)
        out = torch.empty(40, k, device=DEVICE)
        assert grads_mod._weight_grad(dz, x, name, out=out) is out
        torch.testing.assert_close(out, dw, rtol=0, atol=0)
    if launch.INTERPRETED:
        assert grads_mod._dw_layout(dz, x) == "padded"
    assert grads_mod._dw_layout(dz, x.contiguous()) == "direct"


@pytest.mark.gpu
def test_unaligned_dw_layout_is_timed_once_per_shape_gpu(monkeypatch):
    """The first dW of an unaligned K in padded rows times both layouts; later ones in its M bucket reuse
    the choice."""
    monkeypatch.setattr(gemm_tuning, "_TABLES", {})
    monkeypatch.setattr(grads_mod, "_DW_LAYOUT", gemm_tuning.ChoiceTable("unaligned dw layout"))
    g = torch.Generator().manual_seed(17)
    x = _padded_rows(128, 367, g, "cuda")
    dz = torch.randn(128, 512, generator=g).cuda()
    first = grads_mod._dw_layout(dz, x)
    assert first in ("padded", "direct") and len(grads_mod._DW_LAYOUT) == 1
    monkeypatch.setattr(gemm_tuning, "graph_time", lambda fn: pytest.fail("timed again"))
    assert grads_mod._dw_layout(dz[:100], x[:100]) == first


@pytest.mark.gpu
def test_new_batch_size_does_not_recompile_gpu():
    kernels = [
        linear_act_mod._linear_act_fwd_kernel.fn,
        grads_mod._act_dz_kernel,
        dw_mod._act_dw_kernel.fn,
    ]
    if not all(hasattr(k, "device_caches") for k in kernels):
        pytest.skip("this Triton has no JITFunction.device_caches")

    def n_compiled():
        return sum(len(entry[0]) for k in kernels for entry in k.device_caches.values())

    x, w, b, dy = _inputs(2048, 64, 96, torch.bfloat16, "cuda", seed=10)

    def step(m):
        y, saved = linear_act_fwd(x[:m], w, b, "silu")
        linear_act_bwd(dy[:m], x[:m], w, saved, "silu", True)  # the dz kernel, then cuBLAS
        linear_act_bwd(dy[:m], x[:m], w, saved, "silu", True, needs_dx=False, method="triton")

    for m in (2048, 1100):  # tune both buckets once
        step(m)
    before = n_compiled()
    for m in (1025, 1500, 1999, 2047):  # same bucket (2048), new batch sizes
        step(m)
    assert n_compiled() == before


@pytest.mark.gpu
def test_int64_offsets_gpu():
    """M * K > 2**31 elements: the row offsets must not overflow int32."""
    k, n = 1024, 16
    m = 2**31 // k + 3
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("needs ~30 GiB of GPU memory")
    g = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / 32
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
    y, saved = linear_act_fwd(x, w, b, "gelu_tanh")
    for rows in (slice(0, 64), slice(m - 64, m)):
        _assert_norm_close(y[rows], linear_act_ref(x[rows], w, b, "gelu_tanh").float(), torch.bfloat16, "y")
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g)
    dx, dw, db = linear_act_bwd(dy, x, w, saved, "gelu_tanh", True)
    for rows in (slice(0, 64), slice(m - 64, m)):
        want = _grads_from_saved(dy[rows], x[rows], w, saved[rows], "gelu_tanh", False)[0]
        _assert_norm_close(dx[rows], want, torch.bfloat16, "dx")
    dw_ref = torch.zeros(n, k, device="cuda")
    db_ref = torch.zeros(n, device="cuda")
    for start in range(0, m, 2**20):
        rows = slice(start, start + 2**20)
        _, dw_c, db_c = _grads_from_saved(dy[rows], x[rows], w, saved[rows], "gelu_tanh", True)
        dw_ref += dw_c
        db_ref += db_c
    _assert_norm_close(dw, dw_ref, torch.bfloat16, "dW")
    _assert_norm_close(db, db_ref, torch.bfloat16, "db")
    _, dw, db = linear_act_bwd(dy, x, w, saved, "gelu_tanh", True, needs_dx=False, method="triton")
    _assert_norm_close(dw, dw_ref, torch.bfloat16, "dW (triton)")
    _assert_norm_close(db, db_ref, torch.bfloat16, "db (triton)")


def test_fp32_dots_run_on_tensor_cores_at_torchs_precision(monkeypatch):
    """input_precision, which every fused GEMM block's dots take: for fp32 operands on a GPU one TF32 product
    exactly where PyTorch's matmuls may use TF32, else 3xTF32 (fp32's accuracy on tensor cores), never
    FMA-unit "ieee" dots; 16-bit operands "tf32"; in the interpreter (plain fp32 dots whatever it is given)
    "ieee" for fp32."""
    monkeypatch.setattr(gemm_tuning, "INTERPRETED", False)
    with allow_tf32(False):
        assert gemm_tuning.input_precision(torch.float32) == "tf32x3"
        assert gemm_tuning.input_precision(torch.bfloat16) == "tf32"
        assert gemm_tuning.input_precision(torch.float16) == "tf32"
        monkeypatch.setattr(gemm_tuning, "INTERPRETED", True)
        assert gemm_tuning.input_precision(torch.float32) == "ieee"
        monkeypatch.setattr(gemm_tuning, "INTERPRETED", False)
    with allow_tf32(True):
        assert gemm_tuning.input_precision(torch.float32) == "tf32"
        assert gemm_tuning.input_precision(torch.bfloat16) == "tf32"


def test_tuned_kernel_tunes_each_key_once(monkeypatch):
    """TunedKernel asks the autotuner once per (M bucket, N, K, dtype, dot precision) and launches the tuned
    config directly afterwards, with the same result."""
    kernel = linear_act_mod._linear_act_fwd_kernel
    monkeypatch.setattr(gemm_tuning, "_TABLES", {})
    monkeypatch.setattr(kernel, "_options", gemm_tuning.ChoiceTable("_linear_act_fwd_kernel"))
    tuned = []
    run = kernel.autotuner.run

    def counting_run(*args, **kwargs):
        named = dict(zip(kernel.autotuner.arg_names, args, strict=False))
        tuned.append((named["M_BUCKET"], named["N"], named["K"], named["y_ptr"].dtype))  # y's dtype: x's
        return run(*args, **kwargs)

    monkeypatch.setattr(kernel.autotuner, "run", counting_run)
    x, w, b, _ = _inputs(40, 24, 16, torch.float32, DEVICE, seed=11)
    first, _ = linear_act_fwd(x, w, b, "relu")  # tuned (key: bucket 64, N 24, K 16, fp32)
    again, _ = linear_act_fwd(x, w, b, "relu")  # launched directly
    linear_act_fwd(x[:33], w, b, "relu")  # the same bucket: launched directly
    linear_act_fwd(x.bfloat16(), w.bfloat16(), b.bfloat16(), "relu")  # new dtype: tuned
    linear_act_fwd(x, w[:8], b[:8], "relu")  # new N: tuned
    with allow_tf32(not torch.backends.cuda.matmul.allow_tf32):
        linear_act_fwd(x, w, b, "relu")  # fp32 dots in another precision: tuned
    expected = [(64, 24, 16, torch.float32), (64, 24, 16, torch.bfloat16), (64, 8, 16, torch.float32)]
    assert tuned == [*expected, (64, 24, 16, torch.float32)]
    assert torch.equal(first, again)
    kind = "gemm" if DEVICE == "cpu" else "gemm_norm"  # a GPU may run fp32 dots in TF32
    torch.testing.assert_close(first, linear_act_ref(x, w, b, "relu"), **tol(torch.float32, kind))


@pytest.mark.parametrize("m", [1, 100, 128])
def test_act_dz_at_small_batches_writes_db_without_partials(monkeypatch, m):
    """Up to SMALL_M rows one program along M stores db itself (no partials' sum): the same dz, and db as
    the partials' path gives it within fp32 summation order (rows summed in another grouping)."""
    from kernels.gemm import grads

    g = torch.Generator().manual_seed(m)
    dy, y = (torch.randn(m, 300, generator=g).to(DEVICE) for _ in range(2))
    y = y.relu()
    monkeypatch.setattr(grads, "sum_partials", lambda *args: pytest.fail("partials summed at a small batch"))
    dz, db = grads.act_dz(dy, y, "relu", True, torch.float32)
    monkeypatch.undo()
    monkeypatch.setattr(grads, "SMALL_M", 0)
    dz_ref, db_ref = grads.act_dz(dy, y, "relu", True, torch.float32)
    assert torch.equal(dz, dz_ref) and db.shape == (300,) and db.dtype == torch.float32
    # <= 128 terms of |dz| < ~4 in another order: within 128 * 4 * 2**-24 ~ 3e-5 of each other, absolute.
    torch.testing.assert_close(db, db_ref, rtol=0, atol=3e-5)
    torch.testing.assert_close(db, (dy * (y > 0)).sum(0), rtol=0, atol=3e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stack_backward_with_dw_on_a_second_stream_gives_one_streams_gradients(dtype, monkeypatch):
    """At a small batch a stack's backward runs its dW GEMMs on a second stream (SIDE_DW_MAX_M): the same
    gradients, bit for bit (the same cuBLAS calls), as with everything on one stream, launched and replayed
    from a CUDA graph, whose capture records the fork and the join."""
    g = torch.Generator(device="cuda").manual_seed(0)
    widths = [13, 512, 256, 64, 16]  # kaggle's bottom MLP, whose first layer's input rows get padded
    x = torch.randn(128, widths[0], device="cuda", generator=g).to(dtype)
    weights = [
        (torch.randn(n, k, device="cuda", generator=g) / math.sqrt(k)).to(dtype).requires_grad_()
        for k, n in zip(widths[:-1], widths[1:], strict=True)
    ]
    biases = [torch.randn(n, device="cuda", generator=g).to(dtype).requires_grad_() for n in widths[1:]]
    activations = ["relu"] * (len(weights) - 1) + ["identity"]
    dy = torch.randn(128, widths[-1], device="cuda", generator=g).to(dtype)
    params = weights + biases

    def backward():
        for p in params:
            p.grad = None
        linear_act_stack(x, weights, biases, activations).backward(dy)

    used = []

    def spy(device):
        used.append(device)
        return grads_mod.dw_stream(device)

    monkeypatch.setattr(linear_act_mod, "dw_stream", spy)
    backward()
    assert used, "the dW GEMMs did not take the second stream"
    two_streams = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        linear_act_stack(x, weights, biases, activations).backward(dy)
    graph.replay()
    torch.cuda.synchronize()
    replayed = [p.grad.clone() for p in params]
    monkeypatch.setattr(linear_act_mod, "SIDE_DW_MAX_M", 0)
    backward()
    for i, p in enumerate(params):
        assert torch.equal(two_streams[i], p.grad), f"parameter {i}: two streams differ from one"
        assert torch.equal(replayed[i], p.grad), f"parameter {i}: the graph's replay differs from one stream"
