"""The backward of a GEMM with an activation epilogue, ``y = act(x @ W^T + b)``: ``dz = dy * act'`` and the
bias gradient in one Triton pass over [M, N] (``act_dz``), then ``dx = dz @ W`` and ``dW = dz^T @ x`` by
cuBLAS on operands laid out for its fast kernels (``gemm_grads``, ``grad_input``). act' is taken from the
forward's saved y (relu, sigmoid) or z (gelu_tanh, silu), as ``kernels.activations.act_bwd`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import launch
from kernels.activations import act_bwd
from kernels.gemm.layout import aligned_width, leading_columns, new_padded, rows_contiguous
from kernels.gemm.partials import row_programs, sum_partials
from kernels.gemm.tuning import ChoiceTable, fastest, input_precision, m_bucket
from kernels.launch import INTERPRETED, own_stream

__all__ = ["act_dz", "act_grads", "dw_stream", "gemm_grads", "grad_input"]

# act_dz's small batches: up to this many rows one program along M covers them (a row block of the whole
# batch, in 4096-element tiles), and stores db directly: a step at batch 128 launches no partials' sum.
SMALL_M = 128


# M (the batch) changes between calls: do not specialize on it (a new batch size reuses the compiled kernel).
@triton.jit(do_not_specialize=["M"])
def _act_dz_kernel(
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
    """dz = dy * act'(.) and the bias gradient's partial sums: the prologue of the cuBLAS backward of
    linear_act and lora_linear. Program (p, c) loops over row blocks p, p + P, ... (P programs along M) and
    writes its column sums to row p of the partials (summed over the tile's rows once, after the loop:
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
            dz = act_bwd(dy, tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32), ACTIVATION)
        dz_ptrs = dz_ptr + rows[:, None] * stride_dzm + cols[None, :]
        tl.store(dz_ptrs, dz.to(dz_ptr.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            db_acc += tl.where(mask, dz, 0.0)
    if HAS_BIAS:  # cast to the partials' dtype: fp32, or db's own with one program along M
        db = tl.sum(db_acc, axis=0).to(db_part_ptr.dtype.element_ty)
        tl.store(db_part_ptr + pid_m * N + cols, db, mask=cols < N)


def act_dz(
    dy: Tensor, saved: Tensor | None, activation: str, has_bias: bool, dtype: torch.dtype
) -> tuple[Tensor, Tensor | None]:
    """dz = dy * act' [M, N] (rounded to `dtype`) and, with has_bias, db = its column sums [N] (`dtype`), in
    one Triton pass over [M, N] (``_act_dz_kernel``) and a sum of its fp32 partials; `saved` is the
    forward's y (relu, sigmoid) or z (gelu_tanh, silu), not read for identity. M >= 1. Also the first step
    of other ops' backwards (kernels/lora_linear.py). At M <= SMALL_M one row block holds every row: the
    kernel writes db itself, no partials and no second pass."""
    m, n = dy.shape
    dy = rows_contiguous(dy)
    s = rows_contiguous(saved) if activation != "identity" else dy
    dz = launch.empty((m, n), dtype, dy.device)
    if m <= SMALL_M:
        block_m = max(16, triton.next_power_of_2(m))
        block_n = max(16, min(triton.next_power_of_2(n), 4096 // block_m))
        db = launch.empty((1, n), dtype, dy.device) if has_bias else dz
        _act_dz_kernel[(1, triton.cdiv(n, block_n))](
            dy, s, dz, db, m, n, dy.stride(0), s.stride(0), dz.stride(0),
            HAS_BIAS=has_bias, ACTIVATION=activation, BLOCK_M=block_m, BLOCK_N=block_n,
        )  # fmt: skip
        return dz, (db[0] if has_bias else None)
    block_n = min(128, triton.next_power_of_2(n))
    block_m = max(16, 4096 // block_n)
    col_tiles = triton.cdiv(n, block_n)
    # About 4 * MAX_PARTIAL_ROWS programs in all, the fastest count for dz and the partials' sum over the
    # layer widths of the shipped configs: narrow layers want more programs along M, N = 512 (4 column
    # tiles) fewer.
    grid = (row_programs(m, block_m, max(1, 4 // col_tiles)), col_tiles)
    db_part = launch.empty((grid[0], n), torch.float32, dy.device) if has_bias else dz
    _act_dz_kernel[grid](
        dy, s, dz, db_part, m, n, dy.stride(0), s.stride(0), dz.stride(0),
        HAS_BIAS=has_bias, ACTIVATION=activation, BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
    return dz, (sum_partials(db_part, dtype) if has_bias else None)


def _rows_padded_to(x: Tensor, kp: int) -> bool:
    """Whether x [M, K]'s rows lie kp apart in a storage that holds all M rows of kp elements."""
    end = (x.storage_offset() + x.shape[0] * kp) * x.element_size()
    return x.stride(0) == kp and x.untyped_storage().nbytes() >= end


def gemm_grads(
    dz: Tensor, x: Tensor, weight: Tensor, needs_dx: bool, side: torch.cuda.Stream | None = None
) -> tuple[Tensor | None, Tensor]:
    """(dx, dW) of ``z = x @ W^T`` by cuBLAS: dx = dz @ W (``grad_input``; None unless needs_dx); dW =
    dz^T @ x [N, K], contiguous. dz [M, N] contiguous, x [M, K] with contiguous rows, W [N, K]; one dtype.
    Shared by the GEMM ops whose backward is cuBLAS's (linear_act, ln_linear_gelu through it, gated_linear),
    each with its own dz.

    With `side` (a CUDA stream, `dw_stream`), dW is computed there, concurrently with dx and whatever the
    current stream runs next; the caller makes the current stream wait for `side` before dW is read."""
    layout = _dw_layout(dz, x)  # timed here, on the current stream, the first time a shape is seen
    if side is None:
        return (grad_input(dz, weight) if needs_dx else None), _weight_grad(dz, x, layout)
    current = torch.cuda.current_stream(dz.device)
    dw = x.new_empty(weight.shape)  # the current stream's memory: freed and reused there, after the join
    side.wait_stream(current)
    with torch.cuda.stream(side):
        _weight_grad(dz, x, layout, out=dw)
    # dz and x are read on `side`: their memory is not reused until its reads are done.
    dz.record_stream(side)
    x.record_stream(side)
    return (grad_input(dz, weight) if needs_dx else None), dw


def _weight_grad(dz: Tensor, x: Tensor, layout: str, out: Tensor | None = None) -> Tensor:
    """dW = dz^T @ x [N, K] by cuBLAS on the current stream (``gemm_grads``) in `layout` (``_dw_layout``),
    into `out` [N, K] contiguous when given."""
    m, k = x.shape
    if layout == "padded":
        kp = aligned_width(k, x.dtype)
        dw = torch.mm(dz.t(), x.as_strided((m, kp), (kp, 1)))[:, :k]
        return dw.contiguous() if out is None else out.copy_(dw)
    return torch.mm(dz.t(), x) if out is None else torch.mm(dz.t(), x, out=out)


# The dW layout chosen per (M bucket, N, K, dtype, GEMM precision), for K not a multiple of 16 bytes.
_DW_LAYOUT = ChoiceTable("unaligned dw layout")


def _dw_layout(dz: Tensor, x: Tensor) -> str:
    """ "padded" or "direct" (``_weight_grad``). dW [N, K] with K not a multiple of 16 bytes (13 dense
    features, the 367-wide interaction) makes cuBLAS take its align1 kernels, slow at large batches; when
    x's rows are padded (the op's copy, the interaction's output) the GEMM can read [M, Kp] in place and
    drop dW's extra columns, products with the padding ("padded": a copy of dW more). Where both apply, the
    faster for this shape, both timed as CUDA graphs the first time a shape is seen (at a small batch the
    copy may cost more than the unaligned kernel saves); "padded" inside a CUDA graph capture and in the
    interpreter. "direct" (x as it is) elsewhere."""
    m, k = x.shape
    kp = aligned_width(k, x.dtype)
    if kp == k or not _rows_padded_to(x, kp):
        return "direct"
    if INTERPRETED:
        return "padded"
    key = (m_bucket(m), dz.shape[1], k, x.dtype, input_precision(x.dtype))
    candidates = {
        "padded": lambda: _weight_grad(dz, x, "padded"),
        "direct": lambda: _weight_grad(dz, x, "direct"),
    }
    return fastest(_DW_LAYOUT, key, candidates)


def dw_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream on which a backward's weight gradients run beside its input gradients on `device` (CUDA):
    one of its own (``kernels.launch.own_stream``), since the dW GEMMs of every live graph captured with it
    read the cuBLAS workspace cached for it."""
    index = torch.device(device).index
    return own_stream(torch.cuda.current_device() if index is None else index, "dw")


def grad_input(dz: Tensor, weight: Tensor) -> Tensor:
    """dx = dz @ W [M, K] by cuBLAS, in rows padded to 16 bytes where K is not a multiple of 16 bytes (a fresh
    buffer: callers may add to it in place). dz [M, N] contiguous, W [N, K]; one dtype."""
    n, k = weight.shape
    kp = aligned_width(k, weight.dtype)
    # fp32: dz @ W over a contiguous W^T [Kp, N], the reduction dim contiguous in both operands, the only
    # layout that Hopper's TF32 tensor-core kernels take (cuBLAS runs slower sm80 kernels otherwise, even
    # counting the transpose copy), where that is timed faster (_fp32_dx_layout: a small batch's GEMM may
    # run sm80 kernels either way, and then the copy only costs). 16-bit GEMMs take W as it is, faster
    # without the copy. Where K is not a multiple of 16 bytes, W^T gets zero rows up to Kp: an aligned GEMM
    # into [M, Kp], whose first K columns are dx.
    if kp == k and weight.dtype != torch.float32:
        return torch.mm(dz, weight)
    if kp == k:
        return _aligned_fp32_dx(dz, weight, _fp32_dx_layout(dz, weight))
    w_t = weight.new_zeros((kp, n))
    w_t[:k].copy_(weight.t())
    return leading_columns(torch.mm(dz, w_t.t()), k)


def _aligned_fp32_dx(dz: Tensor, weight: Tensor, layout: str) -> Tensor:
    """dx = dz @ W for fp32 W [N, K] with K a multiple of 16 bytes: over a contiguous copy of W^T
    ("transposed") or W as it is ("direct")."""
    return torch.mm(dz, weight.t().contiguous().t() if layout == "transposed" else weight)


# The fp32 dx layout chosen per (M bucket, N, K, GEMM precision).
_DX_LAYOUT = ChoiceTable("fp32 dx layout")


def _fp32_dx_layout(dz: Tensor, weight: Tensor) -> str:
    """ "transposed" or "direct" (``_aligned_fp32_dx``), the faster for this shape, both timed as CUDA graphs
    the first time a shape is seen; "transposed" inside a CUDA graph capture (nothing can be timed there)
    and in the interpreter."""
    if INTERPRETED:
        return "transposed"
    key = (m_bucket(dz.shape[0]), *weight.shape, input_precision(weight.dtype))
    candidates = {
        "transposed": lambda: _aligned_fp32_dx(dz, weight, "transposed"),
        "direct": lambda: _aligned_fp32_dx(dz, weight, "direct"),
    }
    return fastest(_DX_LAYOUT, key, candidates)


def act_grads(
    dy: Tensor,
    x: Tensor,
    weight: Tensor,
    saved: Tensor | None,
    activation: str,
    has_bias: bool,
    needs_dx: bool,
    side: torch.cuda.Stream | None = None,
) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """(dx, dW, db) of ``y = act(x @ W^T + b)``: dz and db partials in one Triton pass over [M, N]
    (``act_dz``), then dx = dz @ W and dW = dz^T @ x by cuBLAS (``gemm_grads``, dW on `side` when given).
    dy, saved [M, N]; x [M, K] with contiguous rows; W [N, K]; one dtype. dx is None unless needs_dx (rows
    padded to 16 bytes), db None unless has_bias; dW and db are zeros when M == 0."""
    m, k = x.shape
    n = weight.shape[0]
    if m == 0:
        db = torch.zeros(n, dtype=x.dtype, device=x.device) if has_bias else None
        return (new_padded(m, k, x) if needs_dx else None), x.new_zeros(n, k), db
    dz, db = act_dz(dy, saved, activation, has_bias, x.dtype)
    dx, dw = gemm_grads(dz, x, weight, needs_dx, side)
    return dx, dw, db
