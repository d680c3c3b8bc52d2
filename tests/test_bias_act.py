"""Tests for kernels/bias_act.py: fused y = act(x + b), forward and backward.

On CPU (no CUDA) conftest sets TRITON_INTERPRET=1, so the fp32 tests run the Triton kernels in the
interpreter; on a GPU machine the same tests run them on DEVICE = "cuda". bf16/fp16 run in the interpreter
too (the kernels compute in fp32 from right after the load); the DLRM-shape tests are GPU-only.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import kernels.bias_act as bias_act_mod
import kernels.gemm.partials as partials
from kernels.bias_act import ACTIVATIONS, bias_act, bias_act_bwd, bias_act_fwd, bias_act_ref
from tests.tolerances import tol

# Where the Triton kernels run: the GPU when there is one, else the CPU interpreter (see conftest).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1, 1), (3, 7), (127, 65), (130, 513), (257, 16)]
HALF_DTYPES = [torch.bfloat16, torch.float16]


def _inputs(m: int, n: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    """Fresh random x [M, N], b [N], dy [M, N] (never zeros), from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, n, generator=g)
    b = torch.randn(n, generator=g)
    dy = torch.randn(m, n, generator=g)
    return (t.to(device=device, dtype=dtype) for t in (x, b, dy))


def _check_fwd_bwd(m: int, n: int, activation: str, dtype: torch.dtype, device: str, seed: int = 0):
    """bias_act forward and autograd backward against the fp32 reference and its autograd grads."""
    x, b, dy = _inputs(m, n, dtype, device, seed)
    x.requires_grad_(True)
    b.requires_grad_(True)
    y = bias_act(x, b, activation)
    y.backward(dy)

    x32 = x.detach().float().requires_grad_(True)
    b32 = b.detach().float().requires_grad_(True)
    y32 = bias_act_ref(x32, b32, activation)
    y32.backward(dy.float())

    assert y.dtype == dtype and y.shape == (m, n)
    assert x.grad.dtype == dtype and b.grad.dtype == dtype and b.grad.shape == (n,)
    torch.testing.assert_close(y, y32.detach().to(dtype), **tol(dtype, "fwd"))
    torch.testing.assert_close(x.grad.float(), x32.grad, **tol(dtype, "grad"))
    torch.testing.assert_close(b.grad.float(), b32.grad, **tol(dtype, "sum"))


# ----------------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_fwd_bwd_fp32(shape, activation):
    _check_fwd_bwd(*shape, activation, torch.float32, DEVICE)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_fwd_bwd_half(shape, activation, dtype):
    _check_fwd_bwd(*shape, activation, dtype, DEVICE)


@pytest.mark.parametrize("activation", ["relu", "gelu_tanh"])
@pytest.mark.parametrize("shape", [(3, 7), (130, 513)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_kernels_write_every_element(shape, activation):
    """Poison the output buffers with NaN: every element must be overwritten by the kernels."""
    m, n = shape
    x, b, dy = _inputs(m, n, torch.float32, DEVICE, seed=1)
    y = torch.full((m, n), float("nan"), device=DEVICE)
    assert bias_act_fwd(x, b, activation, out=y) is y
    torch.testing.assert_close(y, bias_act_ref(x, b, activation), **tol(torch.float32, "fwd"))

    dx = torch.full((m, n), float("nan"), device=DEVICE)
    dx_ret, db = bias_act_bwd(dy, x, b, activation, dx_out=dx)
    assert dx_ret is dx
    x32 = x.clone().requires_grad_(True)
    b32 = b.clone().requires_grad_(True)
    bias_act_ref(x32, b32, activation).backward(dy)
    torch.testing.assert_close(dx, x32.grad, **tol(torch.float32, "grad"))
    torch.testing.assert_close(db, b32.grad, **tol(torch.float32, "sum"))


def test_backward_with_several_row_blocks_per_program(monkeypatch):
    """With few programs along M, each backward program loops over several row blocks and sums them."""
    monkeypatch.setattr(partials, "MAX_PARTIAL_ROWS", 2)
    _check_fwd_bwd(600, 33, "silu", torch.float32, DEVICE)


def test_noncontiguous_inputs():
    """Transposed x and an expanded (stride-0) upstream gradient, as from y.sum().backward()."""
    x, b, _ = _inputs(65, 127, torch.float32, DEVICE, seed=2)
    xt = x.t().requires_grad_(True)  # [127, 65], column-major
    bt = torch.randn(65, generator=torch.Generator().manual_seed(3)).to(DEVICE).requires_grad_(True)
    bias_act(xt, bt, "sigmoid").sum().backward()
    x32 = xt.detach().clone().requires_grad_(True)
    b32 = bt.detach().clone().requires_grad_(True)
    bias_act_ref(x32, b32, "sigmoid").sum().backward()
    torch.testing.assert_close(xt.grad, x32.grad, **tol(torch.float32, "grad"))
    torch.testing.assert_close(bt.grad, b32.grad, **tol(torch.float32, "sum"))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_matches_linear_with_bias(activation):
    """bias_act(F.linear(x, W), b) == act(F.linear(x, W, b)), values and grads of x, W, b."""
    g = torch.Generator().manual_seed(4)
    x, w, b, dy = (
        torch.randn(*shape, generator=g).to(DEVICE) for shape in ((37, 24), (19, 24), (19,), (37, 19))
    )
    x, w, b = (t.requires_grad_(True) for t in (x, w, b))
    act = {
        "identity": lambda z: z,
        "relu": torch.relu,
        "sigmoid": torch.sigmoid,
        "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
        "silu": F.silu,
    }[activation]

    y = bias_act(F.linear(x, w), b, activation)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    y_ref = act(F.linear(x, w, b))
    grads_ref = torch.autograd.grad(y_ref, (x, w, b), dy)

    # |x @ W| is ~5 here: scale atol (the bias is added after rounding the GEMM instead of inside it).
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=5e-5)
    for got, want, name in zip(grads, grads_ref, ("x", "W", "b"), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4, msg=lambda s, n=name: f"grad {n}: {s}")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_relu_propagates_nan_like_torch(device):
    """A NaN input gives NaN out of relu, as torch.relu does (the GPU's max instruction returns the other
    operand, 0): else a NaN batch trains on with a finite loss and train.on_nonfinite never sees it."""
    from kernels.linear_act import linear_act

    x = torch.randn(4, 8, device=device)
    x[1, 2] = float("nan")
    z = torch.zeros(8, device=device)
    assert torch.equal(bias_act(x, z, "relu").isnan(), torch.relu(x).isnan())
    w = torch.randn(16, 8, device=device)
    assert linear_act(x, w, torch.zeros(16, device=device), "relu")[1].isnan().all()


def test_empty_batch():
    x = torch.randn(0, 9, requires_grad=True)
    b = torch.randn(9, generator=torch.Generator().manual_seed(5), requires_grad=True)
    y = bias_act(x, b, "gelu_tanh")
    assert y.shape == (0, 9) and y.dtype == torch.float32
    y.sum().backward()
    assert x.grad.shape == (0, 9)
    torch.testing.assert_close(b.grad, torch.zeros(9))

    dx, db = bias_act_bwd(torch.empty(0, 9), x.detach(), b.detach(), "relu")
    assert dx.shape == (0, 9)
    torch.testing.assert_close(db, torch.zeros(9))


_X = torch.ones(4, 6)
_B = torch.ones(6)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((torch.ones(6), _B, "relu"), r"2-D.*\(6,\)"),
        ((torch.ones(2, 4, 6), _B, "relu"), r"2-D.*\(2, 4, 6\)"),
        ((torch.ones(4, 0), torch.ones(0), "relu"), r"N >= 1.*\(4, 0\)"),
        ((_X, torch.ones(5), "relu"), r"\[6\].*\(5,\)"),
        ((_X, torch.ones(1, 6), "relu"), r"\[6\].*\(1, 6\)"),
        ((_X, _B, "swish"), r"'swish'.*identity.*relu.*sigmoid.*gelu_tanh"),
        ((_X, _B.double(), "relu"), r"torch.float64.*torch.float32"),
        ((_X.long(), _B.long(), "relu"), r"torch.int64"),
        ((_X, torch.ones(6, device="meta"), "relu"), r"meta.*cpu"),
    ],
    ids=["x-1d", "x-3d", "n-zero", "b-short", "b-2d", "activation", "dtype-mismatch", "int-dtype", "devices"],
)
def test_invalid_inputs_raise_value_error(args, match):
    with pytest.raises(ValueError, match=match):
        bias_act_fwd(*args)
    with pytest.raises(ValueError, match=match):
        bias_act_bwd(torch.ones_like(args[0]), *args)
    if args[1].device.type == "cpu":  # the custom op itself dispatches on the mixed cpu/meta device
        with pytest.raises(ValueError, match=match):
            bias_act(*args)


def test_invalid_buffers_raise_value_error():
    with pytest.raises(ValueError, match=r"dy must match x.*\(4, 6\).*\(4, 5\)"):
        bias_act_bwd(torch.ones(4, 5), _X, _B, "relu")
    with pytest.raises(ValueError, match=r"out must match x.*torch.float16"):
        bias_act_fwd(_X, _B, "relu", out=torch.empty(4, 6, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"out must be contiguous"):
        bias_act_fwd(_X, _B, "relu", out=torch.empty(6, 4).t())
    with pytest.raises(ValueError, match=r"dx_out must match x.*\(3, 6\)"):
        bias_act_bwd(_X, _X, _B, "relu", dx_out=torch.empty(3, 6))


def test_opcheck():
    """Schema, fake (meta) kernel, autograd registration and AOT dispatch of dlrm::bias_act."""
    x, b, _ = _inputs(5, 11, torch.float32, DEVICE, seed=6)
    torch.library.opcheck(torch.ops.dlrm.bias_act.default, (x.requires_grad_(True), b, "gelu_tanh"))


def test_cpu_fallback_without_triton(monkeypatch):
    """With Triton unusable (CPU tensors, no interpreter) the op falls back to bias_act_ref."""
    monkeypatch.setattr(bias_act_mod, "use_triton", lambda x: False)
    for activation in ACTIVATIONS:
        _check_fwd_bwd(67, 33, activation, torch.float32, "cpu", seed=7)


def test_torch_compile_fullgraph():
    """torch.compile(fullgraph=True) traces the custom ops (no graph break) and matches eager."""
    torch._dynamo.reset()

    def f(x, w, b):
        return bias_act(F.linear(x, w), b, "gelu_tanh")

    g = torch.Generator().manual_seed(8)
    x, w, b, dy = (
        torch.randn(*shape, generator=g).to(DEVICE) for shape in ((33, 24), (17, 24), (17,), (33, 17))
    )
    x, w, b = (t.requires_grad_(True) for t in (x, w, b))

    t0 = time.perf_counter()
    compiled = torch.compile(f, fullgraph=True)
    y = compiled(x, w, b)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    print(f"torch.compile first call (fwd+bwd): {time.perf_counter() - t0:.1f} s")

    y_eager = f(x, w, b)
    grads_eager = torch.autograd.grad(y_eager, (x, w, b), dy)
    torch.testing.assert_close(y, y_eager, **tol(torch.float32, "fwd"))
    for got, want in zip(grads, grads_eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("n", [512, 256, 64, 16, 1])
@pytest.mark.parametrize("m", [128, 2048, 16384])
def test_dlrm_shapes_gpu(m, n, activation, dtype):
    _check_fwd_bwd(m, n, activation, dtype, "cuda", seed=m + n)


@pytest.mark.gpu
def test_new_batch_size_does_not_recompile_gpu():
    kernel = bias_act_mod._bias_act_fwd_kernel
    if not hasattr(kernel, "device_caches"):
        pytest.skip("this Triton has no JITFunction.device_caches")

    def n_compiled():
        return sum(len(entry[0]) for entry in kernel.device_caches.values())

    x, b, _ = _inputs(2048, 64, torch.float32, "cuda", seed=9)
    bias_act_fwd(x, b, "relu")
    before = n_compiled()
    for m in (1, 7, 128, 129, 2047):
        bias_act_fwd(x[:m], b, "relu")
    assert n_compiled() == before


@pytest.mark.gpu
def test_int64_offsets_gpu():
    """M * N > 2**31 elements: the row offsets must not overflow int32."""
    n = 256
    m = 2**31 // n + 3
    if torch.cuda.get_device_properties(0).total_memory < 24 * 2**30:
        pytest.skip("needs ~20 GiB of GPU memory")
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = bias_act_fwd(x, b, "sigmoid")
    for rows in (slice(0, 4), slice(m - 4, m)):
        torch.testing.assert_close(y[rows], bias_act_ref(x[rows], b, "sigmoid"), **tol(torch.bfloat16, "fwd"))
    del y
    dy = torch.randn_like(x)
    dx, db = bias_act_bwd(dy, x, b, "relu")
    for rows in (slice(0, 4), slice(m - 4, m)):
        want = torch.where(x[rows].float() + b.float() > 0, dy[rows].float(), 0.0)
        torch.testing.assert_close(dx[rows].float(), want, **tol(torch.bfloat16, "grad"))
    db_ref = torch.zeros(n, device="cuda")
    for start in range(0, m, 2**20):
        xs, dys = x[start : start + 2**20].float(), dy[start : start + 2**20].float()
        db_ref += torch.where(xs + b.float() > 0, dys, 0.0).sum(0)
    # Sum of ~8.4M terms: fp32 ordering error ~ eps * sqrt(M) * |dz|, far below the bf16 rounding (rtol).
    torch.testing.assert_close(db.float(), db_ref, rtol=1.6e-2, atol=1e-2)
