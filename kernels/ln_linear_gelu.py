"""LayerNorm -> Linear -> GELU(tanh) in two kernels each way, forward and backward:
``y = gelu_tanh(layer_norm(x) @ W^T + b)``.

Math (per row i of x; gamma, beta the LayerNorm's affine weight and bias, over the K features)
    mu_i   = mean_k x_ik;   rstd_i = 1 / sqrt(mean_k (x_ik - mu_i)^2 + eps)      (biased variance)
    xhat   = (x - mu) rstd;   a = xhat * gamma + beta                              [M, K]
    z      = a @ W^T + b                                                           [M, N]
    y      = gelu_tanh(z)                       (formula in ``kernels/activations.py``)
    backward:
    dz     = dy * gelu_tanh'(z)
    da     = dz @ W;   dW = dz^T @ a;   db = sum over rows of dz
    dgamma = sum over rows of da * xhat;   dbeta = sum over rows of da
    dxhat  = da * gamma;   dx = rstd (dxhat - mean_k(dxhat) - xhat mean_k(dxhat * xhat))

Shapes (GEMM letters): x [M, K] (M rows, the batch B), ln_weight / ln_bias [K], weight [N, K]
(nn.Linear layout), bias [N] or None, y [M, N]. Any M >= 0, N >= 1, K >= 1 (K = 1 normalizes every row
to beta). x may have any row stride; its columns must be contiguous (else it is copied).

Dtypes: x, ln_weight, ln_bias, weight, bias all fp32, bf16 or fp16 (one dtype); y, z and the gradients
have that dtype; the row statistics are fp32. Compute: LayerNorm statistics and the normalization in
fp32 on values cast right after load (two passes over the row: mean, then the variance of x - mu); a is
stored in x's dtype and goes to ``tl.dot`` in it on the GPU's tensor cores (fp32 as one TF32 product exactly
when ``torch.backends.cuda.matmul.allow_tf32``, else as three, 3xTF32, about fp32's accuracy), as fp32 in the
interpreter; fp32 accumulation; bias and GELU in
fp32. This is what PyTorch's autocast does too: layer_norm in fp32, its output rounded for the GEMM.

Forward: ``_ln_rows_kernel`` writes mu, rstd ([M] fp32 each) and a (in rows padded to 16 bytes), in one
pass over x; then linear_act's forward GEMM (``kernels.linear_act.launch_fwd``) computes z = a W^T + b
and y = gelu_tanh(z) in its epilogue. Saved for backward: x, gamma, W, z, a, mu, rstd. Backward: linear_act's
backward (``kernels.linear_act.linear_act_bwd``: a Triton pass for dz = dy * gelu' and the bias partials, then
cuBLAS for da and dW, reading a's padded rows), then ``_ln_bwd_kernel`` for dx and the fp32 partial sums of
dgamma and dbeta in one pass over the rows.

Why a goes to memory rather than being formed in the GEMM's operand loads: normalized in registers, the A
operand keeps the GEMM far below linear_act's on the same shape, and the backward would have to form a
again for dW; the statistics-and-a pass costs about one read of x and one write of a.

It equals ``F.gelu(F.linear(F.layer_norm(x, (K,), gamma, beta, eps), W, b), approximate="tanh")`` computed
in fp32 and cast back to x's dtype (``ln_linear_gelu_ref``), up to the GEMM precision above.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from kernels import launch
from kernels.activations import act_grad_ref
from kernels.gemm.layout import aligned_copy, aligned_width, leading_columns, padded_like, rows_contiguous
from kernels.gemm.partials import row_programs, sum_partials
from kernels.launch import DTYPES, use_triton
from kernels.linear_act import launch_fwd, linear_act_bwd
from kernels.op import define_op

__all__ = ["ln_linear_gelu", "ln_linear_gelu_ref", "ln_linear_gelu_fwd", "ln_linear_gelu_bwd"]

EPS = 1e-5  # nn.LayerNorm's default


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M"])
def _ln_rows_kernel(
    # pointers
    x_ptr,  # [M, K] input
    gamma_ptr,  # [K] LayerNorm weight
    beta_ptr,  # [K] LayerNorm bias
    mean_ptr,  # [M] fp32 output row means
    rstd_ptr,  # [M] fp32 output row 1/std
    a_ptr,  # [M, KP] output a = xhat * gamma + beta, zeros in columns K..KP-1
    # sizes
    M,
    K,
    KP,  # a's padded width (its row stride)
    eps,
    # strides
    stride_xm,
    # meta-parameters
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_K: tl.constexpr,  # >= KP, power of two: a whole row per block
):
    """LayerNorm's row statistics and its output a, BLOCK_M whole rows per program."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    mask_m = rows < M
    mask = mask_m[:, None] & (ks < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / K
    centered = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=1) / K + eps)
    tl.store(mean_ptr + rows, mean, mask=mask_m)
    tl.store(rstd_ptr + rows, rstd, mask=mask_m)
    gamma = tl.load(gamma_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
    a = centered * rstd[:, None] * gamma[None, :] + beta[None, :]  # zero past K: gamma, beta are
    tl.store(a_ptr + rows[:, None] * KP + ks[None, :], a.to(a_ptr.dtype.element_ty),
             mask=mask_m[:, None] & (ks < KP)[None, :])  # fmt: skip


@triton.jit(do_not_specialize=["M"])
def _ln_bwd_kernel(
    # pointers
    x_ptr,  # [M, K] saved input
    da_ptr,  # [M, K] gradient of a (rows stride_dam apart)
    mean_ptr,  # [M] fp32
    rstd_ptr,  # [M] fp32
    gamma_ptr,  # [K]
    dx_ptr,  # [M, K] output dx, x's dtype (written if WRITE_DX)
    dgamma_part_ptr,  # [P, K] fp32 partial column sums of da * xhat
    dbeta_part_ptr,  # [P, K] fp32 partial column sums of da
    # sizes
    M,
    K,
    # strides
    stride_xm,
    stride_dam,
    stride_dxm,
    # meta-parameters
    WRITE_DX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,  # >= K, power of two: a whole row per block
):
    """LayerNorm's backward: dx per row, and dgamma / dbeta partials. Program p loops over row blocks
    p, p + P, ... and writes its column sums to row p of the partials (summed once, after the loop)."""
    pid = tl.program_id(0)
    ks = tl.arange(0, BLOCK_K)
    mask_k = ks < K
    gamma = tl.load(gamma_ptr + ks, mask=mask_k, other=0.0).to(tl.float32)
    dgamma_acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    dbeta_acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for block in range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask_m = rows < M
        mask = mask_m[:, None] & mask_k[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        da = tl.load(da_ptr + rows[:, None] * stride_dam + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=mask_m, other=0.0)[:, None]
        rstd = tl.load(rstd_ptr + rows, mask=mask_m, other=0.0)[:, None]
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        dgamma_acc += da * xhat
        dbeta_acc += da
        if WRITE_DX:
            dxhat = da * gamma[None, :]
            c1 = tl.sum(dxhat, axis=1)[:, None] / K
            c2 = tl.sum(dxhat * xhat, axis=1)[:, None] / K
            dx = rstd * (dxhat - c1 - xhat * c2)
            tl.store(
                dx_ptr + rows[:, None] * stride_dxm + ks[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask
            )
    tl.store(dgamma_part_ptr + pid * K + ks, tl.sum(dgamma_acc, axis=0), mask=mask_k)
    tl.store(dbeta_part_ptr + pid * K + ks, tl.sum(dbeta_acc, axis=0), mask=mask_k)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


def _check_inputs(
    x: Tensor, ln_weight: Tensor, ln_bias: Tensor | None, weight: Tensor, bias: Tensor | None
) -> None:
    """Raise ValueError naming the offending values (ln_bias and bias unchecked where None, as the backward
    passes them); works on fake tensors too."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"ln_linear_gelu: x must be [M, K] and weight [N, K], got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    k = x.shape[1]
    if weight.shape[1] != k or k < 1 or weight.shape[0] < 1:
        raise ValueError(
            f"ln_linear_gelu: weight must be [N, K] (N >= 1) with K = {k} >= 1 columns for x of shape "
            f"{tuple(x.shape)}, got {tuple(weight.shape)}"
        )
    if x.dtype not in DTYPES:
        raise ValueError(f"ln_linear_gelu: x dtype must be one of {DTYPES}, got {x.dtype}")
    named = [("ln_weight", ln_weight, (k,)), ("weight", weight, tuple(weight.shape))]
    if ln_bias is not None:
        named.append(("ln_bias", ln_bias, (k,)))
    if bias is not None:
        named.append(("bias", bias, (weight.shape[0],)))
    for name, t, shape in named:
        if tuple(t.shape) != shape or t.dtype != x.dtype or t.device != x.device:
            raise ValueError(
                f"ln_linear_gelu: {name} must be ({shape}, {x.dtype}, {x.device}) for x of shape "
                f"{tuple(x.shape)}, got ({tuple(t.shape)}, {t.dtype}, {t.device})"
            )


def _rows_meta(width: int) -> dict:
    """Row-wise kernels: a whole row per block, BLOCK_M rows so a block holds ~4k values."""
    block_k = triton.next_power_of_2(width)
    return {
        "BLOCK_K": block_k,
        "BLOCK_M": max(1, min(64, 4096 // block_k)),
        "num_warps": 4 if block_k >= 512 else 2,
    }


def ln_linear_gelu_fwd(
    x: Tensor, ln_weight: Tensor, ln_bias: Tensor, weight: Tensor, bias: Tensor | None, eps: float = EPS
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Launch the LayerNorm pass and the GEMM: (y [M, N], z [M, N], a [M, K], mean [M], rstd [M]) (module
    docstring); y, z, a in x's dtype (a in rows padded to 16 bytes), mean and rstd fp32.

    Raises:
        ValueError: bad shapes, dtypes or devices.
    """
    _check_inputs(x, ln_weight, ln_bias, weight, bias)
    m, k = x.shape
    kp = aligned_width(k, x.dtype)
    a = leading_columns(launch.empty((m, kp), x.dtype, x.device), k)
    mean = launch.empty((m,), torch.float32, x.device)
    rstd = launch.empty((m,), torch.float32, x.device)
    if m > 0:
        x = rows_contiguous(x)
        meta = _rows_meta(kp)
        _ln_rows_kernel[(triton.cdiv(m, meta["BLOCK_M"]),)](
            x, ln_weight.contiguous(), ln_bias.contiguous(), mean, rstd, a, m, k, kp, eps, x.stride(0), **meta
        )
    y, z = launch_fwd(a, weight, bias, "gelu_tanh")
    return y, z, a, mean, rstd


def _check_saved(x: Tensor, weight: Tensor, dy: Tensor, a: Tensor, mean: Tensor, rstd: Tensor) -> None:
    """Raise ValueError unless dy [M, N], a [M, K] and mean, rstd [M] fit x [M, K] and W [N, K]."""
    (m, k), n = x.shape, weight.shape[0]
    shapes = (tuple(dy.shape), tuple(a.shape), tuple(mean.shape), tuple(rstd.shape))
    if shapes != ((m, n), (m, k), (m,), (m,)) or a.dtype != x.dtype:
        raise ValueError(
            f"ln_linear_gelu: dy must be [{m}, {n}], a [{m}, {k}] ({x.dtype}) and mean, rstd [{m}], got "
            f"{shapes[0]}, {shapes[1]} ({a.dtype}), {shapes[2]}, {shapes[3]}"
        )


def ln_linear_gelu_bwd(
    dy: Tensor,
    x: Tensor,
    ln_weight: Tensor,
    weight: Tensor,
    z: Tensor,
    a: Tensor,
    mean: Tensor,
    rstd: Tensor,
    has_bias: bool,
    needs_dx: bool = True,
) -> tuple[Tensor | None, Tensor, Tensor, Tensor, Tensor | None]:
    """The backward (module docstring).

    Args:
        dy: [M, N] gradient of y; x, ln_weight, weight: the forward's inputs; z, a, mean, rstd: the
            forward's saved outputs. has_bias: whether to return db. needs_dx: whether to compute dx.

    Returns:
        (dx [M, K] or None, dgamma [K], dbeta [K], dW [N, K], db [N] or None), in x's dtype.

    Raises:
        ValueError: bad shapes, dtypes or devices.
    """
    _check_inputs(x, ln_weight, None, weight, None)
    _check_saved(x, weight, dy, a, mean, rstd)
    m, k = x.shape
    n = weight.shape[0]
    if m == 0:
        zeros_k = x.new_zeros(k)
        db = x.new_zeros(n) if has_bias else None
        return (x.new_zeros(m, k) if needs_dx else None), zeros_k, zeros_k.clone(), x.new_zeros(n, k), db
    x = rows_contiguous(x)
    da, dw, db = linear_act_bwd(dy, a, weight, z, "gelu_tanh", has_bias, needs_dx=True, method="cublas")
    meta = _rows_meta(k)
    # One program per SM leaves the GPU underused; two per SM beat one and four on the shipped configs'
    # layers (fp32 and bf16).
    programs = row_programs(m, meta["BLOCK_M"], 2)
    dx = launch.empty((m, k), x.dtype, x.device) if needs_dx else None
    dgamma_part = launch.empty((programs, k), torch.float32, x.device)
    dbeta_part = launch.empty((programs, k), torch.float32, x.device)
    _ln_bwd_kernel[(programs,)](
        x, da, mean, rstd, ln_weight.contiguous(), dx if needs_dx else x, dgamma_part, dbeta_part,
        m, k, x.stride(0), da.stride(0), dx.stride(0) if needs_dx else 0,
        WRITE_DX=needs_dx, **meta,
    )  # fmt: skip
    return dx, sum_partials(dgamma_part, x.dtype), sum_partials(dbeta_part, x.dtype), dw, db


# --------------------------------------------------------------------------------------------------
# Reference (plain PyTorch, fp32) and CPU fallback
# --------------------------------------------------------------------------------------------------


def ln_linear_gelu_ref(
    x: Tensor, ln_weight: Tensor, ln_bias: Tensor, weight: Tensor, bias: Tensor | None, eps: float = EPS
) -> Tensor:
    """Reference ``gelu_tanh(F.linear(F.layer_norm(x, (K,), ln_weight, ln_bias, eps), weight, bias))`` in
    fp32, cast back to x's dtype. Differentiable by autograd (the tests' reference gradients).

    Args:
        x: [M, K]; ln_weight, ln_bias: [K]; weight: [N, K]; bias: [N] or None; eps: LayerNorm's eps.

    Returns:
        [M, N] in x's dtype.
    """
    a = F.layer_norm(x.float(), (x.shape[1],), ln_weight.float(), ln_bias.float(), eps)
    z = F.linear(a, weight.float(), None if bias is None else bias.float())
    return F.gelu(z, approximate="tanh").to(x.dtype)


def _ln_linear_gelu_fwd_ref(x, ln_weight, ln_bias, weight, bias, eps):
    xf = x.float()
    var, mean = torch.var_mean(xf, dim=1, unbiased=False)
    rstd = torch.rsqrt(var + eps)
    a = ((xf - mean[:, None]) * rstd[:, None] * ln_weight.float() + ln_bias.float()).to(x.dtype)
    z = F.linear(a.float(), weight.float(), None if bias is None else bias.float())
    a = aligned_copy(a)  # the kernels' layout (see the fake)
    return F.gelu(z, approximate="tanh").to(x.dtype), z.to(x.dtype), a, mean, rstd


def _ln_linear_gelu_bwd_ref(dy, x, ln_weight, weight, z, a, mean, rstd, has_bias, needs_dx):
    """``ln_linear_gelu_bwd`` in plain PyTorch (fp32, analytic: autograd does not record in a custom op)."""
    xhat = (x.float() - mean[:, None]) * rstd[:, None]
    dz = (dy.float() * act_grad_ref(z.float(), "gelu_tanh")).to(x.dtype).float()
    da = (dz @ weight.float()).to(x.dtype).float()
    dxhat = da * ln_weight.float()
    dx = rstd[:, None] * (dxhat - dxhat.mean(1, keepdim=True) - xhat * (dxhat * xhat).mean(1, keepdim=True))
    return (
        dx.to(x.dtype) if needs_dx else None,
        (da * xhat).sum(0).to(x.dtype),
        da.sum(0).to(x.dtype),
        (dz.t() @ a.float()).to(x.dtype),
        dz.sum(0).to(x.dtype) if has_bias else None,
    )


# --------------------------------------------------------------------------------------------------
# Autograd glue: custom ops, so the op works under torch.compile (no tracing into Triton); eager calls
# run the same bodies and formulas without the dispatcher (kernels/op.py)
# --------------------------------------------------------------------------------------------------


def _ln_linear_gelu_impl(
    x: Tensor, ln_weight: Tensor, ln_bias: Tensor, weight: Tensor, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (y, z, a, mean, rstd); the last four are saved for the backward."""
    if use_triton(x):
        return ln_linear_gelu_fwd(x, ln_weight, ln_bias, weight, bias, eps)
    _check_inputs(x, ln_weight, ln_bias, weight, bias)
    return _ln_linear_gelu_fwd_ref(x, ln_weight, ln_bias, weight, bias, eps)


def _ln_linear_gelu_fake(x, ln_weight, ln_bias, weight, bias, eps):
    _check_inputs(x, ln_weight, ln_bias, weight, bias)
    m, n = x.shape[0], weight.shape[0]
    stats = x.new_empty((m,), dtype=torch.float32)
    return x.new_empty((m, n)), x.new_empty((m, n)), padded_like(x), stats, stats.clone()


def _ln_linear_gelu_backward_impl(
    dy: Tensor,
    x: Tensor,
    ln_weight: Tensor,
    weight: Tensor,
    z: Tensor,
    a: Tensor,
    mean: Tensor,
    rstd: Tensor,
    has_bias: bool,
    needs_dx: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (dx, dgamma, dbeta, dW, db); dx / db are empty [0] tensors when needs_dx / has_bias is
    False."""
    args = (dy, x, ln_weight, weight, z, a, mean, rstd, has_bias, needs_dx)
    if use_triton(x):
        dx, dgamma, dbeta, dw, db = ln_linear_gelu_bwd(*args)
    else:
        _check_inputs(x, ln_weight, None, weight, None)
        _check_saved(x, weight, dy, a, mean, rstd)
        dx, dgamma, dbeta, dw, db = _ln_linear_gelu_bwd_ref(*args)
    # Distinct empty tensors: custom-op outputs may not alias each other.
    empty = x.new_empty
    return (dx if dx is not None else empty((0,))), dgamma, dbeta, dw, (db if db is not None else empty((0,)))


def _ln_linear_gelu_backward_fake(dy, x, ln_weight, weight, z, a, mean, rstd, has_bias, needs_dx):
    k = x.shape[1]
    return (
        x.new_empty(x.shape if needs_dx else (0,)),
        x.new_empty((k,)),
        x.new_empty((k,)),
        weight.new_empty(weight.shape),
        x.new_empty((weight.shape[0],) if has_bias else (0,)),
    )


def _setup_context(ctx, inputs, output) -> None:
    x, ln_weight, _, weight, bias, _ = inputs
    _, z, a, mean, rstd = output
    ctx.save_for_backward(x, ln_weight, weight, z, a, mean, rstd)
    ctx.has_bias = bias is not None


def _backward(backward_fn, ctx, dy: Tensor, _dz, _da, _dmean, _drstd):
    # _dz, _da, _dmean, _drstd: gradients w.r.t. internal outputs, which ln_linear_gelu never exposes.
    needs_dx = ctx.needs_input_grad[0]  # False for the first layer: its input is data
    # saved: x, ln_weight, weight, z, a, mean, rstd (_setup_context)
    dx, dgamma, dbeta, dw, db = backward_fn(dy, *ctx.saved_tensors, ctx.has_bias, needs_dx)
    return (dx if needs_dx else None), dgamma, dbeta, dw, (db if ctx.has_bias else None), None


_ln_linear_gelu = define_op(
    "ln_linear_gelu", _ln_linear_gelu_impl, _ln_linear_gelu_fake, _setup_context, _backward,
    _ln_linear_gelu_backward_impl, _ln_linear_gelu_backward_fake,
)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def ln_linear_gelu(
    x: Tensor,
    ln_weight: Tensor,
    ln_bias: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    eps: float = EPS,
) -> Tensor:
    """``gelu_tanh(layer_norm(x) @ weight^T + bias)`` (nn.LayerNorm, nn.Linear, GELU tanh) in two kernels
    each way: LayerNorm, then the GEMM with bias and GELU in its epilogue (module docstring).

    Differentiable in x and every parameter; works in eager and under ``torch.compile`` (the custom op
    ``torch.ops.dlrm.ln_linear_gelu``, whose backward is ``torch.ops.dlrm.ln_linear_gelu_backward``). Runs
    the Triton kernels on CUDA tensors (and on CPU under ``TRITON_INTERPRET=1``), else plain PyTorch.

    Args:
        x: [M, K] tensor, fp32, bf16 or fp16 (M >= 0, K >= 1).
        ln_weight: [K] LayerNorm weight (gamma), x's dtype and device.
        ln_bias: [K] LayerNorm bias (beta), x's dtype and device.
        weight: [N, K] Linear weight (N >= 1), x's dtype and device.
        bias: [N] Linear bias, x's dtype and device, or None.
        eps: added to the (biased) variance, as nn.LayerNorm's eps.

    Returns:
        [M, N] tensor of x's dtype (statistics, normalization, GEMM accumulation and GELU in fp32).

    Raises:
        ValueError: x or weight not 2-D, K mismatch, N == 0 or K == 0, parameter shapes not [K] / [N],
            unsupported or mismatched dtypes, or tensors on different devices.
    """
    y, *_ = _ln_linear_gelu(x, ln_weight, ln_bias, weight, bias, eps)
    return y
