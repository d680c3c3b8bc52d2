"""Linear layer with low-rank adapters (LoRA) and activation in one kernel, forward and backward:
``y = act(x @ W^T + s (x @ A^T) @ B^T + b)`` with W and b frozen, A and B trained.

Math (nn.Linear layout; r the adapter rank, s the scale, e.g. alpha / r)
    u  = x @ A^T                      [M, r]   (computed in the same pass over x as x @ W^T; saved)
    z  = x @ W^T + s u @ B^T + b      [M, N]
    y  = act(z)
    backward (W and b are constants: no dW, no db):
    dz = dy * act'                    (from the saved y or z, as linear_act)
    dB = s dz^T @ u                   [N, r]
    du = s dz @ B                     [M, r]
    dA = du^T @ x                     [r, K]
    dx = dz @ W + du @ A              [M, K]   (only where x needs a gradient)

    act is one of ``ACTIVATIONS``; relu and sigmoid save y, gelu_tanh and silu save z (as linear_act).
    The merged layer ``W' = W + s B @ A`` gives the same z (``lora_merge``).

Shapes: x [M, K], weight [N, K], lora_a [r, K], lora_b [N, r], bias [N] or None; any M >= 0, N, K >= 1,
1 <= r <= 128. x may have any row stride (its columns contiguous, else copied).
Dtypes: x, weight, lora_a, lora_b, bias one of fp32, bf16, fp16; outputs and gradients in that dtype; u is
saved in it too. Compute: fp32 accumulation; dot operands in their own dtype on the GPU's tensor cores (fp32
as one TF32 product exactly when ``torch.backends.cuda.matmul.allow_tf32``, else as three, 3xTF32, about
fp32's accuracy), fp32 in the interpreter; u is rounded to the input dtype
before its product with B (as the PyTorch expression does); bias and activation in fp32.

Kernels: ``_lora_linear_fwd_kernel``, one program per [BLOCK_M, BLOCK_N] tile of y: the K loop accumulates x
W^T and x A^T from the same x tiles (A padded to BLOCK_R >= 16 rows with zeros; W and A read from rows of 16
bytes, whole K chunks unmasked and the tail in one masked chunk; pointer loads, where linear_act's
``matmul_tile`` loads through TMA descriptors), then adds s u B^T, the bias and the activation (the
add-multiply-activation epilogue); the programs of the first column tile store u. Backward: linear_act's dz
pass (``kernels.gemm.grads.act_dz``), then cuBLAS GEMMs; dx comes back in rows padded to 16
bytes (``kernels.gemm.layout.new_padded``), as linear_act's.

It equals ``act(F.linear(x, W, b) + s * F.linear(F.linear(x, A), B))`` computed in fp32 and cast back to
x's dtype (``lora_linear_ref``), up to the GEMM precision above.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from kernels import launch
from kernels.activations import ACTIVATIONS, act_bwd_ref, act_fwd, act_ref, check_activation
from kernels.gemm.grads import act_dz, grad_input
from kernels.gemm.layout import aligned_copy, aligned_weight, new_padded, padded_like, rows_contiguous
from kernels.gemm.tiles import dot_chunk, grouped_tile
from kernels.gemm.tuning import autotuned, even_k, input_precision, m_bucket
from kernels.launch import DTYPES, INTERPRETED, use_triton
from kernels.linear_act import SAVES_Y, SAVES_Z
from kernels.op import define_op

__all__ = [
    "ACTIVATIONS",
    "lora_linear",
    "lora_linear_ref",
    "lora_linear_fwd",
    "lora_linear_bwd",
    "lora_merge",
]

MAX_RANK = 128


# M (the batch) changes between calls: do not specialize on it, so a new batch size reuses the kernel.
@triton.jit(do_not_specialize=["M"])
def _lora_linear_fwd_kernel(
    # pointers
    x_ptr,  # [M, K] input
    w_ptr,  # [N, K] frozen weight
    a_ptr,  # [R, K] adapter A
    b_lora_ptr,  # [N, R] adapter B
    bias_ptr,  # [N] (not read unless HAS_BIAS)
    y_ptr,  # [M, N] output act(z)
    z_ptr,  # [M, N] output z (not written unless SAVE_Z)
    u_ptr,  # [M, R] output u = x A^T (written by the programs of the first column tile)
    # sizes
    M,
    N,
    K,
    R,
    M_BUCKET,  # autotuning key only
    scale,  # s
    # strides (rows, in elements; the column stride is 1)
    stride_xm,
    stride_wn,
    stride_am,
    stride_bn,
    stride_ym,
    stride_zm,
    stride_um,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    SAVE_Z: tl.constexpr,
    ACTIVATION: tl.constexpr,
    DOT_FP32: tl.constexpr,  # cast dot operands to fp32 (interpreter only)
    INPUT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,  # K is a multiple of BLOCK_K: no mask along K
    BLOCK_R: tl.constexpr,  # >= R, power of two, >= 16
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, BLOCK_R)
    ks = tl.arange(0, BLOCK_K)
    mask_m = rows < M
    mask_n = cols < N
    mask_r = ranks < R

    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + cols[None, :] * stride_wn + ks[:, None]  # [BLOCK_K, BLOCK_N] tile of W^T
    a_ptrs = a_ptr + ranks[None, :] * stride_am + ks[:, None]  # [BLOCK_K, BLOCK_R] tile of A^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    # Whole chunks with no mask along K, then (unless EVEN_K) the tail in one masked chunk: a mask on every
    # chunk kept the loads from being 16 bytes wide (kernels.gemm.tiles.matmul_tile).
    k_whole = K if EVEN_K else K - K % BLOCK_K
    for _ in range(0, k_whole, BLOCK_K):
        x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=mask_n[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=mask_r[None, :], other=0.0)
        acc = dot_chunk(acc, x, w, DOT_FP32, INPUT_PRECISION)
        acc_u = dot_chunk(acc_u, x, a, DOT_FP32, INPUT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    if not EVEN_K and k_whole < K:
        mask_k = ks < K - k_whole
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=mask_k[:, None] & mask_r[None, :], other=0.0)
        acc = dot_chunk(acc, x, w, DOT_FP32, INPUT_PRECISION)
        acc_u = dot_chunk(acc_u, x, a, DOT_FP32, INPUT_PRECISION)

    # u, rounded to the input dtype (as F.linear(x, A) gives it), then s u B^T.
    u = acc_u.to(u_ptr.dtype.element_ty)
    if pid_n == 0:
        u_mask = mask_m[:, None] & mask_r[None, :]
        tl.store(u_ptr + rows[:, None] * stride_um + ranks[None, :], u, mask=u_mask)
    # [BLOCK_R, BLOCK_N] tile of B^T
    bt_ptrs = b_lora_ptr + cols[None, :] * stride_bn + ranks[:, None]
    bt = tl.load(bt_ptrs, mask=mask_r[:, None] & mask_n[None, :], other=0.0)
    if DOT_FP32:
        u = u.to(tl.float32)
        bt = bt.to(tl.float32)
    acc += scale * tl.dot(u, bt, input_precision=INPUT_PRECISION)

    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SAVE_Z:
        tl.store(z_ptr + rows[:, None] * stride_zm + cols[None, :], acc.to(z_ptr.dtype.element_ty), mask=mask)
    y = act_fwd(acc, ACTIVATION)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


_lora_linear_fwd_kernel = autotuned(_lora_linear_fwd_kernel, "x_ptr", {"GROUP": 8})


def _check_inputs(x, weight, bias, lora_a, lora_b, activation) -> None:
    """Raise ValueError naming the offending values; works on fake tensors too."""
    check_activation("lora_linear", activation)
    if x.dim() != 2 or weight.dim() != 2 or lora_a.dim() != 2 or lora_b.dim() != 2:
        raise ValueError(
            f"lora_linear: x, weight, lora_a, lora_b must be 2-D, got {tuple(x.shape)}, "
            f"{tuple(weight.shape)}, {tuple(lora_a.shape)}, {tuple(lora_b.shape)}"
        )
    (n, k), r = weight.shape, lora_a.shape[0]
    if x.shape[1] != k or k < 1 or n < 1 or tuple(lora_a.shape) != (r, k) or tuple(lora_b.shape) != (n, r):
        raise ValueError(
            f"lora_linear: need x [M, K], weight [N, K], lora_a [r, K], lora_b [N, r] (N, K >= 1), got "
            f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(lora_a.shape)}, {tuple(lora_b.shape)}"
        )
    if not 1 <= r <= MAX_RANK:
        raise ValueError(f"lora_linear: rank r must be in 1..{MAX_RANK}, got {r}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"lora_linear: bias must be [N] = [{n}], got {tuple(bias.shape)}")
    tensors = [t for t in (x, weight, lora_a, lora_b, bias) if t is not None]
    if x.dtype not in DTYPES or any(t.dtype != x.dtype for t in tensors):
        raise ValueError(f"lora_linear: one dtype of {DTYPES} expected, got {[t.dtype for t in tensors]}")
    if any(t.device != x.device for t in tensors):
        raise ValueError(f"lora_linear: tensors on several devices: {[str(t.device) for t in tensors]}")


def lora_linear_fwd(x, weight, bias, lora_a, lora_b, scale: float, activation: str):
    """Launch the forward kernel: (y [M, N], saved, u [M, r]); saved is None (identity), y (relu, sigmoid)
    or z (gelu_tanh, silu), as linear_act's. Raises ValueError for bad inputs."""
    _check_inputs(x, weight, bias, lora_a, lora_b, activation)
    m, k = x.shape
    n, r = weight.shape[0], lora_a.shape[0]
    save_z = activation in SAVES_Z
    y = launch.empty((m, n), x.dtype, x.device)
    z = launch.empty((m, n), x.dtype, x.device) if save_z else None
    u = launch.empty((m, r), x.dtype, x.device)
    saved = z if save_z else (y if activation in SAVES_Y else None)
    if m == 0:
        return y, saved, u
    x = rows_contiguous(x)
    weight, lora_a, lora_b = aligned_weight(weight), aligned_weight(lora_a), lora_b.contiguous()

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    _lora_linear_fwd_kernel[grid](
        x, weight, lora_a, lora_b, bias.contiguous() if bias is not None else x, y, z if save_z else y, u,
        m, n, k, r, m_bucket(m), float(scale),
        x.stride(0), weight.stride(0), lora_a.stride(0), lora_b.stride(0), y.stride(0),
        (z if save_z else y).stride(0), u.stride(0),
        HAS_BIAS=bias is not None, SAVE_Z=save_z, ACTIVATION=activation, DOT_FP32=INTERPRETED,
        INPUT_PRECISION=input_precision(x.dtype), EVEN_K=even_k(k),
        BLOCK_R=max(16, triton.next_power_of_2(r)),
    )  # fmt: skip
    return y, saved, u


def lora_linear_bwd(dy, x, weight, lora_a, lora_b, saved, u, scale: float, activation: str, needs_dx: bool):
    """The backward (module docstring): (dx [M, K] or None, dA [r, K], dB [N, r]) in x's dtype."""
    _check_inputs(x, weight, None, lora_a, lora_b, activation)
    m, k = x.shape
    if m == 0:
        return (new_padded(m, k, x) if needs_dx else None), torch.zeros_like(lora_a), torch.zeros_like(lora_b)
    dz, _ = act_dz(dy, saved, activation, False, x.dtype)
    db_lora = torch.mm(dz.t(), u).mul_(scale)
    du = torch.mm(dz, lora_b).mul_(scale)
    da = torch.mm(du.t(), x)
    # dx in rows padded to 16 bytes, where cuBLAS writes fast (kernels.gemm.layout.new_padded), A read from
    # such rows too.
    dx = grad_input(dz, weight).addmm_(du, aligned_weight(lora_a)) if needs_dx else None
    return dx, da, db_lora


# --------------------------------------------------------------------------------------------------
# Reference (plain PyTorch, fp32), CPU fallback and merge
# --------------------------------------------------------------------------------------------------


def lora_linear_ref(
    x, weight, bias, lora_a, lora_b, scale: float, activation: str, u_dtype: torch.dtype | None = None
) -> Tensor:
    """Reference ``act(F.linear(x, W, b) + s F.linear(F.linear(x, A), B))`` in fp32, cast back to x's
    dtype; differentiable by autograd (in every input, W and b included). u = x A^T is rounded to
    `u_dtype` (default x's dtype) before its product with B, as the kernel rounds it: an fp32 reference of
    bf16 inputs passes bf16 here, else relu's mask flips wherever that rounding crosses zero."""
    xf = x.float()
    u = F.linear(xf, lora_a.float()).to(u_dtype or x.dtype).float()
    z = F.linear(xf, weight.float(), None if bias is None else bias.float()) + scale * F.linear(
        u, lora_b.float()
    )
    return act_ref(z, activation).to(x.dtype)


def lora_merge(weight: Tensor, lora_a: Tensor, lora_b: Tensor, scale: float) -> Tensor:
    """The merged weight ``W + s B @ A`` [N, K] (computed in fp32, in W's dtype): a plain Linear with it
    gives the adapted layer's z."""
    return (weight.float() + scale * (lora_b.float() @ lora_a.float())).to(weight.dtype)


def _lora_linear_fwd_ref(x, weight, bias, lora_a, lora_b, scale, activation):
    xf = x.float()
    u = F.linear(xf, lora_a.float()).to(x.dtype)
    z = F.linear(xf, weight.float(), None if bias is None else bias.float()) + scale * F.linear(
        u.float(), lora_b.float()
    )
    y = act_ref(z, activation).to(x.dtype)
    saved = z.to(x.dtype) if activation in SAVES_Z else (y if activation in SAVES_Y else None)
    return y, saved, u


def _lora_linear_bwd_ref(dy, x, weight, lora_a, lora_b, saved, u, scale, activation, needs_dx):
    dz = act_bwd_ref(dy, saved, activation).to(x.dtype).float()
    db_lora = scale * (dz.t() @ u.float())
    du = scale * (dz @ lora_b.float())
    da = du.t() @ x.float()
    # dx in the kernels' layout: rows padded to 16 bytes (see the fake).
    dx = aligned_copy((dz @ weight.float() + du @ lora_a.float()).to(x.dtype)) if needs_dx else None
    return dx, da.to(x.dtype), db_lora.to(x.dtype)


# --------------------------------------------------------------------------------------------------
# Autograd glue: custom ops, so the op works under torch.compile; eager calls run the same bodies and
# formulas without the dispatcher (kernels/op.py)
# --------------------------------------------------------------------------------------------------


def _lora_linear_impl(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    lora_a: Tensor,
    lora_b: Tensor,
    scale: float,
    activation: str,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Returns (y, z, u); z is the pre-activation for gelu_tanh/silu, else None (y is saved for relu/sigmoid;
    the custom op's outputs may not alias each other)."""
    if use_triton(x):
        y, saved, u = lora_linear_fwd(x, weight, bias, lora_a, lora_b, scale, activation)
    else:
        _check_inputs(x, weight, bias, lora_a, lora_b, activation)
        y, saved, u = _lora_linear_fwd_ref(x, weight, bias, lora_a, lora_b, scale, activation)
    return y, (saved if activation in SAVES_Z else None), u


def _lora_linear_fake(x, weight, bias, lora_a, lora_b, scale, activation):
    _check_inputs(x, weight, bias, lora_a, lora_b, activation)
    m, n = x.shape[0], weight.shape[0]
    return (
        x.new_empty((m, n)),
        x.new_empty((m, n) if activation in SAVES_Z else (0,)),
        x.new_empty((m, lora_a.shape[0])),
    )


def _lora_linear_backward_impl(
    dy: Tensor,
    x: Tensor,
    weight: Tensor,
    lora_a: Tensor,
    lora_b: Tensor,
    saved: Tensor | None,
    u: Tensor,
    scale: float,
    activation: str,
    needs_dx: bool,
) -> tuple[Tensor | None, Tensor, Tensor]:
    """Returns (dx, dA, dB); dx is None when needs_dx is False."""
    args = (dy, x, weight, lora_a, lora_b, saved, u, scale, activation, needs_dx)
    if use_triton(x):
        return lora_linear_bwd(*args)
    _check_inputs(x, weight, None, lora_a, lora_b, activation)
    return _lora_linear_bwd_ref(*args)


def _lora_linear_backward_fake(dy, x, weight, lora_a, lora_b, saved, u, scale, activation, needs_dx):
    return (
        padded_like(x) if needs_dx else x.new_empty(0),
        lora_a.new_empty(lora_a.shape),
        lora_b.new_empty(lora_b.shape),
    )


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, lora_a, lora_b, scale, activation = inputs
    y, z, u = output
    saved = y if activation in SAVES_Y else (z if activation in SAVES_Z else None)
    ctx.save_for_backward(x, weight, lora_a, lora_b, saved, u)
    ctx.scale, ctx.activation = scale, activation


def _backward(backward_fn, ctx, dy: Tensor, _dz, _du):
    # _dz, _du: gradients w.r.t. internal outputs, which lora_linear never exposes.
    x, weight, lora_a, lora_b, saved, u = ctx.saved_tensors
    needs_dx = ctx.needs_input_grad[0]
    dx, da, db = backward_fn(dy, x, weight, lora_a, lora_b, saved, u, ctx.scale, ctx.activation, needs_dx)
    # W and b are frozen: no gradient (module docstring).
    return (dx if needs_dx else None), None, None, da, db, None, None


_lora_linear = define_op(
    "lora_linear", _lora_linear_impl, _lora_linear_fake, _setup_context, _backward,
    _lora_linear_backward_impl, _lora_linear_backward_fake,
)  # fmt: skip


def lora_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    lora_a: Tensor,
    lora_b: Tensor,
    scale: float = 1.0,
    activation: str = "relu",
) -> Tensor:
    """Fused ``act(x @ weight^T + scale (x @ lora_a^T) @ lora_b^T + bias)``: a frozen Linear with trained
    low-rank adapters, forward and backward (gradients for x, lora_a and lora_b only; weight and bias are
    treated as constants and get none).

    Works in eager and under ``torch.compile`` (the custom op ``torch.ops.dlrm.lora_linear``). Runs the
    Triton kernel on CUDA tensors (and on CPU under ``TRITON_INTERPRET=1``), else plain PyTorch.

    Args:
        x: [M, K], fp32, bf16 or fp16. weight: [N, K]. bias: [N] or None. lora_a: [r, K], lora_b: [N, r]
            (1 <= r <= 128). All one dtype and device.
        scale: s (LoRA's alpha / r).
        activation: one of ``ACTIVATIONS``.

    Returns:
        [M, N] in x's dtype.

    Raises:
        ValueError: shapes, rank, dtypes, devices or activation that do not fit (the message names them).
    """
    y, _, _ = _lora_linear(x, weight, bias, lora_a, lora_b, float(scale), activation)
    return y
