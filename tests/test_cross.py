"""Tests for kernels/cross.py: the fused DCNv2 cross layer x0 * (U (V x_l) + b) + x_l, forward and backward,
against its fp32 PyTorch reference.

On CPU (no CUDA) conftest sets TRITON_INTERPRET=1: the Triton kernels run in the interpreter, whose dots are
plain fp32, so fp32 results compare elementwise. On a GPU machine the same tests run on DEVICE = "cuda", where
fp32 GEMMs follow allow_tf32 (TF32, compared as a relative norm; else 3xTF32, about fp32's accuracy, compared
elementwise); bf16 (on either) is checked as a relative norm.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton

import kernels.cross as cross
import kernels.launch as launch
from kernels.cross import cross_layer, cross_layer_bwd, cross_layer_fwd, cross_layer_ref
from kernels.gemm import tuning as gemm_tuning
from kernels.gemm.layout import tma_descriptor
from kernels.gemm.tuning import input_precision, m_bucket
from tests.tolerances import tol

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (M, N, r): ones, primes, non-multiples of the interpreter's 32-wide tiles (and of the 32-row partial sums),
# r below and above one 32-deep reduction chunk.
SHAPES = [(1, 1, 1), (3, 7, 5), (37, 45, 7), (70, 100, 33)]
OUTPUTS = ["out", "dx0", "dxl", "dv", "du", "db"]


def _ids(s):
    return "x".join(map(str, s))


def _inputs(m: int, n: int, r: int, dtype: torch.dtype, seed: int = 0):
    """Fresh random x0, xl [M, N], V [r, N], U [N, r], b [N] and g [M, N] (never zeros), nn.Linear-like
    scales (|z| ~ 1), on DEVICE in `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    tensors = (
        torch.randn(m, n, generator=gen),
        torch.randn(m, n, generator=gen),
        torch.randn(r, n, generator=gen) / math.sqrt(n),
        torch.randn(n, r, generator=gen) / math.sqrt(r),
        torch.randn(n, generator=gen),
        torch.randn(m, n, generator=gen),
    )
    return [t.to(device=DEVICE, dtype=dtype) for t in tensors]


def _run(fn, inputs, g):
    """fn(*inputs) and the gradients of its 5 inputs for output gradient g (fresh leaves)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(g)
    return out, [t.grad for t in leaves]


def _assert_norm_close(actual, expected, rtol: float, what: str):
    """||actual - expected|| <= rtol ||expected|| + 1e-5 sqrt(numel)."""
    err = (actual.float() - expected.float()).norm().item()
    bound = rtol * expected.float().norm().item() + 1e-5 * math.sqrt(max(expected.numel(), 1))
    assert err <= bound, f"{what}: ||out - ref|| = {err:.3e} > {bound:.3e}"


def _assert_fp32_close(names, actual, expected):
    """fp32 results against the fp32 reference: with TF32 GEMMs on the GPU, tolerances.py's "gemm_norm" as a
    relative norm; with fp32-accurate GEMMs (plain fp32 interpreted, 3xTF32 on a GPU), whose sums over r,
    N or M run in other orders than torch's, its elementwise "gemm" bounds."""
    if DEVICE == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        for name, a, e in zip(names, actual, expected, strict=True):
            _assert_norm_close(a, e, tol(torch.float32, "gemm_norm")["rtol"], name)
        return
    for name, a, e in zip(names, actual, expected, strict=True):
        torch.testing.assert_close(a, e, **tol(torch.float32, "gemm"), msg=name)


@pytest.fixture
def poisoned(monkeypatch):
    """Fill every buffer the launchers allocate with NaN, so an element a kernel does not write shows."""

    def empty(shape, dtype, device):
        return torch.full(shape, math.nan, dtype=dtype, device=device)

    monkeypatch.setattr(launch, "empty", empty)


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_forward_and_backward_equal_the_fp32_reference(shape, poisoned):
    """fp32: output and the five gradients against autograd through cross_layer_ref."""
    *inputs, g = _inputs(*shape, torch.float32)
    out, grads = _run(cross_layer, inputs, g)
    ref, ref_grads = _run(cross_layer_ref, inputs, g)
    _assert_fp32_close(OUTPUTS, [out, *grads], [ref, *ref_grads])


@pytest.mark.parametrize("shape", SHAPES[2:], ids=_ids)
def test_bf16_path_within_its_roundings(shape, poisoned):
    """bf16 inputs against the fp32 reference on the same (bf16-representable) values, as a relative norm.

    The bound, from the roundings to bf16 on each path (unit roundoff u = 2**-9 for torch's GEMM outputs;
    2u for the kernels' stores in the interpreter, whose fp32 -> bf16 conversion truncates): the output
    takes h (u) and its store (2u), dx0 the same, dV and dU the stored dz (2u), h or dh (u) and the result
    (u), dxl dz, dh and the result, db one store. 4u = 7.8e-3 of the norm where they do not cancel;
    tolerances.py's bf16 "gemm_norm" rtol 1.6e-2 leaves a 2x margin (measured up to 4.3e-3, dU)."""
    *inputs, g = _inputs(*shape, torch.bfloat16)
    out, grads = _run(cross_layer, inputs, g)
    ref, ref_grads = _run(cross_layer_ref, [t.float() for t in inputs], g.float())
    assert out.dtype == torch.bfloat16 and all(d.dtype == torch.bfloat16 for d in grads)
    rtol = tol(torch.bfloat16, "gemm_norm")["rtol"]
    for name, a, e in zip(OUTPUTS, [out, *grads], [ref, *ref_grads], strict=True):
        _assert_norm_close(a, e, rtol, name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_forward_kernel_in_every_tuned_config_gpu(dtype, poisoned):
    """On the GPU, the forward kernel in each of the tuning's Hopper configs (the autotuner checks no
    output: a config that never wins a shape of the other tests could win another), at a shape that cuts
    tiles at both ends: out and zb of every element against the reference on the same h."""
    m, n, r = 300, 1000, 96
    block_k = 64 if dtype == torch.bfloat16 else 32
    x0, xl, v, u, b, _ = _inputs(m, n, r, dtype)
    h = xl @ v.t()
    expected_zb = h.float() @ u.float().t() + b.float()
    expected = [x0.float() * expected_zb.to(dtype).float() + xl.float(), expected_zb]
    for block_m, block_n, warps, stages in gemm_tuning._GPU_SHAPES:
        out, zb = (launch.empty((m, n), dtype, x0.device) for _ in range(2))
        h_desc, u_desc = tma_descriptor(h), tma_descriptor(u)
        h_desc.block_shape, u_desc.block_shape = [block_m, block_k], [block_n, block_k]
        quarters = [tma_descriptor(t) for t in (x0, xl, out, zb)]  # the epilogue's quarters of a tile
        for desc in quarters:
            desc.block_shape = [block_m, block_n // 4]
        grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
        cross._cross_fwd_kernel.fn[grid](
            h_desc, u_desc, *quarters, b, out, zb, m, n, r, m_bucket(m), n,
            TMA_STORE=True, DOT_FP32=False, INPUT_PRECISION=input_precision(dtype),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        if dtype == torch.float32:
            _assert_fp32_close(["out", "zb"], [out, zb], expected)
        else:  # bf16 stores, as test_bf16_path_within_its_roundings
            for name, a, e in zip(["out", "zb"], [out, zb], expected, strict=True):
                _assert_norm_close(a, e, tol(torch.bfloat16, "gemm_norm")["rtol"], name)


def test_first_layer_takes_x0_as_its_input():
    """x_l = x0 (the same tensor, the first layer): the gradient of x0 sums both paths."""
    x0, _, v, u, b, g = _inputs(37, 45, 7, torch.float32)
    _, grads = _run(lambda x, *w: cross_layer(x, x, *w), [x0, v, u, b], g)
    _, ref_grads = _run(lambda x, *w: cross_layer_ref(x, x, *w), [x0, v, u, b], g)
    for a, e in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, e, **tol(torch.float32, "gemm"))


def test_launchers_return_what_the_backward_reads():
    """cross_layer_fwd's h is xl V^T and its zb h U^T + b; cross_layer_bwd's gradients equal the op's
    autograd ones."""
    *inputs, g = _inputs(37, 45, 7, torch.float32)
    x0, xl, v, u, b = inputs
    out, h, zb = cross_layer_fwd(*inputs)
    torch.testing.assert_close(h, xl @ v.t())
    torch.testing.assert_close(zb, h @ u.t() + b)
    _, grads = _run(cross_layer, inputs, g)
    for a, e in zip(cross_layer_bwd(g, *inputs, h, zb)[1:], grads[1:], strict=True):
        torch.testing.assert_close(a, e)
    assert out.shape == (37, 45)


def test_empty_batch():
    *inputs, g = _inputs(0, 9, 4, torch.float32)
    out, grads = _run(cross_layer, inputs, g)
    assert out.shape == (0, 9)
    assert grads[4].shape == (9,) and not grads[4].any()  # db: a sum over no rows


def test_bad_inputs_raise_naming_the_values():
    x0, xl, v, u, b, _ = _inputs(3, 7, 5, torch.float32)
    with pytest.raises(ValueError, match=r"u must have shape \(7, 5\)"):
        cross_layer(x0, xl, v, u.t(), b)
    with pytest.raises(ValueError, match=r"b must be 1-D"):
        cross_layer(x0, xl, v, u, b[None])
    with pytest.raises(ValueError, match="xl dtype torch.bfloat16 differs"):
        cross_layer(x0, xl.bfloat16(), v, u, b)
    with pytest.raises(ValueError, match="x0 dtype must be one of"):
        cross_layer(*(t.double() for t in (x0, xl, v, u, b)))


def test_too_wide_rows_raise(monkeypatch):
    """The forward's offsets inside a tile are 32-bit: N at or past MAX_N is refused, by name."""
    import kernels.cross as cross

    monkeypatch.setattr(cross, "MAX_N", 7)
    x0, xl, v, u, b, _ = _inputs(3, 7, 5, torch.float32)
    with pytest.raises(ValueError, match="N must be below 7"):
        cross_layer(x0, xl, v, u, b)


def test_rows_further_apart_give_the_same_forward():
    """x0 and x_l as views of wider rows (the forward's kernel takes one row stride, N: they are copied) give
    the same bits as contiguous ones."""
    x0, xl, v, u, b, _ = _inputs(37, 45, 7, torch.float32)
    wide = [torch.full((37, 50), math.nan, device=DEVICE) for _ in range(2)]
    for buffer, t in zip(wide, (x0, xl), strict=True):
        buffer[:, :45] = t
    expected = cross_layer_fwd(x0, xl, v, u, b)
    actual = cross_layer_fwd(wide[0][:, :45], wide[1][:, :45], v, u, b)
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a, e)


def test_custom_op_registration():
    """torch.library.opcheck: the fake's shapes and strides, the autograd registration and the schema, on
    both ops (what torch.compile and CUDA-graph capture rely on)."""
    *inputs, g = _inputs(5, 9, 3, torch.float32)
    torch.library.opcheck(torch.ops.dlrm.cross_layer.default, [t.requires_grad_() for t in inputs])
    _, h, zb = cross_layer_fwd(*(t.detach() for t in inputs))
    backward_args = [g, *(t.detach() for t in inputs), h, zb]
    torch.library.opcheck(torch.ops.dlrm.cross_layer_backward.default, backward_args)


def test_compiled_equals_eager():
    """Under torch.compile (the custom op in an Inductor graph, batch dynamic) the same output and
    gradients as the eager call."""
    *inputs, g = _inputs(37, 45, 7, torch.float32)
    compiled = torch.compile(cross_layer, dynamic=True, fullgraph=True)
    out, grads = _run(compiled, inputs, g)
    ref, ref_grads = _run(cross_layer, inputs, g)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for a, e in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
