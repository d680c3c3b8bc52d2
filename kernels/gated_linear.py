"""Gated linear unit in one GEMM, forward and backward: ``y = gate(a, b)`` with ``[a, b]`` one linear layer.

Math (the weight's rows are interleaved: row 2j gives a_j, row 2j + 1 gives b_j, so the GEMM's output
tile holds both halves of each of its output features and the gate runs in the epilogue)
    z  = x @ W^T + bias             [M, 2N]; a = z[:, 0::2], b = z[:, 1::2], each [M, N]
    y  = gate(a, b)                 [M, N]
    gates (s = sigmoid; gelu_tanh and silu as in ``kernels/activations.py``):
        sigmoid_tanh  y = s(a) tanh(b)      dy/da = s(a) (1 - s(a)) tanh(b)   dy/db = s(a) (1 - tanh(b)^2)
                      (the gated tanh unit)
        geglu         y = a gelu_tanh(b)    dy/da = gelu_tanh(b)              dy/db = a gelu_tanh'(b)
        swiglu        y = a silu(b)         dy/da = silu(b)                   dy/db = a silu'(b)
    backward: dz[:, 2j] = dy_j dy/da_j, dz[:, 2j + 1] = dy_j dy/db_j   [M, 2N], formed from the saved z;
              dx = dz @ W  [M, K];  dW = dz^T @ x  [2N, K];  dbias = sum over rows of dz  [2N]

Shapes (GEMM letters): x [M, K] (M rows, the batch B), weight [2N, K] (nn.Linear layout of a layer with
2N outputs, interleaved as above), bias [2N] or None, y [M, N]. Any M >= 0, N >= 1, K >= 1. x may have
any row stride (a row-padded view is read in place); its columns must be contiguous (else it is copied).

Dtypes: x, weight and bias all fp32, bf16 or fp16 (one dtype); y, z, dx, dW, dbias have that dtype.
Compute dtype: fp32 accumulation; operands go to ``tl.dot`` in their own dtype on the GPU's tensor cores
(fp32 as one TF32 product exactly when ``torch.backends.cuda.matmul.allow_tf32``, like cuBLAS, else as three,
3xTF32, about fp32's accuracy; see ``kernels/gemm/tuning.py``) and as fp32 in the CPU interpreter. Bias and
gate in fp32 on values cast right after load; z and dz are rounded to the input dtype (dz before the backward
GEMMs, as PyTorch does).

Saved for backward: x, weight and the pre-activation z [M, 2N] (written by the forward kernel as a second
output); the backward kernel re-forms a and b from z.

Kernels: ``_gated_linear_fwd_kernel`` (one program per [BLOCK_M, BLOCK_N] tile of z, i.e. BLOCK_N / 2
output features; epilogue adds the bias, stores z, splits the tile into its (a, b) pairs with
``tl.split`` and stores y), autotuned like linear_act's GEMMs; ``_gated_linear_dz_kernel`` (dz and the
bias gradient's fp32 partial sums in one pass over [M, 2N]); cuBLAS then computes dx and dW as linear_act's
backward does (``kernels.gemm.grads.gemm_grads``: aligned operands for cuBLAS's fast kernels, x
copied once into rows of 16 bytes when its rows are not, e.g. the 13 dense features; dx comes back in rows
padded to 16 bytes). The forward loads x and W through TMA descriptors
(``kernels.gemm.layout.tma_descriptor``: a copy in rows of 16 bytes where an operand's rows are not).

It equals the PyTorch expression ``gate(z[:, 0::2], z[:, 1::2])`` with ``z = F.linear(x, W, bias)``,
computed in fp32 and cast back to x's dtype (``gated_linear_ref``), up to the GEMM precision above.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from kernels import launch
from kernels.activations import act_fwd, act_grad, act_grad_ref, sigmoid
from kernels.gemm.checks import check_dtypes
from kernels.gemm.grads import gemm_grads
from kernels.gemm.layout import (
    aligned_copy,
    new_padded,
    padded_like,
    rows_aligned,
    rows_contiguous,
    tma_descriptor,
)
from kernels.gemm.partials import row_programs, sum_partials
from kernels.gemm.tiles import MATMUL_TILE_DESCRIPTORS, grouped_linear_tile
from kernels.gemm.tuning import autotuned, input_precision, m_bucket
from kernels.launch import INTERPRETED, use_triton
from kernels.op import define_op

__all__ = ["GATES", "gated_linear", "gated_linear_ref", "gated_linear_fwd", "gated_linear_bwd"]

GATES = ("sigmoid_tanh", "geglu", "swiglu")


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _gate_fwd(a, b, GATE: tl.constexpr):
    """gate(a, b) for fp32 tiles."""
    if GATE == "sigmoid_tanh":
        y = sigmoid(a) * (2.0 * sigmoid(2.0 * b) - 1.0)  # tanh(b) = 2 s(2b) - 1
    elif GATE == "geglu":
        y = a * act_fwd(b, "gelu_tanh")
    else:  # swiglu
        y = a * act_fwd(b, "silu")
    return y


@triton.jit
def _gate_bwd(dy, a, b, GATE: tl.constexpr):
    """(dy * dgate/da, dy * dgate/db) for fp32 tiles."""
    if GATE == "sigmoid_tanh":
        sa = sigmoid(a)
        tb = 2.0 * sigmoid(2.0 * b) - 1.0
        da = dy * sa * (1.0 - sa) * tb
        db = dy * sa * (1.0 - tb * tb)
    elif GATE == "geglu":
        da = dy * act_fwd(b, "gelu_tanh")
        db = dy * a * act_grad(b, "gelu_tanh")
    else:  # swiglu
        da = dy * act_fwd(b, "silu")
        db = dy * a * act_grad(b, "silu")
    return da, db


# M (the batch) changes between calls: do not specialize on it, so a new batch size reuses the kernel.
@triton.jit(do_not_specialize=["M"])
def _gated_linear_fwd_kernel(
    # operands: TMA descriptors (``kernels.gemm.layout.tma_descriptor``)
    x_desc,  # of x [M, K], fp32/bf16/fp16
    w_desc,  # of W [N, K] (N = 2 x output features, interleaved a/b rows), x's dtype
    # pointers
    b_ptr,  # [N] bias, x's dtype (not read unless HAS_BIAS)
    z_ptr,  # [M, N] output: the pre-activation z, x's dtype
    y_ptr,  # [M, N / 2] output: gate(a, b), x's dtype
    # sizes
    M,
    N,  # the GEMM's width: 2 x output features
    K,
    M_BUCKET,  # autotuning key only
    # strides (row strides, in elements; the column stride is 1)
    stride_zm,
    stride_ym,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    GATE: tl.constexpr,
    DOT_FP32: tl.constexpr,  # cast dot operands to fp32 (interpreter only)
    INPUT_PRECISION: tl.constexpr,  # fp32 dots: "tf32" or "tf32x3" (torch's allow_tf32), "ieee" interpreted
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # z columns per tile (even): BLOCK_N / 2 output features
    BLOCK_K: tl.constexpr,  # reduction chunk
    GROUP: tl.constexpr,
):
    acc, rows, cols, mask, pid_n = grouped_linear_tile(
        x_desc, w_desc, b_ptr, M, N, K, HAS_BIAS, DOT_FP32, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP
    )
    # Epilogue in fp32: z, then the gate over the tile's (a, b) column pairs.
    tl.store(z_ptr + rows[:, None] * stride_zm + cols[None, :], acc.to(z_ptr.dtype.element_ty), mask=mask)
    # Rounded like the stored z, so the backward (which reads z) differentiates the function computed here.
    acc = acc.to(z_ptr.dtype.element_ty).to(tl.float32)
    za, zb = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
    y = _gate_fwd(za, zb, GATE)
    out = pid_n.to(tl.int64) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    y_mask = (rows < M)[:, None] & (out < N // 2)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + out[None, :], y.to(y_ptr.dtype.element_ty), mask=y_mask)


_gated_linear_fwd_kernel = autotuned(_gated_linear_fwd_kernel, "z_ptr", {"GROUP": 8}, MATMUL_TILE_DESCRIPTORS)


@triton.jit(do_not_specialize=["M"])
def _gated_linear_dz_kernel(
    # pointers
    dy_ptr,  # [M, N / 2] gradient of y
    z_ptr,  # [M, N] saved pre-activation (interleaved a, b)
    dz_ptr,  # [M, N] output dz (interleaved da, db), x's dtype
    db_part_ptr,  # [P, N] fp32 partial column sums of dz (HAS_BIAS), P programs along M
    # sizes
    M,
    N,  # 2 x output features
    # strides (rows; the column stride is 1)
    stride_dym,
    stride_zm,
    stride_dzm,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    GATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # output features per program; it reads and writes 2 x BLOCK_N z columns
):
    """dz from dy and the saved z, and the bias gradient's partial sums. Program (p, c) loops over row
    blocks p, p + P, ... and writes its column sums to row p of the partials (summed once, after the loop)."""
    pid_m = tl.program_id(0)
    out = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output features
    cols = tl.program_id(1) * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)  # their z columns
    db_acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    for block in range(pid_m, tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask_y = (rows < M)[:, None] & (out < N // 2)[None, :]
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        dy = tl.load(dy_ptr + rows[:, None] * stride_dym + out[None, :], mask=mask_y, other=0.0)
        z = tl.load(z_ptr + rows[:, None] * stride_zm + cols[None, :], mask=mask, other=0.0)
        za, zb = tl.split(tl.reshape(z.to(tl.float32), (BLOCK_M, BLOCK_N, 2)))
        da, db = _gate_bwd(dy.to(tl.float32), za, zb, GATE)
        dz = tl.reshape(tl.join(da, db), (BLOCK_M, 2 * BLOCK_N))
        tl.store(
            dz_ptr + rows[:, None] * stride_dzm + cols[None, :], dz.to(dz_ptr.dtype.element_ty), mask=mask
        )
        if HAS_BIAS:
            db_acc += tl.where(mask, dz, 0.0)
    if HAS_BIAS:
        tl.store(db_part_ptr + pid_m * N + cols, tl.sum(db_acc, axis=0), mask=cols < N)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


def _check_inputs(x: Tensor, weight: Tensor, bias: Tensor | None, gate: str) -> None:
    """Raise ValueError naming the offending values; works on fake tensors too."""
    if gate not in GATES:
        raise ValueError(f"gated_linear: unknown gate {gate!r}; expected one of {GATES}")
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"gated_linear: x must be [M, K] and weight [2N, K], got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if weight.shape[1] != x.shape[1] or x.shape[1] < 1 or weight.shape[0] < 2 or weight.shape[0] % 2:
        raise ValueError(
            f"gated_linear: weight must be [2N, K] (2N even, >= 2) with K = {x.shape[1]} >= 1 columns for x "
            f"of shape {tuple(x.shape)}, got {tuple(weight.shape)}"
        )
    check_dtypes("gated_linear", x=x, weight=weight)
    if bias is not None and (
        tuple(bias.shape) != (weight.shape[0],) or bias.dtype != x.dtype or bias.device != x.device
    ):
        raise ValueError(
            f"gated_linear: bias must be [{weight.shape[0]}] ({x.dtype}, {x.device}), got "
            f"{tuple(bias.shape)} ({bias.dtype}, {bias.device})"
        )


def gated_linear_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, gate: str) -> tuple[Tensor, Tensor]:
    """Launch ``_gated_linear_fwd_kernel``: (y [M, N], z [M, 2N]) in x's dtype (module docstring).

    Raises:
        ValueError: bad shapes, dtypes, devices or gate.
    """
    _check_inputs(x, weight, bias, gate)
    m, k = x.shape
    n2 = weight.shape[0]
    z = launch.empty((m, n2), x.dtype, x.device)
    y = launch.empty((m, n2 // 2), x.dtype, x.device)
    if m == 0:
        return y, z

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n2, meta["BLOCK_N"]),)

    _gated_linear_fwd_kernel[grid](
        tma_descriptor(x), tma_descriptor(weight), bias.contiguous() if bias is not None else z, z, y,
        m, n2, k, m_bucket(m), z.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, GATE=gate, DOT_FP32=INTERPRETED, INPUT_PRECISION=input_precision(x.dtype),
    )  # fmt: skip
    return y, z


def gated_linear_bwd(
    dy: Tensor, x: Tensor, weight: Tensor, z: Tensor, gate: str, has_bias: bool, needs_dx: bool = True
) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """The backward (module docstring): a Triton pass for dz and the bias partials, then cuBLAS GEMMs.

    Args:
        dy: [M, N] gradient of y, x's dtype and device.
        x: [M, K] saved input; weight: [2N, K] saved weight; z: [M, 2N] the forward's pre-activation.
        gate: one of ``GATES``, as in the forward.
        has_bias: whether to return dbias. needs_dx: whether to compute dx (False skips its GEMM).

    Returns:
        (dx [M, K] in rows padded to 16 bytes, or None; dW [2N, K]; dbias [2N] or None), in x's dtype;
        dW, dbias zeros when M == 0.

    Raises:
        ValueError: bad shapes, dtypes, devices or gate.
    """
    _check_inputs(x, weight, None, gate)
    m, k = x.shape
    n2 = weight.shape[0]
    for name, t, shape in (("dy", dy, (m, n2 // 2)), ("z", z, (m, n2))):
        if tuple(t.shape) != shape or t.dtype != x.dtype or t.device != x.device:
            raise ValueError(
                f"gated_linear: {name} must be ({shape}, {x.dtype}, {x.device}), got "
                f"({tuple(t.shape)}, {t.dtype}, {t.device})"
            )
    if m == 0:
        db = x.new_zeros(n2) if has_bias else None
        return (new_padded(m, k, x).zero_() if needs_dx else None), x.new_zeros(n2, k), db
    dy, z = dy.contiguous(), z.contiguous()
    x = rows_contiguous(x)
    dz = launch.empty((m, n2), x.dtype, x.device)
    block_n = min(64, triton.next_power_of_2(n2 // 2))
    block_m = max(16, 2048 // block_n)
    grid = (row_programs(m, block_m), triton.cdiv(n2 // 2, block_n))
    db_part = launch.empty((grid[0], n2), torch.float32, x.device) if has_bias else dz
    _gated_linear_dz_kernel[grid](
        dy, z, dz, db_part, m, n2, dy.stride(0), z.stride(0), dz.stride(0),
        HAS_BIAS=has_bias, GATE=gate, BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
    if not rows_aligned(x):
        # cuBLAS takes its slow align1 kernels on rows not 16 bytes apart (K = 13 dense features): copy x
        # once into zero-padded rows, which gemm_grads reads whole, dropping the padding's columns of dW.
        x = aligned_copy(x)
    dx, dw = gemm_grads(dz, x, weight, needs_dx)
    db = sum_partials(db_part, x.dtype) if has_bias else None
    return dx, dw, db


# --------------------------------------------------------------------------------------------------
# Reference (plain PyTorch, fp32) and CPU fallback
# --------------------------------------------------------------------------------------------------


def gate_ref(a: Tensor, b: Tensor, gate: str) -> Tensor:
    """gate(a, b) in plain PyTorch (differentiable). Raises ValueError for an unknown gate."""
    if gate == "sigmoid_tanh":
        return torch.sigmoid(a) * torch.tanh(b)
    if gate == "geglu":
        return a * F.gelu(b, approximate="tanh")
    if gate == "swiglu":
        return a * F.silu(b)
    raise ValueError(f"gated_linear: unknown gate {gate!r}; expected one of {GATES}")


def gated_linear_ref(x: Tensor, weight: Tensor, bias: Tensor | None, gate: str) -> Tensor:
    """Reference ``gate(z[:, 0::2], z[:, 1::2])``, ``z = F.linear(x, weight, bias)``, in fp32, cast back to
    x's dtype. Differentiable by autograd (the tests' reference gradients).

    Args:
        x: [M, K]; weight: [2N, K] (interleaved a/b rows); bias: [2N] or None; gate: one of ``GATES``.

    Returns:
        [M, N] in x's dtype.
    """
    z = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return gate_ref(z[:, 0::2], z[:, 1::2], gate).to(x.dtype)


def _gated_linear_fwd_ref(x: Tensor, weight: Tensor, bias: Tensor | None, gate: str) -> tuple[Tensor, Tensor]:
    z = F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    zf = z.float()
    return gate_ref(zf[:, 0::2], zf[:, 1::2], gate).to(x.dtype), z


def _gated_linear_bwd_ref(dy, x, weight, z, gate, has_bias, needs_dx):
    """``gated_linear_bwd`` in plain PyTorch (fp32 math; analytic: autograd does not record in a custom
    op)."""
    dy, zf = dy.float(), z.float()
    a, b = zf[:, 0::2], zf[:, 1::2]
    if gate == "sigmoid_tanh":
        sa, tb = torch.sigmoid(a), torch.tanh(b)
        da, db = dy * sa * (1 - sa) * tb, dy * sa * (1 - tb * tb)
    else:
        act = "gelu_tanh" if gate == "geglu" else "silu"
        da = dy * (F.gelu(b, approximate="tanh") if act == "gelu_tanh" else F.silu(b))
        db = dy * a * act_grad_ref(b, act)
    dz = torch.stack((da, db), dim=2).reshape(z.shape).to(x.dtype).float()  # rounded as the kernel's
    # dx in the kernels' layout: rows padded to 16 bytes (see the fake).
    dx = aligned_copy((dz @ weight.float()).to(x.dtype)) if needs_dx else None
    return dx, (dz.t() @ x.float()).to(x.dtype), (dz.sum(0).to(x.dtype) if has_bias else None)


# --------------------------------------------------------------------------------------------------
# Autograd glue: custom ops, so the op works under torch.compile (no tracing into Triton); eager calls
# run the same bodies and formulas without the dispatcher (kernels/op.py)
# --------------------------------------------------------------------------------------------------


def _gated_linear_impl(x: Tensor, weight: Tensor, bias: Tensor | None, gate: str) -> tuple[Tensor, Tensor]:
    """Returns (y, z); z [M, 2N] is saved for the backward."""
    if use_triton(x):
        return gated_linear_fwd(x, weight, bias, gate)
    _check_inputs(x, weight, bias, gate)
    return _gated_linear_fwd_ref(x, weight, bias, gate)


def _gated_linear_fake(x: Tensor, weight: Tensor, bias: Tensor | None, gate: str) -> tuple[Tensor, Tensor]:
    _check_inputs(x, weight, bias, gate)
    return x.new_empty((x.shape[0], weight.shape[0] // 2)), x.new_empty((x.shape[0], weight.shape[0]))


def _gated_linear_backward_impl(
    dy: Tensor, x: Tensor, weight: Tensor, z: Tensor, gate: str, has_bias: bool, needs_dx: bool
) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """Returns (dx, dW, dbias); dx / dbias are None when needs_dx / has_bias is False."""
    if use_triton(x):
        return gated_linear_bwd(dy, x, weight, z, gate, has_bias, needs_dx)
    _check_inputs(x, weight, None, gate)
    return _gated_linear_bwd_ref(dy, x, weight, z, gate, has_bias, needs_dx)


def _gated_linear_backward_fake(
    dy: Tensor, x: Tensor, weight: Tensor, z: Tensor, gate: str, has_bias: bool, needs_dx: bool
) -> tuple[Tensor, Tensor, Tensor]:
    return (
        padded_like(x) if needs_dx else x.new_empty(0),
        weight.new_empty(weight.shape),
        x.new_empty((weight.shape[0],) if has_bias else (0,)),
    )


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, gate = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.gate = gate
    ctx.has_bias = bias is not None


def _backward(backward_fn, ctx, dy: Tensor, _dz: Tensor | None):
    # _dz: the gradient w.r.t. the internal output z, which gated_linear never exposes.
    x, weight, z = ctx.saved_tensors
    needs_dx = ctx.needs_input_grad[0]  # False for the first layer: its input is data
    dx, dw, db = backward_fn(dy, x, weight, z, ctx.gate, ctx.has_bias, needs_dx)
    return (dx if needs_dx else None), dw, (db if ctx.has_bias else None), None


_gated_linear = define_op(
    "gated_linear", _gated_linear_impl, _gated_linear_fake, _setup_context, _backward,
    _gated_linear_backward_impl, _gated_linear_backward_fake,
)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def gated_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, gate: str = "sigmoid_tanh") -> Tensor:
    """Fused gated linear unit ``gate(z[:, 0::2], z[:, 1::2])``, ``z = x @ weight^T + bias``, with a fused
    backward.

    Differentiable in x, weight and bias; works in eager and under ``torch.compile`` (the custom op
    ``torch.ops.dlrm.gated_linear``, whose backward is ``torch.ops.dlrm.gated_linear_backward``). Runs
    the Triton kernels on CUDA tensors (and on CPU under ``TRITON_INTERPRET=1``), else plain PyTorch.

    Args:
        x: [M, K] tensor, fp32, bf16 or fp16 (M >= 0, K >= 1).
        weight: [2N, K] tensor, x's dtype and device; rows 2j (a_j) and 2j + 1 (b_j) feed output j.
        bias: [2N] tensor, x's dtype and device, or None.
        gate: "sigmoid_tanh" (``sigmoid(a) tanh(b)``), "geglu" (``a gelu_tanh(b)``) or "swiglu"
            (``a silu(b)``).

    Returns:
        [M, N] tensor of x's dtype (GEMM accumulated in fp32, gate in fp32, one rounding).

    Raises:
        ValueError: x or weight not 2-D, K mismatch, an odd or zero weight height, bias shape not [2N],
            unknown gate, unsupported or mismatched dtypes, or tensors on different devices.
    """
    y, _ = _gated_linear(x, weight, bias, gate)
    return y
