"""Fused add-bias + activation, forward and backward: ``y = act(x + b)``.

Math
    z = x + b                      (b broadcast over rows)
    y = act(z)
    dx = dz = dy * act'(z)         (same dtype as x)
    db = sum over rows of dz       (fp32 sum, returned in b's dtype)

    act is one of ``ACTIVATIONS`` (identity, relu, sigmoid, gelu_tanh, silu), with the formulas of act and
    act' in ``kernels/activations.py``.

Shapes (glossary letters of a GEMM's output): x [M, N] (M rows, e.g. the batch B; N columns, the layer
width), b [N], y [M, N], dy [M, N]. Any M >= 0 and N >= 1; inputs are made contiguous (row-major) by the
launchers, so the kernels only take row strides and assume a column stride of 1.

Dtypes: x and b both fp32, bf16 or fp16 (the same one); y, dx have x's dtype, db has b's dtype.
Compute dtype: fp32. Every load is cast to fp32 at once (the interpreter computes bf16 wrongly
otherwise) and the bias gradient is accumulated in fp32.

Backward saves the *inputs* x and b (not the output y) and recomputes z = x + b in the backward kernel:
that is one formula for every activation, and it costs the same bytes as saving y (x and y have the same
shape and dtype; b is tiny). For relu and identity it is still correct, just not needed: relu'(z) is
``z > 0``, which equals ``y > 0`` (what PyTorch's relu backward reads), and identity' is 1.

The bias gradient is reduced inside the backward kernel: each of P <= ``MAX_PARTIAL_ROWS`` programs along
M loops over every P-th block of BLOCK_M rows, sums its dz into an fp32 partial per column and writes it
to a [P, N] fp32 buffer; the launcher then sums those partials with ``kernels.gemm.partials.sum_partials``.
No atomics, so db is deterministic run to run.

It equals the PyTorch expression ``act(x + b)`` computed in fp32 and cast back to x's dtype (see
``bias_act_ref``); used after a bias-free GEMM, ``bias_act(F.linear(x, W), b, "relu")`` equals
``torch.relu(F.linear(x, W, b))``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.activations import ACTIVATIONS, act_fwd, act_grad, act_grad_ref, act_ref, check_activation
from kernels.gemm.checks import check_dtypes
from kernels.gemm.partials import row_programs, sum_partials
from kernels.launch import INTERPRETED, use_triton
from kernels.op import define_op

__all__ = [
    "ACTIVATIONS",
    "bias_act",
    "bias_act_ref",
    "bias_act_fwd",
    "bias_act_bwd",
    "bias_act_backward",
    "bias_act_backward_fake",
    "bias_act_setup_context",
    "check_inputs",
]


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


# M (the batch) changes between calls: do not specialize on it (value 1 / divisibility by 16), so a new
# batch size reuses the compiled kernel.
@triton.jit(do_not_specialize=["M"])
def _bias_act_fwd_kernel(
    # pointers
    x_ptr,  # [M, N] input, fp32/bf16/fp16
    b_ptr,  # [N] bias, same dtype as x
    y_ptr,  # [M, N] output, same dtype as x
    # sizes
    M,
    N,
    # strides (row strides, in elements; the column stride is 1)
    stride_xm,
    stride_ym,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACTIVATION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # int64 row offsets: M * N can pass 2**31.
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rows < M
    mask_n = cols < N
    mask = mask_m[:, None] & mask_n[None, :]

    b = tl.load(b_ptr + cols, mask=mask_n, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = act_fwd(x + b[None, :], ACTIVATION)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _bias_act_bwd_kernel(
    # pointers
    dy_ptr,  # [M, N] upstream gradient, same dtype as x
    x_ptr,  # [M, N] saved input
    b_ptr,  # [N] saved bias
    dx_ptr,  # [M, N] output: dz = dy * act'(x + b), same dtype as x
    db_part_ptr,  # [P, N] fp32 output: column sums of dz per program along M (P of them)
    # sizes
    M,
    N,
    # strides (row strides, in elements; the column stride is 1)
    stride_dym,
    stride_xm,
    stride_dxm,
    stride_pm,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACTIVATION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = cols < N
    b = tl.load(b_ptr + cols, mask=mask_n, other=0.0).to(tl.float32)
    # Row blocks pid_m, pid_m + P, ... (P programs along M): few partial rows to sum afterwards. The tile's
    # rows are summed once after the loop, not per block (a cross-warp reduction each time).
    db_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for block in range(pid_m, tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows < M)[:, None] & mask_n[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dz = dy * act_grad(x + b[None, :], ACTIVATION)
        dx_ptrs = dx_ptr + rows[:, None] * stride_dxm + cols[None, :]
        tl.store(dx_ptrs, dz.to(dx_ptr.dtype.element_ty), mask=mask)
        # Masked-out rows must not leak into the sum (act'(b) * 0 is 0, but be explicit: NaN * 0 is NaN).
        db_acc += tl.where(mask, dz, 0.0)
    tl.store(db_part_ptr + pid_m.to(tl.int64) * stride_pm + cols, tl.sum(db_acc, axis=0), mask=mask_n)


# --------------------------------------------------------------------------------------------------
# Tuning
# --------------------------------------------------------------------------------------------------


def _pick_config(n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a row width N. Row-wise op: the width alone decides.

    Tiles of up to 128 columns and ~4096 elements (at least 32 rows), 4 warps: the backward's column sums
    run faster on these than on 256-wide tiles with 8 warps, and the forward runs the same on both. The CPU
    interpreter pays a fixed cost per program and almost nothing per element, so there we use tall tiles
    (BLOCK_M >= 128) to keep grids tiny.
    """
    block_n = min(max(triton.next_power_of_2(n), 16), 128)
    block_m = min(max(4096 // block_n, 32), 256)
    if INTERPRETED:
        block_m = max(block_m, 128)
    num_warps = 4
    return block_m, block_n, num_warps


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


def check_inputs(x: Tensor, b: Tensor, activation: str, op: str = "bias_act") -> None:
    """Raise ValueError, its message opening with `op`, unless x is [M, N] (N >= 1) of a dtype in DTYPES, b
    is [N] of x's dtype and device, and activation one of ACTIVATIONS; works on fake tensors too."""
    check_activation(op, activation)
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D [M, N], got shape {tuple(x.shape)}")
    if x.shape[1] < 1:
        raise ValueError(f"{op}: x must have N >= 1 columns, got shape {tuple(x.shape)}")
    if b.dim() != 1 or b.shape[0] != x.shape[1]:
        raise ValueError(
            f"{op}: bias must have shape [N] = [{x.shape[1]}] for x of shape {tuple(x.shape)}, "
            f"got {tuple(b.shape)}"
        )
    check_dtypes(op, x=x, bias=b)


def _check_like(name: str, t: Tensor, x: Tensor) -> None:
    if t.shape != x.shape or t.dtype != x.dtype or t.device != x.device:
        raise ValueError(
            f"bias_act: {name} must match x ({tuple(x.shape)}, {x.dtype}, {x.device}), "
            f"got ({tuple(t.shape)}, {t.dtype}, {t.device})"
        )


def _output_like(name: str, out: Tensor | None, x: Tensor) -> Tensor:
    """The output buffer `name`: `out`, checked to be contiguous and like x, or a new one for None."""
    if out is None:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _check_like(name, out, x)
    if not out.is_contiguous():
        raise ValueError(f"bias_act: {name} must be contiguous, got strides {out.stride()}")
    return out


def bias_act_fwd(x: Tensor, b: Tensor, activation: str, out: Tensor | None = None) -> Tensor:
    """Launch ``_bias_act_fwd_kernel``: ``y = act(x + b)``.

    Args:
        x: [M, N] fp32/bf16/fp16.
        b: [N], x's dtype and device.
        activation: one of ``ACTIVATIONS``.
        out: optional contiguous [M, N] tensor of x's dtype to write y into (every element is written).

    Returns:
        y: [M, N], x's dtype (``out`` when given).

    Raises:
        ValueError: bad shapes, dtypes, devices, activation, or ``out``.
    """
    check_inputs(x, b, activation)
    out = _output_like("out", out, x)
    m, n = x.shape
    if m == 0:
        return out
    x = x.contiguous()
    b = b.contiguous()
    block_m, block_n, num_warps = _pick_config(n)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _bias_act_fwd_kernel[grid](
        x, b, out,
        m, n,
        x.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, ACTIVATION=activation,
        num_warps=num_warps,
    )  # fmt: skip
    return out


def bias_act_bwd(
    dy: Tensor, x: Tensor, b: Tensor, activation: str, dx_out: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Launch ``_bias_act_bwd_kernel``: ``dx = dy * act'(x + b)``, ``db = dx.sum(0)`` (fp32 sum).

    Args:
        dy: [M, N] gradient of y, x's dtype and device.
        x: [M, N] saved forward input, fp32/bf16/fp16.
        b: [N] saved forward bias, x's dtype and device.
        activation: one of ``ACTIVATIONS``.
        dx_out: optional contiguous [M, N] tensor of x's dtype to write dx into (every element is written).

    Returns:
        (dx, db): dx [M, N] in x's dtype, db [N] in b's dtype (zeros when M == 0).

    Raises:
        ValueError: bad shapes, dtypes, devices, activation, or ``dx_out``.
    """
    check_inputs(x, b, activation)
    _check_like("dy", dy, x)
    dx_out = _output_like("dx_out", dx_out, x)
    m, n = x.shape
    if m == 0:
        return dx_out, torch.zeros_like(b)
    dy = dy.contiguous()  # autograd may hand in an expanded (stride-0) gradient
    x = x.contiguous()
    b = b.contiguous()
    block_m, block_n, num_warps = _pick_config(n)
    grid = (row_programs(m, block_m), triton.cdiv(n, block_n))
    # Every (program row, column) of the partials is written by exactly one program.
    db_part = torch.empty((grid[0], n), dtype=torch.float32, device=x.device)
    _bias_act_bwd_kernel[grid](
        dy, x, b, dx_out, db_part,
        m, n,
        dy.stride(0), x.stride(0), dx_out.stride(0), db_part.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, ACTIVATION=activation,
        num_warps=num_warps,
    )  # fmt: skip
    db = sum_partials(db_part, b.dtype)
    return dx_out, db


# --------------------------------------------------------------------------------------------------
# Reference (plain PyTorch, fp32) and CPU fallback
# --------------------------------------------------------------------------------------------------


def bias_act_ref(x: Tensor, bias: Tensor, activation: str) -> Tensor:
    """Reference ``act(x + bias)`` in plain PyTorch: computed in fp32, cast back to x's dtype.

    Differentiable by autograd (used by the tests for the reference gradients).

    Args:
        x: [M, N] float tensor.
        bias: [N] float tensor.
        activation: one of ``ACTIVATIONS``.

    Returns:
        [M, N] tensor of x's dtype.

    Raises:
        ValueError: unknown activation.
    """
    return act_ref(x.float() + bias.float(), activation).to(x.dtype)


def _bias_act_bwd_ref(dy: Tensor, x: Tensor, b: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    """Backward of ``bias_act_ref`` in plain PyTorch (fp32 math): the CPU fallback of the backward op.

    Analytic, not torch.autograd.grad: inside a custom op's implementation autograd does not record.
    """
    g = act_grad_ref(x.float() + b.float(), activation)
    dz = dy.float() * g
    return dz.to(x.dtype), dz.sum(dim=0).to(b.dtype)


# --------------------------------------------------------------------------------------------------
# Autograd glue: custom ops, so the op works under torch.compile (no tracing into Triton); eager calls
# run the same bodies and formulas without the dispatcher (kernels/op.py)
# --------------------------------------------------------------------------------------------------


def _bias_act_impl(x: Tensor, bias: Tensor, activation: str) -> Tensor:
    if use_triton(x):
        return bias_act_fwd(x, bias, activation)
    check_inputs(x, bias, activation)
    return bias_act_ref(x, bias, activation)


def _bias_act_fake(x: Tensor, bias: Tensor, activation: str) -> Tensor:
    check_inputs(x, bias, activation)
    return x.new_empty(x.shape)


def _bias_act_backward_impl(dy: Tensor, x: Tensor, bias: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    if use_triton(x):
        return bias_act_bwd(dy, x, bias, activation)
    check_inputs(x, bias, activation)
    _check_like("dy", dy, x)
    return _bias_act_bwd_ref(dy, x, bias, activation)


def bias_act_backward_fake(dy: Tensor, x: Tensor, bias: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    """The backward op's fake (dx, db) (also the CUDA C++ op's, kernels.cuda.bias_act)."""
    return x.new_empty(x.shape), bias.new_empty(bias.shape)


def bias_act_setup_context(ctx, inputs, output) -> None:
    """The op's autograd context (also the CUDA C++ op's)."""
    x, bias, activation = inputs
    # Save the inputs (z = x + b is recomputed in the backward kernel), not the output.
    ctx.save_for_backward(x, bias)
    ctx.activation = activation


def bias_act_backward(backward_fn, ctx, dy: Tensor):
    """The op's autograd backward over `backward_fn` (dy, x, bias, activation) -> (dx, db) (also the CUDA
    C++ op's)."""
    x, bias = ctx.saved_tensors
    dx, db = backward_fn(dy, x, bias, ctx.activation)
    return dx, db, None


_bias_act = define_op(
    "bias_act", _bias_act_impl, _bias_act_fake, bias_act_setup_context, bias_act_backward,
    _bias_act_backward_impl, bias_act_backward_fake,
)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def bias_act(x: Tensor, bias: Tensor, activation: str = "relu") -> Tensor:
    """Fused ``act(x + bias)`` with a fused backward (dx and the bias gradient in one kernel).

    Meant to follow a bias-free GEMM: ``bias_act(F.linear(x, W), b, "relu")`` equals
    ``torch.relu(F.linear(x, W, b))``. Differentiable in x and bias; works in eager and under
    ``torch.compile`` (it is the custom op ``torch.ops.dlrm.bias_act``). Runs the Triton kernels on CUDA
    tensors (and on CPU under ``TRITON_INTERPRET=1``), else falls back to ``bias_act_ref``.

    Args:
        x: [M, N] tensor, fp32, bf16 or fp16 (M >= 0, N >= 1). Non-contiguous inputs are copied.
        bias: [N] tensor, same dtype and device as x.
        activation: one of ``ACTIVATIONS``: "identity", "relu" (default), "sigmoid", "gelu_tanh"
            (``0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))``), "silu".

    Returns:
        [M, N] tensor of x's dtype: ``act(x + bias)`` computed in fp32.

    Raises:
        ValueError: x not 2-D or with N == 0, bias shape not [N], unknown activation, unsupported dtype,
            x/bias dtype mismatch, or x/bias on different devices (the message names the values).
    """
    return _bias_act(x, bias, activation)
