"""Tests for kernels/cross_hopper.py, the cross layer's forward and backward GEMMs with their epilogues (and
the dz / dh GEMM with its prologue) as warp-specialized Gluon kernels on Hopper GPUs: every element of their
outputs against fp64 references on the same operands, rows past M untouched, and where ``kernels.cross``
and ``kernels.cross_net`` take them. Gluon has no interpreter: the kernel tests need an sm_90 GPU.
"""

from __future__ import annotations

import pytest
import torch

import kernels.cross as cross
import kernels.cross_hopper as cross_hopper
from kernels.cross_net import cross_net
from tests.test_cross import _assert_norm_close, _run
from tests.test_cross_net import _inputs as network_inputs

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU (sm_90)")
# (M, N, r): one row; tails of the 128-row and 128-column tiles and of the 64-deep reduction chunk; N below
# one tile (a whole x0 / x_l sub-tile past N); more tiles than SMs with the MLPerf width and rank; several
# tiles a consumer (its epilogue slots reloaded from tile to tile).
SHAPES = [(1, 8, 8), (300, 64, 32), (129, 1000, 72), (1000, 3456, 512), (40000, 384, 72)]
# Elementwise bounds: the output's one rounding to its dtype (a relative half unit in the last place, here
# doubled) and fp32 sums of r products (Higham (3.5): r u_fp32 sum|h_k u_k|, below 5e-4 at r = 512 for
# these scales).
RTOL = {torch.bfloat16: 2**-8, torch.float16: 2**-10}
ATOL = 1e-3
GUARD = 64  # rows after each output that the kernel must not write


def _normal(seed, dtype):
    """randn(*shape, scale=1.0): N(0, scale^2) tensors on the GPU in `dtype`, seeded `seed`."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dtype)

    return randn


def _inputs(m, n, r, dtype, seed=0):
    """x0, xl [M, N], h [M, r] (~N(0, 1)), U [N, r] and b [N] (|z| ~ 1) on the GPU in `dtype`."""
    randn = _normal(seed, dtype)
    return randn(m, n), randn(m, n), randn(m, r), randn(n, r, scale=r**-0.5), randn(n, scale=0.1)


def _guarded(m, n, dtype):
    """An [M, N] view at the top of an [M + GUARD, N] buffer of NaN (an element left unwritten stays NaN),
    and the buffer."""
    rows = torch.full((m + GUARD, n), float("nan"), device="cuda", dtype=dtype)
    return rows[:m], rows


def _assert_each_close(checks, dtype):
    """Each (name, output, fp64 expected) of `checks` elementwise within RTOL[dtype] and ATOL."""
    for name, got, expected in checks:
        torch.testing.assert_close(
            got.double(), expected, rtol=RTOL[dtype], atol=ATOL, msg=lambda s, name=name: f"{name}: {s}"
        )


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_element_against_the_reference_gpu(shape, dtype):
    m, n, r = shape
    x0, xl, h, u, b = _inputs(m, n, r, dtype)
    (out, out_rows), (zb, zb_rows) = _guarded(m, n, dtype), _guarded(m, n, dtype)
    assert cross_hopper.supported(h, u, b, x0, xl, out, zb)
    cross_hopper.launch_fwd(h, u, b, x0, xl, out, zb)
    torch.cuda.synchronize()
    expected_zb = h.double() @ u.double().t() + b.double()
    expected_out = x0.double() * expected_zb + xl.double()
    _assert_each_close([("zb", zb, expected_zb), ("out", out, expected_out)], dtype)
    assert out_rows[m:].isnan().all() and zb_rows[m:].isnan().all(), "rows past M written"


@pytest.mark.gpu
@needs_hopper
def test_the_layer_takes_it_where_it_can_gpu():
    """kernels.cross's forward runs the Hopper kernel for bf16 / fp16 with rows TMA can describe, and its
    Triton kernel for fp32 and for N not a multiple of 8; both give the reference's values."""
    m, n, r = 200, 3456, 512
    x0, xl, h, u, b = _inputs(m, n, r, torch.bfloat16)
    out, zb = torch.empty_like(x0), torch.empty_like(x0)
    assert cross_hopper.supported(h, u, b, x0, xl, out, zb)
    assert not cross_hopper.supported(*(t.float() for t in (h, u, b, x0, xl, out, zb)))
    x0_odd, xl_odd, h_odd, u_odd, b_odd = _inputs(m, n - 1, r, torch.bfloat16)  # rows of 6,910 bytes
    assert not cross_hopper.supported(h_odd, u_odd, b_odd, x0_odd, xl_odd, x0_odd, xl_odd)
    hopper_out, hopper_zb = torch.empty_like(x0), torch.empty_like(x0)
    cross_hopper.launch_fwd(h, u, b, x0, xl, hopper_out, hopper_zb)
    cross.triton_fwd(x0, xl, h, u, b, out, zb)
    # The two kernels sum in other orders and round once each: a unit in the last place apart at most.
    torch.testing.assert_close(hopper_zb, zb, rtol=2**-7, atol=ATOL)
    torch.testing.assert_close(hopper_out, out, rtol=2**-7, atol=ATOL)


# (ACCUMULATE, FOLD_DXL, dx_l written over g): each variant of the backward kernel.
BWD_VARIANTS = [(False, False, False), (False, False, True), (True, False, False), (True, False, True),
                (False, True, False), (True, True, False)]  # fmt: skip


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize(
    "variant", BWD_VARIANTS, ids=lambda v: f"acc{v[0]:d}-fold{v[1]:d}" + ("-in_place" if v[2] else "")
)
def test_backward_every_element_against_the_reference_gpu(variant, shape, dtype):
    """dx_l = g + dh @ V and dx0 = g * zb (+ acc), or dx0 = g * zb (+ acc) + g + dh @ V where dx_l is not
    wanted; dx_l also over g's own memory. dh and V are slices of NaN-padded buffers: a reduction tail read
    from memory rather than TMA's zero fill would show."""
    accumulate, fold, in_place = variant
    m, n, r = shape
    randn = _normal(m + n + r, dtype)
    dh = torch.full((m, r + 8), float("nan"), device="cuda", dtype=dtype)[:, :r].copy_(randn(m, r))
    v = torch.full((r + 64, n), float("nan"), device="cuda", dtype=dtype)[:r].copy_(
        randn(r, n, scale=r**-0.5)
    )
    g, zb, acc = randn(m, n), randn(m, n), randn(m, n)
    expected_dxl = g.double() + dh.double() @ v.double()
    expected_dx0 = g.double() * zb.double() + (acc.double() if accumulate else 0)
    (dx0, dx0_rows), (dxl, dxl_rows) = _guarded(m, n, dtype), _guarded(m, n, dtype)
    if in_place:
        g = dxl.copy_(g)
    given = (acc,) if accumulate else ()
    assert cross_hopper.supported(dh, v, g, zb, dx0, *given)
    cross_hopper.launch_bwd(dh, v, g, zb, acc if accumulate else None, None if fold else dxl, dx0)
    torch.cuda.synchronize()
    if fold:
        _assert_each_close([("dx0", dx0, expected_dx0 + expected_dxl)], dtype)
    else:
        _assert_each_close([("dx0", dx0, expected_dx0), ("dx_l", dxl, expected_dxl)], dtype)
    assert dx0_rows[m:].isnan().all(), "rows past M written"
    assert (dxl_rows[m:] if in_place or not fold else dxl_rows).isnan().all(), "dx_l written past M or at all"


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES + [(300, 1000, 264)], ids=lambda s: "x".join(map(str, s)))
def test_dz_every_element_against_the_reference_gpu(shape, dtype):
    """dz = g * x0 (its fp32 product rounded once: exact), dh = dz @ U and db = dz's column sums, on every
    element; (300, 1000, 264) has a second R tile of 8 columns. Bounds: the output's rounding (RTOL) and
    fp32 sums of `length` terms, |error| <= length u sum |terms| (Higham (3.5)), u = 2^-24 for the CUDA
    cores' sums, 2^-23 for the tensor cores' (which may truncate)."""
    m, n, r = shape
    randn = _normal(m + n + r, dtype)
    g, x0, u = randn(m, n), randn(m, n), randn(n, r, scale=n**-0.5)
    (dz, dz_rows), (dh, dh_rows) = _guarded(m, n, dtype), _guarded(m, r, dtype)
    assert cross_hopper.supported(g, x0, u, dz, dh)
    db = cross_hopper.launch_dz(g, x0, u, dz, dh)
    torch.cuda.synchronize()
    expected_dz = (g.float() * x0.float()).to(dtype)
    assert torch.equal(dz, expected_dz), "dz is not g * x0 rounded once"
    products = g.double() * x0.double()
    for name, got, expected, terms, length, unit in [
        (
            "dh",
            dh,
            expected_dz.double() @ u.double(),
            expected_dz.double().abs() @ u.double().abs(),
            n,
            2**-23,
        ),
        ("db", db, products.sum(0), products.abs().sum(0), m, 2**-24),
    ]:
        bound = RTOL[dtype] * expected.abs() + length * unit * terms + 1e-6
        assert (got.double() - expected).abs().le(bound).all(), (
            f"{name}: {(got.double() - expected).abs().max()}"
        )
    assert dz_rows[m:].isnan().all() and dh_rows[m:].isnan().all(), "rows past M written"


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("layers", [1, 3])
def test_the_network_backward_takes_it_gpu(layers, monkeypatch):
    """cross_net in bf16 at widths TMA can describe runs the two backward kernels once a layer each, leaves
    autograd's gradient as it was, and gives the gradients of the path without the Hopper kernels (the
    elementwise kernel's dz and dx0, cuBLAS's dh and addmm) to bf16 roundings: each output rounded once
    here, up to twice there (1e-2 of the norm)."""
    *inputs, g = network_inputs(300, 256, 64, layers, torch.bfloat16, seed=layers)
    kept = g.clone()
    launches = []
    for name in ("launch_bwd", "launch_dz"):
        kernel = getattr(cross_hopper, name)
        monkeypatch.setattr(
            cross_hopper, name, lambda *args, k=kernel, n=name: launches.append(n) or k(*args)
        )
    out, grads = _run(cross_net, inputs, g)
    assert sorted(launches) == ["launch_bwd"] * layers + ["launch_dz"] * layers
    assert torch.equal(g, kept), "autograd's gradient was written"
    monkeypatch.setattr(cross_hopper, "supported", lambda *tensors: False)
    ref, ref_grads = _run(cross_net, inputs, g)
    assert len(launches) == 2 * layers
    _assert_norm_close(out, ref, 1e-2, "out")
    for name, a, e in zip(["dx0", "dv", "du", "db"], grads, ref_grads, strict=True):
        _assert_norm_close(a, e, 1e-2, name)


def test_not_on_the_cpu():
    """Without a GPU the forward keeps the Triton kernel (Gluon has no interpreter)."""
    t = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert not cross_hopper.supported(t, t, t[0], t, t, t, t)
