"""kernels/gemm/dx_act.py: layer i's dx GEMM with layer i - 1's act' and bias gradient in its epilogue,
against the exact (fp64) math of the same operands (the MLP stack's backward that uses it:
test_linear_act_stack.py).

The kernel rounds dz_{i-1} once from an fp32 accumulator, so its error is one rounding to the dtype plus
the fp32 accumulation's: |got - exact| <= u |exact| + terms * 2**-24 * sum|terms| (u = 2**-24 for fp32,
2**-8 for bf16), with the terms the products of the reduction (dz_{i-1}) or the rows of the sum (db_{i-1}).
The interpreter's dots are plain fp32 and a GPU's fp32 dots without TF32 are 3xTF32, within that (see
tests/tolerances.py, "gemm"); bf16 products are exact in fp32 on both.
"""

import math

import pytest
import torch

import kernels.gemm.dx_act as dx_act_mod
import kernels.gemm.tuning as gemm_tuning
import kernels.launch as launch
from kernels.activations import ACTIVATIONS, act_bwd_ref
from kernels.gemm.dx_act import dx_act, dx_act_two_pass, fastest_dx
from kernels.gemm.layout import new_padded

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter casts fp32 to bf16 by truncation (up to one ulp, 2**-7), a GPU to nearest (half an ulp).
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8 if torch.cuda.is_available() else 2.0**-7}
# fp32 products of a 3xTF32 dot: up to 3 * 2**-22 of |a b| each (tests/tolerances.py), above fp32's 2**-24.
PRODUCT_ERROR = 3 * 2.0**-22
# act' of sigmoid, gelu_tanh and silu in fp32: exp-based forms, a few ulps (tests/tolerances.py, fp32 "grad").
ACT_ERROR = {"relu": 0.0, "identity": 0.0}
ACT_ERROR_EXP = 1e-5
# The largest |act'| of the activations (gelu_tanh' peaks at ~1.13, silu' at ~1.1), scaling dy's error.
MAX_SLOPE = 1.2


def _operands(m, n, k, activation, dtype, device, seed=0):
    """dz_i [M, N], W_i [N, K] and layer i - 1's saved tensor [M, K] (y for relu/sigmoid, z otherwise)."""
    g = torch.Generator().manual_seed(seed)
    dz = torch.randn(m, n, generator=g)
    w = torch.randn(n, k, generator=g) / math.sqrt(n)
    z = torch.randn(m, k, generator=g)
    saved = {"relu": torch.relu(z), "sigmoid": torch.sigmoid(z), "identity": None}.get(activation, z)
    return [t if t is None else t.to(device, dtype) for t in (dz, w, saved)]


def _assert_rounded_once(got, dz, w, saved, activation, dtype, what):
    """got [M, K] and its column sums against the exact math, within the bound of the module docstring."""
    dy = dz.double() @ w.double()
    exact = act_bwd_ref(dy, None if saved is None else saved.double(), activation).double()
    terms = MAX_SLOPE * (dz.double().abs() @ w.double().abs())  # sum|products|, times the largest |act'|
    relative = UNIT_ROUNDOFF[dtype] + ACT_ERROR.get(activation, ACT_ERROR_EXP)
    bound = relative * exact.abs() + dz.shape[1] * PRODUCT_ERROR * terms + 1e-30
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), f"{what}: worst error {(err / bound).max().item():.2f}x the bound"
    return exact


def _assert_db_rounded_once(db, exact, dtype):
    """db [K] against the column sums of the exact dz_{i-1} [M, K]: the fp32 sum over M rows, then one
    rounding: M * 2**-24 sum|dz| (doubled for margin) for the sum, u |db| for the rounding."""
    db_exact = exact.sum(0)
    bound = UNIT_ROUNDOFF[dtype] * db_exact.abs() + exact.shape[0] * 2.0**-23 * exact.abs().sum(0) + 1e-30
    assert bool(((db.double() - db_exact).abs() <= bound).all()), "db"


def _nan_empty(shape, dtype, device):
    return torch.full(shape, math.nan, dtype=dtype, device=device)


@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(1, 1, 1), (100, 40, 24), (130, 33, 70), (67, 1, 17)], ids=str)
def test_dx_act_is_the_exact_math_rounded_once(monkeypatch, shape, activation, dtype, has_bias):
    """dz_{i-1} and db_{i-1} within one rounding of the exact values: M not a multiple of DB_ROWS (a partial
    group of the partials), N_i = 1 (a reduction narrower than 16 bytes), odd K; output buffers poisoned
    with NaN, so every element must be written."""
    monkeypatch.setattr(dx_act_mod, "new_padded", lambda m, k, like: new_padded(m, k, like).fill_(math.nan))
    monkeypatch.setattr(launch, "empty", _nan_empty)
    dz, w, saved = _operands(*shape, activation, dtype, DEVICE, seed=sum(shape))
    got, db = dx_act(dz, w, saved, activation, has_bias)
    assert got.shape == (shape[0], shape[2]) and got.dtype == dtype
    exact = _assert_rounded_once(got, dz, w, saved, activation, dtype, "dz")
    if not has_bias:
        assert db is None
        return
    assert db.shape == (shape[2],) and db.dtype == dtype
    _assert_db_rounded_once(db, exact, dtype)


@pytest.mark.parametrize("db_rows", [8, 16])
def test_db_partials_of_several_row_groups_a_tile(monkeypatch, db_rows):
    """Partials of DB_ROWS rows, several to a tile (the GPU's tiles of 64-256 rows; the interpreter's 32): the
    same db as one sum."""
    dz, w, saved = _operands(100, 40, 24, "relu", torch.float32, DEVICE, seed=2)
    _, db_one_group = dx_act(dz, w, saved, "relu", True)
    monkeypatch.setattr(dx_act_mod, "DB_ROWS", db_rows)
    _, db = dx_act(dz, w, saved, "relu", True)
    torch.testing.assert_close(db, db_one_group, rtol=1e-5, atol=1e-4)  # tests/tolerances.py, fp32 "sum"


@pytest.mark.parametrize("activation", ["relu", "gelu_tanh"])
def test_two_pass_path_gives_the_same_gradients(activation):
    """The path ``fastest_dx`` weighs the kernel against (cuBLAS's dx, then the dz pass): the same dz and db
    at fp32, within the fp32 GEMM tolerance (tests/tolerances.py, "gemm")."""
    dz, w, saved = _operands(100, 40, 24, activation, torch.float32, DEVICE, seed=5)
    for fused, two_pass in zip(
        dx_act(dz, w, saved, activation, True), dx_act_two_pass(dz, w, saved, activation, True), strict=True
    ):
        torch.testing.assert_close(fused, two_pass, rtol=1e-5, atol=1e-4)


# W_i [N_i, K] of the layers above a relu layer in kaggle's and dlrm_dcnv2's MLPs.
MLP_LAYERS = [(256, 512), (64, 256), (16, 64), (1, 256), (1024, 1024), (512, 1024)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [128, 16384])
@pytest.mark.parametrize("layer", MLP_LAYERS, ids=str)
def test_dlrm_shapes_gpu(layer, m, dtype):
    """The MLP layers of kaggle and dlrm_dcnv2 (W_i [N_i, K]) below a relu layer, on tensor cores (3xTF32 for
    fp32: PyTorch's default precision)."""
    dz, w, saved = _operands(m, *layer, "relu", dtype, "cuda", seed=m)
    got, db = dx_act(dz, w, saved, "relu", True)
    exact = _assert_rounded_once(got, dz, w, saved, "relu", dtype, f"dz {layer} {m}")
    _assert_db_rounded_once(db, exact, dtype)


@pytest.mark.gpu
def test_path_is_timed_once_per_shape_gpu(monkeypatch):
    """The first call of a shape times both paths; later calls in its M bucket reuse the choice."""
    monkeypatch.setattr(gemm_tuning, "_TABLES", {})
    monkeypatch.setattr(dx_act_mod, "_DX_CHOICE", gemm_tuning.ChoiceTable("dx with act'"))
    dz, w, saved = _operands(4096, 256, 512, "relu", torch.bfloat16, "cuda")
    first = fastest_dx(dz, w, saved, "relu", True)
    assert first in ("fused", "two-pass") and len(dx_act_mod._DX_CHOICE) == 1
    monkeypatch.setattr(gemm_tuning, "graph_time", lambda fn: pytest.fail("timed again"))
    assert fastest_dx(dz[:3000], w, saved[:3000], "relu", True) == first
