"""dW and db of ``y = act(x @ W^T + b)`` for a layer whose input needs no gradient (no dx): the Triton dW
GEMM with dz = dy * act' formed in registers (``act_dw``), which saves the cuBLAS backward's [M, N] dz pass
(``kernels.gemm.grads.act_grads``), and the choice of the faster of the two (``fastest_dw``).

Which one runs in linear_act's backward (CUDA-graph replays of each backward alone over the kaggle and
mlperf layers are in scripts/results/linear_act_backward.csv):
  - dx needed (every layer but the first): always cuBLAS, not timed: a Triton dx GEMM with dz fused into
    its loads is slower than cuBLAS's on nearly every layer, and not enough faster on the rest to keep.
  - no dx (the first layer, whose input is data: K = 13 dense features): the faster of the two, timed as
    graph replays the first time a shape is seen on the GPU (``fastest_dw``); which one wins depends on
    the precision and the batch. The backward reads x's 16-byte-row copy, as the op hands it over, so the
    timed choice sees the op's real inputs.

``_act_dw_kernel``: one program per ([BLOCK_N, BLOCK_K] tile of dW, chunk of rows), reducing over
M: it loads dy and the saved y/z tiles [BLOCK_M, BLOCK_N], forms dz in registers (``act_bwd``), rounds it to
the input dtype and dots dz^T with an x tile; the programs of the first K tile also sum dz over rows for db.
Split-M: DLRM layers are small (N * K of a few thousand) while M (the batch) is large, so the rows are cut
into ``splits`` chunks (``_dw_rows_per_split``); each program writes its fp32 partials to [splits, N, K]
and [splits, N] buffers, and the launcher sums them over the split axis
(``kernels.gemm.partials.sum_partials``).
No atomics: every partial element is written by exactly one program, so autotuning re-runs are harmless and
the result is the same run to run (for a given autotuned config).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import launch
from kernels.activations import act_bwd
from kernels.gemm.grads import act_grads
from kernels.gemm.layout import rows_contiguous
from kernels.gemm.partials import sum_partials
from kernels.gemm.tuning import ChoiceTable, autotuned, fastest, input_precision, m_bucket
from kernels.launch import INTERPRETED

__all__ = ["act_dw", "fastest_dw"]


# M (the batch) and ROWS_PER_SPLIT, which follows it, change between calls: do not specialize on them, so a
# new batch size reuses the compiled kernel. M_BUCKET only feeds the autotuning key.
@triton.jit(do_not_specialize=["M", "ROWS_PER_SPLIT"])
def _act_dw_kernel(
    # pointers
    dy_ptr,  # [M, N] upstream gradient, x's dtype
    s_ptr,  # [M, N] saved y (relu, sigmoid) or z (gelu_tanh, silu); not read for identity
    x_ptr,  # [M, K] saved input
    dw_part_ptr,  # [splits, N, K] fp32 output: per-split partial sums of dz^T @ x
    db_part_ptr,  # [splits, N] fp32 output: per-split column sums of dz (not written unless HAS_BIAS)
    # sizes
    M,
    N,
    K,
    M_BUCKET,  # autotuning key only
    ROWS_PER_SPLIT,  # rows of each split (the last may be shorter)
    # strides (in elements; the column stride is 1)
    stride_dym,
    stride_sm,
    stride_xm,
    stride_dws,  # dw_part split stride (N * K)
    stride_dwn,  # dw_part row stride (K)
    stride_dbs,  # db_part split stride (N)
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,  # reduction chunk
):
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    num_pid_k = tl.cdiv(K, BLOCK_K)
    pid_n = pid // num_pid_k
    pid_k = pid % num_pid_k
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = pid_k.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_n = cols < N
    mask_k = ks < K

    row_start = pid_s.to(tl.int64) * ROWS_PER_SPLIT
    row_end = tl.minimum(row_start + ROWS_PER_SPLIT, M)
    rows = row_start + tl.arange(0, BLOCK_M)
    dy_ptrs = dy_ptr + rows[:, None] * stride_dym + cols[None, :]  # [BLOCK_M, BLOCK_N]
    s_ptrs = s_ptr + rows[:, None] * stride_sm + cols[None, :]
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]  # [BLOCK_M, BLOCK_K]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for m0 in range(0, row_end - row_start, BLOCK_M):
        mask_m = rows < row_end - m0
        mask_mn = mask_m[:, None] & mask_n[None, :]
        # Masked-out elements load 0 and give dz = 0 for every activation: they add nothing below.
        dy = tl.load(dy_ptrs, mask=mask_mn, other=0.0).to(tl.float32)
        if ACTIVATION == "identity":
            dz = dy
        else:
            s = tl.load(s_ptrs, mask=mask_mn, other=0.0).to(tl.float32)
            dz = act_bwd(dy, s, ACTIVATION)
        if HAS_BIAS:
            db_acc += tl.sum(dz, axis=0)
        xt = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if DOT_FP32:
            xt = xt.to(tl.float32)
        else:
            dz = dz.to(x_ptr.dtype.element_ty)
        acc = tl.dot(tl.trans(dz), xt, acc, input_precision=INPUT_PRECISION)
        dy_ptrs += BLOCK_M * stride_dym
        s_ptrs += BLOCK_M * stride_sm
        x_ptrs += BLOCK_M * stride_xm

    mask = mask_n[:, None] & mask_k[None, :]
    dw_ptrs = dw_part_ptr + pid_s.to(tl.int64) * stride_dws + cols[:, None] * stride_dwn + ks[None, :]
    tl.store(dw_ptrs, acc, mask=mask)
    if HAS_BIAS:
        # Every program of this column block computed the same db_acc; the one of the first K tile stores it.
        tl.store(db_part_ptr + pid_s.to(tl.int64) * stride_dbs + cols, db_acc, mask=mask_n & (pid_k == 0))


# The dW tile is [N, K] over an M reduction.
_act_dw_kernel = autotuned(_act_dw_kernel, "x_ptr", names=("BLOCK_N", "BLOCK_K", "BLOCK_M"), dims=("N", "K"))


# Split-M for dW: aim for about two waves of programs on an H100/H200 (132 SMs), but give each split at
# least _DW_MIN_ROWS rows (so the partial buffers stay small next to x and dy), in whole multiples of the
# largest BLOCK_M of any config (so no config sees a ragged split except the last).
_DW_TARGET_PROGRAMS = 264
_DW_MIN_ROWS = 1024
_DW_ROW_ALIGN = 256


def _dw_rows_per_split(m: int, n: int, k: int) -> int:
    """Rows of M per dW program, e.g. M=65536: N=16, K=64 -> 1024 (64 splits); N=K=1024 -> 13312 (5)."""
    tiles = triton.cdiv(n, 128) * triton.cdiv(k, 128)
    splits = max(1, min(triton.cdiv(_DW_TARGET_PROGRAMS, tiles), m // _DW_MIN_ROWS))
    return triton.cdiv(triton.cdiv(m, splits), _DW_ROW_ALIGN) * _DW_ROW_ALIGN


def act_dw(
    dy: Tensor, x: Tensor, saved: Tensor | None, activation: str, has_bias: bool
) -> tuple[Tensor, Tensor | None]:
    """Launch ``_act_dw_kernel`` and sum its partials: (dW, db) (module docstring).
    Its callers check the arguments.

    Args:
        dy: [M, N] gradient of y, x's dtype and device.
        x: [M, K] saved forward input, fp32/bf16/fp16 (read in place if its rows are contiguous).
        saved: [M, N] the forward's y (relu, sigmoid) or z (gelu_tanh, silu); None or ignored for identity.
        activation: one of ``ACTIVATIONS``, as in the forward.
        has_bias: whether to return db.

    Returns:
        (dw, db): dw [N, K], db [N] (None unless has_bias), in x's dtype; zeros when M == 0.
    """
    m, k = x.shape
    n = dy.shape[1]
    if m == 0:
        db = torch.zeros(n, dtype=x.dtype, device=x.device) if has_bias else None
        return torch.zeros(n, k, dtype=x.dtype, device=x.device), db
    dy = dy.contiguous()  # autograd may hand in an expanded (stride-0) gradient
    x = rows_contiguous(x)
    s = saved.contiguous() if activation != "identity" else dy  # dy: a dummy, never read for identity
    rows_per_split = _dw_rows_per_split(m, n, k)
    splits = triton.cdiv(m, rows_per_split)
    # Every (split, n, k) of the partials is written by exactly one program (and (split, n) of db_part).
    dw_part = launch.empty((splits, n, k), torch.float32, x.device)
    db_part = launch.empty((splits, n), torch.float32, x.device) if has_bias else dw_part

    def grid_dw(meta):
        return (triton.cdiv(n, meta["BLOCK_N"]) * triton.cdiv(k, meta["BLOCK_K"]), splits)

    _act_dw_kernel[grid_dw](
        dy, s, x, dw_part, db_part,
        m, n, k, m_bucket(m), rows_per_split,
        dy.stride(0), s.stride(0), x.stride(0), dw_part.stride(0), dw_part.stride(1), db_part.stride(0),
        HAS_BIAS=has_bias, ACTIVATION=activation,
        DOT_FP32=INTERPRETED, INPUT_PRECISION=input_precision(x.dtype),
    )  # fmt: skip
    dw = sum_partials(dw_part, x.dtype)
    db = sum_partials(db_part, x.dtype) if has_bias else None
    return dw, db


# The backward implementation chosen per (M bucket, N, K, dtype, GEMM precision, activation, bias), for
# layers whose dx is not needed.
_BACKWARD_CHOICE = ChoiceTable("dW backward")


def fastest_dw(
    dy: Tensor, x: Tensor, weight: Tensor, saved: Tensor | None, activation: str, has_bias: bool
) -> str:
    """The faster dW + db backward for this shape (no dx): both are timed (median of CUDA-event timings) the
    first time a shape is seen. "triton" saves the [M, N] dz pass; cuBLAS's GEMM may still win (module
    docstring). Inside a CUDA graph
    capture nothing can be timed: an unseen shape then takes "triton". The interpreter times nothing either
    and takes "triton", so the CPU tests run the dW kernel through the autograd op too."""
    if INTERPRETED:
        return "triton"
    key = (m_bucket(x.shape[0]), weight.shape[0], x.shape[1], x.dtype, input_precision(x.dtype), activation,
           has_bias)  # fmt: skip
    candidates = {
        "triton": lambda: act_dw(dy, x, saved, activation, has_bias),
        "cublas": lambda: act_grads(dy, x, weight, saved, activation, has_bias, False),
    }
    return fastest(_BACKWARD_CHOICE, key, candidates)
