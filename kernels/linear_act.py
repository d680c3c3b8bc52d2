"""Fused Linear + bias + activation, forward and backward: ``y = act(x @ W^T + b)``.

Math (nn.Linear layout: W is [N, K], one row per output feature)
    z  = x @ W^T + b                 (b broadcast over rows; optional)
    y  = act(z)
    dz = dy * act'(z)
    dx = dz @ W                      [M, K]
    dW = dz^T @ x                    [N, K]
    db = sum over rows of dz         [N]

    act is one of ``ACTIVATIONS`` (identity, relu, sigmoid, gelu_tanh, silu; formulas in
    ``kernels/activations.py``); relu' and sigmoid' are taken from the output y (relu' = [y > 0],
    sigmoid' = y (1 - y)), gelu_tanh' and silu' from the pre-activation z.

Shapes (glossary letters of a GEMM): x [M, K] (M rows, e.g. the batch B; K input features), W [N, K],
b [N] or None, y [M, N]. Any M >= 0, N >= 1, K >= 1 (e.g. K = 13 dense features, N = 1 logit, M = 1).
The kernels take row strides only, and are fast only on rows 16 bytes apart (cuBLAS falls back to its
align1 kernels and Triton to narrow loads otherwise): the autograd op copies an x whose rows are not (K = 13
dense features, a contiguous [B, 367]) once into rows padded with zeros to Kp (16 bytes, ``_pads_input``),
and W likewise, so the forward GEMM runs over Kp unmasked columns and the backward's dW reads the same
copy; row-padded inputs (the dot interaction's output, [B, 367] in rows of 368) are read in place. dx
comes back with its rows padded too (cuBLAS writes it as the first K columns of an [M, Kp] GEMM).

Dtypes: x, W and b all fp32, bf16 or fp16 (one dtype); y, dx, dW, db have that dtype.
Compute dtype: fp32 accumulation everywhere. The GEMM operands go to ``tl.dot`` in their own dtype on the
GPU: bf16/fp16 tensor cores; fp32 follows ``torch.backends.cuda.matmul.allow_tf32`` like cuBLAS does:
IEEE fp32 products when it is False (PyTorch's default), TF32 tensor cores (10-bit mantissa operands, fp32
accumulate: a relative error of ~1e-3 per product) when it is True. In the CPU interpreter the operands
are cast to fp32 first (``DOT_FP32``: its bf16 ``dot`` is wrong), so there the GEMM is plain fp32.
Bias, activation and act' run in fp32 on values cast right after load; dz is rounded to the input dtype
before the backward GEMMs (as PyTorch does).

What the forward saves for backward (besides the inputs x and W):
    identity            nothing (act' = 1)
    relu, sigmoid       the output y: relu' = (y > 0), sigmoid' = y (1 - y); no extra tensor is written
    gelu_tanh, silu     the pre-activation z, written by the forward kernel as a second [M, N] output
                        (``SAVE_Z``), since act' cannot be taken from y

Backward (``linear_act_bwd``), two implementations:
  "cublas": ``_linear_act_dz_kernel`` writes dz = dy * act' and the bias gradient's partial sums in one
      pass over [M, N], then cuBLAS computes dx = dz @ W and dW = dz^T @ x.
  "triton" (dW and db only, no dz pass): ``_linear_act_bwd_dw_kernel``, one program per ([BLOCK_N, BLOCK_K]
      tile of dW, chunk of rows), reducing over M: it loads dy and the saved y/z tiles [BLOCK_M, BLOCK_N],
      forms dz in registers and dots dz^T with an x tile; the programs of the first K tile also sum dz over
      rows for db. Split-M: DLRM layers are small (N * K of a few thousand) while M (the batch) is large,
      so the rows are cut into ``splits`` chunks (see ``_dw_rows_per_split``); each program writes its fp32
      partials to [splits, N, K] and [splits, N] buffers, and the launcher sums them over the split axis
      (``kernels.partials.sum_partials``). No atomics: every partial element is written by exactly one
      program, so autotuning re-runs are harmless and the result is the same run to run (for a given
      autotuned config).
Which one runs was measured on an H100 (torch 2.11, triton 3.6; CUDA-graph replays of each backward alone,
every layer of the kaggle and mlperf configs, B = 16384 and 65536, tf32 and bf16;
scripts/results/linear_act_backward.csv):
  - dx needed (every layer but the first): always "cublas", not timed. A Triton dx GEMM with dz fused into
    its loads (since removed), with the dW kernel, took 1.15-4.0x cuBLAS's time (tf32 1.3-4.0x, bf16
    1.15-3.5x) on every layer but two bf16 ones at B = 65536, 256 -> 64 and 256 -> 128, where it took 0.908x
    and 0.938x (6.6 and 6.0 us saved): too little to keep a dx GEMM kernel for.
  - no dx (the first layer, whose input is data: K = 13 dense features): the faster of the two, timed as
    graph replays the first time a shape is seen on the GPU (``_pick_backward``). On 13 -> 512 Triton took
    0.70x cuBLAS's time in tf32 at B = 16384 (46 vs 67 us) and 0.61x at B = 65536 (133 vs 218 us); in bf16
    1.23x (65 vs 53 us) and 1.0x (165 vs 165 us). Those runs passed x as a contiguous [B, 13] (rows 13
    apart); through the op the backward reads x's 16-byte-row copy, where cuBLAS's dW runs aligned: the
    timed choice sees the op's real inputs.

It equals the PyTorch expression ``act(F.linear(x, W, b))`` computed in fp32 and cast back to x's dtype
(see ``linear_act_ref``), up to the GEMM precision above.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing
from torch import Tensor

from kernels.activations import ACTIVATIONS, act_fwd, act_grad, act_grad_ref, act_ref, check_activation
from kernels.launch import (
    DTYPES,
    INTERPRETED,
    aligned_width,
    leading_columns,
    rows_aligned,
    rows_contiguous,
    use_triton,
)
from kernels.partials import row_programs, sum_partials

__all__ = [
    "ACTIVATIONS",
    "linear_act",
    "linear_act_ref",
    "linear_act_fwd",
    "linear_act_bwd",
]

_SAVES_Y = ("relu", "sigmoid")  # act' is a function of y = act(z)
_SAVES_Z = ("gelu_tanh", "silu")  # act' needs z

# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _act_bwd(dy, s, ACTIVATION: tl.constexpr):
    """dz = dy * act'(.) for fp32 tiles; s is the saved tile: y for relu/sigmoid, z for gelu_tanh/silu."""
    if ACTIVATION == "relu":
        dz = tl.where(s > 0.0, dy, 0.0)
    elif ACTIVATION == "sigmoid":
        dz = dy * s * (1.0 - s)
    elif ACTIVATION == "identity":
        dz = dy
    else:  # gelu_tanh, silu: s is z
        dz = dy * act_grad(s, ACTIVATION)
    return dz


@triton.jit
def _grouped_tile(pid, num_pid_a, num_pid_b, GROUP: tl.constexpr):
    """(pid_a, pid_b) of a 1-D program id, in groups of GROUP rows of tiles (L2 reuse of the B operand)."""
    num_pid_in_group = GROUP * num_pid_b
    group_id = pid // num_pid_in_group
    first_pid_a = group_id * GROUP
    group_size = min(num_pid_a - first_pid_a, GROUP)
    pid_a = first_pid_a + (pid % num_pid_in_group) % group_size
    pid_b = (pid % num_pid_in_group) // group_size
    return pid_a, pid_b


# M (the batch) changes between calls: do not specialize on it (value 1 / divisibility by 16), so a new
# batch size reuses the compiled kernel. M_BUCKET only feeds the autotuning key (a power of two >= 64).
@triton.jit(do_not_specialize=["M"])
def _linear_act_fwd_kernel(
    # pointers
    x_ptr,  # [M, K] input, fp32/bf16/fp16
    w_ptr,  # [N, K] weight, x's dtype
    b_ptr,  # [N] bias, x's dtype (not read unless HAS_BIAS)
    y_ptr,  # [M, N] output y = act(z), x's dtype
    z_ptr,  # [M, N] output z = x @ W^T + b, x's dtype (not written unless SAVE_Z)
    # sizes
    M,
    N,
    K,
    M_BUCKET,  # autotuning key only
    # strides (row strides, in elements; the column stride is 1)
    stride_xm,
    stride_wn,
    stride_ym,
    stride_zm,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    SAVE_Z: tl.constexpr,
    ACTIVATION: tl.constexpr,
    DOT_FP32: tl.constexpr,  # cast dot operands to fp32 (interpreter only)
    INPUT_PRECISION: tl.constexpr,  # fp32 dots: "tf32" or "ieee" (torch's allow_tf32)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # reduction chunk
    GROUP: tl.constexpr,
):
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP)
    # int64 row offsets: M * K and M * N can pass 2**31.
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    mask_m = rows < M
    mask_n = cols < N

    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + cols[None, :] * stride_wn + ks[:, None]  # [BLOCK_K, BLOCK_N] tile of W^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = ks < K - k0
        a = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    # Epilogue: bias, (z), activation, in fp32.
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SAVE_Z:
        tl.store(z_ptr + rows[:, None] * stride_zm + cols[None, :], acc.to(z_ptr.dtype.element_ty), mask=mask)
    y = act_fwd(acc, ACTIVATION)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


# ROWS_PER_SPLIT follows M: do not specialize on it either.
@triton.jit(do_not_specialize=["M", "ROWS_PER_SPLIT"])
def _linear_act_bwd_dw_kernel(
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
            dz = _act_bwd(dy, s, ACTIVATION)
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


# --------------------------------------------------------------------------------------------------
# Tuning
# --------------------------------------------------------------------------------------------------


# Autotuning key: the output/reduction widths and a power-of-two bucket of M (see _m_bucket), so a new batch
# size in the same bucket reuses the tuned config. Triton adds the tensors' dtypes to the key itself.
@triton.jit(do_not_specialize=["M"])
def _linear_act_dz_kernel(
    # pointers
    dy_ptr,  # [M, N] gradient of y
    s_ptr,  # [M, N] saved y (relu, sigmoid) or z (gelu_tanh, silu); dy for identity (not read)
    dz_ptr,  # [M, N] output dz, x's dtype
    db_part_ptr,  # [P, N] fp32 partial column sums of dz (HAS_BIAS), P programs along M
    # sizes
    M,
    N,
    # strides (rows; the column stride is 1)
    stride_dym,
    stride_sm,
    stride_dzm,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dz = dy * act'(.) and the bias gradient's partial sums: the prologue of the cuBLAS backward
    (``_linear_act_bwd_cublas``). Program (p, c) loops over row blocks p, p + P, ... (P programs along M)
    and writes its column sums to row p of the partials (summed over the tile's rows once, after the loop:
    no cross-warp reduction per row block)."""
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    db_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for block in range(pid_m, tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        dy = tl.load(dy_ptr + rows[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if ACTIVATION == "identity":
            dz = dy
        else:
            s_ptrs = s_ptr + rows[:, None] * stride_sm + cols[None, :]
            dz = _act_bwd(dy, tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32), ACTIVATION)
        dz_ptrs = dz_ptr + rows[:, None] * stride_dzm + cols[None, :]
        tl.store(dz_ptrs, dz.to(dz_ptr.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            db_acc += tl.where(mask, dz, 0.0)
    if HAS_BIAS:
        tl.store(db_part_ptr + pid_m * N + cols, tl.sum(db_acc, axis=0), mask=cols < N)


_KEY = ["M_BUCKET", "N", "K"]
_M_BUCKET_MIN, _M_BUCKET_MAX = 64, 65536

# Hopper configs: (tile rows, tile cols, num_warps, num_stages) plus a reduction chunk. Tile dims per kernel
# (rows, cols | reduction): fwd (BLOCK_M, BLOCK_N | BLOCK_K), dw (BLOCK_N, BLOCK_K | BLOCK_M).
# 16-bit operands use a 64-deep reduction chunk, fp32 a 32-deep one (same bytes per stage in shared memory:
# 128x256 tiles with 3 stages need ~144 KiB either way, under Hopper's 227 KiB); _pruner keeps the set of the
# operand's element size.
_GPU_SHAPES = [
    (128, 256, 8, 3),
    (256, 128, 8, 3),
    (128, 128, 4, 4),
    (128, 64, 4, 4),
    (64, 128, 4, 4),
    (64, 64, 4, 4),
]
_RED_BY_ELEMENT_SIZE = {2: 64, 4: 32}
# The interpreter runs ~5 ms per program and takes one config: 32-wide tiles, so the tests' small shapes still
# span several tiles (and partial ones) in every dimension.
_INTERPRETER_SHAPE = (32, 32, 32, 4, 1)


def _configs(names: tuple[str, str, str], extra: dict) -> list[triton.Config]:
    if INTERPRETED:
        a, b, r, warps, stages = _INTERPRETER_SHAPE
        return [
            triton.Config({names[0]: a, names[1]: b, names[2]: r, **extra}, num_warps=warps, num_stages=1)
        ]
    return [
        triton.Config({names[0]: a, names[1]: b, names[2]: r, **extra}, num_warps=warps, num_stages=stages)
        for r in _RED_BY_ELEMENT_SIZE.values()
        for a, b, warps, stages in _GPU_SHAPES
    ]


def _pruner(names: tuple[str, str, str], dims: tuple[str, str], operand: str):
    """Keep the configs of the operand's element size whose tiles are not far larger than the problem.

    A tile dim of 64 always stays, so every problem keeps at least the (64, 64) config.
    """

    def prune(configs, named_args, **kwargs):
        elsize = named_args[operand].element_size()
        limits = [max(64, triton.next_power_of_2(int(named_args[d]))) for d in dims]
        kept = [
            c
            for c in configs
            if c.kwargs[names[2]] == _RED_BY_ELEMENT_SIZE[elsize]
            and c.kwargs[names[0]] <= limits[0]
            and c.kwargs[names[1]] <= limits[1]
        ]
        return kept or configs[-1:]

    return prune


def _quick_bench(kernel_call, quantiles):
    """Shorter than Triton's default (25 ms warm-up, 100 ms measured) per config: ample for these kernels."""
    from triton.testing import do_bench

    return do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


def _autotuned(kernel, names: tuple[str, str, str], dims: tuple[str, str], operand: str, extra: dict):
    """``triton.autotune`` over the Hopper configs; one fixed config in the interpreter (no benchmarking)."""
    if INTERPRETED:
        return triton.autotune(configs=_configs(names, extra), key=_KEY)(kernel)
    return triton.autotune(
        configs=_configs(names, extra),
        key=_KEY,
        prune_configs_by={"early_config_prune": _pruner(names, dims, operand)},
        do_bench=_quick_bench,
    )(kernel)


_linear_act_fwd_kernel = _autotuned(
    _linear_act_fwd_kernel, ("BLOCK_M", "BLOCK_N", "BLOCK_K"), ("M_BUCKET", "N"), "x_ptr", {"GROUP": 8}
)
_linear_act_bwd_dw_kernel = _autotuned(
    _linear_act_bwd_dw_kernel, ("BLOCK_N", "BLOCK_K", "BLOCK_M"), ("N", "K"), "x_ptr", {}
)


def _m_bucket(m: int) -> int:
    """next_power_of_2(M) clamped to [64, 65536]: the M part of the autotuning key."""
    return min(max(triton.next_power_of_2(m), _M_BUCKET_MIN), _M_BUCKET_MAX)


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


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every buffer the launchers hand to a kernel comes from here (tests poison it with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _new_padded(m: int, k: int, x: Tensor) -> Tensor:
    """[M, K] in x's dtype with rows Kp = ``aligned_width(K)`` apart, over an [M, Kp] buffer from ``_empty``
    (``leading_columns``; padding not initialized): dx has rows aligned for the GEMM that writes it even
    for odd K (H200, M=16384, N=512, fp32: dx = dz @ W took 73 us into K=367 rows, 39 us into K=368)."""
    return leading_columns(_empty((m, aligned_width(k, x.dtype)), x.dtype, x.device), k)


def _zero_padded(t: Tensor, width: int) -> Tensor:
    """A contiguous copy [R, width] of t [R, K] (width >= K) whose columns K..width-1 are zeros."""
    return F.pad(t, (0, width - t.shape[1])).contiguous()


def _pads_input(x: Tensor) -> bool:
    """Whether the autograd op copies x into row-padded rows for its GEMMs: its rows are not contiguous or
    not 16 bytes apart."""
    m, k = x.shape
    return not (x.stride(1) == 1 and rows_aligned(x) and (m <= 1 or x.stride(0) >= k))


def _check_inputs(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> None:
    """Raise ValueError naming the offending values; works on fake tensors too."""
    check_activation("linear_act", activation)
    if x.dim() != 2:
        raise ValueError(f"linear_act: x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"linear_act: weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"linear_act: weight [N, K] must have K = {x.shape[1]} columns for x of shape {tuple(x.shape)}, "
            f"got {tuple(weight.shape)}"
        )
    if x.shape[1] < 1 or weight.shape[0] < 1:
        raise ValueError(
            f"linear_act: need K >= 1 and N >= 1, got x {tuple(x.shape)} and weight {tuple(weight.shape)}"
        )
    if x.dtype not in DTYPES:
        raise ValueError(f"linear_act: x dtype must be one of {DTYPES}, got {x.dtype}")
    if weight.dtype != x.dtype:
        raise ValueError(f"linear_act: weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    if weight.device != x.device:
        raise ValueError(f"linear_act: weight is on {weight.device} but x is on {x.device}")
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != weight.shape[0]:
            raise ValueError(
                f"linear_act: bias must have shape [N] = [{weight.shape[0]}] for weight of shape "
                f"{tuple(weight.shape)}, got {tuple(bias.shape)}"
            )
        if bias.dtype != x.dtype:
            raise ValueError(f"linear_act: bias dtype {bias.dtype} differs from x dtype {x.dtype}")
        if bias.device != x.device:
            raise ValueError(f"linear_act: bias is on {bias.device} but x is on {x.device}")


def _check_like(name: str, t: Tensor | None, shape: tuple[int, ...], x: Tensor) -> None:
    if t is None or tuple(t.shape) != tuple(shape) or t.dtype != x.dtype or t.device != x.device:
        got = "None" if t is None else f"({tuple(t.shape)}, {t.dtype}, {t.device})"
        raise ValueError(f"linear_act: {name} must be ({tuple(shape)}, {x.dtype}, {x.device}), got {got}")


def _check_bwd_inputs(
    dy: Tensor, x: Tensor, weight: Tensor, saved: Tensor | None, activation: str, has_bias: bool
) -> None:
    _check_inputs(x, weight, None, activation)
    if not isinstance(has_bias, bool):
        raise ValueError(f"linear_act: has_bias must be a bool, got {has_bias!r}")
    shape = (x.shape[0], weight.shape[0])
    _check_like("dy", dy, shape, x)
    if activation != "identity":
        what = "y" if activation in _SAVES_Y else "z"
        _check_like(f"saved (the forward's {what} for {activation!r})", saved, shape, x)


def linear_act_fwd(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str
) -> tuple[Tensor, Tensor | None]:
    """Launch ``_linear_act_fwd_kernel``: ``y = act(x @ weight^T + bias)``.

    Args:
        x: [M, K] fp32/bf16/fp16.
        weight: [N, K], x's dtype and device.
        bias: [N], x's dtype and device, or None.
        activation: one of ``ACTIVATIONS``.

    Returns:
        (y, saved): y [M, N] in x's dtype; saved is what ``linear_act_bwd`` needs: None for identity, y
        itself for relu and sigmoid, the pre-activation z [M, N] (x's dtype) for gelu_tanh and silu.

    Raises:
        ValueError: bad shapes, dtypes, devices or activation.
    """
    _check_inputs(x, weight, bias, activation)
    m, k = x.shape
    n = weight.shape[0]
    save_z = activation in _SAVES_Z
    y = _empty((m, n), x.dtype, x.device)
    z = _empty((m, n), x.dtype, x.device) if save_z else None
    saved = z if save_z else (y if activation in _SAVES_Y else None)
    if m == 0:
        return y, saved
    x = rows_contiguous(x)
    weight = weight.contiguous()
    bias = bias.contiguous() if bias is not None else None

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    _linear_act_fwd_kernel[grid](
        x, weight, bias if bias is not None else x, y, z if save_z else y,
        m, n, k, _m_bucket(m),
        x.stride(0), weight.stride(0), y.stride(0), (z if save_z else y).stride(0),
        HAS_BIAS=bias is not None, SAVE_Z=save_z, ACTIVATION=activation,
        DOT_FP32=INTERPRETED, INPUT_PRECISION=_input_precision(x.dtype),
    )  # fmt: skip
    return y, saved


def _input_precision(dtype: torch.dtype) -> str:
    """How tl.dot multiplies fp32 operands: TF32 tensor cores only where PyTorch's own matmuls may
    (``torch.backends.cuda.matmul.allow_tf32``), so every backend computes the same GEMM precision."""
    return "tf32" if dtype != torch.float32 or torch.backends.cuda.matmul.allow_tf32 else "ieee"


def linear_act_bwd(
    dy: Tensor,
    x: Tensor,
    weight: Tensor,
    saved: Tensor | None,
    activation: str,
    has_bias: bool,
    needs_dx: bool = True,
    method: str = "auto",
) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """The backward: ``dz = dy * act'``, ``dx = dz @ W``, ``dW = dz^T @ x``, ``db`` (module docstring).

    Args:
        dy: [M, N] gradient of y, x's dtype and device.
        x: [M, K] saved forward input, fp32/bf16/fp16.
        weight: [N, K] saved weight, x's dtype and device.
        saved: the second output of ``linear_act_fwd`` (None or ignored for identity; y for relu and
            sigmoid; z for gelu_tanh and silu): [M, N], x's dtype and device.
        activation: one of ``ACTIVATIONS``, as in the forward.
        has_bias: whether to return db (the forward had a bias).
        needs_dx: whether to compute dx; False skips its GEMM (e.g. the first layer, whose input needs
            no gradient).
        method: "cublas" (a Triton dz + db kernel, then cuBLAS GEMMs), "triton" (dW and db by the Triton
            dW kernel with dz fused into its loads; only with needs_dx=False) or "auto": "cublas" when dx
            is needed, else the faster of the two for this shape, timed once per (M bucket, N, K, dtype,
            GEMM precision, activation, bias) on the GPU and remembered; "triton" in the interpreter.

    Returns:
        (dx, dw, db): dx [M, K] (None unless needs_dx; rows padded to 16 bytes, see ``_new_padded``), dw
        [N, K], db [N] (None unless has_bias), all in x's dtype; dw and db are zeros when M == 0.

    Raises:
        ValueError: bad shapes, dtypes, devices or activation, a missing ``saved``, an unknown method, or
            method "triton" with needs_dx.
    """
    _check_bwd_inputs(dy, x, weight, saved, activation, has_bias)
    if method not in ("auto", "triton", "cublas"):
        raise ValueError(f"unknown backward method {method!r}: expected 'auto', 'triton' or 'cublas'")
    if method == "triton" and needs_dx:
        raise ValueError(
            "backward method 'triton' computes dW and db only: it needs needs_dx=False, got True"
        )
    args = (dy, x, weight, saved, activation, has_bias)
    if method == "auto":
        method = "cublas" if needs_dx else _pick_backward(*args)
    if method == "triton":
        return _linear_act_bwd_triton(*args)
    return _linear_act_bwd_cublas(*args, needs_dx)


# The backward implementation chosen per (M bucket, N, K, dtype, GEMM precision, activation, bias), for
# layers whose dx is not needed.
_BACKWARD_CHOICE: dict[tuple, str] = {}


def _pick_backward(dy, x, weight, saved, activation, has_bias) -> str:
    """The faster dW + db backward for this shape (no dx): both are timed (median of CUDA-event timings) the
    first time a shape is seen. "triton" saves the [M, N] dz pass; cuBLAS's GEMM may still win (module
    docstring: tf32 Triton 0.61-0.70x cuBLAS's time on 13 -> 512, bf16 1.0-1.23x). Inside a CUDA graph
    capture nothing can be timed: an unseen shape then takes "triton". The interpreter times nothing either
    and takes "triton", so the CPU tests run the dW kernel through the autograd op too."""
    if INTERPRETED:
        return "triton"
    key = (_m_bucket(x.shape[0]), weight.shape[0], x.shape[1], x.dtype, _input_precision(x.dtype), activation,
           has_bias)  # fmt: skip
    if key not in _BACKWARD_CHOICE:
        if torch.cuda.is_current_stream_capturing():
            return "triton"
        args = (dy, x, weight, saved, activation, has_bias)
        times = {
            name: _graph_time(fn, args)
            for name, fn in (
                ("triton", _linear_act_bwd_triton),
                ("cublas", partial(_linear_act_bwd_cublas, needs_dx=False)),
            )
        }
        _BACKWARD_CHOICE[key] = min(times, key=times.get)
    return _BACKWARD_CHOICE[key]


def _graph_time(fn, args) -> float:
    """Median ms of `fn(*args)` replayed as a CUDA graph: the GPU time a graph-captured step pays. Timed as
    launched from Python instead, host overhead decided the choice for small layers, differently run to
    run (H200, B=16384: 256 -> 1 tf32 backward 32 us or 59 us)."""
    fn(*args)  # autotuning and lazy initialization, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args)
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=40, return_mode="median")
    del graph
    return ms


def _linear_act_bwd_cublas(dy, x, weight, saved, activation, has_bias, needs_dx):
    """dz and db partials in one Triton pass over [M, N], then dx = dz @ W and dW = dz^T @ x by cuBLAS."""
    m, k = x.shape
    n = weight.shape[0]
    if m == 0:
        db = torch.zeros(n, dtype=x.dtype, device=x.device) if has_bias else None
        return (_new_padded(m, k, x) if needs_dx else None), x.new_zeros(n, k), db
    dy = dy.contiguous()
    s = saved.contiguous() if activation != "identity" else dy
    dz = _empty((m, n), x.dtype, x.device)
    block_n = min(128, triton.next_power_of_2(n))
    block_m = max(16, 4096 // block_n)
    grid = (row_programs(m, block_m), triton.cdiv(n, block_n))
    db_part = _empty((grid[0], n), torch.float32, x.device) if has_bias else dz
    _linear_act_dz_kernel[grid](
        dy, s, dz, db_part, m, n, dy.stride(0), s.stride(0), dz.stride(0),
        HAS_BIAS=has_bias, ACTIVATION=activation, BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
    kp = aligned_width(k, x.dtype)
    dx = None
    if needs_dx:
        # dz @ W over a contiguous W^T [Kp, N] with zero rows past K: an aligned GEMM into [M, Kp], whose
        # first K columns are dx, with the reduction dim contiguous in both operands, the only layout that
        # Hopper's TF32 tensor-core kernels take (H200, B=16384, 512 -> 256 fp32: 34 us over W, 26 us over
        # W^T with its transpose copy; cuBLAS runs sm80 kernels otherwise).
        w_t = (weight.new_zeros if kp != k else weight.new_empty)((kp, n))
        w_t[:k].copy_(weight.t())
        dx = leading_columns(torch.mm(dz, w_t.t()), k)
    # dW [N, K] with K not a multiple of 16 bytes (13 dense features, the 367-wide interaction) makes cuBLAS
    # take its slow align1 kernels (H200, B=65536, 13 -> 512 bf16: 496 us), so when x's rows are padded
    # (the op's copy, the interaction's output) the GEMM reads [M, Kp] in place and the extra columns of dW,
    # products with the padding, are dropped.
    end = (x.storage_offset() + m * kp) * x.element_size()
    if x.stride(0) == kp and x.untyped_storage().nbytes() >= end:
        dw = torch.mm(dz.t(), x.as_strided((m, kp), (kp, 1)))[:, :k].contiguous()
    else:
        dw = torch.mm(dz.t(), x)
    db = sum_partials(db_part, x.dtype) if has_bias else None
    return dx, dw, db


def _linear_act_bwd_triton(dy, x, weight, saved, activation, has_bias):
    """(None, dW, db) from the Triton dW kernel, dz formed in registers (module docstring)."""
    m, k = x.shape
    n = weight.shape[0]
    if m == 0:
        db = torch.zeros(n, dtype=x.dtype, device=x.device) if has_bias else None
        return None, torch.zeros(n, k, dtype=x.dtype, device=x.device), db
    dy = dy.contiguous()  # autograd may hand in an expanded (stride-0) gradient
    x = rows_contiguous(x)
    s = saved.contiguous() if activation != "identity" else dy  # dy: a dummy, never read for identity
    rows_per_split = _dw_rows_per_split(m, n, k)
    splits = triton.cdiv(m, rows_per_split)
    # Every (split, n, k) of the partials is written by exactly one program (and (split, n) of db_part).
    dw_part = _empty((splits, n, k), torch.float32, x.device)
    db_part = _empty((splits, n), torch.float32, x.device) if has_bias else dw_part

    def grid_dw(meta):
        return (triton.cdiv(n, meta["BLOCK_N"]) * triton.cdiv(k, meta["BLOCK_K"]), splits)

    _linear_act_bwd_dw_kernel[grid_dw](
        dy, s, x, dw_part, db_part,
        m, n, k, _m_bucket(m), rows_per_split,
        dy.stride(0), s.stride(0), x.stride(0), dw_part.stride(0), dw_part.stride(1), db_part.stride(0),
        HAS_BIAS=has_bias, ACTIVATION=activation,
        DOT_FP32=INTERPRETED, INPUT_PRECISION=_input_precision(x.dtype),
    )  # fmt: skip
    dw = sum_partials(dw_part, x.dtype)
    db = sum_partials(db_part, x.dtype) if has_bias else None
    return None, dw, db


# --------------------------------------------------------------------------------------------------
# Reference (plain PyTorch, fp32) and CPU fallback
# --------------------------------------------------------------------------------------------------


def linear_act_ref(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> Tensor:
    """Reference ``act(F.linear(x, weight, bias))`` in plain PyTorch: fp32 math, cast back to x's dtype.

    Differentiable by autograd (used by the tests for the reference gradients).

    Args:
        x: [M, K] float tensor.
        weight: [N, K] float tensor.
        bias: [N] float tensor or None.
        activation: one of ``ACTIVATIONS``.

    Returns:
        [M, N] tensor of x's dtype.

    Raises:
        ValueError: unknown activation.
    """
    z = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return act_ref(z, activation).to(x.dtype)


def _linear_act_fwd_ref(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str
) -> tuple[Tensor, Tensor | None]:
    """``linear_act_fwd`` in plain PyTorch (fp32 math): the CPU fallback of the forward op."""
    z = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    y = act_ref(z, activation).to(x.dtype)
    if activation in _SAVES_Z:
        return y, z.to(x.dtype)
    return y, (y if activation in _SAVES_Y else None)


def _linear_act_bwd_ref(
    dy: Tensor,
    x: Tensor,
    weight: Tensor,
    saved: Tensor | None,
    activation: str,
    has_bias: bool,
    needs_dx: bool,
) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """``linear_act_bwd`` in plain PyTorch (fp32 math): the CPU fallback of the backward op.

    Analytic, not torch.autograd.grad: inside a custom op's implementation autograd does not record.
    """
    dy = dy.float()
    s = saved.float() if saved is not None else None
    if activation == "identity":
        dz = dy
    elif activation == "relu":
        dz = torch.where(s > 0, dy, 0.0)
    elif activation == "sigmoid":
        dz = dy * s * (1.0 - s)
    else:  # gelu_tanh, silu: s is z
        dz = dy * act_grad_ref(s, activation)
    dx = (dz @ weight.float()).to(x.dtype) if needs_dx else None
    dw = (dz.t() @ x.float()).to(x.dtype)
    db = dz.sum(dim=0).to(x.dtype) if has_bias else None
    return dx, dw, db


# --------------------------------------------------------------------------------------------------
# Autograd glue: custom ops, so the op works in eager and under torch.compile (no tracing into Triton)
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("dlrm::linear_act", mutates_args=())
def _linear_act_op(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (y, z, x_padded); z is the pre-activation for gelu_tanh/silu and an empty [0] tensor
    otherwise; x_padded is x copied into rows padded with zeros to 16 bytes where ``_pads_input(x)`` (the x
    the GEMMs read, saved for the backward), else an empty [0] tensor (x itself is read and saved).

    (Custom-op outputs may not alias each other or the inputs, so y is not returned twice for relu/sigmoid
    nor x as x_padded: the autograd glue saves y and x themselves.)
    """
    _check_inputs(x, weight, bias, activation)
    k, kp = x.shape[1], aligned_width(x.shape[1], x.dtype)
    # Zero columns, in W too: the forward GEMM runs over all Kp columns, with no mask along K (a mask at
    # K = 367 is not constant over 16 bytes, which keeps Triton from vectorizing the loads of its tiles).
    x_padded = _zero_padded(x, kp) if _pads_input(x) else None
    if use_triton(x) and x_padded is not None:
        y, saved = linear_act_fwd(x_padded, _zero_padded(weight, kp), bias, activation)
    elif use_triton(x):
        y, saved = linear_act_fwd(x, weight, bias, activation)
    else:
        y, saved = _linear_act_fwd_ref(x, weight, bias, activation)
    z = saved if activation in _SAVES_Z else x.new_empty((0,))
    return y, z, (leading_columns(x_padded, k) if x_padded is not None else x.new_empty((0,)))


@_linear_act_op.register_fake
def _linear_act_fake(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str
) -> tuple[Tensor, Tensor, Tensor]:
    _check_inputs(x, weight, bias, activation)
    shape = (x.shape[0], weight.shape[0])
    kp = aligned_width(x.shape[1], x.dtype)
    x_padded = x.new_empty_strided(x.shape, (kp, 1)) if _pads_input(x) else x.new_empty(0)
    return x.new_empty(shape), x.new_empty(shape if activation in _SAVES_Z else (0,)), x_padded


@torch.library.custom_op("dlrm::linear_act_backward", mutates_args=())
def _linear_act_backward_op(
    dy: Tensor,
    x: Tensor,
    weight: Tensor,
    saved: Tensor | None,
    activation: str,
    has_bias: bool,
    needs_dx: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (dx, dw, db); dx / db are empty [0] tensors when needs_dx / has_bias is False."""
    if use_triton(x):
        dx, dw, db = linear_act_bwd(dy, x, weight, saved, activation, has_bias, needs_dx)
    else:
        _check_bwd_inputs(dy, x, weight, saved, activation, has_bias)
        dx, dw, db = _linear_act_bwd_ref(dy, x, weight, saved, activation, has_bias, needs_dx)
        dx = _new_padded(*dx.shape, x).copy_(dx) if needs_dx else None  # the kernels' layout (see the fake)
    empty = x.new_empty((0,))
    return (dx if dx is not None else empty), dw, (db if db is not None else empty)


@_linear_act_backward_op.register_fake
def _linear_act_backward_fake(
    dy: Tensor,
    x: Tensor,
    weight: Tensor,
    saved: Tensor | None,
    activation: str,
    has_bias: bool,
    needs_dx: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    return (
        x.new_empty_strided(x.shape, (aligned_width(x.shape[1], x.dtype), 1)) if needs_dx else x.new_empty(0),
        weight.new_empty(weight.shape),
        x.new_empty((weight.shape[0],) if has_bias else (0,)),
    )


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, activation = inputs
    y, z, x_padded = output
    # Save y for relu/sigmoid, z for gelu_tanh/silu, nothing extra for identity (module docstring).
    saved = y if activation in _SAVES_Y else (z if activation in _SAVES_Z else None)
    ctx.save_for_backward(x_padded if _pads_input(x) else x, weight, saved)
    ctx.activation = activation
    ctx.has_bias = bias is not None


def _backward(ctx, dy: Tensor, _dz: Tensor | None, _dx_padded: Tensor | None):
    # _dz, _dx_padded: gradients w.r.t. the internal outputs, which linear_act never exposes (None/zero).
    x, weight, saved = ctx.saved_tensors
    needs_dx = ctx.needs_input_grad[0]  # False for the first layer: its input is data
    dx, dw, db = _linear_act_backward_op(dy, x, weight, saved, ctx.activation, ctx.has_bias, needs_dx)
    return (dx if needs_dx else None), dw, (db if ctx.has_bias else None), None


_linear_act_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def linear_act(x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str = "relu") -> Tensor:
    """Fused ``act(x @ weight^T + bias)`` (an nn.Linear plus activation) with a fused backward.

    Equals ``act(F.linear(x, weight, bias))``. Differentiable in x, weight and bias; works in eager and
    under ``torch.compile`` (it is the custom op ``torch.ops.dlrm.linear_act``, whose backward is the
    custom op ``torch.ops.dlrm.linear_act_backward``). Runs the Triton kernels on CUDA tensors (and on CPU
    under ``TRITON_INTERPRET=1``), else falls back to plain PyTorch (``linear_act_ref``'s math).

    Args:
        x: [M, K] tensor, fp32, bf16 or fp16 (M >= 0, K >= 1). Copied once into rows padded to 16 bytes
            if its rows are not contiguous or not 16 bytes apart (module docstring).
        weight: [N, K] tensor (nn.Linear layout, N >= 1), same dtype and device as x.
        bias: [N] tensor, same dtype and device as x, or None (no bias).
        activation: one of ``ACTIVATIONS``: "identity", "relu" (default), "sigmoid", "gelu_tanh"
            (``0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))``), "silu" (``z sigmoid(z)``).

    Returns:
        [M, N] tensor of x's dtype: the GEMM accumulated in fp32 (TF32 tensor cores for fp32 inputs on
        the GPU), bias and activation in fp32, rounded once to x's dtype.

    Raises:
        ValueError: x or weight not 2-D, K mismatch, N == 0 or K == 0, bias shape not [N], unknown
            activation, unsupported dtype, dtype mismatch, or tensors on different devices (the message
            names the values).
    """
    y, _, _ = _linear_act_op(x, weight, bias, activation)
    return y
